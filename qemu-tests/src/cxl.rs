//! The CXL guest: its QEMU topology (two host bridges, a switch, three volatile type-3
//! devices and a persistent one), and the comparison of fabricd's discovery with the
//! kernel's own account (`cxl list -vvv` from Debian's ndctl, run in the same guest).

use std::fs;
use std::path::{Path, PathBuf};

use crate::vm::VmSpec;

/// Bytes of each type-3 device's memory.
pub const DEVICE_BYTES: u64 = 256 << 20;

/// One emulated type-3 device.
#[derive(Debug, Clone)]
pub struct Type3 {
    /// QEMU id.
    pub id: &'static str,
    /// Serial number the device reports.
    pub serial: u64,
    /// Persistent (with a label storage area) rather than volatile.
    pub persistent: bool,
    /// The port it sits under.
    pub bus: &'static str,
}

/// The devices of the CXL guest. The first two are the region's targets, in order.
pub const DEVICES: [Type3; 4] = [
    Type3 { id: "mem0", serial: 0x1000, persistent: false, bus: "swp0" },
    Type3 { id: "mem1", serial: 0x1001, persistent: false, bus: "swp1" },
    Type3 { id: "mem2", serial: 0x1002, persistent: false, bus: "swp2" },
    Type3 { id: "mem3", serial: 0x2000, persistent: true, bus: "rp2" },
];

/// The backing file of device `id` under `dir`.
pub fn backing_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.raw"))
}

/// Adds the CXL topology to `spec`, its memory backed by sparse files in `dir` (created
/// here): host bridge cxl.1 with root ports rp0 (a switch with downstream ports swp0..2, one
/// volatile device each) and rp1 (empty), host bridge cxl.2 with rp2 (the persistent
/// device); window 0 (4 GiB) over cxl.1, window 1 (4 GiB) over cxl.2.
pub fn add_topology(spec: &mut VmSpec, dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    spec.machine = "q35,cxl=on".to_owned();
    spec.device("pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1")
        .device("cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=0")
        .device("cxl-rp,port=1,bus=cxl.1,id=rp1,chassis=0,slot=1")
        .device("cxl-upstream,bus=rp0,id=us0");
    for p in 0..3 {
        spec.device(format!("cxl-downstream,port={p},bus=us0,id=swp{p},chassis=0,slot={}", 4 + p));
    }
    spec.device("pxb-cxl,bus_nr=32,bus=pcie.0,id=cxl.2").device("cxl-rp,port=0,bus=cxl.2,id=rp2,chassis=0,slot=2");
    for d in &DEVICES {
        let file = backing_file(dir, d.id);
        fs::OpenOptions::new().create(true).truncate(false).write(true).open(&file)?.set_len(DEVICE_BYTES)?;
        spec.object(format!(
            "memory-backend-file,id={}-be,share=on,mem-path={},size={DEVICE_BYTES}",
            d.id,
            file.display()
        ));
        if d.persistent {
            let lsa = dir.join(format!("{}-lsa.raw", d.id));
            fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lsa)?.set_len(1 << 20)?;
            spec.object(format!("memory-backend-file,id={}-lsa,share=on,mem-path={},size=1M", d.id, lsa.display()));
            spec.device(format!(
                "cxl-type3,bus={},persistent-memdev={id}-be,lsa={id}-lsa,id={id},sn={:#x}",
                d.bus,
                d.serial,
                id = d.id
            ));
        } else {
            spec.device(format!(
                "cxl-type3,bus={},volatile-memdev={id}-be,id={id},sn={:#x}",
                d.bus,
                d.serial,
                id = d.id
            ));
        }
    }
    spec.arg("-M").arg("cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G,cxl-fmw.1.targets.0=cxl.2,cxl-fmw.1.size=4G");
    Ok(())
}

