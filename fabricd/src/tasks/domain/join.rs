//! Joining the domain: connect to etcd, agree on the domain settings, claim (or find) this
//! node's slot, grant a lease and put the member record on it. At start this runs before
//! the map is opened (the slot decides where the node's memory lies) and bounds the start
//! by etcd's timeouts; after a lost lease the domain task runs it again with a new
//! incarnation. The slot is remembered in the state dir, so a node that held one can start
//! serving while etcd is unreachable and join once it answers; so are this node's shares
//! of memory other hosts reach too (`[[memory.shares]]`), claimed at start after the slot.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64};

use arc_swap::{ArcSwap, ArcSwapOption};
use fabric_domain::records::{RECORD_VERSION, Record, SHARED_FILE};
use fabric_domain::{
    DEFAULT_DATA_PATHS, DomainClient, DomainConfig, DomainSettings, DomainView, EtcdError, FabricGroup, Fence, Lease,
    MemberRecord, ShareWant, fresh_incarnation,
};
use fabric_proto::wire::Coherence;
use fabric_topology::Inventory;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::{Domain, DomainStatus, RuntimeGuard, Standing};
use crate::config::{Config, ShareConfig};
use crate::memory::backing::ResourceShare;

/// Why a node could not take its place in the domain at start.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The domain's runtime could not be started.
    #[error("starting the runtime of the etcd client")]
    Runtime(#[source] std::io::Error),
    /// etcd refused: the name is held by a live daemon, the settings differ, the domain is
    /// full, a record is damaged.
    #[error("joining domain {domain} as {node}")]
    Etcd {
        /// The domain.
        domain: String,
        /// This node.
        node: String,
        /// Why.
        #[source]
        source: EtcdError,
    },
    /// etcd is unreachable and this node never held a slot (nothing in the state dir):
    /// it cannot know where its memory lies in the domain.
    #[error("etcd is unreachable and node {node} has no slot remembered in {path} (it never joined)")]
    NoSlot {
        /// This node.
        node: String,
        /// The slot file looked for.
        path: PathBuf,
        /// Why etcd was not reached.
        #[source]
        source: EtcdError,
    },
    /// etcd is unreachable and this node's share of shared memory (`[[memory.shares]]`) was
    /// never claimed (or was for another capacity): it cannot know where its new regions may go.
    #[error("etcd is unreachable and node {node} has no share of {resource} remembered in {path}")]
    NoShare {
        /// This node.
        node: String,
        /// The shared resource.
        resource: String,
        /// The share file looked for.
        path: PathBuf,
        /// Why etcd was not reached.
        #[source]
        source: Box<EtcdError>,
    },
    /// The remembered slot could not be saved or read.
    #[error("slot file {path}")]
    SlotFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The domain task stopped before it answered.
    #[error("the domain task stopped during the join")]
    Stopped,
    /// The node link's credentials (`[peer]` ca, cert, key) cannot be used.
    #[error("node link")]
    Credentials(#[source] crate::peer::CredentialsError),
    /// The node link cannot listen at `peer.address`.
    #[error("node link")]
    Listen(#[source] crate::peer::ListenError),
    /// A `[[memory.shares]]` device is spelled unlike the device this node has of that
    /// name (another case): served without its share, new regions would go anywhere on it.
    #[error(
        "memory.shares names {listed}, which this node does not see; it sees {seen}: write the device id as `fabricctl topo` shows it"
    )]
    ShareDevice {
        /// The device as listed.
        listed: String,
        /// The device this node sees.
        seen: String,
    },
}

/// A join that holds: the client, the lease the member key lives on, the fence its
/// writes go through, its incarnation.
#[derive(Debug)]
pub(super) struct Joined {
    pub(super) client: DomainClient,
    pub(super) lease: Lease,
    pub(super) fence: Fence,
    pub(super) incarnation: u64,
}

/// The outcome of the join at start: the domain (its slot known) and the join when etcd
/// answered. [`Starting::run`] starts the domain task once the map is open.
#[derive(Debug)]
pub struct Starting {
    domain: Arc<Domain>,
    joined: Option<Joined>,
    /// The domain as the join read it, published before the node serves anyone.
    first: Option<DomainView>,
    shares: Vec<ResourceShare>,
}

