//! Builds, in a temp dir, the `/sys` that Linux 6.12 shows for a QEMU CXL setup, with the
//! kernel's enumeration numbers as parameters (so tests can renumber it).
//!
//! Where the layout comes from:
//! - Object placement and attribute names: `Documentation/ABI/testing/sysfs-bus-cxl`
//!   (Linux 6.12) and ndctl `cxl/lib/libcxl.c`, which finds ports nested in their parent
//!   port's directory (`root0/port1/port2/endpoint3`), decoders `decoderX.Y` inside port X,
//!   `dportN`/`uport`/`parent_dport` links, and a memdev's host as its parent directory.
//! - `/sys/bus/cxl/devices/X -> ../../../devices/platform/ACPI0017:00/root0/...` for the CXL
//!   root hierarchy and `-> ../../../devices/pci0000:0c/.../memN` for memdevs: the kernel
//!   docs' `cxl list -v` example (driver-api/cxl/.../single-device.rst), which shows root
//!   dports as `pciDDDD:BB`, host-bridge dports as root-port BDFs and endpoint hosts `memN`.
//! - Value formats from `drivers/cxl/core/{port,region,memdev}.c`: `%#llx` sizes and
//!   addresses, `%pa` (16 zero-padded digits) for `dpa_size`, `0xffffffffffffffff` for an
//!   unallocated `dpa_resource`, empty `uuid` for RAM regions, decimal DAX `size`.
//! - QEMU (docs/system/devices/cxl.rst; hw/acpi/cxl.c, where the CHBS UID equals the pxb
//!   `bus_nr`, so the root dport and the window's target are `12`; the window has no
//!   restrictions, so every `cap_*` is 1; FW revision `BWFW VERSION 00`). Command line:
//!
//! ```text
//! qemu-system-x86_64 -M q35,cxl=on -m 4G,maxmem=8G,slots=8 -smp 4 ...
//!  -object memory-backend-ram,id=cxl-mem0,share=on,size=256M   (and cxl-mem1, cxl-mem2)
//!  -object memory-backend-file,id=cxl-pmem0,share=on,mem-path=/tmp/pmem0.raw,size=256M
//!  -object memory-backend-file,id=cxl-lsa0,share=on,mem-path=/tmp/lsa0.raw,size=256M
//!  -object memory-backend-ram,id=cxl-dc0,share=on,size=512M
//!  -device pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1,numa_node=0
//!  -device cxl-rp,port=0,bus=cxl.1,id=root_port0,chassis=0,slot=0
//!  -device cxl-rp,port=1,bus=cxl.1,id=root_port1,chassis=0,slot=1
//!  -device cxl-upstream,bus=root_port0,id=us0
//!  -device cxl-downstream,port=0,bus=us0,id=swport0,chassis=0,slot=4   (port=1..3: swport1..3)
//!  -device cxl-type3,bus=swport0,volatile-memdev=cxl-mem0,id=cxl-vmem0,sn=0x1
//!  -device cxl-type3,bus=swport1,volatile-memdev=cxl-mem1,id=cxl-vmem1,sn=0x2
//!  -device cxl-type3,bus=swport2,volatile-memdev=cxl-mem2,id=cxl-vmem2,sn=0x3
//!  -device cxl-type3,bus=swport3,persistent-memdev=cxl-pmem0,lsa=cxl-lsa0,id=cxl-pmem0,sn=0x4
//!  -device cxl-type3,bus=root_port1,volatile-dc-memdev=cxl-dc0,num-dc-regions=2,id=dcd0,sn=0x5
//!  -M cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G,cxl-fmw.0.interleave-granularity=4k
//! # in the guest:
//! cxl create-region -m -t ram -d decoder0.0 -w 2 -g 256 mem0 mem1     # region0, dax0.0
//! cxl create-region -m -t pmem -d decoder0.0 -w 1 mem3                # region1 (uuid)
//! ```
//!
//! PCI: host bridge `pci0000:0c`, root ports `0c:00.0`/`0c:01.0`, switch upstream `0d:00.0`,
//! downstream `0e:00.0`..`0e:03.0`, memdevs `0f:00.0`, `10:00.0`, `11:00.0`, `12:00.0` and the
//! DCD at `13:00.0`. The window base `0x290000000` is illustrative (QEMU places CFMWs above
//! the device memory region, so it moves with `-m`/`maxmem`). Mainline 6.12 shows the DCD
//! with `ram/size` and `pmem/size` 0 only; its `dc0/size`, `dc1/size` follow the posted DCD
//! series (v8, `memX/dcY/size`), which the backend also reads.

