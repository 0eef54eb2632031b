//! Per-region device-DAX (`[memory] dax_per_region`): one DAX device carved out of a CXL
//! region's DAX region for each fabricd region, placed at the HPA range the address map gives
//! the region, so that a client's descriptor reaches its region's bytes and nothing else
//! (docs/fabricd.md, "Memory backends").
//!
//! This drives the kernel's dax bus ABI (Documentation/ABI/testing/sysfs-bus-dax,
//! drivers/dax/bus.c) the way `daxctl create-device` / `destroy-device` do:
//!
//! - carve: write `1` to the DAX region's `dax_region/create` (a new, empty device; reading
//!   `create` back names it), write `START-END` (inclusive, hex HPAs) to the device's
//!   `mapping`, then hand it to `device_dax` (`drivers/device_dax/new_id`: a CXL RAM region's
//!   devices match `kmem` by type and `device_dax` only by id; `bind` if that did not bind it);
//! - destroy: `unbind`, `size` 0, then the device's name to `dax_region/delete`.
//!
//! The kernel's word is never taken for it: after each step the device is read back
//! (`size`, `mappingN/start`, `end`, `driver`). 6.12's `mapping` store returns success
//! without allocating when the length is not a multiple of the device's `align`, and
//! `__request_region` places nothing where asked if the range is taken; a device whose one
//! range is not exactly the one asked for is destroyed again and the allocation refused.
//!
//! The DAX region is the operator's to give: its first device (`daxN.0`, the one the kernel
//! made over the whole region, which cannot be deleted) is unbound and shrunk to 0 at start,
//! and every other device in the region is a region's or is deleted at start ([`plan`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_drivers::sysfs::{AttrError, SysfsRoot, link_name, list_dir, parse_dec_u64, parse_hex_u64, read_attr};

/// Why a DAX region cannot be carved, or a carve or destroy failed.
#[derive(Debug, thiserror::Error)]
pub enum CarveError {
    /// `[memory] dax` names a device other than a region's first (`daxN.0`).
    #[error("{0:?} is not the first device of a DAX region (daxN.0): per-region DAX carves the region daxN.0 covers")]
    NotSeed(String),
    /// The region cannot be carved.
    #[error("{what}: {why}")]
    Unusable {
        /// The DAX device or region.
        what: String,
        /// Why not.
        why: String,
    },
    /// A sysfs attribute could not be read or written.
    #[error("{}: {source}", path.display())]
    Sysfs {
        /// The attribute.
        path: PathBuf,
        /// The error (the kernel's refusal of a write is its errno).
        source: std::io::Error,
    },
    /// An attribute was unreadable or malformed.
    #[error(transparent)]
    Attr(#[from] AttrError),
    /// The kernel did not do what was asked.
    #[error("{device}: {why}")]
    Kernel {
        /// The DAX device.
        device: String,
        /// What it did instead.
        why: String,
    },
    /// A device carved for an allocation that then failed could not be deleted: it holds
    /// its range in the kernel (and maybe a previous holder's bytes) until the next start
    /// deletes it, so the range must not be handed out meanwhile.
    #[error("{device} could not be deleted after {failed}")]
    Stranded {
        /// The DAX device.
        device: String,
        /// What failed first, and why the delete failed.
        failed: String,
    },
}

impl CarveError {
    /// The error of a carve step that failed, once the device `name` made for it could
    /// not be deleted (`undo`): [`CarveError::Stranded`] then.
    pub fn stranding(name: &str, failed: String, undo: Result<(), CarveError>) -> Result<(), CarveError> {
        undo.map_err(|e| {
            tracing::warn!(device = %name, error = %e, "cannot delete a DAX device nobody got; its range stays out of use until the next start");
            CarveError::Stranded { device: name.to_owned(), failed: format!("{failed} ({e})") }
        })
    }
}

/// A DAX device as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaxDevice {
    /// Kernel name (`dax0.3`).
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Its HPA ranges, in page-offset order: (start, bytes).
    pub ranges: Vec<(u64, u64)>,
    /// The driver it is bound to.
    pub driver: Option<String>,
}

