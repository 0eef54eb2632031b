//! Command-line arguments (clap).

use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

/// fabricctl: inspect the interconnect fabric — topology, devices and paths.
#[derive(Debug, Parser)]
#[command(name = "fabricctl", version, about, long_about = None)]
pub struct Cli {
    /// More logging on stderr (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, action = ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the fabric topology: matrix, tree, JSON, Graphviz DOT or NCCL topology XML.
    Topology(TopologyArgs),
    /// List every device with its identity, kind, NUMA locality, links and memory.
    Devices(DevicesArgs),
    /// Show the best route between two devices (ids or matrix labels such as GPU0).
    Path(PathArgs),
    /// Run a benchmark against its baseline, measured in the same run.
    Bench(BenchArgs),
}

/// `fabricctl bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which benchmark.
    #[command(subcommand)]
    pub which: BenchCommand,
    /// Print the result as JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// `fabricctl topology -o json` on this host vs `lstopo-no-graphics --whole-io --of xml`.
    Host {
        /// Runs of each command.
        #[arg(long, default_value_t = 20)]
        runs: u32,
        /// The sysfs root to discover.
        #[arg(long, value_name = "DIR", default_value = "/")]
        sysfs_root: PathBuf,
    },
    /// Load and build a large sim fabric; path queries vs a whole-graph BFS.
    Scale {
        /// The sim fabric.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/cluster-100k.toml")]
        sim: PathBuf,
        /// Path queries to time.
        #[arg(long, default_value_t = 2000)]
        queries: usize,
    },
}

/// Where the inventory comes from.
#[derive(Debug, Clone, Default, Args)]
pub struct SourceArgs {
    /// Discover the host whose sysfs tree is under DIR (default: the live host, `/`).
    #[arg(long, value_name = "DIR", conflicts_with = "sim")]
    pub sysfs_root: Option<PathBuf>,
    /// Load a simulated fabric from a TOML file.
    #[arg(long, value_name = "FILE")]
    pub sim: Option<PathBuf>,
    /// Restrict the output to one node (nccl-xml: the node to export; default the first).
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
}

/// `topology` output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TopologyFormat {
    /// `nvidia-smi topo -m`-style matrix (a summary for large fabrics).
    Table,
    /// hwloc-like indented tree.
    Tree,
    /// The `fabric.topology/v1` document.
    Json,
    /// Graphviz DOT.
    Dot,
    /// NCCL topology XML for NCCL_TOPO_FILE (one node).
    #[value(name = "nccl-xml")]
    NcclXml,
}

/// `devices` and `path` output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ListFormat {
    /// Aligned text.
    Table,
    /// A versioned JSON document.
    Json,
}

/// `fabricctl topology`.
#[derive(Debug, Args)]
pub struct TopologyArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = TopologyFormat::Table)]
    pub output: TopologyFormat,
    /// Inventory source.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// `fabricctl devices`.
#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table)]
    pub output: ListFormat,
    /// Inventory source.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// `fabricctl path`.
#[derive(Debug, Args)]
pub struct PathArgs {
    /// Source device: a device id (`uuid:GPU-…`, `pci:node0/0000:17:00.0`) or a label (`GPU0`).
    pub a: String,
    /// Destination device, in the same forms.
    pub b: String,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table)]
    pub output: ListFormat,
    /// Inventory source.
    #[command(flatten)]
    pub source: SourceArgs,
}
