//! The partition operations: list (what the caller may see), set and remove (admins:
//! the authorization table says so), with the uid/gid bindings kept in
//! [`crate::partitions`]. On a domain node they are the domain's partitions instead:
//! `partitions/<name>` records in etcd, naming devices of any nodes (see
//! `docs/domain.md`).

use fabric_proto::wire::{BoundedVec, DeviceName, ErrorBody, ErrorCode, Name, PartitionSpec, PartitionsResponse};

use fabric_domain::PartitionRecord;
use fabric_domain::records::Record;

use crate::daemon::Daemon;
use crate::ops::dispatch::errors::{internal, refusal};
use crate::ops::dispatch::operation::PartitionChange;
use crate::ops::scope::{Caller, Scope};
use crate::partitions::Binding;

/// The partitions `caller` may see: all of them for an admin, those that bind it for
/// anyone else (none for an unbound client).
pub fn partition_list(d: &Daemon, caller: &Caller) -> PartitionsResponse {
    if let Some(domain) = &d.domain {
        let specs = domain
            .view()
            .partitions()
            .filter(|p| caller.in_partition(&p.name))
            .map(|p| PartitionSpec {
                name: Name::truncated(&p.name),
                devices: BoundedVec::new(p.devices.iter().map(|id| DeviceName::truncated(id.as_str())).collect())
                    .unwrap_or_default(),
                uids: BoundedVec::new(p.uids.clone()).unwrap_or_default(),
                gids: BoundedVec::new(p.gids.clone()).unwrap_or_default(),
            })
            .collect();
        return PartitionsResponse { partitions: BoundedVec::new(specs).unwrap_or_default() };
    }
    let view = d.map_view();
    let specs = view
        .map
        .state()
        .partitions
        .iter()
        .filter(|p| caller.admin() || matches!(&caller.scope, Scope::Bound(b) if b.contains(&p.name)))
        .map(|p| {
            let b = view.binding(&p.name);
            PartitionSpec {
                name: Name::truncated(&p.name),
                devices: BoundedVec::new(p.devices.iter().map(|id| DeviceName::truncated(&id.to_string())).collect())
                    .unwrap_or_default(),
                uids: BoundedVec::new(b.uids).unwrap_or_default(),
                gids: BoundedVec::new(b.gids).unwrap_or_default(),
            }
        })
        .collect();
    PartitionsResponse { partitions: BoundedVec::new(specs).unwrap_or_default() }
}

/// `Partitions` set: a change holds the map writer's lock throughout, saves the address
/// map state and the bindings as one record (temporary file, fsync, rename, fsync of the
/// directory: `crate::store`), publishes both and only then returns; a crash leaves the
/// old partition or the new one, never devices bound to a stale set of users. The caller
/// is authorized (an admin).
pub fn set_partition(d: &Daemon, caller: &Caller, change: &PartitionChange) -> Result<(), ErrorBody> {
    if let Some(domain) = &d.domain {
        let merged = domain.fabric().map_err(|e| refusal(ErrorCode::Internal, format!("domain fabric: {e}")))?;
        let inv = merged.fabric.inventory();
        if let Some(id) = change.devices.iter().find(|id| inv.find(id).is_none()) {
            return Err(refusal(ErrorCode::NotFound, format!("no device {id} in the domain")));
        }
        let record = PartitionRecord::new(&change.name, change.devices.clone(), &change.uids, &change.gids);
        record.validate().map_err(|e| refusal(ErrorCode::BadRequest, format!("partition {}: {e}", change.name)))?;
        domain.set_partition(&change.name, Some(&record)).map_err(|e| domain_refusal(&change.name, &e))?;
        tracing::info!(
            uid = caller.uid(),
            partition = %change.name,
            devices = change.devices.len(),
            uids = ?change.uids,
            gids = ?change.gids,
            "domain partition set"
        );
        return Ok(());
    }
    let mut map = d.map_writer();
    let view = d.view();
    if let Some(id) = change.devices.iter().find(|id| view.fabric.inventory().find(id).is_none()) {
        return Err(refusal(ErrorCode::NotFound, format!("no device {id}")));
    }
    let binding = Binding::new(&change.name, &change.uids, &change.gids);
    let committed = d
        .commit_map(&mut map, |m, bindings| {
            *bindings = crate::partitions::with_binding(bindings, &binding)?;
            Ok(m.partition(&change.name, &change.devices))
        })
        .map_err(|e| internal("saving the partition", &e))?;
    tracing::info!(
        uid = caller.uid(),
        pid = caller.principal().pid(),
        partition = %change.name,
        devices = change.devices.len(),
        uids = ?change.uids,
        gids = ?change.gids,
        generation = committed.generation,
        "partition set"
    );
    Ok(())
}

