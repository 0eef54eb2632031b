//! Binding a PCI function to `vfio-pci` through sysfs: `driver_override`, unbind from the
//! driver it has, `drivers_probe`; every path under an injected root so that tests run on
//! a fake tree. The kernel's answer is checked, never assumed: the `driver` link must
//! name `vfio-pci` afterwards.

use std::path::{Path, PathBuf};

/// Why a function cannot be taken for VFIO.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    /// Binding needs root (sysfs writes, `/dev/vfio`).
    #[error("binding to vfio-pci needs root (euid {0})")]
    NotRoot(u32),
    /// sysfs has no such function.
    #[error("no PCI function {0} in sysfs")]
    NoDevice(String),
    /// The function is in no IOMMU group: no IOMMU translates for it.
    #[error("{0} has no IOMMU group (is the IOMMU on? intel_iommu=on / amd_iommu=on)")]
    NoIommuGroup(String),
    /// The `vfio-pci` driver is not loaded.
    #[error("the vfio-pci driver is not loaded (modprobe vfio-pci)")]
    VfioPciAbsent,
    /// A sysfs write failed.
    #[error("writing {value:?} to {path}: {error}")]
    Write {
        /// The attribute.
        path: String,
        /// What was written.
        value: String,
        /// Why (as text: the error is cloned into reports).
        error: String,
    },
    /// The kernel did not bind `vfio-pci`.
    #[error("{bdf} is bound to {driver:?} after the bind, not vfio-pci")]
    NotBound {
        /// The function.
        bdf: String,
        /// Its driver afterwards (`None`: none).
        driver: Option<String>,
    },
}

/// A function's binding as sysfs has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Its IOMMU group.
    pub group: u32,
    /// Its driver now.
    pub driver: Option<String>,
    /// `vendor:device` as sysfs gives them (`0x1234`, `0x11e8`).
    pub ids: (String, String),
    /// Its `dma_mask_bits` attribute, when sysfs has one.
    pub dma_mask_bits: Option<u8>,
}

fn devices(root: &Path) -> PathBuf {
    root.join("sys/bus/pci/devices")
}

/// `bdf`'s sysfs directory under `root` (what `vfio-ioctls` reads the group link from).
pub fn device_dir(root: &Path, bdf: &str) -> PathBuf {
    devices(root).join(bdf)
}

fn link_base(p: &Path) -> Option<String> {
    std::fs::read_link(p).ok()?.file_name()?.to_str().map(str::to_owned)
}