/// Parses what a DAX device's sysfs shows: `size` (decimal) and each `mappingN`'s `start`
/// and `end` (hex, inclusive), in N order. The ranges must add up to `size`.
pub fn parse_device(
    name: &str,
    size: &str,
    mappings: &[(&str, &str)],
    driver: Option<String>,
) -> Result<DaxDevice, String> {
    let size = parse_dec_u64(size).ok_or_else(|| format!("size {:?}", truncated(size)))?;
    let mut ranges = Vec::with_capacity(mappings.len());
    let mut total = 0u64;
    for (i, (s, e)) in mappings.iter().enumerate() {
        let (Some(start), Some(end)) = (parse_hex_u64(s), parse_hex_u64(e)) else {
            return Err(format!("mapping{i}: {:?}-{:?}", truncated(s), truncated(e)));
        };
        let len = end
            .checked_sub(start)
            .and_then(|l| l.checked_add(1))
            .ok_or_else(|| format!("mapping{i}: end {end:#x} before start {start:#x}"))?;
        total = total.checked_add(len).ok_or_else(|| format!("mapping{i}: ranges overflow"))?;
        ranges.push((start, len));
    }
    if total != size {
        return Err(format!("its mappings hold {total:#x} bytes, its size is {size:#x}"));
    }
    Ok(DaxDevice { name: name.to_owned(), size, ranges, driver })
}

fn truncated(s: &str) -> String {
    s.chars().take(40).collect()
}

/// `daxN.M` → (N, M).
pub fn dax_ids(name: &str) -> Option<(u32, u32)> {
    let (a, b) = name.strip_prefix("dax")?.split_once('.')?;
    let ok = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|c| c.is_ascii_digit());
    (ok(a) && ok(b)).then(|| Some((a.parse().ok()?, b.parse().ok()?)))?
}

/// A region that wants a carved device: fabricd region `region` at HPA `start`, `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    /// fabricd's region id.
    pub region: u64,
    /// First HPA.
    pub start: u64,
    /// Bytes.
    pub len: u64,
}

/// What start-up does with the carved devices it finds: see [`plan`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Regions whose device is there, exactly: (region, device).
    pub found: Vec<(u64, String)>,
    /// Regions with no device of exactly their range: carved again (device memory keeps
    /// its bytes, so the same range holds the same contents).
    pub missing: Vec<u64>,
    /// Devices no region claims (an allocation a crash cut off before it was journaled, a
    /// free whose destroy it cut off, a device someone else made): deleted.
    pub orphans: Vec<String>,
}

/// Matches the carved devices found at start (not the region's first, `daxN.0`) with the
/// journaled regions: a device whose one range is exactly a region's is that region's;
/// every other device is an orphan. Orphans are destroyed before the missing are carved
/// (one may hold part of a missing region's range).
pub fn plan(devices: &[DaxDevice], wanted: &[Wanted]) -> Plan {
    let mut out = Plan::default();
    let mut claimed = vec![false; devices.len()];
    for w in wanted {
        let hit = devices
            .iter()
            .enumerate()
            .find(|(i, d)| !claimed[*i] && d.ranges.len() == 1 && d.ranges[0] == (w.start, w.len));
        match hit {
            Some((i, d)) => {
                claimed[i] = true;
                out.found.push((w.region, d.name.clone()));
            }
            None => out.missing.push(w.region),
        }
    }
    out.orphans = devices.iter().zip(&claimed).filter(|(_, c)| !**c).map(|(d, _)| d.name.clone()).collect();
    out
}

/// Held from a carve's `create` until its device has its range (see [`DaxRegion::carve`]).
static CREATING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A DAX region fabricd carves: the one the configured `daxN.0` belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaxRegion {
    /// Its first device, as configured (`dax0.0`).
    pub seed: String,
    /// The region id (`N`).
    pub id: u32,
    /// The region's device directory (`…/regionN/dax_regionN`), parent of its devices.
    pub dir: PathBuf,
    /// `sys/bus/dax`.
    pub bus: PathBuf,
    /// Where device nodes are (`/dev`).
    pub dev: PathBuf,
    /// First HPA.
    pub start: u64,
    /// Bytes.
    pub size: u64,
    /// Device sizes and starts are multiples of this (`dax_region/align`).
    pub align: u64,
}

/// A device carved for a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Carved {
    /// Kernel name (`dax0.1`).
    pub name: String,
    /// Its device node.
    pub path: PathBuf,
}

fn write(path: &Path, value: &str) -> Result<(), CarveError> {
    std::fs::write(path, value).map_err(|source| CarveError::Sysfs { path: path.to_owned(), source })
}

