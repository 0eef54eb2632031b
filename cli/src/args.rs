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
    /// Seconds to wait for fabricd: for it to take the connection, then for each whole
    /// answer. A daemon that does not answer in time is an error (exit 1), not a hang.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400), global = true)]
    pub timeout: u64,
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
    /// The global fabric address map: list, translate, reverse, gc, partitions, rebuild.
    Map(MapArgs),
    /// Run a benchmark against its baseline, measured in the same run.
    Bench(BenchArgs),
    /// Ask a running fabricd how it is: what is missing or degraded, and why.
    Status(StatusArgs),
    /// Partitions served by fabricd: list them; set or remove one (root or the admin group).
    Partitions(PartitionsArgs),
    /// Regions, exports and imports fabricd holds for you (or for everyone, with --all).
    Regions(RegionsArgs),
    /// The domain fabricd's node belongs to: status, nodes, and an admin's slot gc.
    Domain(crate::domain::DomainArgs),
    /// Compare discovered GPUs and their matrix classes with `nvidia-smi -q -x` and
    /// `nvidia-smi topo -m` outputs (exit 1 when they differ).
    GpuCompare(GpuCompareArgs),
}

/// `fabricctl gpu-compare`.
#[derive(Debug, Args)]
pub struct GpuCompareArgs {
    /// The output of `nvidia-smi -q -x`.
    #[arg(long, value_name = "FILE")]
    pub smi_xml: PathBuf,
    /// The output of `nvidia-smi topo -m`.
    #[arg(long, value_name = "FILE")]
    pub smi_topo: PathBuf,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table)]
    pub output: ListFormat,
    /// Inventory source.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// `fabricctl partitions`.
#[derive(Debug, Args)]
pub struct PartitionsArgs {
    /// What to do (default: list).
    #[command(subcommand)]
    pub command: Option<PartitionsCommand>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table, global = true)]
    pub output: ListFormat,
    /// The daemon's socket (default: $FABRIC_SOCKET, /run/fabric/fabricd.sock for root,
    /// else $XDG_RUNTIME_DIR/fabric/fabricd.sock).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1, global = true)]
    pub daemon: Option<Option<PathBuf>>,
}

/// `fabricctl partitions` subcommands.
#[derive(Debug, Subcommand)]
pub enum PartitionsCommand {
    /// The partitions you may see (all of them for an admin).
    List,
    /// Create or replace a partition: its devices and the users and groups bound to it.
    Set {
        /// Partition name.
        name: String,
        /// Member devices (ids, or labels such as GPU0 from `fabricctl topology --daemon`).
        #[arg(required = true)]
        devices: Vec<String>,
        /// Bind this uid (repeatable).
        #[arg(long = "uid", value_name = "UID")]
        uids: Vec<u32>,
        /// Bind this gid: its members, by primary or supplementary group (repeatable).
        #[arg(long = "gid", value_name = "GID")]
        gids: Vec<u32>,
    },
    /// Remove a partition and its bindings.
    Remove {
        /// Partition name.
        name: String,
    },
}

/// `fabricctl regions`.
#[derive(Debug, Args)]
pub struct RegionsArgs {
    /// Everyone's regions, exports and imports (root or the admin group).
    #[arg(long)]
    pub all: bool,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table)]
    pub output: ListFormat,
    /// The daemon's socket (default as for `status`).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1)]
    pub daemon: Option<Option<PathBuf>>,
}

/// `fabricctl status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table)]
    pub output: ListFormat,
    /// The daemon's socket (default: $FABRIC_SOCKET, /run/fabric/fabricd.sock for root,
    /// else $XDG_RUNTIME_DIR/fabric/fabricd.sock).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1)]
    pub daemon: Option<Option<PathBuf>>,
}

/// `fabricctl map`.
#[derive(Debug, Args)]
pub struct MapArgs {
    /// What to do (default: list the map).
    #[command(subcommand)]
    pub command: Option<MapCommand>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table, global = true)]
    pub output: ListFormat,
    /// The map state file (default: one per source under $FABRIC_STATE_DIR,
    /// /var/lib/fabric for root, else $XDG_STATE_HOME/fabric or ~/.local/state/fabric).
    /// Its map is listed, not a daemon's.
    #[arg(long, value_name = "FILE", global = true, conflicts_with = "daemon")]
    pub state: Option<PathBuf>,
    /// Map configuration (TOML; see configs/addrmap.toml): base, width, node spans,
    /// alignments. It steers new placements only; placed ranges never move. A local map,
    /// not a daemon's.
    #[arg(long, value_name = "FILE", global = true, conflicts_with = "daemon")]
    pub config: Option<PathBuf>,
    /// Inventory source.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// `fabricctl map` subcommands.
