//! Library values as plain Python data (dicts of ints, strings and lists; the package turns
//! them into dataclasses), and the text names Python callers use for enums.

use fabric_mm::{
    Access, CacheStats, DeviceInfo, Error, Location, MemoryClass, NearMemory, PathInfo, RegistrationStats, RemotePlace,
    Revocation, RevocationReason,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Every memory class by its Python name, the names fabricd's documents use.
const CLASSES: [(MemoryClass, &str); 6] = [
    (MemoryClass::Hbm, "hbm"),
    (MemoryClass::Dram, "dram"),
    (MemoryClass::CxlVolatile, "cxl_volatile"),
    (MemoryClass::CxlPersistent, "cxl_persistent"),
    (MemoryClass::CxlDynamic, "cxl_dynamic"),
    (MemoryClass::HostExported, "host_exported"),
];

/// The Python name of a memory class.
pub(crate) fn class_name(c: MemoryClass) -> &'static str {
    // An exhaustive match, so that a new class fails to compile here until it has a name.
    match c {
        MemoryClass::Hbm => "hbm",
        MemoryClass::Dram => "dram",
        MemoryClass::CxlVolatile => "cxl_volatile",
        MemoryClass::CxlPersistent => "cxl_persistent",
        MemoryClass::CxlDynamic => "cxl_dynamic",
        MemoryClass::HostExported => "host_exported",
    }
}

/// A memory class from its Python name; the error lists the names.
pub(crate) fn class_of(name: &str) -> Result<MemoryClass, Error> {
    CLASSES.iter().find(|(_, n)| *n == name).map(|(c, _)| *c).ok_or_else(|| {
        let names: Vec<&str> = CLASSES.iter().map(|(_, n)| *n).collect();
        Error::InvalidArgument(format!("unknown memory class {name:?} (one of {})", names.join(", ")))
    })
}

/// An access mode from `"ro"`/`"rw"` (also `"read_only"`/`"read_write"`).
pub(crate) fn access_of(name: &str) -> Result<Access, Error> {
    match name {
        "ro" | "read_only" => Ok(Access::ReadOnly),
        "rw" | "read_write" => Ok(Access::ReadWrite),
        _ => Err(Error::InvalidArgument(format!("unknown access {name:?} (\"ro\" or \"rw\")"))),
    }
}

pub(crate) fn access_name(a: Access) -> &'static str {
    match a {
        Access::ReadOnly => "ro",
        Access::ReadWrite => "rw",
    }
}

pub(crate) fn reason_name(r: RevocationReason) -> &'static str {
    match r {
        RevocationReason::Revoked => "revoked",
        RevocationReason::Freed => "freed",
        RevocationReason::OwnerExited => "owner_exited",
        RevocationReason::DeviceLost => "device_lost",
    }
}

pub(crate) fn revocation<'py>(py: Python<'py>, r: &Revocation) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("region", r.region)?;
    d.set_item("generation", r.generation)?;
    d.set_item("import_id", r.import)?;
    d.set_item("reason", reason_name(r.reason))?;
    Ok(d)
}

pub(crate) fn device<'py>(py: Python<'py>, info: &DeviceInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", &info.id)?;
    d.set_item("kind", &info.kind)?;
    d.set_item("node", info.node.as_deref())?;
    let memory = PyList::empty(py);
    for (class, size) in &info.memory {
        memory.append((class_name(*class), *size))?;
    }
    d.set_item("memory", memory)?;
    Ok(d)
}

pub(crate) fn path<'py>(py: Python<'py>, p: &PathInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path_class", &p.class)?;
    d.set_item("bandwidth_mbps", p.bandwidth_mbps)?;
    d.set_item("max_bandwidth_mbps", p.max_bandwidth_mbps)?;
    d.set_item("latency_ns", p.latency_ns)?;
    d.set_item("route", &p.route)?;
    d.set_item("degraded_links", p.degraded_links)?;
    Ok(d)
}

pub(crate) fn near<'py>(py: Python<'py>, m: &NearMemory) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("device", &m.device)?;
    d.set_item("memory", class_name(m.memory))?;
    d.set_item("size", m.size)?;
    d.set_item("path", path(py, &m.path)?)?;
    Ok(d)
}

pub(crate) fn location<'py>(py: Python<'py>, l: &Location) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match l {
        Location::Resource { device, memory, ordinal, offset, set } => {
            d.set_item("kind", "resource")?;
            d.set_item("device", device)?;
            d.set_item("memory", class_name(*memory))?;
            d.set_item("ordinal", *ordinal)?;
            d.set_item("offset", *offset)?;
            d.set_item("set", set.as_deref())?;
        }
        Location::Hole { owner } => {
            d.set_item("kind", "hole")?;
            d.set_item("owner", owner)?;
        }
        Location::Unmapped => d.set_item("kind", "unmapped")?,
        Location::NotInPartition => d.set_item("kind", "not_in_partition")?,
        Location::Remote { node, live, place } => {
            d.set_item("kind", "remote")?;
            d.set_item("node", node)?;
            d.set_item("live", *live)?;
            match place {
                RemotePlace::Resource { device, memory, ordinal, offset } => {
                    d.set_item("device", device)?;
                    d.set_item("memory", class_name(*memory))?;
                    d.set_item("ordinal", *ordinal)?;
                    d.set_item("offset", *offset)?;
                }
                RemotePlace::Set { set, offset } => {
                    d.set_item("set", set)?;
                    d.set_item("offset", *offset)?;
                }
                RemotePlace::Hole => {}
            }
        }
    }
    Ok(d)
}

fn cache<'py>(py: Python<'py>, c: &CacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("hits", c.hits)?;
    d.set_item("range_hits", c.range_hits)?;
    d.set_item("misses", c.misses)?;
    d.set_item("evictions", c.evictions)?;
    d.set_item("invalidations", c.invalidations)?;
    d.set_item("entries", c.entries)?;
    d.set_item("bytes", c.bytes)?;
    Ok(d)
}

pub(crate) fn registration_stats<'py>(py: Python<'py>, s: &RegistrationStats) -> PyResult<Bound<'py, PyDict>> {
    let d = cache(py, &s.cache)?;
    d.set_item("live", s.live)?;
    d.set_item("registered_bytes", s.registered_bytes)?;
    Ok(d)
}