impl Starting {
    /// The domain.
    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// This node's shares of memory other hosts reach too (`[[memory.shares]]`), as claimed
    /// (or remembered).
    pub fn shares(&self) -> &[ResourceShare] {
        &self.shares
    }

    /// Starts the domain task: it publishes the placements of the map `reader` follows,
    /// watches the domain, and rejoins when needed.
    pub fn run(self, reader: fabric_addrmap::Reader) -> Arc<Domain> {
        let domain = self.domain.clone();
        domain.runtime.get().spawn(super::watch::run(self.domain, self.joined, self.first, reader));
        domain
    }
}

/// The settings this node brings: the map's address bits and node span (validated fixed),
/// and the data paths `[domain] data_paths` allows (by default every one fabricd serves).
pub fn local_settings(config: &Config) -> DomainSettings {
    let span = match config.map.node_span {
        fabric_addrmap::NodeSpan::Fixed(span) => span,
        fabric_addrmap::NodeSpan::Auto { min } => min,
    };
    let paths = config.domain.as_ref().map_or_else(|| DEFAULT_DATA_PATHS.to_vec(), DomainConfig::data_paths);
    DomainSettings::new(config.map.address_bits, span, paths)
}

/// Checks the settings a configuration brings against the domain's record rules (at load).
pub fn check_settings(config: &Config) -> Result<(), String> {
    local_settings(config).validate().map_err(|e| e.to_string())
}

