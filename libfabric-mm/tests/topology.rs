//! Topology queries against a real fabricd on the bundled HGX sim
//! (configs/sim/hgx-h100-8gpu.toml): GPUs talk over NVLink through the NVSwitches (bundles
//! of 5, 4, 4 and 5 NVLink4 links, 25,000 MB/s each), NICs hang off PCIe Gen5 switches, two
//! sockets, and nic1 trained at x8 instead of x16.
#![allow(clippy::unwrap_used)]

mod common;

use fabric_mm::{Memory, MemoryClass};
use fabric_topology::{DeviceKind, link::pcie_mbps};

/// Identity of the device named `name` on the sim node (`gpu0`, `nic4`, `numa1`, …).
fn id_of(view: &fabric_mm::FabricView, name: &str) -> String {
    let inv = view.fabric().inventory();
    let d = inv
        .devices
        .iter()
        .find(|d| d.name.as_deref() == Some(name) || d.id.to_string().ends_with(&format!("/{name}")))
        .or_else(|| {
            // GPUs are named by UUID and NICs by PCI address: the sim file's `gpuN` / `nicN`
            // is the Nth of its kind, in the file's order.
            let (kind, k) = match name.split_at(3) {
                ("gpu", k) => (DeviceKind::Gpu, k),
                ("nic", k) => (DeviceKind::Nic, k),
                _ => return None,
            };
            inv.devices.iter().filter(|d| d.kind == kind).nth(k.parse().ok()?)
        })
        .unwrap_or_else(|| panic!("no {name} in the sim fabric"));
    d.id.to_string()
}

#[test]
fn paths_give_the_sim_files_classes_and_bottlenecks() {
    let d = common::daemon();
    let s = common::session(&d.socket);
    let view = s.fabric_view().unwrap();
    let (gpu0, gpu1) = (id_of(&view, "gpu0"), id_of(&view, "gpu1"));

    // GPU to GPU: NV18 (all 18 links, through the NVSwitches), and the widest single
    // route runs through a 5-link bundle: 5 x 25,000 MB/s.
    let nv = s.path(&gpu0, &gpu1).unwrap();
    assert_eq!(nv.class, "NV18", "{nv:?}");
    assert_eq!(nv.bandwidth_mbps, Some(5 * 25_000), "{nv:?}");
    assert_eq!(nv.route.first(), Some(&gpu0));
    assert_eq!(nv.route.last(), Some(&gpu1));
    let kind_of = |id: &str| {
        let inv = view.fabric().inventory();
        inv.devices.iter().find(|d| d.id.to_string() == id).map(|d| d.kind)
    };
    assert_eq!(nv.route.len(), 3, "{nv:?}");
    assert_eq!(kind_of(&nv.route[1]), Some(DeviceKind::NvSwitch), "through an NVSwitch: {nv:?}");
    assert_eq!(nv.degraded_links, 0);

    // A GPU on socket 0 to a NIC on socket 1: SYS, over the CPUs' link, and no faster
    // than the NIC's PCIe Gen5 x16 link.
    let nic4 = id_of(&view, "nic4");
    let sys = s.path(&gpu0, &nic4).unwrap();
    assert_eq!(sys.class, "SYS", "{sys:?}");
    assert!(sys.route.iter().any(|h| h.ends_with("numa0")) && sys.route.iter().any(|h| h.ends_with("numa1")));
    assert!(sys.bandwidth_mbps.unwrap() <= pcie_mbps(5, 16).unwrap(), "{sys:?}");
    assert!(sys.bandwidth_mbps < nv.bandwidth_mbps);

    // Same PCIe switch: PIX; nic1 trained at x8: the bottleneck is Gen5 x8, built for x16.
    let nic0 = id_of(&view, "nic0");
    let pix = s.path(&gpu0, &nic0).unwrap();
    assert_eq!(pix.class, "PIX", "{pix:?}");
    assert_eq!(pix.bandwidth_mbps, pcie_mbps(5, 16));
    let slow = s.path(&gpu0, &id_of(&view, "nic1")).unwrap();
    assert_eq!(slow.class, "PIX");
    assert_eq!(slow.bandwidth_mbps, pcie_mbps(5, 8), "{slow:?}");
    assert_eq!(slow.max_bandwidth_mbps, pcie_mbps(5, 16));
    assert_eq!(slow.degraded_links, 1);

    // Itself: X.
    assert_eq!(s.path(&gpu0, &gpu0).unwrap().class, "X");
    // Unknown devices are refused, not guessed.
    assert!(s.path(&gpu0, "uuid:GPU-nope").is_err());
}

