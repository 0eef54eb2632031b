//! The C ABI of address translation (part of `include/fabric_mm.h`): where a GFA lands —
//! the device, the class and ordinal of its memory resource, the offset in it and the
//! interleave set it went through — over [`crate::Session::translate`], and the way back,
//! resource offsets to GFAs, over [`crate::Session::reverse`]. A child of [`crate::ffi`],
//! whose conventions it shares.

use std::ffi::{c_char, c_int};

use super::{FMM_E_PROTOCOL, FmmSession, arg_err, class, class_code, fail, get, guard, req_str, set_error};
use crate::ffi_path::fill;
use crate::session::{Location, RemotePlace, ResourceOffset};

/// `fmm_location_t.kind`: the GFA lands in a device's memory resource.
pub const FMM_LOCATION_RESOURCE: c_int = 0;
/// `fmm_location_t.kind`: a hole reserved for a vanished owner (`device` names it).
pub const FMM_LOCATION_HOLE: c_int = 1;
/// `fmm_location_t.kind`: nothing holds the address.
pub const FMM_LOCATION_UNMAPPED: c_int = 2;
/// `fmm_location_t.kind`: mapped, but outside the caller's partition.
pub const FMM_LOCATION_NOT_IN_PARTITION: c_int = 3;
/// `fmm_location_t.kind`: in another node's slot of the domain; `node` names it, `live`
/// says whether it is a live member, and `device` (empty for an interleave set's range or
/// a hole of its slot), `memory_class`, `ordinal`, `set` and `offset` say where in its memory.
pub const FMM_LOCATION_REMOTE: c_int = 4;
/// The most GFAs one `fmm_translate` call takes (and resource offsets one `fmm_reverse`).
pub const FMM_TRANSLATE_MAX: usize = 1024;
/// `fmm_reverse`'s answer for a resource offset with no GFA the caller may see (never a
/// mapped GFA: a range ends at or below 2^64 - 1).
pub const FMM_NO_GFA: u64 = u64::MAX;

/// A byte of a device's memory resource (`fmm_reverse`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmResourceOffset {
    /// The device's identity, NUL-terminated (as `fmm_location_t.device` gives it).
    pub device: *const c_char,
    /// The class of memory (`FMM_MEM_*`).
    pub memory_class: c_int,
    /// Which resource of that class on the device.
    pub ordinal: u16,
    /// Byte offset in the resource (a DPA offset for a member of an interleave set).
    pub offset: u64,
}

/// Where a GFA lands (`fmm_translate`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmLocation {
    /// `FMM_LOCATION_*`.
    pub kind: c_int,
    /// `FMM_LOCATION_RESOURCE`: the device's identity; `FMM_LOCATION_HOLE`: the owner the
    /// hole is kept for; else empty. NUL-terminated (the protocol bounds it to 256 bytes).
    pub device: [c_char; 257],
    /// `FMM_LOCATION_RESOURCE`: the class of memory (`FMM_MEM_*`); else -1.
    pub memory_class: c_int,
    /// `FMM_LOCATION_RESOURCE`: which resource of that class on the device; else 0.
    pub ordinal: u16,
    /// `FMM_LOCATION_RESOURCE`: the byte offset in the resource; else 0.
    pub offset: u64,
    /// `FMM_LOCATION_RESOURCE`: the interleave set the address went through, empty when
    /// none; `FMM_LOCATION_REMOTE`: the other node's set the range belongs to, empty when
    /// none. NUL-terminated (at most 64 bytes).
    pub set: [c_char; 65],
    /// `FMM_LOCATION_REMOTE`: the node whose slot holds the address; else empty.
    /// NUL-terminated (at most 64 bytes).
    pub node: [c_char; 65],
    /// `FMM_LOCATION_REMOTE`: 1 when that node is a live member now, 0 when it is gone (its
    /// slot kept as a hole); else 0.
    pub live: c_int,
}

fn c_location(l: &Location) -> Result<FmmLocation, c_int> {
    let mut c = FmmLocation {
        kind: FMM_LOCATION_UNMAPPED,
        device: [0; 257],
        memory_class: -1,
        ordinal: 0,
        offset: 0,
        set: [0; 65],
        node: [0; 65],
        live: 0,
    };
    match l {
        Location::Resource { device, memory, ordinal, offset, set } => {
            c.kind = FMM_LOCATION_RESOURCE;
            fill(&mut c.device, device)?;
            c.memory_class = class_code(*memory);
            c.ordinal = *ordinal;
            c.offset = *offset;
            fill(&mut c.set, set.as_deref().unwrap_or(""))?;
        }
        Location::Hole { owner } => {
            c.kind = FMM_LOCATION_HOLE;
            fill(&mut c.device, owner)?;
        }
        Location::Unmapped => {}
        Location::NotInPartition => c.kind = FMM_LOCATION_NOT_IN_PARTITION,
        Location::Remote { node, live, place } => {
            c.kind = FMM_LOCATION_REMOTE;
            fill(&mut c.node, node)?;
            c.live = c_int::from(*live);
            match place {
                RemotePlace::Resource { device, memory, ordinal, offset } => {
                    fill(&mut c.device, device)?;
                    c.memory_class = class_code(*memory);
                    c.ordinal = *ordinal;
                    c.offset = *offset;
                }
                RemotePlace::Set { set, offset } => {
                    fill(&mut c.set, set)?;
                    c.offset = *offset;
                }
                RemotePlace::Hole => {}
            }
        }
    }
    Ok(c)
}