/// Joins the domain `config.domain` names (the caller checked it is set), blocking until
/// etcd answers or its timeouts pass. Refuses when etcd refuses; starts without a join
/// (the task keeps trying) when etcd is unreachable and a slot is remembered.
pub fn start(
    config: &Config,
    inv: &Inventory,
    state_dir: &Path,
    node_id: fabric_proto::wire::NodeId,
) -> Result<Starting, JoinError> {
    let Some(dc) = config.domain.clone() else {
        return Err(JoinError::Stopped);
    };
    let link = match config.peer.credentials() {
        Some((ca, cert, key)) => Some(crate::peer::NodeLink::new(
            crate::peer::creds::load(ca, cert, key, &dc.name, &dc.node).map_err(JoinError::Credentials)?,
            config.peer.answer_poll(),
        )),
        None => None,
    };
    // Two workers: the lease's renewals and etcd's connection are served while the other
    // is in a long step (a big watch response applied, a copy chunk's TLS); with one, a
    // 12,500-node domain under load lost its lease to its own work and rejoined in a loop.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("fabricd-domain")
        .enable_all()
        .build()
        .map_err(JoinError::Runtime)?;
    let local = local_settings(config);
    let member = member(config, &dc, inv, node_id);
    let slot_file = state_dir.join("domain-slot.json");
    let share_file = state_dir.join("domain-shares.json");
    let wants = share_wants(config, inv)?;
    let known = remembered_shares(&share_file, &dc);
    // The slot this node served before, if it did: its map (and so its memory's GFAs) lies
    // there, so a start claims that slot back or refuses (`SlotCollected`: an admin's gc
    // gave it to another node), as a rejoin does; never another one under the same map.
    let served = remembered(&slot_file, &dc, local.node_span)?;
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (dc, local, member) = (dc.clone(), local.clone(), member.clone());
        let claims = share_claims(&wants, &known);
        runtime.spawn(async move {
            let joined = async {
                let (slot, joined) = join(&dc, &local, &member, served).await?;
                match claim_shares(&joined.client, &joined.fence, &claims).await {
                    Ok(shares) => {
                        // The domain read before the node is ready: its first answers (a
                        // map, a peer's link) see the whole domain, not an empty view.
                        // A failed read is the domain task's to do again.
                        let first = super::watch::read_view(&joined.client, None)
                            .await
                            .inspect_err(|reason| tracing::warn!(%reason, "the domain could not be read at start; the domain task reads it"))
                            .ok();
                        Ok((slot, joined, shares, first))
                    }
                    Err(e) => {
                        // Not a member without its shares: give the lease back.
                        let _ = joined.client.leave(joined.lease).await;
                        Err(e)
                    }
                }
            };
            let _ = tx.send(joined.await);
        });
    }
    let err = |source| JoinError::Etcd { domain: dc.name.clone(), node: dc.node.clone(), source };
    let (slot, joined, claimed, first) = match rx.recv().map_err(|_| JoinError::Stopped)? {
        Ok((slot, joined, claimed, first)) => {
            remember(&slot_file, &dc, slot, local.node_span)?;
            remember_shares(&share_file, &dc, &claimed)?;
            (slot, Some(joined), claimed, first)
        }
        Err(e) if unreachable(&e) => match served {
            Some(slot) => {
                if let Some(missing) = wants.iter().find(|w| !known.iter().any(|k| k.fits(w))) {
                    let resource = missing.want.resource.clone();
                    let source = Box::new(e);
                    return Err(JoinError::NoShare { node: dc.node.clone(), resource, path: share_file, source });
                }
                tracing::warn!(error = %crate::error_chain(&e), slot, "etcd unreachable: serving with the remembered slot, joining when it answers");
                (slot, None, known, None)
            }
            None => return Err(JoinError::NoSlot { node: dc.node.clone(), path: slot_file, source: e }),
        },
        Err(e) => return Err(err(e)),
    };
    let matched: Vec<(&ShareWanted, &KnownShare)> =
        wants.iter().filter_map(|w| claimed.iter().find(|c| c.fits(w)).map(|c| (w, c))).collect();
    let shares: Vec<ResourceShare> = matched.iter().map(|(w, c)| w.share(c.offset, c.len)).collect();
    let held = matched.into_iter().map(|(_, c)| c.clone()).collect();
    let status = DomainStatus {
        standing: match &joined {
            Some(_) => Standing::Joined,
            None => Standing::Unreachable("etcd did not answer at start".to_owned()),
        },
        incarnation: joined.as_ref().map_or(0, |j| j.incarnation),
        etcd_reachable: joined.is_some(),
        round_trip: None,
    };
    let view = first.clone().unwrap_or_else(|| DomainView::new(fabric_domain::Keys::new(&dc.name), Domain::limits()));
    let client = joined.as_ref().map(|j| j.client.clone());
    tracing::info!(domain = %dc.name, node = %dc.node, slot, "domain slot");
    let domain = Arc::new(Domain {
        config: dc,
        settings: local,
        slot,
        member,
        status: ArcSwap::from_pointee(status),
        view: ArcSwap::from_pointee(view),
        recent: std::sync::Mutex::default(),
        fence: ArcSwap::from_pointee(joined.as_ref().map(|j| j.fence.clone())),
        client: ArcSwap::from_pointee(client),
        leadership: ArcSwap::from_pointee(None),
        map_changed: Notify::new(),
        topology: ArcSwapOption::empty(),
        merged: ArcSwapOption::empty(),
        merging: std::sync::Mutex::default(),
        pairs: std::sync::Mutex::default(),
        merges: AtomicU64::new(0),
        etcd_errors: AtomicU64::new(0),
        lease: AtomicI64::new(0),
        left: std::sync::atomic::AtomicBool::new(false),
        link,
        shares: held,
        daemon: std::sync::OnceLock::new(),
        runtime: RuntimeGuard::new(runtime),
    });
    if let Some(link) = &domain.link {
        let incarnation = joined.as_ref().map_or(0, |j| j.incarnation);
        link.listen(domain.runtime.get(), &domain.member.peer_address, Arc::downgrade(&domain), incarnation)
            .map_err(JoinError::Listen)?;
    }
    Ok(Starting { domain, joined, first, shares })
}

/// One join: settings, slot, lease, `member` with a fresh incarnation. `serving`: the
/// slot a rejoining node serves, the only one it may hold (claimed back if a gc freed it and
/// nobody took it; another slot would be other GFAs); `None` at start, where a slot is
/// claimed if none is held.
pub(super) async fn join(
    config: &DomainConfig,
    local: &DomainSettings,
    member: &MemberRecord,
    serving: Option<u32>,
) -> Result<(u32, Joined), EtcdError> {
    let client = DomainClient::connect(config, Domain::limits()).await?;
    // A node whose configuration names no data paths takes the domain's (an earlier build's
    // domain has `[shared_file]`); one that names them must match.
    client.ensure_settings_with(local, config.data_paths.is_some()).await?;
    let slot = match serving {
        None => client.claim_slot(local).await?,
        Some(serving) => client.claim_slot_at(serving).await?,
    };
    let lease = client.grant_lease().await?;
    let incarnation = fresh_incarnation();
    let record = MemberRecord { incarnation, ..member.clone() };
    let fence = match client.join_fenced_in_slot(&lease, &record, slot).await {
        Ok(fence) => fence,
        Err(e) => {
            // Give the lease back (with the member key, if the join got that far) rather
            // than let it run out.
            let _ = client.leave(lease).await;
            return Err(e);
        }
    };
    tracing::info!(domain = %config.name, node = %config.node, slot, incarnation, "joined the domain");
    Ok((slot, Joined { client, lease, fence, incarnation }))
}