impl DaxRegion {
    /// Takes over the DAX region of `seed` (`daxN.0`, under `root`'s `sys/bus/dax/devices`;
    /// device nodes under `dev`): it must be dynamic (`dax_region/create`, which a CXL RAM
    /// region's is and a static pmem namespace's is not), and `seed` is unbound and shrunk to
    /// 0 if it is not already (a restart finds it so).
    pub fn open(root: &SysfsRoot, dev: &Path, seed: &str) -> Result<Self, CarveError> {
        let Some((id, 0)) = dax_ids(seed) else { return Err(CarveError::NotSeed(seed.to_owned())) };
        let unusable = |why: String| CarveError::Unusable { what: seed.to_owned(), why };
        let link = root.path(format!("sys/bus/dax/devices/{seed}"));
        let real = std::fs::canonicalize(&link).map_err(|e| unusable(format!("{}: {e}", link.display())))?;
        let dir = real.parent().map(Path::to_path_buf).ok_or_else(|| unusable("it has no parent device".into()))?;
        let attrs = dir.join("dax_region");
        if !attrs.join("create").exists() {
            return Err(unusable(format!(
                "its DAX region ({}) is static: the kernel cannot carve it (no dax_region/create)",
                dir.display()
            )));
        }
        let size = read_dec(&attrs.join("size"))?;
        let align = read_dec(&attrs.join("align"))?;
        if !align.is_power_of_two() || align > 1 << 30 {
            return Err(unusable(format!("region align {align} is not a power of two up to 1 GiB")));
        }
        let bus = root.path("sys/bus/dax");
        let mut region = DaxRegion { seed: seed.to_owned(), id, dir, bus, dev: dev.to_owned(), start: 0, size, align };
        let d = region.device(seed)?;
        // Only a device no one else uses is taken over: a seed bound to kmem is System RAM
        // (unbinding it would hot-remove memory), to another driver someone's device.
        if let Some(other) = d.driver.as_deref().filter(|drv| *drv != "device_dax") {
            return Err(unusable(format!(
                "it is bound to {other}, not device_dax or nothing (a kmem device is a NUMA node: serve it with memory.numa)"
            )));
        }
        if d.size != 0 {
            tracing::info!(device = seed, size = d.size, "taking over the DAX region: its first device shrinks to 0");
            region.release(&d)?;
        }
        // With no range, `resource` is the region's start.
        region.start = read_attr(&real.join("resource"))
            .ok()
            .and_then(|s| parse_hex_u64(&s))
            .ok_or_else(|| unusable(format!("{}: no readable resource", real.join("resource").display())))?;
        if !region.start.is_multiple_of(align) || size == 0 || !size.is_multiple_of(align) {
            return Err(unusable(format!(
                "region start {:#x} and size {size:#x} are not {align}-aligned",
                region.start
            )));
        }
        Ok(region)
    }

    /// Reads device `name` of this region.
    pub fn device(&self, name: &str) -> Result<DaxDevice, CarveError> {
        let d = self.dir.join(name);
        let size = read_attr(&d.join("size"))?;
        let mut maps: Vec<(u32, String, String)> = Vec::new();
        for m in list_dir(&d)? {
            let Some(k) = m.strip_prefix("mapping").and_then(|k| k.parse::<u32>().ok()) else { continue };
            let p = d.join(&m);
            maps.push((k, read_attr(&p.join("start"))?, read_attr(&p.join("end"))?));
        }
        maps.sort_by_key(|m| m.0);
        let pairs: Vec<(&str, &str)> = maps.iter().map(|(_, s, e)| (s.as_str(), e.as_str())).collect();
        let driver = link_name(&d.join("driver")).ok();
        parse_device(name, &size, &pairs, driver).map_err(|why| CarveError::Kernel { device: name.to_owned(), why })
    }

    /// The region's devices other than its first: what fabricd carved (or someone else did).
    pub fn devices(&self) -> Result<Vec<DaxDevice>, CarveError> {
        let mut out = Vec::new();
        for name in list_dir(&self.dir)? {
            if dax_ids(&name).is_some_and(|(n, m)| n == self.id && m > 0) {
                out.push(self.device(&name)?);
            }
        }
        Ok(out)
    }