#![allow(dead_code, clippy::unwrap_used)] // Test scaffolding: a failed fixture write should abort the test.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// The kernel's enumeration numbers, which change between boots.
#[derive(Debug, Clone)]
pub struct Names {
    /// Host bridge `portN`.
    pub hb: u32,
    /// Switch `portN`.
    pub sw: u32,
    /// `endpointN` of mem0..mem4 (in PCI order).
    pub ep: [u32; 5],
    /// `memN` of the five memdevs (in PCI order).
    pub mem: [u32; 5],
    /// `regionN` of the RAM and the PMEM region.
    pub region: [u32; 2],
}

impl Default for Names {
    /// The numbering a fresh 6.12 boot gives.
    fn default() -> Self {
        Self { hb: 1, sw: 2, ep: [3, 4, 5, 6, 7], mem: [0, 1, 2, 3, 4], region: [0, 1] }
    }
}

/// Window (root decoder) base and size.
pub const WINDOW: (u64, u64) = (0x2_9000_0000, 0x1_0000_0000);
/// 256 MiB per memdev.
pub const MEM: u64 = 0x1000_0000;
/// The PMEM region's UUID.
pub const PMEM_UUID: &str = "8a4b2c1e-6f3d-4e5a-9b7c-0d1e2f3a4b5c";

/// A fixture tree; the sysfs root is `dir` (so `dir/sys/...`).
pub struct Tree {
    pub dir: tempfile::TempDir,
}

impl Tree {
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Writes an attribute (creating directories).
    pub fn file(&self, rel: &str, content: &str) {
        let p = self.p(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, format!("{content}\n")).unwrap();
    }

    /// Makes `rel` a relative symlink to `target` (both relative to the root).
    pub fn link(&self, rel: &str, target: &str) {
        let p = self.p(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let _ = fs::remove_file(&p);
        symlink(relative(rel.rsplit_once('/').unwrap().0, target), p).unwrap();
    }

    pub fn remove(&self, rel: &str) {
        let p = self.p(rel);
        if p.is_dir() && !p.is_symlink() { fs::remove_dir_all(p).unwrap() } else { fs::remove_file(p).unwrap() }
    }
}

/// The relative path from directory `from` to `to` (both `/`-separated, relative to one root).
fn relative(from: &str, to: &str) -> String {
    let f: Vec<&str> = from.split('/').collect();
    let t: Vec<&str> = to.split('/').collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut parts = vec![".."; f.len() - common];
    parts.extend(&t[common..]);
    parts.join("/")
}

const BUS: &str = "sys/bus/cxl/devices";
const HB: &str = "sys/devices/pci0000:0c";

struct Mem {
    /// PCI path below the host bridge directory.
    pci: &'static str,
    serial: u64,
    ram: u64,
    pmem: u64,
    /// (parent is the switch, dport id in the parent).
    under_switch: bool,
    dport: u32,
}

const MEMS: [Mem; 5] = [
    Mem {
        pci: "0000:0c:00.0/0000:0d:00.0/0000:0e:00.0/0000:0f:00.0",
        serial: 1,
        ram: MEM,
        pmem: 0,
        under_switch: true,
        dport: 0,
    },
    Mem {
        pci: "0000:0c:00.0/0000:0d:00.0/0000:0e:01.0/0000:10:00.0",
        serial: 2,
        ram: MEM,
        pmem: 0,
        under_switch: true,
        dport: 1,
    },
    Mem {
        pci: "0000:0c:00.0/0000:0d:00.0/0000:0e:02.0/0000:11:00.0",
        serial: 3,
        ram: MEM,
        pmem: 0,
        under_switch: true,
        dport: 2,
    },
    Mem {
        pci: "0000:0c:00.0/0000:0d:00.0/0000:0e:03.0/0000:12:00.0",
        serial: 4,
        ram: 0,
        pmem: MEM,
        under_switch: true,
        dport: 3,
    },
    Mem { pci: "0000:0c:01.0/0000:13:00.0", serial: 5, ram: 0, pmem: 0, under_switch: false, dport: 1 },
];

fn hx(v: u64) -> String {
    format!("{v:#x}")
}

/// `%pa`: 0x and 16 digits.
fn pa(v: u64) -> String {
    format!("0x{v:016x}")
}

struct Dec<'a> {
    start: u64,
    size: u64,
    ways: u32,
    gran: u32,
    targets: &'a str,
}