/// Translates `count` GFAs (at most `FMM_TRANSLATE_MAX`, one round trip): `out[i]` says
/// where `gfas[i]` lands. `count` 0 does nothing (`gfas` and `out` may then be NULL). An
/// address nothing holds is not an error: its kind is `FMM_LOCATION_UNMAPPED`.
///
/// # Safety
/// `s` is a live session; `gfas` has `count` readable entries and `out` room for `count`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_translate(
    s: *const FmmSession,
    gfas: *const u64,
    count: usize,
    out: *mut FmmLocation,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        if count == 0 {
            return Ok(());
        }
        // Before a slice is made of the caller's pointer: a count past isize::MAX bytes
        // (a -1 passed by mistake) would be undefined behaviour there.
        if count > FMM_TRANSLATE_MAX {
            return Err(arg_err(&format!("count {count} is more than FMM_TRANSLATE_MAX ({FMM_TRANSLATE_MAX})")));
        }
        if gfas.is_null() || out.is_null() {
            return Err(arg_err("gfas or out is NULL with a non-zero count"));
        }
        // SAFETY: gfas is non-NULL (checked) with count readable entries (caller contract).
        let gfas = unsafe { std::slice::from_raw_parts(gfas, count) };
        let locations = s.0.translate(gfas).map_err(|e| fail(&e))?;
        if locations.len() != count {
            set_error(&format!("the daemon answered {} of {count} translations", locations.len()));
            return Err(FMM_E_PROTOCOL);
        }
        let converted = locations.iter().map(c_location).collect::<Result<Vec<_>, _>>()?;
        for (i, l) in converted.into_iter().enumerate() {
            // SAFETY: out is non-NULL (checked) with room for count > i entries (caller contract).
            unsafe { out.add(i).write(l) };
        }
        Ok(())
    })
}

