//! Whether an importer node is in the NVLink domain of one of this node's GPUs — what a
//! CUDA fabric handle needs to be imported there. Two sources, either enough: the NVLink
//! cliques the member records carry (NVML's cluster UUID and clique id, on real NVL
//! hosts), and the domain's merged topology, where a GPU of the importer node reaches the
//! GPU by NVLink (through the fabric-level switches, as on the sim supernode).
//! The same two sources say whether an importer node may load and store a region on the
//! sim's shared fabric: one of its devices must share a scale-up domain (NVLink, xGMI,
//! UALink) with the region's device, as the sim's shared files stand in for that fabric.

use fabric_domain::{DataPathKind, FabricGroup};
use fabric_nodelink::PeerError;
use fabric_proto::wire::ErrorCode;
use fabric_topology::{DeviceId, DeviceKind, Fabric, HopClass};

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
    match domain.fabric() {
        Ok(view) if reaches_by_nvlink(&view.fabric, device, importer) => Ok(()),
        Ok(_) => Err(refused(format!(
            "node {importer} is not in the NVLink domain of {device} (no shared NVLink clique, no NVLink path in the domain's topology): a CUDA fabric handle is imported only within one NVLink domain; copy the bytes instead"
        ))),
        Err(e) => Err(refused(format!(
            "the domain's topology does not build ({e}), so the NVLink domain of {device} is unknown"
        ))),
    }
}

/// `Ok` when a device of node `importer` reaches `device` (this node's) by a scale-up
/// fabric with memory semantics (NVLink, xGMI, UALink), or shares an NVLink clique with
/// this node; otherwise why not, for the log (the importer gets a copy-only grant).
pub fn scale_up(d: &Daemon, device: &DeviceId, importer: &str) -> Result<(), String> {
    let Some(domain) = &d.domain else { return Err("this node is in no domain".into()) };
    let theirs: Vec<FabricGroup> =
        domain.view().members().find(|m| m.name == importer).map(|m| m.groups.clone()).unwrap_or_default();
    if shares_clique(domain.groups(), &theirs) {
        return Ok(());
    }
    match domain.fabric() {
        Ok(view)
            if reaches(&view.fabric, device, importer, |c| {
                matches!(c, HopClass::Nv(_) | HopClass::Xgmi(_) | HopClass::Ual(_))
            }) =>
        {
            Ok(())
        }
        Ok(_) => {
            Err(format!("no device of node {importer} shares a scale-up domain with {device} in the domain's topology"))
        }
        Err(e) => Err(format!("the domain's topology does not build ({e})")),
    }
}

fn refused(message: String) -> PeerError {
    PeerError::Denied { code: ErrorCode::NotImplemented, message }
}

/// Whether the two group lists name one NVLink clique.
fn shares_clique(ours: &[FabricGroup], theirs: &[FabricGroup]) -> bool {
    ours.iter().any(|g| matches!(g, FabricGroup::NvlinkClique { .. }) && theirs.contains(g))
}

/// Whether a GPU of node `importer` reaches `device` by NVLink in `fabric`.
fn reaches_by_nvlink(fabric: &Fabric, device: &DeviceId, importer: &str) -> bool {
    reaches(fabric, device, importer, |c| matches!(c, HopClass::Nv(_)))
}

/// Whether a GPU or accelerator of node `importer` reaches `device` in `fabric` by a
/// class that `by` accepts.
fn reaches(fabric: &Fabric, device: &DeviceId, importer: &str, by: impl Fn(HopClass) -> bool) -> bool {
    let Some(a) = fabric.inventory().find(device) else { return false };
    fabric
        .devices_of(DeviceKind::Gpu)
        .chain(fabric.devices_of(DeviceKind::Accelerator))
        .filter(|b| fabric.device(*b).node.as_deref() == Some(importer))
        .any(|b| by(fabric.classify(a, b)))
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
}
