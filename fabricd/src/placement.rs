//! Where a region sits in the global fabric address space: the GFA of its first byte
//! (its resource's GFA plus its offset, or its interleave set's GFA plus its offset in the
//! set), and the interleave sets regions can be striped over. A region has a GFA only when
//! its bytes are contiguous in GFA space: a region on one member of an interleave set is
//! not (its bytes are every `ways`-th chunk of the set), so it has none.

use fabric_addrmap::{InterleaveSet, Presence, Snapshot};
use fabric_proto::wire::{ErrorBody, ErrorCode};

use crate::daemon::Daemon;
use crate::memory::{SetSpec, Whereabouts};
use crate::ops::refusal;

// A set made from a CXL region has a name the wire and the journal carry whole.
const _: () = assert!(fabric_addrmap::sync::MAX_REGION_SET_NAME == fabric_proto::wire::Name::MAX);

/// The GFA of the first byte of `w`, when the map places it contiguously.
pub fn gfa_in(snap: &Snapshot, w: &Whereabouts) -> Option<u64> {
    let st = snap.state();
    match w {
        Whereabouts::Resource { device, kind, ordinal, offset, len } => {
            let p = st.placements.iter().find(|p| {
                p.key.device == *device
                    && p.key.kind == *kind
                    && p.key.ordinal == *ordinal
                    && p.presence == Presence::Present
            })?;
            offset.checked_add(*len).filter(|&e| e <= p.size)?;
            p.start.checked_add(*offset)
        }
        Whereabouts::Set { name, offset, len } => {
            let s = st.interleaves.iter().find(|s| s.name == *name && s.presence == Presence::Present)?;
            offset.checked_add(*len).filter(|&e| e <= s.size())?;
            s.start.checked_add(*offset)
        }
    }
}

/// The GFA of region `region`'s first byte, when it has one.
pub fn region_gfa(d: &Daemon, region: u64) -> Option<u64> {
    let w = d.memory.whereabouts(region)?;
    let snap = d.map_snapshot();
    gfa_in(&snap, &w)
}

/// The interleave set `name` of the map `snap` (the one the request was authorized
/// against: a rescan that publishes the set anew meanwhile does not change which devices
/// the allocation lands on), for striping a region over it.
pub fn set_spec(snap: &Snapshot, name: &str) -> Result<SetSpec, ErrorBody> {
    let sets = &snap.state().interleaves;
    let Some(s) = sets.iter().find(|s| s.name == name) else {
        let known: Vec<&str> = sets.iter().map(|s| s.name.as_str()).collect();
        let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
        return Err(refusal(ErrorCode::NotFound, format!("no interleave set {name:?} (sets: {known})")));
    };
    if s.presence != Presence::Present {
        return Err(refusal(ErrorCode::Unavailable, format!("interleave set {name:?} lost a member; it is a hole")));
    }
    Ok(spec_of(s))
}

/// The registry's view of an interleave set of the map.
pub fn spec_of(s: &InterleaveSet) -> SetSpec {
    SetSpec {
        name: s.name.clone(),
        members: s.members.iter().map(|k| (k.device.clone(), k.kind, k.ordinal)).collect(),
        member_size: s.member_size,
        start: s.start,
    }
}