/// Whether `e` says etcd did not answer (rather than refused).
pub(super) fn unreachable(e: &EtcdError) -> bool {
    matches!(e, EtcdError::Connect { .. } | EtcdError::Timeout { .. } | EtcdError::Request { .. })
}

/// The member record this node joins with, but its incarnation (fresh for each join). It
/// offers [`SHARED_FILE`] only with a `peer.shared_dir`: an owner grants that node the sim's
/// shared files, and asks the domain's topology whether it may, only then.
fn member(config: &Config, dc: &DomainConfig, inv: &Inventory, node_id: fabric_proto::wire::NodeId) -> MemberRecord {
    MemberRecord {
        version: RECORD_VERSION,
        name: dc.node.clone(),
        incarnation: 0,
        peer_address: config.peer_address().unwrap_or_default(),
        capabilities: config.peer.shared_dir.iter().map(|_| SHARED_FILE.to_owned()).collect(),
        groups: groups(config, inv),
        software: env!("CARGO_PKG_VERSION").to_owned(),
        node_id: Some(node_id.to_string()),
    }
}

/// The fabric groups the node's member record lists: the NVLink cliques of its GPUs
/// (NVML's cluster UUID and clique id), then the CXL pools of the `[[memory.shares]]`
/// devices it sees; each once, at most as many as a member record lists.
fn groups(config: &Config, inv: &Inventory) -> Vec<FabricGroup> {
    let cliques = inv.devices.iter().filter_map(|d| d.gpu.as_ref()).filter_map(|gpu| {
        let (cluster, clique) = (gpu.fabric_cluster.as_ref()?, gpu.fabric_clique?);
        Some(FabricGroup::NvlinkClique { cluster_uuid: cluster.clone(), clique_id: clique })
    });
    let pools = config
        .memory
        .shares
        .iter()
        .filter(|s| share_device(inv, s).is_some())
        .map(|s| FabricGroup::CxlPool { pool: s.pool() });
    let mut out: Vec<FabricGroup> = Vec::new();
    for group in cliques.chain(pools) {
        if !out.contains(&group) && out.len() < fabric_domain::records::MAX_LIST_LEN {
            out.push(group);
        }
    }
    out
}

/// A share this node claims: one memory resource of a `[[memory.shares]]` device.
#[derive(Debug, Clone)]
struct ShareWanted {
    /// Its resource (`<device id>/<kind><ordinal>`), capacity and length.
    want: ShareWant,
    device: fabric_topology::DeviceId,
    kind: fabric_topology::MemoryKind,
    ordinal: u16,
    coherence: Coherence,
}

impl ShareWanted {
    fn share(&self, offset: u64, len: u64) -> ResourceShare {
        let (device, kind, ordinal, coherence) = (self.device.clone(), self.kind, self.ordinal, self.coherence);
        ResourceShare { device, kind, ordinal, offset, len, coherence }
    }
}

/// The device of `share` this node has: the one whose id is the listed one (parsed, so
/// any spelling of a PCI address finds it).
fn share_device<'a>(inv: &'a Inventory, share: &ShareConfig) -> Option<&'a fabric_topology::Device> {
    let id: fabric_topology::DeviceId = share.device.parse().ok()?;
    inv.devices.iter().find(|d| d.id == id)
}