fn attr(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

/// Reads `bdf`'s binding under `root` (the `/` whose `sys/` is sysfs).
pub fn inspect(root: &Path, bdf: &str) -> Result<Function, BindError> {
    let dir = devices(root).join(bdf);
    if !dir.exists() {
        return Err(BindError::NoDevice(bdf.to_owned()));
    }
    let group = link_base(&dir.join("iommu_group"))
        .and_then(|g| g.parse().ok())
        .ok_or_else(|| BindError::NoIommuGroup(bdf.to_owned()))?;
    Ok(Function {
        bdf: bdf.to_owned(),
        group,
        driver: link_base(&dir.join("driver")),
        ids: (attr(&dir.join("vendor")).unwrap_or_default(), attr(&dir.join("device")).unwrap_or_default()),
        dma_mask_bits: attr(&dir.join("dma_mask_bits")).and_then(|v| v.parse().ok()),
    })
}

fn write(path: PathBuf, value: &str) -> Result<(), BindError> {
    std::fs::write(&path, value).map_err(|e| BindError::Write {
        path: path.display().to_string(),
        value: value.to_owned(),
        error: e.to_string(),
    })
}

/// Binds `bdf` to `vfio-pci` (as `euid`), unless it already is; returns it as bound.
pub fn bind(root: &Path, bdf: &str, euid: u32) -> Result<Function, BindError> {
    if euid != 0 {
        return Err(BindError::NotRoot(euid));
    }
    let f = inspect(root, bdf)?;
    if f.driver.as_deref() == Some("vfio-pci") {
        return Ok(f);
    }
    if !root.join("sys/bus/pci/drivers/vfio-pci").is_dir() {
        return Err(BindError::VfioPciAbsent);
    }
    let dir = devices(root).join(bdf);
    write(dir.join("driver_override"), "vfio-pci")?;
    if f.driver.is_some() {
        write(dir.join("driver/unbind"), bdf)?;
    }
    write(root.join("sys/bus/pci/drivers_probe"), bdf)?;
    let after = inspect(root, bdf)?;
    if after.driver.as_deref() != Some("vfio-pci") {
        return Err(BindError::NotBound { bdf: bdf.to_owned(), driver: after.driver });
    }
    tracing::info!(bdf, group = f.group, was = ?f.driver, "bound to vfio-pci");
    Ok(after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const BDF: &str = "0000:00:04.0";

    /// A fake `/`: one function in group 5, bound to `driver` (if any), with `vfio-pci`
    /// loaded when `vfio`.
    fn tree(driver: Option<&str>, vfio: bool, group: bool) -> tempfile::TempDir {
        let t = tempfile::tempdir().expect("tempdir");
        let r = t.path();
        let dev = r.join("sys/devices/pci0000:00").join(BDF);
        std::fs::create_dir_all(&dev).expect("mkdir");
        std::fs::create_dir_all(r.join("sys/bus/pci/devices")).expect("mkdir");
        symlink(&dev, r.join("sys/bus/pci/devices").join(BDF)).expect("link");
        std::fs::write(dev.join("vendor"), "0x1234\n").expect("write");
        std::fs::write(dev.join("device"), "0x11e8\n").expect("write");
        std::fs::write(dev.join("driver_override"), "(null)\n").expect("write");
        std::fs::write(r.join("sys/bus/pci/drivers_probe"), "").expect("write");
        if group {
            std::fs::create_dir_all(r.join("sys/kernel/iommu_groups/5")).expect("mkdir");
            symlink(r.join("sys/kernel/iommu_groups/5"), dev.join("iommu_group")).expect("link");
        }
        for d in driver.into_iter().chain(vfio.then_some("vfio-pci")) {
            let dd = r.join("sys/bus/pci/drivers").join(d);
            std::fs::create_dir_all(&dd).expect("mkdir");
            std::fs::write(dd.join("unbind"), "").expect("write");
        }
        if let Some(d) = driver {
            symlink(r.join("sys/bus/pci/drivers").join(d), dev.join("driver")).expect("link");
        }
        t
    }

    fn read(p: PathBuf) -> String {
        std::fs::read_to_string(p).expect("read")
    }

    #[test]
    fn refuses_without_root_group_or_vfio_pci() {
        let t = tree(None, true, true);
        assert_eq!(bind(t.path(), BDF, 1000), Err(BindError::NotRoot(1000)));
        assert_eq!(bind(t.path(), "0000:00:09.0", 0), Err(BindError::NoDevice("0000:00:09.0".into())));
        let t = tree(None, true, false);
        assert_eq!(bind(t.path(), BDF, 0), Err(BindError::NoIommuGroup(BDF.into())));
        let t = tree(None, false, true);
        assert_eq!(bind(t.path(), BDF, 0), Err(BindError::VfioPciAbsent));
    }

    #[test]
    fn a_function_already_on_vfio_pci_is_taken_as_is() {
        let t = tree(Some("vfio-pci"), true, true);
        let f = bind(t.path(), BDF, 0).expect("bound");
        assert_eq!((f.group, f.driver.as_deref()), (5, Some("vfio-pci")));
        assert_eq!(f.ids, ("0x1234".to_owned(), "0x11e8".to_owned()));
        // Nothing written.
        assert_eq!(read(t.path().join("sys/bus/pci/drivers_probe")), "");
    }

    #[test]
    fn binding_overrides_unbinds_and_probes_then_checks_the_kernel_answer() {
        let t = tree(Some("edu"), true, true);
        // The fake kernel does not rebind: the writes land, and the check says so.
        let e = bind(t.path(), BDF, 0).expect_err("not rebound");
        assert_eq!(e, BindError::NotBound { bdf: BDF.into(), driver: Some("edu".into()) });
        let dev = t.path().join("sys/bus/pci/devices").join(BDF);
        assert_eq!(read(dev.join("driver_override")), "vfio-pci");
        assert_eq!(read(t.path().join("sys/bus/pci/drivers/edu/unbind")), BDF);
        assert_eq!(read(t.path().join("sys/bus/pci/drivers_probe")), BDF);
    }

    #[test]
    fn an_unbound_function_is_only_probed() {
        let t = tree(None, true, true);
        let e = bind(t.path(), BDF, 0).expect_err("not rebound");
        assert_eq!(e, BindError::NotBound { bdf: BDF.into(), driver: None });
        assert_eq!(read(t.path().join("sys/bus/pci/drivers_probe")), BDF);
    }
}
