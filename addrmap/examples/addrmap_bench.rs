//! Runs the address map benchmarks and prints their results as JSON lines:
//! `cargo run --release -p fabric-addrmap --example addrmap_bench -- [ranges] [lookups]`.
#![allow(clippy::print_stdout, reason = "an example that reports to its user")]

use fabric_addrmap::{MapConfig, bench};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let ranges = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let lookups = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let inv = bench::gpu_cluster(12_500, 8, 141_000_000_000);
    let (_, built) = bench::build_map(&inv, MapConfig::default())?;
    println!("{}", serde_json::to_string(&built)?);
    let t = bench::translate(ranges, lookups)?;
    println!("{}", serde_json::to_string(&t)?);
    Ok(())
}