    /// Carves a device of exactly `[start, start + len)` (HPAs, `align`-aligned, inside the
    /// region) and binds it to `device_dax`. Nothing is left behind on failure, but for
    /// a device the kernel made without naming it back (`create` unreadable), which the
    /// next start deletes with every device no region names.
    pub fn carve(&self, start: u64, len: u64) -> Result<Carved, CarveError> {
        let end = start.checked_add(len).filter(|&e| len > 0 && e <= self.start.saturating_add(self.size));
        if start < self.start || end.is_none() || !start.is_multiple_of(self.align) || !len.is_multiple_of(self.align) {
            return Err(CarveError::Unusable {
                what: self.seed.clone(),
                why: format!("range {start:#x}+{len:#x} is not {}-aligned inside the region", self.align),
            });
        }
        // Reading `create` back names the region's youngest device, so a second carve
        // between the write and the read would hand both carvers one device: the steps up
        // to the device's range run one carve at a time (the bind's wait for its node does
        // not; a few sysfs writes, never under the registry's lock).
        let (name, placed) = {
            let _one = CREATING.lock().unwrap_or_else(|p| p.into_inner());
            let create = self.dir.join("dax_region/create");
            write(&create, "1")?;
            let name = read_attr(&create)?;
            if !dax_ids(&name).is_some_and(|(n, m)| n == self.id && m > 0) {
                return Err(CarveError::Kernel {
                    device: self.seed.clone(),
                    why: format!(
                        "dax_region/create named {:?}, not a new device of region {}",
                        truncated(&name),
                        self.id
                    ),
                });
            }
            let placed = self.place(&name, start, len);
            (name, placed)
        };
        match placed.and_then(|d| self.bind(&d)) {
            Ok(path) => {
                tracing::info!(device = %name, start, len, "DAX device carved");
                Ok(Carved { name, path })
            }
            Err(e) => {
                CarveError::stranding(&name, e.to_string(), self.destroy(&name))?;
                Err(e)
            }
        }
    }

    /// Gives new device `name` its range and checks the kernel placed it there.
    fn place(&self, name: &str, start: u64, len: u64) -> Result<DaxDevice, CarveError> {
        let d = self.device(name)?;
        if d.size != 0 || d.driver.is_some() {
            return Err(CarveError::Kernel { device: name.to_owned(), why: "the new device is not empty".into() });
        }
        write(&self.dir.join(name).join("mapping"), &format!("{start:#x}-{:#x}", start + len - 1))?;
        let d = self.device(name)?;
        if d.ranges != [(start, len)] {
            return Err(CarveError::Kernel {
                device: name.to_owned(),
                why: format!("asked for {start:#x}+{len:#x}, the kernel gave {:x?}", d.ranges),
            });
        }
        Ok(d)
    }