/// The resources of the `[[memory.shares]]` devices this node has, each with the bytes it
/// claims (at most the resource, whole granules). A device the inventory lacks has no
/// memory here to share: logged and skipped. One spelled unlike a device the node has
/// (another case: `0x5EED`, where the kernel says `0x5eed`) is refused: skipped, that
/// device would be served whole, over the other hosts' shares.
fn share_wants(config: &Config, inv: &Inventory) -> Result<Vec<ShareWanted>, JoinError> {
    let granule = crate::memory::alloc::GRANULE;
    let mut out = Vec::new();
    for s in &config.memory.shares {
        let Some(dev) = share_device(inv, s) else {
            if let Some(d) = inv.devices.iter().find(|d| d.id.to_string().eq_ignore_ascii_case(&s.device)) {
                return Err(JoinError::ShareDevice { listed: s.device.clone(), seen: d.id.to_string() });
            }
            tracing::warn!(device = %s.device, "memory.shares names a device this node does not see; no share claimed");
            continue;
        };
        for (kind, ordinal, capacity) in crate::memory::device_resources(dev) {
            let len = s.bytes.min(capacity / granule * granule);
            if len == 0 {
                continue;
            }
            let resource = crate::memory::resource_name(&dev.id, kind, ordinal);
            out.push(ShareWanted {
                want: ShareWant { resource, capacity, len, at: None, grow_to: None },
                device: dev.id.clone(),
                kind,
                ordinal,
                coherence: if s.coherent { Coherence::Hardware } else { Coherence::Software },
            });
        }
    }
    Ok(out)
}

/// What to claim of each wanted resource: where the share file remembers this node's
/// share of it (at least the remembered size: its regions may lie anywhere in it; grown in
/// place to the configured size where that is more and the room is free), or anywhere.
fn share_claims(wanted: &[ShareWanted], known: &[KnownShare]) -> Vec<ShareWant> {
    wanted
        .iter()
        .map(|w| match known.iter().find(|k| k.fits(w)) {
            Some(k) => {
                if k.len > w.want.len {
                    tracing::warn!(resource = %k.resource, held = k.len, asked = w.want.len, "keeping the remembered share's size; a smaller one needs a gc of the node");
                }
                ShareWant { grow_to: (w.want.len > k.len).then_some(w.want.len), ..k.want() }
            }
            None => w.want.clone(),
        })
        .collect()
}

/// Claims (or finds) this node's share of each resource of `wants`: back where it was
/// ([`ShareWant::at`]), the others at one offset where that is free (the members of an
/// interleave set stripe at one DPA on each).
/// Fenced by the membership just joined: a node whose lease ran out meanwhile claims none.
async fn claim_shares(client: &DomainClient, fence: &Fence, wants: &[ShareWant]) -> Result<Vec<KnownShare>, EtcdError> {
    if wants.is_empty() {
        return Ok(Vec::new());
    }
    let shares = client.claim_shares_fenced(fence, wants, crate::memory::alloc::GRANULE).await?;
    Ok(wants
        .iter()
        .zip(shares)
        .map(|(w, s)| KnownShare { resource: w.resource.clone(), capacity: w.capacity, offset: s.offset, len: s.len })
        .collect())
}

/// Claims this node's shares back where it serves them (a rejoin: a gc while the node was
/// away freed them); [`EtcdError::ShareLost`] when another node holds a range now.
pub(super) async fn claim_back(client: &DomainClient, fence: &Fence, held: &[KnownShare]) -> Result<(), EtcdError> {
    let wants: Vec<ShareWant> = held.iter().map(KnownShare::want).collect();
    claim_shares(client, fence, &wants).await.map(drop)
}

/// A claimed share as the share file remembers it, and as the node serves it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(super) struct KnownShare {
    resource: String,
    capacity: u64,
    offset: u64,
    len: u64,
}

impl KnownShare {
    /// Whether this is the share of `wanted`'s resource, seen at the same capacity.
    fn fits(&self, wanted: &ShareWanted) -> bool {
        self.resource == wanted.want.resource && self.capacity == wanted.want.capacity
    }

    /// This share, to be claimed back where it is.
    fn want(&self) -> ShareWant {
        ShareWant {
            resource: self.resource.clone(),
            capacity: self.capacity,
            len: self.len,
            at: Some(self.offset),
            grow_to: None,
        }
    }

    /// This share as `domain status` shows it.
    pub(super) fn doc(&self) -> fabric_proto::domain::ShareDoc {
        fabric_proto::domain::ShareDoc { resource: self.resource.clone(), offset: self.offset, len: self.len }
    }
}

/// The share file: this node's shares in which domain.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct ShareMemory {
    domain: String,
    node: String,
    shares: Vec<KnownShare>,
}

fn remember_shares(path: &Path, config: &DomainConfig, shares: &[KnownShare]) -> Result<(), JoinError> {
    let memory = ShareMemory { domain: config.name.clone(), node: config.node.clone(), shares: shares.to_vec() };
    write_json(path, &memory)
}