const UNUSED: Dec<'static> = Dec { start: 0, size: 0, ways: 1, gran: 256, targets: "" };

impl Tree {
    fn decoder(&self, dir: &str, devtype: &str, d: &Dec<'_>) {
        self.file(&format!("{dir}/devtype"), devtype);
        self.file(&format!("{dir}/start"), &hx(d.start));
        self.file(&format!("{dir}/size"), &hx(d.size));
        self.file(&format!("{dir}/interleave_ways"), &d.ways.to_string());
        self.file(&format!("{dir}/interleave_granularity"), &d.gran.to_string());
        self.file(&format!("{dir}/locked"), "0");
        if devtype != "cxl_decoder_endpoint" {
            self.file(&format!("{dir}/target_list"), d.targets);
        }
        let name = dir.rsplit('/').next().unwrap();
        self.link(&format!("{BUS}/{name}"), dir);
    }

    fn endpoint_decoder(&self, dir: &str, d: &Dec<'_>, mode: &str, dpa: Option<(u64, u64)>) {
        self.decoder(dir, "cxl_decoder_endpoint", d);
        self.file(&format!("{dir}/mode"), mode);
        let (base, size) = dpa.unwrap_or((u64::MAX, 0));
        self.file(&format!("{dir}/dpa_resource"), &hx(base));
        self.file(&format!("{dir}/dpa_size"), &pa(size));
    }
}