    /// Binds a carved device to `device_dax` (if it is not already) and waits for its node.
    pub fn bind(&self, d: &DaxDevice) -> Result<PathBuf, CarveError> {
        let drivers = self.bus.join("drivers/device_dax");
        match d.driver.as_deref() {
            Some("device_dax") => {}
            Some(other) => {
                return Err(CarveError::Kernel {
                    device: d.name.clone(),
                    why: format!("bound to {other}, not device_dax"),
                });
            }
            None => {
                // `new_id` attaches at once; `bind` is for a kernel where it did not.
                if let Err(e) = write(&drivers.join("new_id"), &d.name) {
                    tracing::debug!(device = %d.name, error = %e, "new_id refused; trying bind");
                }
                if self.device(&d.name)?.driver.is_none() {
                    write(&drivers.join("bind"), &d.name)?;
                }
                match self.device(&d.name)?.driver.as_deref() {
                    Some("device_dax") => {}
                    other => {
                        return Err(CarveError::Kernel {
                            device: d.name.clone(),
                            why: format!("not bound to device_dax after bind (driver {other:?})"),
                        });
                    }
                }
            }
        }
        // devtmpfs makes the node as the device registers; wait briefly rather than race.
        let path = self.dev.join(&d.name);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !path.exists() {
            if Instant::now() > deadline {
                return Err(CarveError::Kernel { device: d.name.clone(), why: format!("no {}", path.display()) });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(path)
    }

    /// Unbinds device `d` (from whatever driver holds it) and shrinks it to 0: its range
    /// goes back to the region. Mappings of it die with the unbind (the kernel zaps them;
    /// a later access is `SIGBUS`).
    fn release(&self, d: &DaxDevice) -> Result<(), CarveError> {
        if d.driver.is_some() {
            write(&self.dir.join(&d.name).join("driver/unbind"), &d.name)?;
        }
        write(&self.dir.join(&d.name).join("size"), "0")?;
        let after = read_dec(&self.dir.join(&d.name).join("size"))?;
        if after != 0 {
            return Err(CarveError::Kernel { device: d.name.clone(), why: format!("size {after:#x} after 0") });
        }
        Ok(())
    }

    /// Destroys carved device `name`: unbind, size 0, delete. Refused for one bound to a
    /// driver other than `device_dax`.
    pub fn destroy(&self, name: &str) -> Result<(), CarveError> {
        if !dax_ids(name).is_some_and(|(n, m)| n == self.id && m > 0) {
            return Err(CarveError::Kernel {
                device: name.to_owned(),
                why: "not a carved device of this region".into(),
            });
        }
        let d = self.device(name)?;
        // One bound to another driver is someone's (kmem: System RAM, which unbinding would
        // hot-remove): never taken from them.
        if let Some(other) = d.driver.as_deref().filter(|drv| *drv != "device_dax") {
            return Err(CarveError::Kernel { device: name.to_owned(), why: format!("bound to {other}: left alone") });
        }
        self.release(&d)?;
        write(&self.dir.join("dax_region/delete"), name)?;
        if self.dir.join(name).exists() {
            return Err(CarveError::Kernel { device: name.to_owned(), why: "still there after delete".into() });
        }
        tracing::info!(device = name, "DAX device deleted");
        Ok(())
    }

    /// Bytes of the region not in any device (`dax_region/available_size`).
    pub fn available(&self) -> Result<u64, CarveError> {
        read_dec(&self.dir.join("dax_region/available_size"))
    }
}

fn read_dec(path: &Path) -> Result<u64, CarveError> {
    let s = read_attr(path)?;
    parse_dec_u64(&s).ok_or_else(|| AttrError::Invalid { path: path.to_owned(), value: truncated(&s) }.into())
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    pub(in crate::memory) const M: u64 = 1 << 20;
    pub(in crate::memory) const BASE: u64 = 0x1_1000_0000;

    /// A sysfs tree as 6.12 shows a CXL RAM region's DAX region (`region0/dax_region0`, 512 MiB
    /// at `BASE`, align 2 MiB) with its first device `dax0.0` (`size`, `resource`, bound to
    /// `device_dax` when `size` is non-zero) and `devices` carved ones, each (id, start, len).
    pub(in crate::memory) fn tree(
        seed_size: u64,
        create: bool,
        devices: &[(u32, u64, u64)],
    ) -> (tempfile::TempDir, SysfsRoot) {
        let t = tempfile::tempdir().unwrap();
        let dr = t.path().join("sys/devices/platform/ACPI0017:00/root0/decoder0.0/region0/dax_region0");
        let attrs = dr.join("dax_region");
        std::fs::create_dir_all(&attrs).unwrap();
        std::fs::write(attrs.join("size"), format!("{}\n", 512 * M)).unwrap();
        std::fs::write(attrs.join("align"), format!("{}\n", 2 * M)).unwrap();
        std::fs::write(attrs.join("id"), "0\n").unwrap();
        if create {
            std::fs::write(attrs.join("create"), "\n").unwrap();
            std::fs::write(attrs.join("delete"), "").unwrap();
        }
        let drivers = t.path().join("sys/bus/dax/drivers/device_dax");
        std::fs::create_dir_all(&drivers).unwrap();
        std::fs::create_dir_all(t.path().join("sys/bus/dax/devices")).unwrap();
        std::fs::create_dir_all(t.path().join("dev")).unwrap();
        let add = |name: &str, size: u64, range: Option<(u64, u64)>, bound: bool| {
            let d = dr.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
            std::fs::write(d.join("resource"), format!("{:#x}\n", range.map_or(BASE, |r| r.0))).unwrap();
            if let Some((s, l)) = range {
                std::fs::create_dir_all(d.join("mapping0")).unwrap();
                std::fs::write(d.join("mapping0/start"), format!("{s:#x}\n")).unwrap();
                std::fs::write(d.join("mapping0/end"), format!("{:#x}\n", s + l - 1)).unwrap();
            }
            if bound {
                std::os::unix::fs::symlink(&drivers, d.join("driver")).unwrap();
            }
            let rel = format!("../../../devices/platform/ACPI0017:00/root0/decoder0.0/region0/dax_region0/{name}");
            std::os::unix::fs::symlink(rel, t.path().join("sys/bus/dax/devices").join(name)).unwrap();
            std::fs::write(t.path().join("dev").join(name), "").unwrap();
        };
        add("dax0.0", seed_size, (seed_size > 0).then_some((BASE, seed_size)), seed_size > 0);
        for &(id, s, l) in devices {
            add(&format!("dax0.{id}"), l, Some((s, l)), true);
        }
        let root = SysfsRoot::new(t.path(), "");
        (t, root)
    }

    pub(in crate::memory) fn open(
        t: &tempfile::TempDir,
        root: &SysfsRoot,
        seed: &str,
    ) -> Result<DaxRegion, CarveError> {
        DaxRegion::open(root, &t.path().join("dev"), seed)
    }

    #[test]
    fn a_dynamic_dax_region_is_taken_over_through_its_first_device() {
        // The first device over the whole region, bound: unbound and shrunk to 0 (the fake
        // tree keeps what is written, as the kernel would show it).
        let (t, root) = tree(512 * M, true, &[]);
        let r = open(&t, &root, "dax0.0").unwrap();
        assert_eq!((r.id, r.start, r.size, r.align), (0, BASE, 512 * M, 2 * M));
        assert!(r.dir.ends_with("region0/dax_region0"));
        let seed = r.dir.join("dax0.0");
        assert_eq!(std::fs::read_to_string(seed.join("size")).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(seed.join("driver/unbind")).unwrap(), "dax0.0");
        assert!(r.available().is_err(), "no available_size in this tree");
        // Already 0 (a restart): nothing is written.
        let (t, root) = tree(0, true, &[]);
        open(&t, &root, "dax0.0").unwrap();
        assert!(!t.path().join("sys/bus/dax/drivers/device_dax/unbind").exists());
    }

    #[test]
    fn a_seed_bound_to_kmem_is_refused_and_left_alone() {
        let (t, root) = tree(512 * M, true, &[]);
        // dax0.0 onlined as System RAM: its driver is kmem, not device_dax.
        let seed = t.path().join("sys/bus/dax/devices/dax0.0");
        std::fs::remove_file(seed.join("driver")).unwrap();
        let kmem = t.path().join("sys/bus/dax/drivers/kmem");
        std::fs::create_dir_all(&kmem).unwrap();
        std::os::unix::fs::symlink(&kmem, seed.join("driver")).unwrap();
        let e = open(&t, &root, "dax0.0").unwrap_err();
        assert!(e.to_string().contains("bound to kmem"), "{e}");
        assert_eq!(std::fs::read_to_string(seed.join("size")).unwrap().trim(), (512 * M).to_string(), "not shrunk");
        assert!(!kmem.join("unbind").exists(), "not unbound");
    }

    #[test]
    fn what_cannot_be_carved_is_refused_by_name() {
        let (t, root) = tree(0, true, &[]);
        assert!(matches!(open(&t, &root, "dax0.1"), Err(CarveError::NotSeed(_))));
        assert!(matches!(open(&t, &root, "dax0"), Err(CarveError::NotSeed(_))));
        assert!(matches!(open(&t, &root, "dax9.0"), Err(CarveError::Unusable { .. })));
        // A static region (a pmem namespace's) has no `create`.
        let (t, root) = tree(0, false, &[]);
        let e = open(&t, &root, "dax0.0").unwrap_err();
        assert!(e.to_string().contains("static"), "{e}");
        // An align that is not a power of two.
        let (t, root) = tree(0, true, &[]);
        std::fs::write(t.path().join("sys/bus/dax/devices/dax0.0/../dax_region/align"), "3000000\n").unwrap();
        assert!(open(&t, &root, "dax0.0").unwrap_err().to_string().contains("power of two"));
    }

    #[test]
    fn carved_devices_are_read_with_their_ranges() {
        let (t, root) = tree(0, true, &[(1, BASE, 4 * M), (3, BASE + 8 * M, 2 * M)]);
        let r = open(&t, &root, "dax0.0").unwrap();
        let d = r.devices().unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].name, "dax0.1");
        assert_eq!(d[0].ranges, vec![(BASE, 4 * M)]);
        assert_eq!(d[0].driver.as_deref(), Some("device_dax"));
        assert_eq!(d[1].size, 2 * M);
        // A size its mappings do not add up to is the kernel's inconsistency, refused.
        std::fs::write(r.dir.join("dax0.3/size"), "4194304\n").unwrap();
        assert!(matches!(r.devices(), Err(CarveError::Kernel { .. })));
    }