#[derive(Debug, Subcommand)]
pub enum MapCommand {
    /// Which device, resource and offset a global fabric address (GFA) lands on.
    Translate {
        /// The GFA (0x-prefixed hex or decimal).
        #[arg(value_parser = address)]
        gfa: u64,
        /// Resolve through a partition's view only.
        #[arg(long, value_name = "NAME")]
        partition: Option<String>,
    },
    /// The GFA of a byte of a device's memory.
    Reverse {
        /// The device: an id or a label (GPU0).
        device: String,
        /// Byte offset in the resource (0x-prefixed hex or decimal).
        #[arg(value_parser = address)]
        offset: u64,
        /// Memory kind (hbm, cxl_volatile, cxl_persistent, cxl_dynamic, host_exported);
        /// default: the device's first mapped kind.
        #[arg(long, value_parser = crate::map::memory_kind)]
        kind: Option<fabric_topology::MemoryKind>,
        /// Which resource of that kind (0 for the first).
        #[arg(long, default_value_t = 0)]
        ordinal: u16,
    },
    /// Release the holes vanished devices left (all, one device's, or one node's).
    Gc {
        /// Only this device's holes (a device id).
        #[arg(long, value_name = "ID", conflicts_with = "node")]
        device: Option<String>,
        /// Only the holes in this node's slots.
        #[arg(long, value_name = "NAME")]
        node: Option<String>,
    },
    /// Manage partitions: named subsets of devices that see only their own ranges.
    #[command(subcommand)]
    Partition(PartitionCommand),
    /// Start the map again after its state file was damaged (the bad file is moved aside).
    Rebuild {
        /// Start from the inventory alone, or from the previous good copy of the state.
        #[arg(long, value_enum, default_value_t = RebuildSource::Previous)]
        from: RebuildSource,
    },
}

/// Partition subcommands.
#[derive(Debug, Subcommand)]
pub enum PartitionCommand {
    /// Create or replace a partition.
    Set {
        /// Partition name.
        name: String,
        /// Member devices (ids or labels).
        #[arg(required = true)]
        devices: Vec<String>,
    },
    /// Remove a partition.
    Remove {
        /// Partition name.
        name: String,
    },
}

/// What `bench control` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ControlMode {
    /// The control path's round trips against a bare echo server.
    Latency,
    /// Latency isolation under other clients' work, and group commit.
    Isolation,
}

