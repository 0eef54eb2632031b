//! The listing and admin operations over the daemon's registries: `Partitions` (list for
//! anyone, set and remove for admins, with the uid/gid bindings kept in
//! [`crate::partitions`]) and `Regions` (the caller's regions, exports and imports, or
//! everyone's for an admin).

use fabric_proto::wire::{
    BoundedVec, DeviceName, ErrorBody, ErrorCode, Name, PartitionSpec, PartitionsRequest, PartitionsResponse,
    RegionsRequest, RegionsResponse,
};
use fabric_topology::DeviceId;

use crate::daemon::Daemon;
use crate::ops::refusal;
use crate::partitions::Binding;
use crate::scope::{Caller, Scope};

fn admin_required(d: &Daemon, caller: &Caller, what: &str) -> ErrorBody {
    let group = d.config.socket.admin_group.as_deref().unwrap_or("(none configured)");
    refusal(
        ErrorCode::AdminRequired,
        format!("{what} needs root or membership of socket.admin_group {group}; uid {} is neither", caller.cred.uid),
    )
}

/// The partitions `caller` may see: all of them for an admin, those that bind it for
/// anyone else (none for an unbound client).
pub fn partition_list(d: &Daemon, caller: &Caller) -> PartitionsResponse {
    let map = d.map_snapshot();
    let specs = map
        .state()
        .partitions
        .iter()
        .filter(|p| caller.admin || matches!(&caller.scope, Scope::Bound(b) if b.contains(&p.name)))
        .map(|p| {
            let b = d.partitions.get(&p.name);
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

/// `Partitions`. A change holds the map writer's lock throughout, saves the address map
/// state and the bindings as one record (temporary file, fsync, rename, fsync of the
/// directory: `crate::store`), publishes both and only then answers; a crash leaves the
/// old partition or the new one, never devices bound to a stale set of users.
pub fn partitions(d: &Daemon, caller: &Caller, req: PartitionsRequest) -> Result<PartitionsResponse, ErrorBody> {
    if matches!(req, PartitionsRequest::List) {
        return Ok(partition_list(d, caller));
    }
    if !caller.admin {
        return Err(admin_required(d, caller, "changing partitions"));
    }
    let internal = |what: &str, e: &dyn std::error::Error| {
        refusal(ErrorCode::Internal, format!("{what}: {}", crate::error_chain(e)))
    };
    {
        let mut map = d.map_writer();
        match &req {
            PartitionsRequest::Set(spec) => {
                if spec.name.is_empty() {
                    return Err(refusal(ErrorCode::BadRequest, "a partition needs a name"));
                }
                let mut ids = Vec::new();
                for dev in spec.devices.iter() {
                    let id = dev
                        .parse::<DeviceId>()
                        .map_err(|e| refusal(ErrorCode::BadRequest, format!("device {dev:?}: {e}")))?;
                    if d.view().fabric.inventory().find(&id).is_none() {
                        return Err(refusal(ErrorCode::NotFound, format!("no device {id}")));
                    }
                    ids.push(id);
                }
                let binding = Binding::new(&spec.name, &spec.uids, &spec.gids);
                let change = d
                    .commit_map(&mut map, |m, bindings| {
                        *bindings = crate::partitions::with_binding(bindings, &binding)?;
                        Ok(m.partition(&spec.name, &ids))
                    })
                    .map_err(|e| internal("saving the partition", &e))?;
                tracing::info!(
                    uid = caller.cred.uid,
                    pid = caller.cred.pid,
                    partition = %spec.name,
                    devices = ids.len(),
                    uids = ?spec.uids.as_slice(),
                    gids = ?spec.gids.as_slice(),
                    generation = change.generation,
                    "partition set"
                );
            }
            PartitionsRequest::Remove { name } => {
                let in_map = map.map().state().partitions.iter().any(|p| p.name == name.as_str());
                let bound = d.partitions.snapshot().iter().any(|b| b.name == name.as_str());
                if !in_map && !bound {
                    return Err(refusal(ErrorCode::NotFound, format!("no partition {name:?}")));
                }
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
                tracing::info!(uid = caller.cred.uid, pid = caller.cred.pid, partition = %name, "partition removed");
            }
            PartitionsRequest::List => {}
        }
    }
    Ok(partition_list(d, caller))
}

/// `Regions`: the caller's regions, exports and imports (by uid, across its sessions),
/// or with `all` everyone's (admins only).
pub fn regions(d: &Daemon, caller: &Caller, req: RegionsRequest) -> Result<RegionsResponse, ErrorBody> {
    if req.all && !caller.admin {
        return Err(admin_required(d, caller, "listing every uid's regions"));
    }
    Ok(d.memory.list(if req.all { None } else { Some(caller.cred.uid) }))
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