/// The remembered shares, when the file names this domain and node (none otherwise: a
/// damaged or missing file is no share known).
fn remembered_shares(path: &Path, config: &DomainConfig) -> Vec<KnownShare> {
    let Ok(bytes) = std::fs::read(path) else { return Vec::new() };
    match serde_json::from_slice::<ShareMemory>(&bytes) {
        Ok(m) if m.domain == config.name && m.node == config.node => m.shares,
        Ok(_) => Vec::new(),
        Err(_) => {
            tracing::warn!(file = %path.display(), "share file is damaged: ignored");
            Vec::new()
        }
    }
}

/// Writes `value` to `path` whole ([`fabric_addrmap::durable::write_whole`]: a temporary
/// file, fsync, rename, fsync of the directory).
fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), JoinError> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| JoinError::SlotFile { path: path.to_owned(), source: std::io::Error::other(e) })?;
    // All or nothing, and on disk before the join goes on: a crash leaves the old slot or
    // the new one, never an empty file.
    fabric_addrmap::durable::write_whole(path, &bytes)
        .map(drop)
        .map_err(|e| JoinError::SlotFile { path: e.path, source: e.source })
}

/// The slot file: which slot this node held in which domain.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct SlotMemory {
    domain: String,
    node: String,
    slot: u32,
    node_span: u64,
}

fn remember(path: &Path, config: &DomainConfig, slot: u32, node_span: u64) -> Result<(), JoinError> {
    let memory = SlotMemory { domain: config.name.clone(), node: config.node.clone(), slot, node_span };
    write_json(path, &memory)
}

/// The remembered slot, when the file names this domain, node and span.
fn remembered(path: &Path, config: &DomainConfig, node_span: u64) -> Result<Option<u32>, JoinError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(JoinError::SlotFile { path: path.to_owned(), source }),
    };
    let Ok(memory) = serde_json::from_slice::<SlotMemory>(&bytes) else {
        tracing::warn!(file = %path.display(), "slot file is damaged: ignored");
        return Ok(None);
    };
    let same = memory.domain == config.name && memory.node == config.node && memory.node_span == node_span;
    Ok(same.then_some(memory.slot))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};

    use super::*;

    fn node_with_pool_device() -> Inventory {
        let mut dev = Device::new(DeviceId::cxl(0x5eed0000), DeviceKind::CxlMemdev, Some("tray0"));
        dev.memory.push(MemoryResource { kind: MemoryKind::CxlVolatile, size: 1 << 30, hpa: None, numa_node: None });
        let mut inv = Inventory::default();
        inv.devices.push(dev);
        inv
    }

    fn config(device: &str) -> Config {
        let text = format!(
            "[map]\nnode_span = {{ fixed = 1099511627776 }}\n[domain]\nname = \"d\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"tray0\"\n\
             [[memory.shares]]\ndevice = \"{device}\"\nbytes = 268435456\n"
        );
        Config::parse(&text, Path::new("test.toml"), Path::new("/etc/fabric")).expect("config")
    }

    /// A share device spelled in another case than the kernel's names the device the node
    /// has: skipped with a warning, it would be served whole, over the other hosts' shares.
    #[test]
    fn a_share_device_spelled_in_another_case_is_refused_not_skipped() {
        let inv = node_with_pool_device();
        let wants = share_wants(&config("serial:cxl/0x5eed0000"), &inv).expect("the device's own spelling");
        assert_eq!(
            wants.iter().map(|w| w.want.resource.as_str()).collect::<Vec<_>>(),
            ["serial:cxl/0x5eed0000/cxl_volatile0"]
        );
        match share_wants(&config("serial:cxl/0x5EED0000"), &inv) {
            Err(JoinError::ShareDevice { listed, seen }) => {
                assert_eq!((listed.as_str(), seen.as_str()), ("serial:cxl/0x5EED0000", "serial:cxl/0x5eed0000"))
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // A device this node does not have at all is another host's: skipped.
        assert!(share_wants(&config("serial:cxl/0x1234"), &inv).expect("skipped").is_empty());
        assert_eq!(groups(&config("serial:cxl/0x5eed0000"), &inv).len(), 1, "its pool is in the member record");
    }
}