    #[test]
    fn a_carve_the_kernel_does_not_confirm_leaves_nothing() {
        let (t, root) = tree(0, true, &[]);
        let r = open(&t, &root, "dax0.0").unwrap();
        // Outside the region, misaligned: refused before anything is written.
        assert!(matches!(r.carve(BASE - 2 * M, 2 * M), Err(CarveError::Unusable { .. })));
        assert!(matches!(r.carve(BASE + M, 2 * M), Err(CarveError::Unusable { .. })));
        assert!(matches!(r.carve(BASE + 510 * M, 4 * M), Err(CarveError::Unusable { .. })));
        assert_eq!(std::fs::read_to_string(r.dir.join("dax_region/create")).unwrap(), "\n");
        // A `create` that names no new device (here the file keeps the `1` written to it).
        let e = r.carve(BASE, 2 * M).unwrap_err();
        assert!(e.to_string().contains("not a new device"), "{e}");
        // Only carved devices of this region are destroyed.
        assert!(r.destroy("dax0.0").is_err());
        assert!(r.destroy("dax1.1").is_err());
    }

    #[test]
    fn device_text_parses_or_is_refused() {
        let d =
            parse_device("dax0.1", "6291456", &[("0x100000000", "0x1001fffff"), ("0x100400000", "0x1007fffff")], None)
                .unwrap();
        assert_eq!(d.ranges, vec![(0x1_0000_0000, 2 * M), (0x1_0040_0000, 4 * M)]);
        assert_eq!(parse_device("dax0.1", "0", &[], None).unwrap().ranges, vec![]);
        assert!(parse_device("dax0.1", "4096", &[], None).is_err(), "size without ranges");
        assert!(parse_device("dax0.1", "x", &[], None).is_err());
        assert!(parse_device("dax0.1", "1", &[("0x10", "0xf")], None).is_err(), "end before start");
        assert!(parse_device("dax0.1", "0", &[("0x0", "0xffffffffffffffff")], None).is_err(), "overflow");
        assert_eq!(dax_ids("dax12.3"), Some((12, 3)));
        for bad in ["dax.1", "dax1.", "dax1", "daxa.1", "dax1.1.1", "dax9999999999.0", "../dax0.0"] {
            assert_eq!(dax_ids(bad), None, "{bad}");
        }
    }

