//! Whether an importer node is in the NVLink domain of one of this node's GPUs — what a
//! CUDA fabric handle needs to be imported there. Two sources, either enough: the NVLink
//! cliques the member records carry (NVML's cluster UUID and clique id, on real NVL
//! hosts), and the topology of the two nodes, where a GPU of the importer node reaches the
//! GPU by NVLink (through the fabric-level switches, as on the sim supernode).
//! That topology also says whether an importer node may load and store a region on
//! the sim's shared fabric, which stands in for a scale-up fabric: one of its devices must
//! be in the scale-up domain of the region's device.
//!
//! Both questions are asked of the two nodes' topology records merged alone
//! ([`crate::tasks::domain::Domain::pair_fabric`]), not of the whole domain's: a scale-up
//! path runs through the two nodes' devices and the fabric-level switches around them,
//! which each record carries, never through a third node's devices; and an import after
//! a node of a 12,500-node domain joined or left does not wait for the whole domain to be
//! merged again.

use std::time::{Duration, Instant};

use fabric_domain::{DataPathKind, FabricGroup};
use fabric_nodelink::PeerError;
use fabric_proto::wire::ErrorCode;
use fabric_topology::{DeviceId, DeviceIdx, DeviceKind, Fabric};

use super::owner::On;
use crate::daemon::Daemon;

/// `Ok` when `importer` is in the NVLink domain of `device` (a GPU of this node).
pub fn check(d: &Daemon, device: &DeviceId, importer: &str) -> Result<(), PeerError> {
    let Some(domain) = &d.domain else {
        return Err(refused(format!("this node is in no domain, so node {importer} shares no NVLink domain with it")));
    };
    if !domain.allows(DataPathKind::Nvlink) {
        return Err(refused(format!(
            "the domain's data paths ({}) leave out nvlink: a CUDA fabric handle is not handed to another node; copy the bytes instead",
            domain.data_paths().join(", ")
        )));
    }
    let theirs: Vec<FabricGroup> =
        domain.view().members().find(|m| m.name == importer).map(|m| m.groups.clone()).unwrap_or_default();
    if shares_clique(domain.groups(), &theirs) {
        return Ok(());
    }
    match domain.pair_fabric(importer) {
        Ok(fabric) if reaches_by_nvlink(&fabric, device, importer) => Ok(()),
        Ok(_) => Err(refused(format!(
            "node {importer} is not in the NVLink domain of {device} (no shared NVLink clique, no NVLink path in the two nodes' topology records): a CUDA fabric handle is imported only within one NVLink domain; copy the bytes instead"
        ))),
        Err(e) => Err(refused(format!(
            "the two nodes' topology records do not merge ({e}), so the NVLink domain of {device} is unknown"
        ))),
    }
}

/// Why an importer node gets no sim shared file for a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoReach {
    /// The two nodes' topology records put it outside the region's scale-up domain: copy-only.
    Outside(String),
    /// Not known yet — the importer's topology record not seen, the two records not
    /// merged: refused for now (`Unavailable`), never answered copy-only for good.
    Unknown(String),
}

/// How long [`scale_up`] waits for this node's view of the domain to learn what it does
/// not know yet: a node publishes its topology record right after it joins, so an import
/// it asks at once may arrive first.
const TOPOLOGY_WAIT: Duration = Duration::from_secs(2);

