//! Region GFAs and interleave-set allocation on the real daemon: a region's `gfa`
//! translates back to its device and offset, a region striped over a 2-way set lies in the
//! set's window with its chunks alternating between the members, and a region on one
//! member of a set has no GFA (its bytes are not contiguous in GFA space).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocResponse, AllocTarget, CodecError, Connection, DeviceName, ErrorCode, ExportPolicy,
    ExportRequest, FreeRequest, ImportRequest, MemoryClass, Name, Request, ResourceName, Response, TranslateQuery,
    TranslateRequest, Translation,
};
use fabric_topology::{DeviceKind, MemoryKind};

const MIB: u64 = 1 << 20;

fn alloc(c: &mut Connection, target: AllocTarget, size: u64) -> AllocResponse {
    let (r, fds) = c.call(Request::Alloc(AllocRequest { target, size, align: 0 }), &[]).unwrap();
    assert_eq!(fds.len(), 1);
    let Response::Alloc(a) = r else { panic!("{r:?}") };
    a
}

fn translate(c: &mut Connection, gfa: u64) -> Translation {
    let queries = vec![TranslateQuery::Gfa(gfa)].try_into().unwrap();
    let Response::Translate(t) = c.call(Request::Translate(TranslateRequest { queries }), &[]).unwrap().0 else {
        panic!()
    };
    t.results[0].clone()
}

fn at(device: &str, memory: MemoryClass, offset: u64, set: Option<&str>) -> Translation {
    Translation::Resource {
        resource: ResourceName { device: DeviceName::truncated(device), memory, ordinal: 0 },
        offset,
        set: set.map(Name::truncated),
    }
}

#[test]
fn region_gfas_translate_back_and_sets_stripe_over_their_members() {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap();
    let inv = fabric_drivers::sim::load(&sim).unwrap();
    let set = fabric_addrmap::region_sets(&inv).into_iter().find(|s| s.ways == 2).unwrap();
    let (m0, m1) = (set.members[0].device.to_string(), set.members[1].device.to_string());
    assert_eq!(set.members[0].kind, MemoryKind::CxlVolatile);
    let setup = common::Setup::with_sim(&sim, "");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);

    // A region striped over the set: 5 MiB rounds up to 2 ways x 2 MiB granules = 8 MiB.
    let a = alloc(&mut c, AllocTarget::Set(Name::truncated(&set.name)), 5 * MIB);
    assert_eq!(a.size, 8 * MIB);
    let g = a.gfa.expect("a set region has a GFA");
    // Granularity 4 KiB: chunks alternate between the members, each at DPA offset
    // (set offset / 8 KiB) * 4 KiB.
    assert_eq!(translate(&mut c, g), at(&m0, MemoryClass::CxlVolatile, 0, Some(&set.name)));
    assert_eq!(translate(&mut c, g + 4096), at(&m1, MemoryClass::CxlVolatile, 0, Some(&set.name)));
    assert_eq!(translate(&mut c, g + 8192 + 5), at(&m0, MemoryClass::CxlVolatile, 4096 + 5, Some(&set.name)));
    assert_eq!(translate(&mut c, g + 8 * MIB - 1), at(&m1, MemoryClass::CxlVolatile, 4 * MIB - 1, Some(&set.name)));

    // A region on one member takes DPA 4..6 MiB of mem0 and has no GFA (not contiguous).
    let direct = alloc(
        &mut c,
        AllocTarget::Resource(ResourceName {
            device: DeviceName::truncated(&m0),
            memory: MemoryClass::CxlVolatile,
            ordinal: 0,
        }),
        2 * MIB,
    );
    assert_eq!(direct.gfa, None);
    // The next set region skips what any member has in use: DPA 6 MiB, set offset 12 MiB.
    let b = alloc(&mut c, AllocTarget::Set(Name::truncated(&set.name)), 4 * MIB);
    assert_eq!(b.gfa, Some(g + 12 * MIB));
    assert_eq!(translate(&mut c, g + 12 * MIB), at(&m0, MemoryClass::CxlVolatile, 6 * MIB, Some(&set.name)));
    // Freeing the first set region gives its DPA range back in both members.
    c.call(Request::Free(FreeRequest { region: a.region, node: None }), &[]).unwrap();
    let again = alloc(&mut c, AllocTarget::Set(Name::truncated(&set.name)), 8 * MIB);
    assert_eq!(again.gfa, Some(g));

    // An unknown set is refused with the names of the known ones.
    match c.call(
        Request::Alloc(AllocRequest { target: AllocTarget::Set(Name::truncated("nope")), size: MIB, align: 0 }),
        &[],
    ) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, ErrorCode::NotFound);
            assert!(body.message.contains(&set.name), "{}", body.message);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gpu_region_gfa_is_its_hbm_gfa_plus_its_offset() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap().id.to_string();
    let target = || AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm };
    let a = alloc(&mut c, target(), 2 * MIB);
    let b = alloc(&mut c, target(), 4 * MIB);
    let (ga, gb) = (a.gfa.unwrap(), b.gfa.unwrap());
    // Regions sit at offsets 0 and 2 MiB of the HBM: their GFAs differ by that.
    assert_eq!(gb - ga, 2 * MIB);
    assert_eq!(translate(&mut c, ga), at(&gpu, MemoryClass::Hbm, 0, None));
    assert_eq!(translate(&mut c, gb + 12345), at(&gpu, MemoryClass::Hbm, 2 * MIB + 12345, None));
    // The GFA of offset 0 of the HBM, asked the other way, is the first region's.
    let queries = vec![TranslateQuery::Resource {
        resource: ResourceName { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm, ordinal: 0 },
        offset: 0,
    }]
    .try_into()
    .unwrap();
    let Response::Translate(t) = c.call(Request::Translate(TranslateRequest { queries }), &[]).unwrap().0 else {
        panic!()
    };
    assert_eq!(t.results[0], Translation::Gfa(ga));
    // An importer gets the same GFA.
    let policy = ExportPolicy {
        uids: Default::default(),
        gids: Default::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let Response::Export(e) =
        c.call(Request::Export(ExportRequest { region: b.region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    let mut other = common::client(&setup.socket);
    let Response::Import(i) =
        other.call(Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadOnly }), &[]).unwrap().0
    else {
        panic!()
    };
    assert_eq!(i.gfa, Some(gb));
}