#[test]
fn nearest_memory_ranks_own_hbm_then_nvlink_peers_then_host_dram() {
    let d = common::daemon();
    let s = common::session(&d.socket);
    let view = s.fabric_view().unwrap();
    let gpu0 = id_of(&view, "gpu0");

    let all = s.nearest_memory(&gpu0, None).unwrap();
    assert_eq!(all[0].device, gpu0, "its own HBM first");
    assert_eq!((all[0].memory, all[0].path.class.as_str()), (MemoryClass::Hbm, "X"));
    // Then the seven other GPUs over NVLink, before any host memory.
    assert!(all[1..8].iter().all(|m| m.memory == MemoryClass::Hbm && m.path.class == "NV18"), "{all:#?}");
    let dram: Vec<_> = all.iter().filter(|m| m.memory == MemoryClass::Dram).collect();
    assert_eq!(dram.len(), 2, "two sockets: {all:#?}");
    // gpu0 sits on socket 0: its DRAM ranks before socket 1's.
    assert!(dram[0].device.ends_with("numa0") && dram[1].device.ends_with("numa1"), "{dram:#?}");
    assert!(dram[0].path.bandwidth_mbps >= dram[1].path.bandwidth_mbps);

    let only = s.nearest_memory(&gpu0, Some(MemoryClass::Dram)).unwrap();
    assert_eq!(only.iter().map(|m| &m.device).collect::<Vec<_>>(), dram.iter().map(|m| &m.device).collect::<Vec<_>>());

    // alloc_nearest lands on the GPU's own HBM.
    let r = s.alloc_nearest(&gpu0, 1 << 20).unwrap();
    let loc = s.translate(&[r.gfa().unwrap()]).unwrap();
    assert!(
        matches!(&loc[0], fabric_mm::Location::Resource { device, memory: MemoryClass::Hbm, .. } if *device == gpu0),
        "{loc:?}"
    );
}

#[test]
fn the_c_abi_gives_the_same_path_and_allocates_nearest() {
    use fabric_mm::ffi::{FMM_OK, fmm_region_free, fmm_session_close, fmm_session_open};
    use fabric_mm::ffi_path::{FmmPath, fmm_alloc_nearest, fmm_path};
    use std::ffi::CString;

    let d = common::daemon();
    let s = common::session(&d.socket);
    let view = s.fabric_view().unwrap();
    let (gpu0, nic4) = (id_of(&view, "gpu0"), id_of(&view, "nic4"));
    let want = s.path(&gpu0, &nic4).unwrap();

    let sock = CString::new(d.socket.to_str().unwrap()).unwrap();
    let (a, b) = (CString::new(gpu0.clone()).unwrap(), CString::new(nic4).unwrap());
    let mut session = std::ptr::null_mut();
    // SAFETY: valid strings and out-pointers; every handle is closed below.
    unsafe {
        assert_eq!(fmm_session_open(sock.as_ptr(), 0, 1 << 44, &mut session), FMM_OK);
        let mut p = std::mem::zeroed::<FmmPath>();
        assert_eq!(fmm_path(session, a.as_ptr(), b.as_ptr(), &mut p), FMM_OK);
        let class = std::ffi::CStr::from_ptr(p.class.as_ptr()).to_str().unwrap();
        assert_eq!(class, want.class);
        assert_eq!(Some(p.bandwidth_mbps), want.bandwidth_mbps);
        assert_eq!(p.hops as usize, want.route.len());
        assert!(fmm_path(session, a.as_ptr(), std::ptr::null(), &mut p) < 0, "NULL is refused");
        let mut region = std::ptr::null_mut();
        assert_eq!(fmm_alloc_nearest(session, a.as_ptr(), 1 << 20, &mut region), FMM_OK);
        assert!(!region.is_null());
        fmm_region_free(region);
        fmm_session_close(session);
    }
}