/// A memdev as `cxl list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelMemdev {
    /// Serial number.
    pub serial: u64,
    /// Volatile bytes (0 when the kernel reports none).
    pub ram_size: u64,
    /// Persistent bytes (0 when the kernel reports none).
    pub pmem_size: u64,
}

/// A decoder as `cxl list` reports it: only what the kernel showed is `Some`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelDecoder {
    /// Interleave ways.
    pub ways: Option<u64>,
    /// Interleave granularity.
    pub granularity: Option<u64>,
    /// HPA start.
    pub resource: Option<u64>,
    /// HPA size.
    pub size: Option<u64>,
    /// DPA start (endpoint decoders).
    pub dpa_resource: Option<u64>,
    /// DPA size (endpoint decoders).
    pub dpa_size: Option<u64>,
    /// Targets by position: dport BDFs, or host bridge names for root decoders.
    pub targets: Vec<String>,
    /// The region it decodes for (endpoint decoders).
    pub region: Option<String>,
}

/// A region as `cxl list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRegion {
    /// HPA start.
    pub resource: u64,
    /// Bytes.
    pub size: u64,
    /// Interleave ways.
    pub ways: u64,
    /// Interleave granularity.
    pub granularity: u64,
    /// Memdev names by position.
    pub memdevs: Vec<String>,
    /// Endpoint decoders by position.
    pub decoders: Vec<String>,
}

/// The kernel's account, from `cxl list -vvv`, keyed by the kernel's names (valid within
/// the boot that produced both listings).
#[derive(Debug, Default)]
pub struct KernelView {
    /// Memdevs by name (`mem3`).
    pub memdevs: std::collections::BTreeMap<String, KernelMemdev>,
    /// Decoders by name (`decoder4.0`).
    pub decoders: std::collections::BTreeMap<String, KernelDecoder>,
    /// Regions by name (`region0`).
    pub regions: std::collections::BTreeMap<String, KernelRegion>,
}

fn num(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str().and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok()))
}

