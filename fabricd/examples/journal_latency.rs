//! Measures what durability costs on this machine: append + fdatasync latency, group
//! commit, and compaction, on a journal in DIR (default: a temporary directory, which must
//! be on a real disk for the numbers to mean anything; tmpfs makes fsync free).
//!
//!     cargo run --release -p fabricd --example journal_latency -- [DIR] [APPENDS] [PAYLOAD_BYTES]
#![allow(clippy::print_stdout, reason = "an example that reports measurements")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use fabricd::journal::{Journal, JournalOptions};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn report(what: &str, mut samples: Vec<Duration>, records_per_sample: usize) {
    samples.sort();
    let total: Duration = samples.iter().sum();
    let per_sec = (samples.len() * records_per_sample) as f64 / total.as_secs_f64();
    println!(
        "{what:<34} n={:<5} p50={:>8.1?} p99={:>8.1?} max={:>8.1?}  {per_sec:>9.0} records/s",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1],
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let tmp;
    let dir = match args.next() {
        Some(d) => PathBuf::from(d),
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().join("journal")
        }
    };
    let appends: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2000);
    let size: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(128);
    let payload = vec![0x5a; size];
    let (mut journal, replay) = Journal::open(&dir, JournalOptions::default())?;
    println!("journal in {} ({} records replayed)", dir.display(), replay.records.len());

    let mut single = Vec::with_capacity(appends);
    for _ in 0..appends {
        let t = Instant::now();
        journal.append(1, &payload)?;
        single.push(t.elapsed());
    }
    report(&format!("append {size} B + fdatasync"), single, 1);

    for batch_len in [16, 64] {
        let batch: Vec<(u16, &[u8])> = (0..batch_len).map(|_| (1, payload.as_slice())).collect();
        let mut batches = Vec::new();
        for _ in 0..(appends / batch_len).max(10) {
            let t = Instant::now();
            journal.append_batch(&batch)?;
            batches.push(t.elapsed());
        }
        report(&format!("append_batch {batch_len} x {size} B"), batches, batch_len);
    }

    let snapshot = vec![0xa5; 1 << 20];
    let mut compactions = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        journal.compact(&snapshot)?;
        compactions.push(t.elapsed());
    }
    report("compact, 1 MiB snapshot", compactions, 1);
    Ok(())
}
