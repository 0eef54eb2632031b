//! The daemon's state: the discovered fabric, the address map and the journal lock, built
//! once at start; and the discovery the configuration selects.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::store::{CommitError, FileStore, MapStore, MapView, MapWriter, Published};

use arc_swap::ArcSwap;
use fabric_proto::wire::{DeviceChange, Event, MapChange};
use std::time::Instant;

use fabric_addrmap::{AddressMap, InventorySync, SyncScope};
use fabric_drivers::SysfsRoot;
use fabric_proto::MatrixLabels;
use fabric_proto::order::device_order;
use fabric_topology::inventory::InventoryError;
use fabric_topology::{BackendReport, BackendState, DeviceIdx, Fabric, Inventory};

use crate::config::{BackendName, Config, ConfigError, Environment};
use crate::events::EventBus;
use crate::journal::{Journal, JournalError, JournalOptions};
use crate::memory::{Durability, Memory};
use crate::metrics::{Live, Metrics};
use crate::ops::principal::Principal;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A default path could not be chosen.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `discovery.sim_node` names no node of the sim fabric.
    #[error("discovery.sim_node {0:?} is not a node of the sim fabric")]
    SimNode(String),
    /// The domain could not be joined (`crate::tasks::domain`).
    #[error("domain")]
    Domain(#[source] Box<crate::tasks::domain::JoinError>),
    /// More than one sim fabric is configured.
    #[error("discovery.sim lists {0} files; this fabricd serves one sim fabric")]
    ManySims(usize),
    /// The sim fabric could not be loaded.
    #[error("loading sim fabric {path}")]
    Sim {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: fabric_drivers::sim::SimError,
    },
    /// Discovery produced an inconsistent inventory.
    #[error("indexing the discovered inventory")]
    Index(#[source] InventoryError),
    /// The state directory is not the daemon's own private directory (`crate::sys::privdir`).
    #[error("state directory")]
    StateDir(#[source] crate::sys::privdir::DirError),
    /// The journal could not be opened (another daemon holds its lock, or damage).
    #[error("journal in {path}")]
    Journal {
        /// The journal directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: JournalError,
    },
    /// The admin group does not exist.
    #[error("socket.admin_group {0:?} is not a group on this system")]
    UnknownAdminGroup(String),
    /// The sim device memory directory could not be prepared, or the registry could not
    /// be restored from the journal.
    #[error("sim device memory")]
    Memory(#[source] crate::memory::MemoryError),
    /// The map record (address map state and partition bindings) could not be loaded,
    /// migrated, brought up to date or saved.
    #[error("map record {path}")]
    Record {
        /// The record's file.
        path: PathBuf,
        /// Why.
        #[source]
        source: CommitError,
    },
    /// A DAX device or BAR `[memory]` exports cannot back regions.
    #[error("[memory] device memory")]
    Backing(#[source] crate::memory::backing::BackingError),
    /// A NUMA node `[memory] numa` or `numa_plain` exports cannot back regions.
    #[error("[memory] numa")]
    Numa(#[source] crate::memory::numa::NumaError),
    /// The directory for regions on NUMA nodes (`[memory] numa_dir`) cannot be used.
    #[error("[memory] numa_dir")]
    NumaDir(#[source] crate::memory::numadir::NumaDirError),
    /// The copy engine's threads could not be started.
    #[error("copy engine")]
    Copy(#[source] crate::copy::CopyError),
    /// This node's id could not be read or made (`crate::nodeid`).
    #[error("node id")]
    NodeId(#[source] crate::nodeid::NodeIdFileError),
}

/// Runs the discovery the configuration selects: the sim fabric when one is configured,
/// else the configured host backends under `discovery.sysfs_root`, in their order.
/// Backends left out of the configuration are reported as not present.
pub fn discover(config: &Config) -> Result<Inventory, StartError> {
    let mut inv = match config.discovery.sim.as_slice() {
        [] => discover_host(config),
        [path] => {
            tracing::info!(file = %path.display(), "loading sim fabric");
            let inv =
                fabric_drivers::sim::load(path).map_err(|source| StartError::Sim { path: path.clone(), source })?;
            match &config.discovery.sim_node {
                Some(node) => only_node(inv, node)?,
                None => inv,
            }
        }
        many => return Err(StartError::ManySims(many.len())),
    };
    // Exported BARs are memory resources of their functions (so the map places them);
    // one that cannot be used now is skipped here and refused at start (`backings`).
    let root = SysfsRoot::new(&config.discovery.sysfs_root, "");
    let mut bars = Vec::new();
    for spec in &config.memory.bars {
        match crate::memory::backing::bar(&root, spec) {
            Ok(b) => bars.push(b),
            Err(e) => tracing::warn!(bar = %spec, error = %e, "exported BAR not usable"),
        }
    }
    for absent in crate::memory::backing::add_bar_resources(&mut inv, &bars) {
        tracing::warn!(bar = %absent, "exported BAR's function is not in the fabric");
    }
    // Exported NUMA nodes' memory becomes host_exported resources of their numaN devices
    // the same way; one refused here is refused at start too (`backings`).
    let mut nodes = Vec::new();
    let listed =
        config.memory.numa.iter().map(|&n| (n, false)).chain(config.memory.numa_plain.iter().map(|&n| (n, true)));
    for (n, plain) in listed {
        match crate::memory::numa::resolve_node(&root, &inv, n, plain) {
            Ok(b) => nodes.push(b),
            Err(e) => tracing::warn!(node = n, error = %e, "exported NUMA node not usable"),
        }
    }
    for absent in crate::memory::numa::add_node_resources(&mut inv, &nodes) {
        tracing::warn!(node = absent, "exported NUMA node has no numaN device in the fabric");
    }
    Ok(inv)
}

/// The part of a sim fabric one node serves: its devices, the fabric-level ones (switches
/// that belong to no node) and the links among them. CXL decoders and regions are the
/// node's own (they name its devices).
fn only_node(inv: Inventory, node: &str) -> Result<Inventory, StartError> {
    if !inv.devices.iter().any(|d| d.node.as_deref() == Some(node)) {
        return Err(StartError::SimNode(node.to_owned()));
    }
    let keep = |d: &fabric_topology::Device| d.node.as_deref().is_none_or(|n| n == node);
    let mut out = Inventory::new();
    let mut index = vec![None; inv.devices.len()];
    for (i, d) in inv.devices.iter().enumerate() {
        if keep(d) {
            index[i] = Some(out.add_device(d.clone()).map_err(StartError::Index)?);
        }
    }
    for l in &inv.links {
        let at = |i: DeviceIdx| index.get(i.get()).copied().flatten();
        if let (Some(a), Some(b)) = (at(l.a), at(l.b)) {
            out.add_link(fabric_topology::Link { a, b, ..l.clone() });
        }
    }
    let own = |id: &fabric_topology::DeviceId| out.find(id).is_some();
    let decoders = inv.cxl.decoders.into_iter().filter(|d| d.owner.as_ref().is_none_or(own)).collect();
    let regions = inv.cxl.regions.into_iter().filter(|r| r.targets.iter().all(own)).collect();
    out.cxl = fabric_topology::cxl::CxlInventory { decoders, regions };
    out.hmem = inv.hmem;
    out.backends = inv.backends;
    Ok(out)
}

fn discover_host(config: &Config) -> Inventory {
    // A domain node's devices are the node's, under the name it joins with (the map places
    // and publishes only its own node's memory); a lone daemon names them after the host.
    let root = match &config.domain {
        Some(d) => SysfsRoot::new(&config.discovery.sysfs_root, d.node.as_str()),
        None => SysfsRoot::with_hostname(&config.discovery.sysfs_root),
    };
    tracing::info!(root = %root.root().display(), node = root.node(), "discovering host");
    let all = fabric_drivers::host_backends(&root);
    let mut chosen: Vec<&dyn fabric_drivers::Backend> = Vec::new();
    for want in &config.discovery.backends {
        if let Some(b) = all.iter().find(|b| b.name() == backend_name(*want)) {
            chosen.push(b.as_ref());
        }
    }
    let mut inv = fabric_drivers::discover(&chosen);
    for b in &all {
        if !chosen.iter().any(|c| c.name() == b.name()) {
            inv.backends.push(BackendReport::not_present(b.name(), "disabled by discovery.backends"));
        }
    }
    inv
}

/// The device memory `[memory] dax` and `bars` export, resolved against the live sysfs
/// (`discovery.sysfs_root`, device nodes under its `dev/`) and `inv` (after [`discover`]).
pub fn backings(config: &Config, inv: &Inventory) -> Result<crate::memory::backing::Backings, StartError> {
    let root = SysfsRoot::new(&config.discovery.sysfs_root, "");
    let dev = root.path("dev");
    let m = &config.memory;
    let mut b = crate::memory::backing::resolve(&root, &dev, inv, &m.dax, m.dax_per_region, &m.bars)
        .map_err(StartError::Backing)?;
    crate::memory::backing::locate_bars(inv, &mut b.bars);
    b.nodes = crate::memory::numa::resolve(&root, inv, &m.numa, &m.numa_plain).map_err(StartError::Numa)?;
    crate::memory::numa::locate_nodes(inv, &mut b.nodes).map_err(StartError::Numa)?;
    Ok(b)
}

fn backend_name(b: BackendName) -> &'static str {
    match b {
        BackendName::Pci => "pci",
        BackendName::Cxl => "cxl",
        BackendName::Ualink => "ualink",
        BackendName::Nvml => "nvml",
        BackendName::Cuda => "cuda",
    }
}

/// One line per backend: `name: present (N devices)` / `not present: reason` / `failed`.
pub fn backend_line(r: &BackendReport) -> String {
    match &r.state {
        BackendState::Present => format!("{}: present ({} devices)", r.backend, r.devices),
        BackendState::NotPresent(why) => format!("{}: not present: {why}", r.backend),
        BackendState::Failed(why) => format!("{}: failed: {why}", r.backend),
    }
}

/// Loads the map record from `store` (migrating a state dir of a daemon before it), brings
/// the map in line with `config` and `inv`, and saves the record when anything changed or
/// none was saved yet. Nothing is published before that save: no reader exists yet.
fn open_map(store: &dyn MapStore, config: &Config, inv: &Inventory) -> Result<(MapWriter, Published), CommitError> {
    let (map, bindings, at) = match store.load()? {
        Some(r) => (AddressMap::from_state(Arc::unwrap_or_clone(r.map))?, r.bindings, r.generation),
        None => (AddressMap::new(config.map.clone())?, Arc::new(Vec::new()), 0),
    };
    let published = Published::new(MapView { map: map.snapshot(), bindings });
    let mut writer = MapWriter::new(map, at);
    let skipped = writer.commit(store, &published, at == 0, |m, _| {
        // A domain node's map is its own node's alone: one laid out under the host's name
        // (the daemon ran alone before) would keep that name's slot, answer the GFAs of
        // whichever node holds that slot in the domain, and publish nothing of its own.
        if let Some(d) = &config.domain {
            m.only_node(&d.node)?;
        }
        m.set_config(config.map.clone())?;
        Ok(fabric_addrmap::sync_inventory(m, inv, sync_scope(config))?.sets.skipped)
    })?;
    warn_unmapped(&skipped);
    Ok((writer, published))
}

/// Each device's memory resources (kind and size, in order), by device id.
fn memory_of(
    inv: &Inventory,
) -> std::collections::BTreeMap<&fabric_topology::DeviceId, Vec<(fabric_topology::MemoryKind, u64)>> {
    inv.devices.iter().map(|d| (&d.id, d.memory.iter().map(|m| (m.kind, m.size)).collect())).collect()
}

/// Says which CXL regions a map sync could not make interleave sets, and why.
fn warn_unmapped(skipped: &[String]) {
    for s in skipped {
        tracing::warn!(set = %s, "CXL region not mapped as an interleave set");
    }
}

/// What a map sync covers: the whole inventory when the daemon runs alone; only its own
/// node in a domain (the other nodes place their own memory in their slots).
fn sync_scope(config: &Config) -> SyncScope<'_> {
    match &config.domain {
        Some(d) => SyncScope::Node(&d.node),
        None => SyncScope::Domain,
    }
}

/// The discovered fabric and what is derived from it; replaced as a whole when a rescan
/// finds a change (readers keep the one they loaded).
#[derive(Debug)]
pub struct View {
    /// The fabric.
    pub fabric: Fabric,
    /// Devices in the stable order.
    pub order: Vec<DeviceIdx>,
    /// Matrix labels over the fabric.
    pub labels: MatrixLabels,
    /// Node names.
    pub nodes: Vec<String>,
}

impl View {
    /// Indexes `inv` into a fabric and derives the order, labels and nodes.
    pub fn build(inv: Inventory) -> Result<Self, StartError> {
        let fabric = Fabric::build(inv).map_err(StartError::Index)?;
        let order = device_order(&fabric);
        let labels = MatrixLabels::from_order(&fabric, &order);
        let nodes = fabric_proto::order::sorted_nodes(&fabric);
        Ok(Self { fabric, order, labels, nodes })
    }
}

/// The running daemon's state, shared by every connection.
#[derive(Debug)]
pub struct Daemon {
    /// The configuration it started with.
    pub config: Config,
    /// The socket it serves.
    pub socket_path: PathBuf,
    /// Its state directory.
    pub state_dir: PathBuf,
    /// This node's id: the owner its handles and grants name (`crate::nodeid`).
    pub node: fabric_proto::wire::NodeId,
    view: ArcSwap<View>,
    /// Serialises rescans.
    rescan: Mutex<()>,
    /// Devices seen since start that the last rescan did not find.
    vanished: Mutex<BTreeSet<String>>,
    /// Event subscriptions.
    pub events: Arc<EventBus>,
    /// The address map and bindings' one writer; only changes take its lock.
    map: Mutex<MapWriter>,
    /// The map and bindings `map` last saved, published as one; what every reader uses.
    published: Published,
    /// Where the map record is saved before a change is published.
    store: Box<dyn MapStore>,
    record_path: PathBuf,
    started: Instant,
    sessions: AtomicU32,
    next_session: AtomicU64,
    /// Gid of `socket.admin_group`, resolved at start.
    pub admin_gid: Option<u32>,
    /// Request counters and the gauges the metrics page shows (shared with the copy
    /// engine's threads).
    pub metrics: Arc<Metrics>,
    /// The copy engine (`Copy` requests).
    pub copies: crate::copy::CopyEngine,
    /// Refusals, logged with a rate limit (`refusals.rs`).
    pub refusals: crate::ops::refusals::RefusalLog,
    /// Regions, exports and imports of sim device memory.
    pub memory: Memory,
    /// How the open-file table is shared: connections and the descriptors objects keep.
    pub fd_budget: crate::sys::fdbudget::Budget,
    /// The PCI functions held through VFIO (`dma.vfio`).
    pub vfio: crate::dma::vfio::Vfio,
    /// Rescans asked for outside the interval (kernel uevents).
    pub monitor: crate::tasks::monitor::Trigger,
    /// Orders operations authorized against the partition state before changes to it.
    pub policy: crate::ops::dispatch::gate::PolicyGate,
    /// The domain this node joined (`[domain]`); `None` when it runs alone.
    pub domain: Option<Arc<crate::tasks::domain::Domain>>,
}

impl Daemon {
    /// Tests: a standalone daemon on the bundled HGX sim fabric, its files under `dir`.
    #[cfg(test)]
    pub(crate) fn on_sim_for_tests(dir: &std::path::Path) -> Self {
        let sim = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
        Self::on_sim_file_for_tests(dir, &sim)
    }

    /// Tests: [`Daemon::on_sim_for_tests`] on the sim file `sim`.
    #[cfg(test)]
    pub(crate) fn on_sim_file_for_tests(dir: &std::path::Path, sim: &std::path::Path) -> Self {
        Self::on_sim_configured_for_tests(dir, sim, "")
    }

    /// Tests: [`Daemon::on_sim_file_for_tests`] with `more` configuration (whole sections
    /// other than `socket`, `state`, `discovery` and `metrics`).
    #[cfg(test)]
    pub(crate) fn on_sim_configured_for_tests(dir: &std::path::Path, sim: &std::path::Path, more: &str) -> Self {
        let text = format!(
            "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\n[metrics]\nlisten = \"\"\n{more}",
            dir.join("fabricd.sock").display().to_string(),
            dir.join("state").display().to_string(),
            sim.display().to_string(),
        );
        #[allow(clippy::unwrap_used)]
        Self::start(crate::config::Config::parse(&text, &dir.join("fabricd.toml"), dir).unwrap()).unwrap()
    }

    /// Starts with the defaults for the current user: [`Daemon::start_in`].
    pub fn start(config: Config) -> Result<Self, StartError> {
        Self::start_in(config, &Environment::current())
    }

    /// The state dir checked (`crate::sys::privdir`), discovery, the fabric, the address map
    /// (`map.state` in the state dir, opened, brought up to date and saved) and the journal
    /// (its lock keeps a second daemon off the same state dir).
    pub fn start_in(mut config: Config, env: &Environment) -> Result<Self, StartError> {
        let socket_path = config.socket_path(env)?;
        let state_dir = config.state_dir(env)?;
        let admin_gid = match &config.socket.admin_group {
            Some(name) => Some(
                crate::transport::socket::group_gid(name).map_err(|_| StartError::UnknownAdminGroup(name.clone()))?,
            ),
            None => None,
        };
        // Checked (and created 0700) before anything is read from it or written to it: it
        // holds region files, export secrets and resume tokens.
        crate::sys::privdir::PrivateDir::create(&state_dir).map_err(StartError::StateDir)?;
        let journal_dir = state_dir.join("journal");
        let (journal, replay) = Journal::open(&journal_dir, JournalOptions::default())
            .map_err(|source| StartError::Journal { path: journal_dir.clone(), source })?;
        tracing::info!(dir = %journal_dir.display(), records = replay.records.len(), "journal open");
        // After the journal's lock: only the daemon that owns the state dir draws an id.
        let node = crate::nodeid::load_or_create(&state_dir).map_err(StartError::NodeId)?;
        tracing::info!(%node, "node id");
        // Before discovery, so that the inventory shows the vfio-pci binding.
        let vfio = crate::dma::vfio::Vfio::start(&config.dma, &config.discovery.sysfs_root);
        let inv = discover(&config)?;
        for r in &inv.backends {
            tracing::info!(backend = %r.backend, "{}", backend_line(r));
        }
        // In a domain, the slot decides where this node's memory lies: joined (or the slot
        // remembered) before the map is opened, and pinned in the map's configuration.
        let starting = match &config.domain {
            Some(_) => {
                let starting = crate::tasks::domain::join::start(&config, &inv, &state_dir, node)
                    .map_err(|e| StartError::Domain(Box::new(e)))?;
                let d = starting.domain();
                let span = d.settings().node_span;
                let pin = fabric_addrmap::NodeOverride {
                    base: Some(u64::from(d.slot()).saturating_mul(span)),
                    span: Some(span),
                };
                config.map.nodes.insert(d.node().to_owned(), pin);
                Some(starting)
            }
            None => None,
        };
        let store = FileStore::new(&state_dir);
        let record_path = store.path().to_owned();
        let (writer, published) = open_map(&store, &config, &inv)
            .map_err(|source| StartError::Record { path: record_path.clone(), source })?;
        let shares = starting.as_ref().map(|s| s.shares().to_vec()).unwrap_or_default();
        let domain = starting.map(|s| s.run(writer.map().reader()));
        let view = View::build(inv)?;
        let fabric = &view.fabric;
        if let Some(d) = &domain {
            d.fabric_changed(fabric);
        }
        tracing::info!(
            devices = fabric.inventory().devices.len(),
            links = fabric.inventory().links.len(),
            map_generation = writer.map().generation(),
            "fabric loaded"
        );
        let mut backings = backings(&config, fabric.inventory())?;
        backings.shares = shares;
        if !backings.nodes.is_empty() {
            let base = env.fabric_runtime_dir();
            let dir = crate::memory::numadir::numa_root(&config.memory.numa_dir, base.as_deref(), &state_dir)
                .ok_or(StartError::Config(ConfigError::NoDefault("memory.numa_dir")))?;
            crate::memory::numadir::prepare(&dir).map_err(StartError::NumaDir)?;
            tracing::info!(dir = %dir.display(), "regions on NUMA nodes live under this tmpfs directory");
            for n in &mut backings.nodes {
                n.dir = dir.clone();
            }
        }
        let durability = Durability { journal, replay, config: config.memory.clone(), backings };
        let memory_root = config.memory_root(&state_dir);
        let mut memory = Memory::open_durable(&memory_root, fabric.inventory(), config.limits.clone(), durability)
            .map_err(StartError::Memory)?;
        // main raised the soft open-file limit first: this is the table the daemon has.
        let fd_budget = crate::sys::fdbudget::budget(config.limits.clients, crate::sys::open_file_limit());
        memory.set_fd_budget(fd_budget, crate::sys::effective_uid());
        // Delivered once the end hook is set, below.
        let mut lost_at_start = crate::memory::Aftermath::default();
        for dev in &fabric.inventory().devices {
            if let Some(why) = crate::tasks::monitor::failure(dev) {
                tracing::warn!(device = %dev.id, reason = why, "device reports a failure; its memory is not served");
                lost_at_start.append(memory.device_lost(&dev.id).1);
            }
        }
        let metrics = Arc::new(Metrics::new(fabric));
        metrics.set_map(writer.map().generation(), writer.map().state().mapped_bytes());
        let copies = crate::copy::CopyEngine::start(config.copy.clone(), metrics.clone()).map_err(StartError::Copy)?;
        let events = Arc::new(EventBus::default());
        // Revocations are effects of the operation that caused them: it tells the
        // importers and stops the copies that depended on what it ended, before it answers.
        let (bus, sweeper) = (events.clone(), copies.sweeper());
        memory.on_end(crate::memory::EndHook {
            stop_copies: Box::new(move |memory| {
                sweeper.sweep(memory);
            }),
            tell: Box::new(move |revocations| {
                for (session, r) in revocations {
                    bus.send_to(session, Event::Revocation(r));
                }
            }),
        });
        memory.deliver(lost_at_start);
        Ok(Self {
            config,
            socket_path,
            state_dir,
            node,
            view: ArcSwap::from_pointee(view),
            rescan: Mutex::new(()),
            vanished: Mutex::new(BTreeSet::new()),
            events,
            map: Mutex::new(writer),
            published,
            store: Box::new(store),
            record_path,
            started: Instant::now(),
            sessions: AtomicU32::new(0),
            next_session: AtomicU64::new(1),
            admin_gid,
            metrics,
            copies,
            refusals: crate::ops::refusals::RefusalLog::new(),
            memory,
            fd_budget,
            vfio,
            monitor: crate::tasks::monitor::Trigger::default(),
            policy: crate::ops::dispatch::gate::PolicyGate::new(),
            domain,
        })
    }

    /// Devices seen since start that the last rescan did not find, sorted.
    pub fn vanished(&self) -> Vec<String> {
        self.vanished.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }

    /// Logs (rate-limited, see [`crate::ops::refusals`]) that `op` of `who` was refused with
    /// `err`. Every refusal of a request or connection goes through here.
    pub fn refused(&self, who: &Principal, op: &'static str, err: &fabric_proto::wire::ErrorBody) {
        self.refused_line(who, op, err.code, &err.message);
    }

    /// [`Daemon::refused`] with a log line other than the message the client gets.
    pub fn refused_line(&self, who: &Principal, op: &'static str, code: fabric_proto::wire::ErrorCode, line: &str) {
        use crate::ops::refusals::{Group, node_key};
        match who {
            Principal::Local(_) => self.refusals.refused(Group { uid: who.uid(), node: 0, op, code }, who.pid(), line),
            // Another node: a group of its own, its name leading the line (its uid is a
            // stand-in, its pid none).
            Principal::Peer(n) => {
                let group = Group { uid: who.uid(), node: node_key(&n.node), op, code };
                self.refusals.refused(group, who.pid(), &format!("node {}: {line}", n.node));
            }
        }
    }

    /// The current fabric view.
    pub fn view(&self) -> Arc<View> {
        self.view.load_full()
    }

    /// Runs discovery again and, when the fabric changed, swaps in the new view, brings
    /// the address map in line (vanished devices leave holes) and saves it, and publishes
    /// the device, link and map events. Returns the events published.
    pub fn rescan(&self) -> Result<Vec<Event>, StartError> {
        let _one = self.rescan.lock().unwrap_or_else(|p| p.into_inner());
        let inv = discover(&self.config)?;
        let old = self.view();
        let vanished: BTreeSet<String> = self.vanished().into_iter().collect();
        let mut events = crate::tasks::monitor::diff(old.fabric.inventory(), &inv, &vanished);
        let sets_differ = fabric_addrmap::region_sets(old.fabric.inventory()) != fabric_addrmap::region_sets(&inv);
        // A device whose memory changed size, nothing else (a CXL partition resized): the
        // map follows, or GFAs past a shrunk resource would still translate.
        let memory_differs = memory_of(old.fabric.inventory()) != memory_of(&inv);
        if events.is_empty() && !sets_differ && !memory_differs {
            return Ok(events);
        }
        let view = View::build(inv)?;
        let map_err = |source| StartError::Record { path: self.record_path.clone(), source };
        {
            let mut map = self.map_writer();
            let inv = view.fabric.inventory();
            let scope = sync_scope(&self.config);
            let InventorySync { change, sets } = self
                .commit_map(&mut map, |m, _| Ok(fabric_addrmap::sync_inventory(m, inv, scope)?))
                .map_err(map_err)?;
            warn_unmapped(&sets.skipped);
            if !change.is_empty() || !sets.changes.is_empty() {
                let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
                let all = || std::iter::once(&change).chain(&sets.changes);
                events.push(Event::Map(MapChange {
                    generation: map.map().generation(),
                    added: n(all().map(|c| c.added.len() + c.returned.len()).sum::<usize>() + sets.added.len()),
                    holed: n(all().map(|c| c.vanished.len()).sum()),
                    removed: n(all().map(|c| c.collected.len()).sum::<usize>() + sets.removed.len()),
                }));
            }
        }
        if let Err(e) = self.memory.add_devices(view.fabric.inventory()) {
            tracing::warn!(error = %crate::error_chain(&e), "cannot prepare the memory of new devices");
        }
        if memory_differs {
            self.memory.resize_resources(view.fabric.inventory());
        }
        let view = Arc::new(view);
        self.view.store(view.clone());
        if let Some(d) = &self.domain {
            d.fabric_changed(&view.fabric);
        }
        // The vanished set after the view: `status` reads both, and a device it lists as
        // missing then always comes with the rescan's whole view (its degraded links too).
        let missing = {
            let mut gone = self.vanished.lock().unwrap_or_else(|p| p.into_inner());
            for ev in &events {
                if let Event::Device { device, change } = ev {
                    match change {
                        DeviceChange::Removed => gone.insert(device.as_str().to_owned()),
                        _ => gone.remove(device.as_str()),
                    };
                }
            }
            gone.len() as u64
        };
        self.metrics.set_fabric(&view.fabric, missing);
        // Memory first, so that a client acting on an event finds it done; revocations
        // after the device events, so that subscribers learn why.
        let lost = self.device_memory(&events);
        let snap = self.map_snapshot();
        // A client bound to a domain partition hears of its local members' changes too.
        let domain_view = self.domain.as_ref().map(|d| d.view());
        let members = |names: &[String]| {
            let mut m = crate::ops::scope::partition_members(&snap, names);
            if let Some(view) = &domain_view {
                let bound = view.partitions().filter(|p| names.contains(&p.name));
                m.extend(bound.flat_map(|p| p.devices.iter().map(ToString::to_string)));
            }
            m
        };
        // A client's reach under the bindings current now (an admin may have bound or
        // unbound it since it subscribed), resolved once for all these events.
        let reached = std::cell::RefCell::new(std::collections::HashMap::new());
        let reach_of = |client: &Arc<crate::ops::principal::Client>| {
            reached
                .borrow_mut()
                .entry(Arc::as_ptr(client))
                .or_insert_with(|| crate::ops::scope::Caller::resolve(self, client.clone()).event_reach())
                .clone()
        };
        for ev in &events {
            tracing::info!(event = ?ev, "fabric changed");
            self.events.publish(ev, &reach_of, &members);
        }
        // The loss's revocations after the events that say why.
        self.memory.deliver(lost);
        Ok(events)
    }

    /// The memory side of device events: a removed or failed device's regions are lost
    /// (exports revoked, importers and owners to be told, reason `DeviceLost`); a
    /// recovered one takes new regions again. Returns what the losses left to deliver.
    fn device_memory(&self, events: &[Event]) -> crate::memory::Aftermath {
        let mut after = crate::memory::Aftermath::default();
        for ev in events {
            let Event::Device { device, change } = ev else { continue };
            let Ok(id) = device.as_str().parse::<fabric_topology::DeviceId>() else { continue };
            match change {
                DeviceChange::Removed | DeviceChange::Failed => {
                    let (r, lost) = self.memory.device_lost(&id);
                    after.append(lost);
                    if r.regions > 0 {
                        tracing::warn!(
                            device = %id,
                            regions = r.regions,
                            exports = r.exports,
                            imports = r.imports,
                            registrations = r.registrations,
                            "device lost with its regions; exports revoked, importers told, DMA into them ended"
                        );
                    }
                }
                DeviceChange::Recovered => {
                    self.memory.device_back(&id);
                }
                DeviceChange::Added => {}
            }
        }
        after
    }

    /// The address map's writer, for the changes (rescans, partitions), serialised by its
    /// lock (a poisoned lock is recovered: the map is only changed through
    /// [`MapWriter::commit`], which leaves it as it was on failure). Readers never take it:
    /// [`Daemon::map_view`].
    pub fn map_writer(&self) -> MutexGuard<'_, MapWriter> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The map and the bindings as last saved, lock-free (the writer publishes both with
    /// one atomic swap). A request that reads both reads them from one view.
    pub fn map_view(&self) -> Arc<MapView> {
        self.published.load()
    }

    /// The address map's current snapshot ([`Daemon::map_view`]'s map).
    pub fn map_snapshot(&self) -> Arc<fabric_addrmap::Snapshot> {
        self.published.load().map.clone()
    }

    /// Changes the map and the bindings with `f`, saves both as one record, and only then
    /// publishes them to readers ([`MapWriter::commit`]); `map` is the writer's guard
    /// ([`Daemon::map_writer`]).
    pub fn commit_map<T>(
        &self,
        map: &mut MapWriter,
        f: impl FnOnce(&mut AddressMap, &mut Vec<crate::partitions::Binding>) -> Result<T, CommitError>,
    ) -> Result<T, CommitError> {
        let r = map.commit(self.store.as_ref(), &self.published, false, f)?;
        self.metrics.set_map(map.map().generation(), map.map().state().mapped_bytes());
        if let Some(d) = &self.domain {
            d.map_changed();
        }
        Ok(r)
    }

    /// The Prometheus page (`docs/fabricd.md`, section Metrics).
    pub fn metrics_page(&self) -> String {
        let opened = self.next_session.load(Ordering::Relaxed).saturating_sub(1);
        self.metrics.render(Live {
            sessions: u64::from(self.sessions()),
            sessions_total: opened,
            memory: self.memory.counts(),
            domain: self.domain.as_ref().map(|d| d.gauges()),
        })
    }

    /// Seconds since start.
    pub fn uptime_s(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Connected sessions.
    pub fn sessions(&self) -> u32 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// A session id for a session that is no connection (another node's imports).
    pub fn reserve_session(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers a new session; the guard unregisters it.
    pub fn open_session(&self) -> SessionGuard<'_> {
        self.sessions.fetch_add(1, Ordering::Relaxed);
        SessionGuard { daemon: self, id: self.next_session.fetch_add(1, Ordering::Relaxed) }
    }
}

/// A connected session; dropping it unregisters it.
#[derive(Debug)]
pub struct SessionGuard<'a> {
    daemon: &'a Daemon,
    /// The session id.
    pub id: u64,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        self.daemon.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private copy of the bundled HGX sim file, to edit between rescans: its directory,
    /// path and text.
    fn sim_copy() -> (tempfile::TempDir, PathBuf, String) {
        let dir = tempfile::tempdir().expect("tempdir");
        let bundled = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
        let sim = dir.path().join("sim.toml");
        let text = std::fs::read_to_string(&bundled).expect("sim file");
        std::fs::write(&sim, &text).expect("copy");
        (dir, sim, text)
    }

    /// A rescan that finds only a device's memory resized (a CXL partition changed; here the
    /// sim's GPUs' HBM halved) brings the map along: before, the device set and links
    /// being the same, the rescan returned early and GFAs past the new size still
    /// translated to the device.
    #[test]
    fn a_rescan_that_finds_memory_resized_updates_the_map() {
        let (dir, sim, text) = sim_copy();
        let d = Daemon::on_sim_file_for_tests(dir.path(), &sim);
        let snap = d.map_snapshot();
        let hbm = |snap: &fabric_addrmap::Snapshot| {
            let p = snap.state().placements.iter().find(|p| p.key.kind == fabric_topology::MemoryKind::Hbm);
            p.map(|p| (p.start, p.size)).expect("an HBM range")
        };
        let (start, size) = hbm(&snap);
        assert_eq!(size, 80 << 30);
        assert!(snap.translate(start + size - 1).is_ok());
        std::fs::write(&sim, text.replace("hbm = \"80GiB\"", "hbm = \"40GiB\"")).expect("resize");
        d.rescan().expect("rescan");
        let snap = d.map_snapshot();
        assert_eq!(hbm(&snap), (start, 40 << 30), "the range stays, at its new size");
        assert!(snap.translate(start + (40 << 30) - 1).is_ok());
        assert!(snap.translate(start + size - 1).is_err(), "past the new size: no device byte");
    }

    /// The memory registry follows a resized device too: new regions fit the new size (a
    /// region of the old size past the new end is not carved), and a region that lies
    /// past it is named in the problems. Before, the registry kept the size it started
    /// with until a restart.
    #[test]
    fn a_rescan_that_finds_memory_resized_resizes_the_registry() {
        let (dir, sim, text) = sim_copy();
        let d = Daemon::on_sim_file_for_tests(dir.path(), &sim);
        let gpu = d
            .view()
            .fabric
            .inventory()
            .devices
            .iter()
            .find(|x| x.kind == fabric_topology::DeviceKind::Gpu)
            .expect("a GPU")
            .id
            .clone();
        let place = crate::memory::Place { device: gpu, kind: fabric_topology::MemoryKind::Hbm, ordinal: None };
        let me = crate::memory::Identity { pid: std::process::id() as i32, uid: 0, gid: 0 };
        let big = d.memory.alloc(&me, 1, &place, 50 << 30, 0).expect("50 GiB of 80").region;
        std::fs::write(&sim, text.replace("hbm = \"80GiB\"", "hbm = \"40GiB\"")).expect("shrink");
        d.rescan().expect("rescan");
        let refused = d.memory.alloc(&me, 1, &place, 20 << 30, 0);
        assert!(refused.is_err(), "carved past the new 40 GiB: {refused:?}");
        let problems = d.memory.problems();
        assert!(
            problems.iter().any(|p| p.contains(&format!("region {big}")) && p.contains("past the new size")),
            "{problems:?}"
        );
        std::fs::write(&sim, &text).expect("grow back");
        d.rescan().expect("rescan");
        d.memory.alloc(&me, 1, &place, 20 << 30, 0).expect("the grown device takes it again");
    }
}