fn walk(v: &serde_json::Value, out: &mut KernelView) {
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
        serde_json::Value::Object(o) => {
            if let (Some(name), Some(serial)) = (o.get("memdev").and_then(|m| m.as_str()), o.get("serial")) {
                out.memdevs.insert(
                    name.to_owned(),
                    KernelMemdev {
                        serial: num(serial).unwrap_or(u64::MAX),
                        ram_size: o.get("ram_size").and_then(num).unwrap_or(0),
                        pmem_size: o.get("pmem_size").and_then(num).unwrap_or(0),
                    },
                );
            }
            if let Some(name) = o.get("decoder").and_then(|d| d.as_str()).filter(|_| o.contains_key("interleave_ways"))
            {
                let mut targets: Vec<(u64, String)> = o
                    .get("targets")
                    .and_then(|t| t.as_array())
                    .map(|t| {
                        t.iter()
                            .filter_map(|x| {
                                Some((x.get("position").and_then(num)?, x.get("target")?.as_str()?.to_owned()))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                targets.sort();
                out.decoders.insert(
                    name.to_owned(),
                    KernelDecoder {
                        ways: o.get("interleave_ways").and_then(num),
                        granularity: o.get("interleave_granularity").and_then(num),
                        resource: o.get("resource").and_then(num),
                        size: o.get("size").and_then(num),
                        dpa_resource: o.get("dpa_resource").and_then(num),
                        dpa_size: o.get("dpa_size").and_then(num),
                        targets: targets.into_iter().map(|(_, t)| t).collect(),
                        region: o.get("region").and_then(|r| r.as_str()).map(str::to_owned),
                    },
                );
            }
            if let (Some(name), Some(maps)) =
                (o.get("region").and_then(|r| r.as_str()), o.get("mappings").and_then(|m| m.as_array()))
            {
                let mut m: Vec<(u64, String, String)> = maps
                    .iter()
                    .filter_map(|x| {
                        Some((
                            x.get("position").and_then(num)?,
                            x.get("memdev")?.as_str()?.to_owned(),
                            x.get("decoder")?.as_str()?.to_owned(),
                        ))
                    })
                    .collect();
                m.sort();
                out.regions.insert(
                    name.to_owned(),
                    KernelRegion {
                        resource: o.get("resource").and_then(num).unwrap_or(0),
                        size: o.get("size").and_then(num).unwrap_or(0),
                        ways: o.get("interleave_ways").and_then(num).unwrap_or(0),
                        granularity: o.get("interleave_granularity").and_then(num).unwrap_or(0),
                        memdevs: m.iter().map(|x| x.1.clone()).collect(),
                        decoders: m.iter().map(|x| x.2.clone()).collect(),
                    },
                );
            }
            for (_, child) in o.iter().filter(|(_, c)| c.is_array() || c.is_object()) {
                walk(child, out);
            }
        }
        _ => {}
    }
}

/// Parses `cxl list -vvv` output.
pub fn kernel_view(list: &serde_json::Value) -> KernelView {
    let mut out = KernelView::default();
    walk(list, &mut out);
    out
}

/// The last path component of a fabric device id (`pci:NODE/0000:0e:00.0` → `0000:0e:00.0`,
/// `name:NODE/pci0000:0c` → `pci0000:0c`): how the kernel names the same target.
fn id_tail(id: &str) -> &str {
    id.rsplit('/').next().unwrap_or(id)
}

/// Every difference between fabricd's topology document (`fabric.topology/v1`) and the
/// kernel's account: memdevs (serial, volatile and persistent size), decoders (ways,
/// granularity, targets, HPA and DPA ranges, region), regions (resource, size, ways,
/// granularity, targets by serial in position order). Empty when they agree exactly.
pub fn compare(kernel: &KernelView, topo: &serde_json::Value) -> Vec<String> {
    use std::collections::BTreeMap;
    let mut diffs = Vec::new();
    let mut d = |s: String| diffs.push(s);

    // Memdevs, by serial.
    let kmem: BTreeMap<u64, &KernelMemdev> = kernel.memdevs.values().map(|m| (m.serial, m)).collect();
    let mut fmem: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for dev in topo["devices"].as_array().into_iter().flatten() {
        let c = &dev["cxl"];
        if let Some(serial) = c["serial"].as_u64() {
            fmem.insert(serial, (c["ram_size"].as_u64().unwrap_or(0), c["pmem_size"].as_u64().unwrap_or(0)));
        }
    }
    if kmem.keys().collect::<Vec<_>>() != fmem.keys().collect::<Vec<_>>() {
        d(format!(
            "memdev serials: kernel {:x?}, fabricd {:x?}",
            kmem.keys().collect::<Vec<_>>(),
            fmem.keys().collect::<Vec<_>>()
        ));
    }
    for (serial, k) in &kmem {
        if let Some(&(ram, pmem)) = fmem.get(serial)
            && (ram, pmem) != (k.ram_size, k.pmem_size)
        {
            d(format!(
                "memdev {serial:#x}: kernel ram {} pmem {}, fabricd ram {ram} pmem {pmem}",
                k.ram_size, k.pmem_size
            ));
        }
    }

    // Decoders, by kernel name.
    let fdec: BTreeMap<&str, &serde_json::Value> = topo["cxl"]["decoders"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| Some((x["kernel_name"].as_str()?, x)))
        .collect();
    let knames: Vec<&str> = kernel.decoders.keys().map(String::as_str).collect();
    let fnames: Vec<&str> = fdec.keys().copied().collect();
    if knames != fnames {
        d(format!("decoders: kernel {knames:?}, fabricd {fnames:?}"));
    }
    for (name, k) in &kernel.decoders {
        let Some(f) = fdec.get(name.as_str()) else { continue };
        let pairs = [
            ("ways", k.ways, f["ways"].as_u64()),
            ("granularity", k.granularity, f["granularity"].as_u64()),
            ("resource", k.resource, f["start"].as_u64()),
            ("size", k.size, f["size"].as_u64()),
            ("dpa_resource", k.dpa_resource, f["dpa_start"].as_u64()),
            ("dpa_size", k.dpa_size, f["dpa_size"].as_u64()),
        ];
        for (what, kv, fv) in pairs {
            if kv.is_some() && kv != fv {
                d(format!("{name} {what}: kernel {kv:?}, fabricd {fv:?}"));
            }
        }
        let ft: Vec<&str> =
            f["targets"].as_array().into_iter().flatten().filter_map(|t| t.as_str()).map(id_tail).collect();
        if !k.targets.is_empty() && k.targets != ft {
            d(format!("{name} targets: kernel {:?}, fabricd {ft:?}", k.targets));
        }
        if f["level"] == "endpoint"
            && let Some(kr) = k.region.as_ref().and_then(|r| kernel.regions.get(r))
        {
            let want = format!("hpa:{:#x}", kr.resource);
            let got = f["region"].as_str().unwrap_or("");
            if got != want && Some(got) != k.region.as_deref() {
                d(format!("{name} region: kernel {:?} ({want}), fabricd {got:?}", k.region));
            }
        }
    }

    // Regions, by kernel name.
    let freg: BTreeMap<&str, &serde_json::Value> = topo["cxl"]["regions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| Some((x["kernel_name"].as_str()?, x)))
        .collect();
    let kr: Vec<&str> = kernel.regions.keys().map(String::as_str).collect();
    let fr: Vec<&str> = freg.keys().copied().collect();
    if kr != fr {
        d(format!("regions: kernel {kr:?}, fabricd {fr:?}"));
    }
    for (name, k) in &kernel.regions {
        let Some(f) = freg.get(name.as_str()) else { continue };
        let pairs = [
            ("resource", k.resource, f["resource"].as_u64()),
            ("size", k.size, f["size"].as_u64()),
            ("ways", k.ways, f["ways"].as_u64()),
            ("granularity", k.granularity, f["granularity"].as_u64()),
        ];
        for (what, kv, fv) in pairs {
            if Some(kv) != fv {
                d(format!("{name} {what}: kernel {kv}, fabricd {fv:?}"));
            }
        }
        let want: Vec<String> = k
            .memdevs
            .iter()
            .map(|m| kernel.memdevs.get(m).map_or(format!("?{m}"), |x| format!("serial:cxl/{:#x}", x.serial)))
            .collect();
        let got: Vec<String> =
            f["targets"].as_array().into_iter().flatten().filter_map(|t| t.as_str().map(str::to_owned)).collect();
        if want != got {
            d(format!("{name} targets: kernel {want:?}, fabricd {got:?}"));
        }
    }
    diffs
}

/// Differences between the address map listing (`fabricctl map -o json`) and the region:
/// one interleave range of the region's size, with its ways, granularity and members (the
/// region's targets by serial, in position order).
pub fn check_map(kernel: &KernelView, region: &str, map: &serde_json::Value) -> Vec<String> {
    let Some(k) = kernel.regions.get(region) else { return vec![format!("the kernel lists no {region}")] };
    let owner = format!("set:cxl-region:hpa-{:#x}", k.resource);
    let Some(r) = map["ranges"].as_array().into_iter().flatten().find(|r| r["owner"] == owner.as_str()) else {
        return vec![format!("the map has no range owned by {owner}")];
    };
    let mut diffs = Vec::new();
    if r["size"].as_u64() != Some(k.size) {
        diffs.push(format!("{owner}: size {:?}, region {}", r["size"], k.size));
    }
    let il = &r["interleave"];
    if il["ways"].as_u64() != Some(k.ways) || il["granularity"].as_u64() != Some(k.granularity) {
        diffs.push(format!("{owner}: interleave {il}, region ways {} granularity {}", k.ways, k.granularity));
    }
    let want: Vec<String> = k
        .memdevs
        .iter()
        .map(|m| kernel.memdevs.get(m).map_or(format!("?{m}"), |x| format!("serial:cxl/{:#x}#cxl_volatile0", x.serial)))
        .collect();
    let got: Vec<String> =
        il["members"].as_array().into_iter().flatten().filter_map(|t| t.as_str().map(str::to_owned)).collect();
    if want != got {
        diffs.push(format!("{owner}: members {got:?}, region targets {want:?}"));
    }
    diffs
}

/// The region's targets in position order: the first two devices (the guest script puts
/// serial 0x1000 at position 0 and 0x1001 at position 1).
fn region_targets(dir: &Path) -> [PathBuf; 2] {
    [backing_file(dir, DEVICES[0].id), backing_file(dir, DEVICES[1].id)]
}

/// Writes the pattern for region bytes `[0, len)` straight into the devices' backing files,
/// where a 2-way 256 B interleave at DPA `dpa_base` puts them: what the guest then reads
/// through the region proves the kernel's decoders route as the map says.
pub fn fill_backends(dir: &Path, len: u64, seed: u64, dpa_base: [u64; 2]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let files = region_targets(dir).map(|p| fs::OpenOptions::new().write(true).open(p));
    let [a, b] = files;
    let files = [a?, b?];
    let mut off = 0;
    while off < len {
        let (pos, dpa) = crate::pattern::interleave(off, 2, 256);
        let mut chunk = Vec::with_capacity(256);
        for w in (0..256).step_by(8) {
            chunk.extend_from_slice(&crate::pattern::word(seed, off + w).to_le_bytes());
        }
        files[pos as usize].write_all_at(&chunk, dpa_base[pos as usize] + dpa)?;
        off += 256;
    }
    Ok(())
}

/// Reads region bytes `[0, len)` back from the backing files (the second path) and
/// compares them with the pattern; `Err` names the first wrong word and where it was.
pub fn check_backends(dir: &Path, len: u64, seed: u64, dpa_base: [u64; 2]) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let paths = region_targets(dir);
    let mut files = Vec::new();
    for p in &paths {
        files.push(fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    let mut off = 0;
    let mut chunk = [0u8; 256];
    while off < len {
        let (pos, dpa) = crate::pattern::interleave(off, 2, 256);
        let at = dpa_base[pos as usize] + dpa;
        files[pos as usize]
            .read_exact_at(&mut chunk, at)
            .map_err(|e| format!("{}: {e}", paths[pos as usize].display()))?;
        for w in (0..256).step_by(8) {
            let got = u64::from_le_bytes(chunk[w..w + 8].try_into().unwrap_or_default());
            let want = crate::pattern::word(seed, off + w as u64);
            if got != want {
                return Err(format!(
                    "region offset {:#x} (device position {pos}, DPA {:#x}, file {}): {got:#018x}, expected {want:#018x}",
                    off + w as u64,
                    at + w as u64,
                    paths[pos as usize].display()
                ));
            }
        }
        off += 256;
    }
    Ok(())
}

/// Serial of the dynamic-capacity device [`add_dcd`] adds.
pub const DCD_SERIAL: u64 = 0x3000;

/// Adds a dynamic-capacity device (QEMU id `dcd0`, two DC regions over 512 MiB, serial
/// [`DCD_SERIAL`]) on the empty root port rp1 of a topology from [`add_topology`].
pub fn add_dcd(spec: &mut VmSpec, dir: &Path) -> std::io::Result<()> {
    let file = dir.join("dcd0.raw");
    fs::OpenOptions::new().create(true).truncate(false).write(true).open(&file)?.set_len(512 << 20)?;
    spec.object(format!("memory-backend-file,id=dcd0-be,share=on,mem-path={},size=512M", file.display()));
    spec.device(format!("cxl-type3,bus=rp1,volatile-dc-memdev=dcd0-be,num-dc-regions=2,id=dcd0,sn={DCD_SERIAL:#x}"));
    Ok(())
}