#[test]
fn the_c_abi_ranks_nearest_memory_as_the_rust_api_does() {
    use fabric_mm::ffi::{FMM_E_ARG, FMM_MEM_DRAM, FMM_MEM_HBM, FMM_OK, fmm_session_close, fmm_session_open};
    use fabric_mm::ffi_path::{FMM_MEM_ANY, FmmNearMemory, fmm_nearest_memory};
    use std::ffi::{CStr, CString};

    let d = common::daemon();
    let s = common::session(&d.socket);
    let view = s.fabric_view().unwrap();
    let gpu0 = id_of(&view, "gpu0");
    let want = s.nearest_memory(&gpu0, None).unwrap();
    let want_dram = s.nearest_memory(&gpu0, Some(MemoryClass::Dram)).unwrap();
    assert!(want.len() > 2 && want_dram.len() == 2, "{want:#?}");

    let sock = CString::new(d.socket.to_str().unwrap()).unwrap();
    let dev = CString::new(gpu0.clone()).unwrap();
    let mut session = std::ptr::null_mut();
    // SAFETY: valid strings, out-pointers and arrays of the capacities passed; the
    // session is closed below.
    unsafe {
        assert_eq!(fmm_session_open(sock.as_ptr(), 0, 1 << 44, &mut session), FMM_OK);
        // Sizing call: no array, the count only.
        let mut count = 0usize;
        let nearest = |class, out: &mut [FmmNearMemory], count: &mut usize| {
            fmm_nearest_memory(session, dev.as_ptr(), class, out.as_mut_ptr(), out.len(), count)
        };
        assert_eq!(nearest(FMM_MEM_ANY, &mut [], &mut count), FMM_OK);
        assert_eq!(count, want.len());

        let mut all = vec![std::mem::zeroed::<FmmNearMemory>(); count];
        assert_eq!(nearest(FMM_MEM_ANY, &mut all, &mut count), FMM_OK);
        assert_eq!(count, want.len());
        for (got, want) in all.iter().zip(&want) {
            assert_eq!(CStr::from_ptr(got.device.as_ptr()).to_str().unwrap(), want.device);
            let class = match want.memory {
                MemoryClass::Hbm => FMM_MEM_HBM,
                MemoryClass::Dram => FMM_MEM_DRAM,
                other => panic!("the HGX sim has no {other:?}"),
            };
            assert_eq!(got.memory_class, class);
            assert_eq!(got.size, want.size);
            assert_eq!(CStr::from_ptr(got.path.class.as_ptr()).to_str().unwrap(), want.path.class);
            assert_eq!(got.path.bandwidth_mbps, want.path.bandwidth_mbps.unwrap_or(0), "0 for unknown");
            assert_eq!(got.path.hops as usize, want.path.route.len());
        }
        // Nearest first: the GPU's own HBM, as the class `X`.
        assert_eq!(CStr::from_ptr(all[0].device.as_ptr()).to_str().unwrap(), gpu0);
        assert_eq!(CStr::from_ptr(all[0].path.class.as_ptr()).to_str().unwrap(), "X");

        // One class; a short array gets the first entries and the full count.
        let mut one = [std::mem::zeroed::<FmmNearMemory>(); 2];
        one[1].size = 0xDEAD;
        assert_eq!(nearest(FMM_MEM_DRAM, &mut one[..1], &mut count), FMM_OK);
        assert_eq!(count, want_dram.len());
        assert_eq!(CStr::from_ptr(one[0].device.as_ptr()).to_str().unwrap(), want_dram[0].device);
        assert_eq!(one[1].size, 0xDEAD, "nothing written past the capacity");

        // Refusals are typed, with a message.
        assert_eq!(nearest(99, &mut one, &mut count), FMM_E_ARG);
        assert_eq!(
            fmm_nearest_memory(session, dev.as_ptr(), FMM_MEM_ANY, std::ptr::null_mut(), 1, &mut count),
            FMM_E_ARG
        );
        assert_eq!(
            fmm_nearest_memory(session, dev.as_ptr(), FMM_MEM_ANY, one.as_mut_ptr(), 2, std::ptr::null_mut()),
            FMM_E_ARG
        );
        let nobody = CString::new("name:nowhere/nothing").unwrap();
        assert_eq!(
            fmm_nearest_memory(session, nobody.as_ptr(), FMM_MEM_ANY, one.as_mut_ptr(), 2, &mut count),
            FMM_E_ARG
        );
        assert!(!CStr::from_ptr(fabric_mm::ffi::fmm_last_error()).to_bytes().is_empty());
        fmm_session_close(session);
    }
}