/// Where `map rebuild` starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RebuildSource {
    /// Place every range anew from the inventory.
    Inventory,
    /// The previous good copy of the state, brought up to date.
    Previous,
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
    /// GFA lookups over a map of N ranges vs a `BTreeMap` range query.
    Translate {
        /// Ranges in the map.
        #[arg(long, default_value_t = 1_000_000)]
        ranges: usize,
        /// Lookups to time.
        #[arg(long, default_value_t = 4_000_000)]
        lookups: usize,
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
    /// fabricd's control path (no-op, alloc, export, import; requests per second with many
    /// clients) vs a bare Unix-socket echo with the same framing.
    Control {
        /// A running daemon's socket (default: start a private fabricd on `--sim`).
        #[arg(long, value_name = "SOCKET")]
        socket: Option<PathBuf>,
        /// The sim fabric a private fabricd serves.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/hgx-h100-8gpu.toml")]
        sim: PathBuf,
        /// Round trips timed per operation.
        #[arg(long, default_value_t = 20_000)]
        iterations: usize,
        /// Concurrent clients in the throughput run.
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Seconds each throughput run lasts (0.1 to 600).
        #[arg(long, default_value_t = 3.0, value_parser = run_seconds)]
        seconds: f64,
        /// `latency`: round trips against the echo server; `isolation`: no-op latency while
        /// other clients allocate or change partitions, and allocations per second from 1
        /// and 16 clients (group commit).
        #[arg(long, value_enum, default_value_t = ControlMode::Latency)]
        mode: ControlMode,
        /// `isolation` on a running daemon (`--socket`): the interleave set the load
        /// allocates on, e.g. a CXL region's set on a DAX device the daemon zeroes.
        #[arg(long, value_name = "NAME", requires = "socket")]
        set: Option<String>,
        /// `isolation`: bytes of one allocation in eight of the load.
        #[arg(long, value_name = "BYTES", default_value_t = 1 << 30)]
        zeroed_bytes: u64,
    },
    /// libfabric-mm registration: a cache hit (ns) and a miss per MiB vs `mlock` of the same
    /// bytes.
    Register {
        /// A running daemon's socket (default: start a private fabricd on `--sim`).
        #[arg(long, value_name = "SOCKET")]
        socket: Option<PathBuf>,
        /// The sim fabric a private fabricd serves.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/hgx-h100-8gpu.toml")]
        sim: PathBuf,
        /// Bytes per registration.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: u64,
        /// Timed misses (and mlocks).
        #[arg(long, default_value_t = 30)]
        iterations: usize,
        /// Timed cache hits.
        #[arg(long, default_value_t = 1_000_000)]
        hits: usize,
    },
    /// `memcpy` into an imported region mapped in the unified window vs into a local buffer
    /// of the same size.
    Loadstore {
        /// A running daemon's socket (default: start a private fabricd on `--sim`).
        #[arg(long, value_name = "SOCKET")]
        socket: Option<PathBuf>,
        /// The sim fabric a private fabricd serves.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/hgx-h100-8gpu.toml")]
        sim: PathBuf,
        /// Bytes per copy.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: u64,
        /// Timed copies of each kind.
        #[arg(long, default_value_t = 30)]
        iterations: usize,
    },
    /// fabricd's copy engine bandwidth vs a single-thread memcpy of the same size, for
    /// each size and engine count (a private fabricd per engine count).
    Copy {
        /// The sim fabric the private fabricd serves.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/hgx-h100-8gpu.toml")]
        sim: PathBuf,
        /// Copy sizes in bytes, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1048576,4194304,16777216,67108864")]
        sizes: Vec<u64>,
        /// Engine counts (`copy.engines`), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        engines: Vec<u32>,
        /// Copies timed per size (the median is reported).
        #[arg(long, default_value_t = 9)]
        iterations: usize,
        /// Requests in flight for the pipelined and batched figures.
        #[arg(long, default_value_t = 8)]
        depth: usize,
        /// Copies per request for the batched figure (CopyBatch, 1 to 64).
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Where the private daemons' state dirs go (default /dev/shm): a tmpfs mounted
        /// with huge=always gives the sim regions huge pages.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// The control path through libfabric-mm (import + map + unmap, and the library's
    /// no-op) vs a bare Unix-socket echo with the same framing.
    Libcontrol {
        /// A running daemon's socket (default: start a private fabricd on `--sim`).
        #[arg(long, value_name = "SOCKET")]
        socket: Option<PathBuf>,
        /// The sim fabric a private fabricd serves.
        #[arg(long, value_name = "FILE", default_value = "configs/sim/hgx-h100-8gpu.toml")]
        sim: PathBuf,
        /// Round trips timed per figure.
        #[arg(long, default_value_t = 20_000)]
        iterations: usize,
    },
    /// Cross-node import + map + unmap (through the node link) vs the same on the owner
    /// node, remote stores vs local ones, and revocation reach, against two running nodes
    /// of one domain with a node link and a shared sim fabric (`scripts/domain.sh up 2`);
    /// with `--net-importer`, `bench netcopy` against a third node too, in the same JSON
    /// (`FABRIC_DOMAIN_NET=1 scripts/domain.sh up 3`).
    Crossnode {
        /// The owner node's socket (it allocates and exports).
        #[arg(long, value_name = "SOCKET")]
        owner: PathBuf,
        /// The importer node's socket.
        #[arg(long, value_name = "SOCKET")]
        importer: PathBuf,
        /// Round trips timed per figure.
        #[arg(long, default_value_t = 2_000)]
        iterations: usize,
        /// A node sharing no memory fabric with the owner: the network copy runs
        /// against it (`netcopy_ratio`, and the `netcopy` document).
        #[arg(long, value_name = "SOCKET")]
        net_importer: Option<PathBuf>,
        /// Bytes per copy and per stream of the network copy.
        #[arg(long, default_value_t = 64 << 20)]
        net_bytes: u64,
    },
    /// A copy across nodes that share no memory (class NET: push and pull over the node
    /// link) vs a raw TCP and a raw TLS stream of the same bytes between the two nodes
    /// (loopback, or their network namespaces), against two running nodes of one
    /// domain, the importer without the shared fabric
    /// (`FABRIC_DOMAIN_NET=1 scripts/domain.sh up 2`).
    Netcopy {
        /// The owner node's socket (it allocates and exports).
        #[arg(long, value_name = "SOCKET")]
        owner: PathBuf,
        /// The importer node's socket (copies through a copy-only import).
        #[arg(long, value_name = "SOCKET")]
        importer: PathBuf,
        /// Bytes per copy and per stream.
        #[arg(long, default_value_t = 64 << 20)]
        bytes: u64,
        /// Rounds per figure (the best counts).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// The owner node's network namespace (`ip netns` name): the raw streams go to
        /// its link address there, which must be an IP:port (root;
        /// `FABRIC_DOMAIN_NETNS=1 scripts/domain.sh`).
        #[arg(long, value_name = "NAME", requires = "importer_netns")]
        owner_netns: Option<String>,
        /// The importer node's network namespace: the raw streams are sent from there.
        #[arg(long, value_name = "NAME", requires = "owner_netns")]
        importer_netns: Option<String>,
    },
    /// The bare echo server `control` compares against (internal).
    #[command(hide = true)]
    EchoServer {
        /// The socket to serve.
        #[arg(long, value_name = "SOCKET")]
        socket: PathBuf,
    },
}

/// Where the inventory comes from.
#[derive(Debug, Clone, Default, Args)]
pub struct SourceArgs {
    /// Discover the host whose sysfs tree is under DIR (default: the live host, `/`).
    #[arg(long, value_name = "DIR", conflicts_with = "sim", global = true)]
    pub sysfs_root: Option<PathBuf>,
    /// Load a simulated fabric from a TOML file.
    #[arg(long, value_name = "FILE", global = true)]
    pub sim: Option<PathBuf>,
    /// Ask a running fabricd instead of discovering (topology, devices, path and the map
    /// listing, every format). SOCKET defaults to $FABRIC_SOCKET, /run/fabric/fabricd.sock
    /// for root, else $XDG_RUNTIME_DIR/fabric/fabricd.sock. Without --daemon, --sim or
    /// --sysfs-root, the daemon at that default socket is used when one answers there.
    #[arg(long, value_name = "SOCKET", num_args = 0..=1, conflicts_with_all = ["sim", "sysfs_root"], global = true)]
    pub daemon: Option<Option<PathBuf>>,
    /// Restrict the output to one node (nccl-xml: the node to export; default the first).
    #[arg(long, value_name = "NAME", global = true)]
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

/// A GFA or an offset, checked before anything is discovered or saved.
fn address(s: &str) -> Result<u64, String> {
    crate::map::parse_number(s).map_err(|e| e.to_string())
}

/// A run's length in seconds: a finite number from 0.1 to 600 (`nan` or `inf` would reach
/// `Duration::from_secs_f64`, which panics on them).
fn run_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.1..=600.0).contains(&v) {
        return Err(format!("{s} is not between 0.1 and 600 seconds"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nan` and `inf` parse as f64 and reached `Duration::from_secs_f64`, which panicked
    /// (exit 101); now they are usage errors like any other bad length.
    #[test]
    fn a_run_length_is_a_finite_number_of_seconds_in_range() {
        for bad in ["nan", "NaN", "inf", "-1", "0", "601", "3s"] {
            let r = Cli::try_parse_from(["fabricctl", "bench", "control", "--seconds", bad]);
            assert!(r.is_err(), "{bad} was taken");
        }
        for good in ["0.1", "3", "600"] {
            assert!(Cli::try_parse_from(["fabricctl", "bench", "control", "--seconds", good]).is_ok(), "{good}");
        }
    }
}