/// Builds the QEMU tree with `n`'s numbering.
pub fn qemu_cxl(n: &Names) -> Tree {
    let t = Tree { dir: tempfile::tempdir().unwrap() };
    let acpi = "sys/devices/platform/ACPI0017:00";
    let root = format!("{acpi}/root0");
    let hb = format!("{root}/port{}", n.hb);
    let sw = format!("{hb}/port{}", n.sw);
    let usp = format!("{HB}/0000:0c:00.0/0000:0d:00.0");

    // PCI functions the CXL objects point at (a few identifying attributes each).
    t.file(&format!("{acpi}/path"), "\\_SB_.CXLM");
    for (f, class) in
        [("0000:0c:00.0", "0x060400"), ("0000:0c:01.0", "0x060400"), ("0000:0c:00.0/0000:0d:00.0", "0x060400")]
    {
        t.file(&format!("{HB}/{f}/class"), class);
    }
    for i in 0..4 {
        t.file(&format!("{usp}/0000:0e:0{i}.0/class"), "0x060400");
    }

    // root0: the ACPI0017 CXL root, its host-bridge dport (UID 12) and the CFMW window.
    t.link(&format!("{root}/uport"), acpi);
    t.file(&format!("{root}/devtype"), "cxl_port");
    t.link(&format!("{root}/dport12"), HB);
    t.link(&format!("{BUS}/root0"), &root);
    let win = Dec { start: WINDOW.0, size: WINDOW.1, ways: 1, gran: 4096, targets: "12" };
    let d0 = format!("{root}/decoder0.0");
    t.decoder(&d0, "cxl_decoder_root", &win);
    for cap in ["cap_ram", "cap_pmem", "cap_type2", "cap_type3"] {
        t.file(&format!("{d0}/{cap}"), "1");
    }
    t.file(&format!("{d0}/qos_class"), "0");
    t.file(&format!("{d0}/create_ram_region"), &format!("region{}", n.region[1] + 1));
    t.link(&format!("{root}/nvdimm-bridge0/subsystem"), "sys/bus/cxl");
    t.link(&format!("{BUS}/nvdimm-bridge0"), &format!("{root}/nvdimm-bridge0"));

    // The host bridge port: dports are root ports by PCIe port number.
    let (r0, r1) = (WINDOW.0, WINDOW.0 + 2 * MEM);
    t.link(&format!("{hb}/uport"), HB);
    t.link(&format!("{hb}/parent_dport"), HB);
    t.link(&format!("{hb}/dport0"), &format!("{HB}/0000:0c:00.0"));
    t.link(&format!("{hb}/dport1"), &format!("{HB}/0000:0c:01.0"));
    t.file(&format!("{hb}/decoders_committed"), "2");
    t.link(&format!("{BUS}/port{}", n.hb), &hb);
    let hbd = |i: u32| format!("{hb}/decoder{}.{i}", n.hb);
    t.decoder(&hbd(0), "cxl_decoder_switch", &Dec { start: r0, size: 2 * MEM, ways: 1, gran: 256, targets: "0" });
    t.decoder(&hbd(1), "cxl_decoder_switch", &Dec { start: r1, size: MEM, ways: 1, gran: 4096, targets: "0" });
    t.decoder(&hbd(2), "cxl_decoder_switch", &UNUSED);
    t.decoder(&hbd(3), "cxl_decoder_switch", &UNUSED);

    // The switch: uport is the upstream port, dports the four downstream ports.
    t.link(&format!("{sw}/uport"), &usp);
    t.link(&format!("{sw}/parent_dport"), &format!("{HB}/0000:0c:00.0"));
    for i in 0..4 {
        t.link(&format!("{sw}/dport{i}"), &format!("{usp}/0000:0e:0{i}.0"));
    }
    t.file(&format!("{sw}/decoders_committed"), "2");
    t.link(&format!("{BUS}/port{}", n.sw), &sw);
    let swd = |i: u32| format!("{sw}/decoder{}.{i}", n.sw);
    t.decoder(&swd(0), "cxl_decoder_switch", &Dec { start: r0, size: 2 * MEM, ways: 2, gran: 256, targets: "0,1" });
    t.decoder(&swd(1), "cxl_decoder_switch", &Dec { start: r1, size: MEM, ways: 1, gran: 4096, targets: "3" });
    t.decoder(&swd(2), "cxl_decoder_switch", &UNUSED);
    t.decoder(&swd(3), "cxl_decoder_switch", &UNUSED);

    // Memdevs and their endpoints.
    for (i, m) in MEMS.iter().enumerate() {
        let pci = format!("{HB}/{}", m.pci);
        let mem = format!("{pci}/mem{}", n.mem[i]);
        t.file(&format!("{pci}/class"), "0x050210");
        t.file(&format!("{pci}/vendor"), "0x8086");
        t.file(&format!("{pci}/device"), "0x0d93");
        t.file(&format!("{mem}/serial"), &hx(m.serial));
        t.file(&format!("{mem}/ram/size"), &hx(m.ram));
        t.file(&format!("{mem}/pmem/size"), &hx(m.pmem));
        t.file(&format!("{mem}/numa_node"), "0");
        t.file(&format!("{mem}/firmware_version"), "BWFW VERSION 00");
        t.file(&format!("{mem}/payload_max"), "2048");
        t.file(&format!("{mem}/label_storage_size"), if m.pmem > 0 { "268435456" } else { "0" });
        t.file(&format!("{mem}/devtype"), "cxl_memdev");
        t.link(&format!("{BUS}/mem{}", n.mem[i]), &mem);
        if m.pmem > 0 {
            t.file(&format!("{mem}/pmem{}/devtype", n.mem[i]), "cxl_nvdimm");
            t.link(&format!("{BUS}/pmem{}", n.mem[i]), &format!("{mem}/pmem{}", n.mem[i]));
        }
        if i == 4 {
            t.file(&format!("{mem}/dc0/size"), &hx(MEM));
            t.file(&format!("{mem}/dc0/read_only"), "0");
            t.file(&format!("{mem}/dc1/size"), &hx(MEM));
            t.file(&format!("{mem}/dc1/read_only"), "0");
        }
        let parent = if m.under_switch { &sw } else { &hb };
        let ep = format!("{parent}/endpoint{}", n.ep[i]);
        let dport = if m.under_switch {
            format!("{usp}/0000:0e:0{}.0", m.dport)
        } else {
            format!("{HB}/0000:0c:0{}.0", m.dport)
        };
        t.link(&format!("{ep}/uport"), &mem);
        t.link(&format!("{ep}/parent_dport"), &dport);
        t.file(&format!("{ep}/devtype"), "cxl_port");
        t.link(&format!("{BUS}/endpoint{}", n.ep[i]), &ep);
        let ed = |k: u32| format!("{ep}/decoder{}.{k}", n.ep[i]);
        let (d, mode, dpa) = match i {
            0 | 1 => (Dec { start: r0, size: 2 * MEM, ways: 2, gran: 256, targets: "" }, "ram", Some((0, MEM))),
            3 => (Dec { start: r1, size: MEM, ways: 1, gran: 4096, targets: "" }, "pmem", Some((0, MEM))),
            _ => (UNUSED, "none", None),
        };
        t.file(&format!("{ep}/decoders_committed"), if dpa.is_some() { "1" } else { "0" });
        t.endpoint_decoder(&ed(0), &d, mode, dpa);
        for k in 1..4 {
            t.endpoint_decoder(&ed(k), &UNUSED, "none", None);
        }
    }

    // region0: 2-way RAM interleave of mem0+mem1 at 256 B, onlined through dax0.0.
    let ep = |i: usize| format!("decoder{}.0", n.ep[i]);
    let rg = format!("{d0}/region{}", n.region[0]);
    t.file(&format!("{rg}/uuid"), "");
    t.file(&format!("{rg}/mode"), "ram");
    t.file(&format!("{rg}/size"), &hx(2 * MEM));
    t.file(&format!("{rg}/resource"), &hx(r0));
    t.file(&format!("{rg}/interleave_ways"), "2");
    t.file(&format!("{rg}/interleave_granularity"), "256");
    t.file(&format!("{rg}/target0"), &ep(0));
    t.file(&format!("{rg}/target1"), &ep(1));
    t.file(&format!("{rg}/commit"), "1");
    t.file(&format!("{rg}/devtype"), "cxl_region");
    let dr = format!("{rg}/dax_region{}", n.region[0]);
    t.file(&format!("{dr}/dax_region/id"), &n.region[0].to_string());
    t.file(&format!("{dr}/dax_region/size"), &(2 * MEM).to_string());
    t.file(&format!("{dr}/dax_region/align"), "2097152");
    let dax = format!("{dr}/dax{}.0", n.region[0]);
    t.file(&format!("{dax}/size"), &(2 * MEM).to_string());
    t.file(&format!("{dax}/target_node"), "1");
    t.file(&format!("{dax}/numa_node"), "1");
    t.file(&format!("{dax}/align"), "2097152");
    t.link(&format!("{BUS}/region{}", n.region[0]), &rg);

    // region1: 1-way PMEM region on mem3.
    let rg = format!("{d0}/region{}", n.region[1]);
    t.file(&format!("{rg}/uuid"), PMEM_UUID);
    t.file(&format!("{rg}/mode"), "pmem");
    t.file(&format!("{rg}/size"), &hx(MEM));
    t.file(&format!("{rg}/resource"), &hx(r1));
    t.file(&format!("{rg}/interleave_ways"), "1");
    t.file(&format!("{rg}/interleave_granularity"), "4096");
    t.file(&format!("{rg}/target0"), &ep(3));
    t.file(&format!("{rg}/commit"), "1");
    t.file(&format!("{rg}/devtype"), "cxl_region");
    t.file(&format!("{rg}/pmem_region{}/devtype", n.region[1]), "cxl_pmem_region");
    t.link(&format!("{BUS}/region{}", n.region[1]), &rg);
    t.link(&format!("{BUS}/pmem_region{}", n.region[1]), &format!("{rg}/pmem_region{}", n.region[1]));
    t
}