/// `fmm_view_*`: one snapshot answers any number of queries without a round trip, with the
/// same answers as the per-call functions; its devices enumerate with their kinds; misuse
/// is a typed error.
#[test]
fn a_c_view_answers_the_gpu_matrix_from_one_snapshot() {
    use fabric_mm::ffi::{FMM_E_ARG, FMM_OK, fmm_session_close, fmm_session_open};
    use fabric_mm::ffi_path::{
        FMM_MEM_ANY, FmmDeviceInfo, FmmNearMemory, FmmPath, fmm_nearest_memory, fmm_path, fmm_view_close,
        fmm_view_device, fmm_view_device_count, fmm_view_nearest_memory, fmm_view_open, fmm_view_path,
    };
    use std::ffi::{CStr, CString};

    let d = common::daemon();
    let sock = CString::new(d.socket.to_str().unwrap()).unwrap();
    let mut session = std::ptr::null_mut();
    let mut view = std::ptr::null_mut();
    // SAFETY: valid strings, out-pointers and arrays; every handle is closed below.
    unsafe {
        assert_eq!(fmm_session_open(sock.as_ptr(), 0, 1 << 44, &mut session), FMM_OK);
        assert_eq!(fmm_view_open(session, &mut view), FMM_OK);
        let n = fmm_view_device_count(view);
        let want = common::session(&d.socket).fabric_view().unwrap().fabric().inventory().devices.len();
        assert_eq!(n, want);
        let mut gpus = Vec::new();
        for i in 0..n {
            let mut info = std::mem::zeroed::<FmmDeviceInfo>();
            assert_eq!(fmm_view_device(view, i, &mut info), FMM_OK);
            let kind = CStr::from_ptr(info.kind.as_ptr()).to_str().unwrap();
            if kind == "gpu" {
                assert!(info.memory_bytes > 0, "a sim GPU has HBM");
                gpus.push(CString::new(CStr::from_ptr(info.id.as_ptr()).to_bytes()).unwrap());
            }
        }
        assert_eq!(gpus.len(), 8, "the HGX sim has eight GPUs");
        let mut info = std::mem::zeroed::<FmmDeviceInfo>();
        assert_eq!(fmm_view_device(view, n, &mut info), FMM_E_ARG, "past the end");
        assert_eq!(fmm_view_device(view, 0, std::ptr::null_mut()), FMM_E_ARG);
        assert_eq!(fmm_view_device_count(std::ptr::null()), 0);
        // The GPU-to-GPU matrix from the view equals the per-call answers.
        for a in &gpus {
            for b in &gpus {
                let (mut from_view, mut fresh) = (std::mem::zeroed::<FmmPath>(), std::mem::zeroed::<FmmPath>());
                assert_eq!(fmm_view_path(view, a.as_ptr(), b.as_ptr(), &mut from_view), FMM_OK);
                assert_eq!(fmm_path(session, a.as_ptr(), b.as_ptr(), &mut fresh), FMM_OK);
                let class = |p: &FmmPath| CStr::from_ptr(p.class.as_ptr()).to_str().unwrap().to_owned();
                assert_eq!(class(&from_view), class(&fresh));
                assert_eq!((from_view.bandwidth_mbps, from_view.hops), (fresh.bandwidth_mbps, fresh.hops));
                if a == b {
                    assert_eq!(class(&from_view), "X");
                } else {
                    assert!(class(&from_view).starts_with("NV"), "{}", class(&from_view));
                }
            }
        }
        let (mut c1, mut c2) = (0usize, 0usize);
        let mut near = vec![std::mem::zeroed::<FmmNearMemory>(); 4];
        let mut fresh = vec![std::mem::zeroed::<FmmNearMemory>(); 4];
        let g = gpus[0].as_ptr();
        assert_eq!(fmm_view_nearest_memory(view, g, FMM_MEM_ANY, near.as_mut_ptr(), 4, &mut c1), FMM_OK);
        assert_eq!(fmm_nearest_memory(session, g, FMM_MEM_ANY, fresh.as_mut_ptr(), 4, &mut c2), FMM_OK);
        assert_eq!(c1, c2);
        for (x, y) in near.iter().zip(&fresh) {
            assert_eq!(CStr::from_ptr(x.device.as_ptr()), CStr::from_ptr(y.device.as_ptr()));
            assert_eq!((x.memory_class, x.size), (y.memory_class, y.size));
        }
        let nobody = CString::new("uuid:GPU-00000000-0000-0000-0000-000000000000").unwrap();
        let mut p = std::mem::zeroed::<FmmPath>();
        assert!(fmm_view_path(view, g, nobody.as_ptr(), &mut p) < 0, "an unknown device is refused");
        assert!(fmm_view_path(std::ptr::null(), g, g, &mut p) < 0, "a NULL view is refused");
        fmm_view_close(view);
        fmm_view_close(std::ptr::null_mut());
        fmm_session_close(session);
    }
}