/// `Partitions` remove: the partition's devices and its binding go in one record (see
/// [`set_partition`]).
pub fn remove_partition(d: &Daemon, caller: &Caller, name: &str) -> Result<(), ErrorBody> {
    if let Some(domain) = &d.domain {
        if !domain.view().partitions().any(|p| p.name == name) {
            return Err(refusal(ErrorCode::NotFound, format!("no partition {name:?} in the domain")));
        }
        domain.set_partition(name, None).map_err(|e| domain_refusal(name, &e))?;
        tracing::info!(uid = caller.uid(), partition = %name, "domain partition removed");
        return Ok(());
    }
    let mut map = d.map_writer();
    // The writer's lock is held: the published view is the writer's state.
    if !d.map_view().has_partition(name) {
        return Err(refusal(ErrorCode::NotFound, format!("no partition {name:?}")));
    }
    let in_map = map.map().state().partitions.iter().any(|p| p.name == name);
    d.commit_map(&mut map, |m, bindings| {
        if in_map {
            m.remove_partition(name)?;
        }
        if let Some(rest) = crate::partitions::without_binding(bindings, name) {
            *bindings = rest;
        }
        Ok(())
    })
    .map_err(|e| internal("removing the partition", &e))?;
    tracing::info!(uid = caller.uid(), pid = caller.principal().pid(), partition = %name, "partition removed");
    Ok(())
}

/// A domain partition change etcd did not take (or this node could not ask).
fn domain_refusal(name: &str, e: &crate::tasks::domain::GcError) -> ErrorBody {
    refusal(ErrorCode::Unavailable, format!("domain partition {name}: {}", crate::error_chain(e)))
}

#[cfg(test)]
mod tests {
    use fabric_proto::wire::{
        AccessMode, ExportInfo, ExportPolicy, FrameKind, HEADER_LEN, Header, Message, RegionInfo, RegionsRequest,
        RegionsResponse, Request, ResourceName, Response, TopologyRequest, decode_body, decode_header, encode_message,
    };

    use super::*;

    /// `fuzz/seeds/wire_frame` holds frames of the opcodes protocol 1.1 added; they must
    /// stay decodable (FABRICD_WRITE_SEEDS=1 rewrites them).
    #[test]
    fn wire_seeds_of_the_1_1_opcodes_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/wire_frame");
        let policy = ExportPolicy {
            uids: BoundedVec::new(vec![61001]).unwrap(),
            gids: BoundedVec::default(),
            partition: Some(Name::truncated("tenant-a")),
            access: AccessMode::ReadOnly,
        };
        let listing = RegionsResponse {
            regions: BoundedVec::new(vec![RegionInfo {
                region: 1,
                generation: 1,
                owner_uid: 61001,
                owner_pid: 42,
                resource: ResourceName {
                    device: DeviceName::truncated("uuid:GPU-0"),
                    memory: fabric_proto::wire::MemoryClass::Hbm,
                    ordinal: 0,
                },
                offset: 0,
                size: 2 << 20,
            }])
            .unwrap(),
            exports: BoundedVec::new(vec![ExportInfo {
                region: 1,
                generation: 1,
                owner_uid: 61001,
                policy,
                revoked: false,
            }])
            .unwrap(),
            imports: BoundedVec::default(),
            truncated: false,
        };
        let seeds = [
            ("regions_request", Message::Request(Request::Regions(RegionsRequest { all: true }))),
            ("inventory_request", Message::Request(Request::Inventory(TopologyRequest::default()))),
            ("regions_response", Message::Response(Response::Regions(listing))),
        ];
        for (name, msg) in seeds {
            let op = msg.opcode().unwrap();
            let mut frame = Vec::new();
            encode_message(&Header::new(op, msg.kind(), 7), &msg, &mut frame).unwrap();
            let path = dir.join(name);
            if std::env::var_os("FABRICD_WRITE_SEEDS").is_some() {
                std::fs::write(&path, &frame).unwrap();
            }
            let bytes = std::fs::read(&path).unwrap();
            let h = decode_header(&bytes).unwrap();
            assert!(h.kind == FrameKind::Request || h.kind == FrameKind::Response);
            assert_eq!(decode_body(&h, &bytes[HEADER_LEN..]).unwrap(), msg, "{name}");
        }
    }
}