/// Finds the GFA of `count` resource offsets (at most `FMM_TRANSLATE_MAX`, one round
/// trip): `gfas[i]` is the GFA of `items[i]`, or `FMM_NO_GFA` where that byte has none the
/// caller may see (unknown or vanished resource, a member of a set that is a hole, outside
/// the caller's partitions, an offset past its mapped bytes). `count` 0 does nothing
/// (`items` and `gfas` may then be NULL). An item with a NULL or non-UTF-8 device or an
/// unknown memory class fails the call with `FMM_E_ARG`, writing nothing.
///
/// # Safety
/// `s` is a live session; `items` has `count` readable entries, each `device` NULL or a
/// NUL-terminated string; `gfas` has room for `count`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_reverse(
    s: *const FmmSession,
    items: *const FmmResourceOffset,
    count: usize,
    gfas: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        if count == 0 {
            return Ok(());
        }
        // Before a slice is made of the caller's pointer: a count past isize::MAX bytes
        // (a -1 passed by mistake) would be undefined behaviour there.
        if count > FMM_TRANSLATE_MAX {
            return Err(arg_err(&format!("count {count} is more than FMM_TRANSLATE_MAX ({FMM_TRANSLATE_MAX})")));
        }
        if items.is_null() || gfas.is_null() {
            return Err(arg_err("items or gfas is NULL with a non-zero count"));
        }
        // SAFETY: items is non-NULL (checked) with count readable entries (caller contract).
        let items = unsafe { std::slice::from_raw_parts(items, count) };
        let items = items
            .iter()
            .map(|i| {
                // SAFETY: each device is NULL or NUL-terminated (caller contract).
                let device = unsafe { req_str(i.device, "device") }?.to_owned();
                Ok(ResourceOffset { device, memory: class(i.memory_class)?, ordinal: i.ordinal, offset: i.offset })
            })
            .collect::<Result<Vec<_>, c_int>>()?;
        let found = s.0.reverse(&items).map_err(|e| fail(&e))?;
        if found.len() != count {
            set_error(&format!("the daemon answered {} of {count} reverse translations", found.len()));
            return Err(FMM_E_PROTOCOL);
        }
        for (i, g) in found.into_iter().enumerate() {
            // SAFETY: gfas is non-NULL (checked) with room for count > i entries (caller contract).
            unsafe { gfas.add(i).write(g.unwrap_or(FMM_NO_GFA)) };
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::ptr::{null, null_mut};

    use super::*;
    use crate::ffi::{FMM_E_ARG, FMM_E_BUFFER, FMM_MEM_CXL_VOLATILE};
    use fabric_proto::wire::MemoryClass;

    fn text(field: &[c_char]) -> &str {
        // SAFETY: c_location NUL-terminates every field it fills, and a zeroed field is empty.
        unsafe { CStr::from_ptr(field.as_ptr()) }.to_str().unwrap()
    }

    #[test]
    fn translate_refuses_a_null_session_even_with_no_gfas() {
        let mut out = [FmmLocation {
            kind: 9,
            device: [0; 257],
            memory_class: 0,
            ordinal: 0,
            offset: 0,
            set: [0; 65],
            node: [0; 65],
            live: 0,
        }];
        // SAFETY: NULL session: refused before gfas or out are touched.
        assert_eq!(unsafe { fmm_translate(null(), [0u64].as_ptr(), 1, out.as_mut_ptr()) }, FMM_E_ARG);
        // SAFETY: as above.
        assert_eq!(unsafe { fmm_translate(null(), null(), 0, null_mut()) }, FMM_E_ARG);
        assert_eq!(out[0].kind, 9, "nothing written");
    }

    #[test]
    fn every_location_kind_converts() {
        let cxl = Location::Resource {
            device: "serial:cxl/0x1".into(),
            memory: MemoryClass::CxlVolatile,
            ordinal: 1,
            offset: 0x1005,
            set: Some("cxl-region:hpa-0x1000000000".into()),
        };
        let c = c_location(&cxl).unwrap();
        assert_eq!(
            (c.kind, c.memory_class, c.ordinal, c.offset),
            (FMM_LOCATION_RESOURCE, FMM_MEM_CXL_VOLATILE, 1, 0x1005)
        );
        assert_eq!((text(&c.device), text(&c.set)), ("serial:cxl/0x1", "cxl-region:hpa-0x1000000000"));
        let hbm = Location::Resource {
            device: "uuid:GPU-1".into(),
            memory: MemoryClass::Hbm,
            ordinal: 0,
            offset: 0,
            set: None,
        };
        assert_eq!(text(&c_location(&hbm).unwrap().set), "");
        let hole = c_location(&Location::Hole { owner: "set:gone".into() }).unwrap();
        assert_eq!((hole.kind, text(&hole.device), hole.memory_class), (FMM_LOCATION_HOLE, "set:gone", -1));
        assert_eq!(c_location(&Location::Unmapped).unwrap().kind, FMM_LOCATION_UNMAPPED);
        assert_eq!(c_location(&Location::NotInPartition).unwrap().kind, FMM_LOCATION_NOT_IN_PARTITION);
    }

    #[test]
    fn another_nodes_memory_names_the_node_and_where_in_it() {
        let remote = |live, place| Location::Remote { node: "tray7".into(), live, place };
        let hbm =
            RemotePlace::Resource { device: "uuid:GPU-7".into(), memory: MemoryClass::Hbm, ordinal: 0, offset: 0x40 };
        let c = c_location(&remote(true, hbm)).unwrap();
        assert_eq!((c.kind, c.live, c.memory_class, c.offset), (FMM_LOCATION_REMOTE, 1, crate::ffi::FMM_MEM_HBM, 0x40));
        assert_eq!((text(&c.node), text(&c.device), text(&c.set)), ("tray7", "uuid:GPU-7", ""));
        let set = c_location(&remote(true, RemotePlace::Set { set: "cxl-region:7".into(), offset: 9 })).unwrap();
        assert_eq!((text(&set.device), text(&set.set), set.offset, set.memory_class), ("", "cxl-region:7", 9, -1));
        let gone = c_location(&remote(false, RemotePlace::Hole)).unwrap();
        assert_eq!((gone.kind, gone.live, text(&gone.node), text(&gone.device)), (FMM_LOCATION_REMOTE, 0, "tray7", ""));
    }

    #[test]
    fn the_longest_protocol_names_fit_and_longer_ones_are_refused() {
        let at = |device: String, set: String| Location::Resource {
            device,
            memory: MemoryClass::Dram,
            ordinal: 0,
            offset: 0,
            set: Some(set),
        };
        let c = c_location(&at("d".repeat(256), "s".repeat(64))).unwrap();
        assert_eq!((text(&c.device).len(), text(&c.set).len()), (256, 64));
        assert_eq!(c_location(&at("d".repeat(257), String::new())).unwrap_err(), FMM_E_BUFFER);
    }
}