/// `Ok` when a device of node `importer` is in the scale-up domain of `device` (this
/// node's) in the two nodes' merged topology: joined by NVLink, xGMI, UALink or NVLink-C2C
/// links that are up ([`Fabric::same_scale_up_domain`]), so a Grace's memory counts for
/// the GPUs of other trays on the same NVSwitches, and a tray whose NVLinks are all down
/// is outside. A pair's merged topology kept from before answers where this runs; a
/// merge, and the wait for what is not known yet (asked again for up to
/// `TOPOLOGY_WAIT`), go through `on`: never on the domain runtime's workers, whose links'
/// TLS and etcd lease a peer's import must not hold up.
pub fn scale_up(d: &Daemon, device: &DeviceId, importer: &str, on: On) -> Result<(), NoReach> {
    let Some(domain) = &d.domain else { return Err(NoReach::Outside("this node is in no domain".into())) };
    if let Some(fabric) = domain.pair_fabric_cached(importer) {
        match scale_up_in(&fabric, device, importer) {
            Err(NoReach::Unknown(_)) => {}
            known => return known,
        }
    }
    on.blocking(|| {
        let deadline = Instant::now() + TOPOLOGY_WAIT;
        loop {
            let answer = match domain.pair_fabric(importer) {
                Ok(fabric) => scale_up_in(&fabric, device, importer),
                Err(e) => Err(NoReach::Unknown(format!("the two nodes' topology records do not merge ({e})"))),
            };
            match answer {
                Err(NoReach::Unknown(_)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                answer => return answer,
            }
        }
    })
}

/// [`scale_up`] in `fabric`.
fn scale_up_in(fabric: &Fabric, device: &DeviceId, importer: &str) -> Result<(), NoReach> {
    let Some(a) = fabric.inventory().find(device) else {
        return Err(NoReach::Unknown(format!("{device} is not in this node's topology record")));
    };
    if !fabric.nodes().iter().any(|n| n == importer) {
        return Err(NoReach::Unknown(format!("node {importer}'s topology is not known here yet")));
    }
    let mut theirs =
        (0..fabric.len()).map(|i| DeviceIdx(i as u32)).filter(|&b| fabric.device(b).node.as_deref() == Some(importer));
    if theirs.any(|b| fabric.same_scale_up_domain(a, b)) {
        return Ok(());
    }
    Err(NoReach::Outside(format!("no device of node {importer} is in the scale-up domain of {device}")))
}

fn refused(message: String) -> PeerError {
    PeerError::Denied { code: ErrorCode::NotImplemented, message }
}

/// Whether the two group lists name one NVLink clique.
fn shares_clique(ours: &[FabricGroup], theirs: &[FabricGroup]) -> bool {
    ours.iter().any(|g| matches!(g, FabricGroup::NvlinkClique { .. }) && theirs.contains(g))
}

/// Whether a GPU of node `importer` reaches `device` by a scale-up link in `fabric`.
fn reaches_by_nvlink(fabric: &Fabric, device: &DeviceId, importer: &str) -> bool {
    let Some(a) = fabric.inventory().find(device) else { return false };
    fabric
        .devices_of(DeviceKind::Gpu)
        .filter(|b| fabric.device(*b).node.as_deref() == Some(importer))
        .any(|b| matches!(fabric.classify(a, b), fabric_topology::HopClass::Nv(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clique(uuid: &str, id: u32) -> FabricGroup {
        FabricGroup::NvlinkClique { cluster_uuid: uuid.into(), clique_id: id }
    }

    #[test]
    fn only_a_shared_nvlink_clique_counts() {
        let pool = FabricGroup::CxlPool { pool: "p0".into() };
        assert!(shares_clique(&[clique("u", 1)], &[pool.clone(), clique("u", 1)]));
        assert!(!shares_clique(&[clique("u", 1)], &[clique("u", 2)]));
        assert!(!shares_clique(&[clique("u", 1)], &[clique("v", 1)]));
        let pools = [pool.clone()];
        assert!(!shares_clique(&pools, &pools));
        assert!(!shares_clique(&[], &[]));
    }

    /// tray0: a Grace with a GPU on C2C, its GPU on the fabric's NVSwitch; tray1 the
    /// same; tray2's GPU with its NVLink down; tray3 a host with no scale-up link.
    fn trays() -> Fabric {
        use fabric_topology::link::LinkKind;
        use fabric_topology::{Bandwidth, Device, Inventory, Link, LinkState};
        let mut inv = Inventory::new();
        let mut dev = |node: Option<&str>, name: &str, kind| {
            let id = DeviceId::named(node.unwrap_or("fabric"), name);
            inv.add_device(Device::new(id, kind, node)).unwrap()
        };
        let sw = dev(None, "nvsw0", DeviceKind::NvSwitch);
        let mut pairs = Vec::new();
        for t in ["tray0", "tray1", "tray2"] {
            pairs.push((dev(Some(t), "numa0", DeviceKind::Cpu), dev(Some(t), "gpu0", DeviceKind::Gpu)));
        }
        dev(Some("tray3"), "numa0", DeviceKind::Cpu);
        let nv = LinkKind::NvLink { generation: 5, count: 18 };
        for (i, &(cpu, gpu)) in pairs.iter().enumerate() {
            inv.add_link(Link::new(cpu, gpu, LinkKind::C2c, Bandwidth::full(450_000), None));
            let state = if i == 2 { LinkState::Down } else { LinkState::Up };
            inv.add_link(Link { state, ..Link::new(gpu, sw, nv, Bandwidth::full(900_000), None) });
        }
        Fabric::build(inv).unwrap()
    }

    #[test]
    fn an_importer_in_the_devices_scale_up_domain_reaches_it_and_one_unknown_is_not_refused_for_good() {
        let f = trays();
        let (gpu, dram) = (DeviceId::named("tray0", "gpu0"), DeviceId::named("tray0", "numa0"));
        assert_eq!(scale_up_in(&f, &gpu, "tray1"), Ok(()));
        assert_eq!(scale_up_in(&f, &dram, "tray1"), Ok(()), "a Grace's memory: C2C, then NVLink");
        assert!(matches!(scale_up_in(&f, &gpu, "tray2"), Err(NoReach::Outside(_))), "its NVLink is down");
        assert!(matches!(scale_up_in(&f, &dram, "tray3"), Err(NoReach::Outside(_))));
        let unknown = |r| matches!(r, Err(NoReach::Unknown(_)));
        assert!(unknown(scale_up_in(&f, &gpu, "tray9")), "no topology of tray9 yet");
        assert!(unknown(scale_up_in(&f, &DeviceId::named("tray0", "gpu7"), "tray1")));
    }
}