    fn dev(name: &str, ranges: &[(u64, u64)]) -> DaxDevice {
        DaxDevice { name: name.into(), size: ranges.iter().map(|r| r.1).sum(), ranges: ranges.to_vec(), driver: None }
    }

    #[test]
    fn start_up_keeps_exact_devices_recarves_the_missing_and_deletes_the_rest() {
        let devices = [
            dev("dax0.1", &[(BASE, 4 * M)]),
            dev("dax0.2", &[(BASE + 4 * M, 8 * M)]),
            // Half of region 3's range: not its device.
            dev("dax0.3", &[(BASE + 12 * M, 2 * M)]),
            // Two ranges: never a region's.
            dev("dax0.4", &[(BASE + 32 * M, 2 * M), (BASE + 40 * M, 2 * M)]),
        ];
        let wanted = [
            Wanted { region: 1, start: BASE, len: 4 * M },
            Wanted { region: 2, start: BASE + 4 * M, len: 8 * M },
            Wanted { region: 3, start: BASE + 12 * M, len: 4 * M },
        ];
        let p = plan(&devices, &wanted);
        assert_eq!(p.found, vec![(1, "dax0.1".to_owned()), (2, "dax0.2".to_owned())]);
        assert_eq!(p.missing, vec![3]);
        assert_eq!(p.orphans, vec!["dax0.3".to_owned(), "dax0.4".to_owned()]);
        // Two regions cannot claim one device.
        let twice = [wanted[0], Wanted { region: 9, ..wanted[0] }];
        let p = plan(&devices[..1], &twice);
        assert_eq!((p.found.len(), p.missing, p.orphans.len()), (1, vec![9], 0));
        assert_eq!(plan(&[], &[]), Plan::default());
    }
}
