//! Kind-specific details of template endpoints: GPUs and accelerators (HBM), NICs (speed,
//! rail), NVMe, NVSwitches and CXL memdevs (capacities, dynamic capacity).

use fabric_topology::cxl::CxlMemdevInfo;
use fabric_topology::{DeviceKind, GpuInfo, MemoryKind, MemoryResource};

use super::error::Located;
use super::plan::Compiler;
use super::schema::Template;

/// PCI class codes by kind.
const CLASS_GPU: u32 = 0x03_0200;
const CLASS_ACCELERATOR: u32 = 0x12_0000;
const CLASS_NIC: u32 = 0x02_0000;
const CLASS_NVME: u32 = 0x01_0802;
const CLASS_BRIDGE_OTHER: u32 = 0x06_8000;
const CLASS_CXL_MEMDEV: u32 = 0x05_0210;

fn memory(kind: MemoryKind, size: u64) -> MemoryResource {
    MemoryResource { kind, size, hpa: None, numa_node: None }
}

/// Adds every endpoint of the template, kind by kind in a fixed order (which fixes the
/// order of ports and bus numbers below each switch).
pub(crate) fn endpoints(c: &mut Compiler<'_>, t: &Template) -> Result<(), Located> {
    for spec in t.gpu.iter().chain(&t.accelerator) {
        if let Some(m) = &spec.dma_mask_bits
            && !(12..=64).contains(m.get_ref())
        {
            return Err(Located::at(m, "dma_mask_bits must be 12 to 64"));
        }
    }
    for spec in &t.gpu {
        c.endpoints(spec.base(), DeviceKind::Gpu, CLASS_GPU, |d, _| {
            d.gpu = Some(GpuInfo {
                model: spec.model.clone(),
                nvlink_capable: spec.nvlinks,
                compute_capability: spec.compute_capability.clone(),
                ..GpuInfo::default()
            });
            d.memory.extend(spec.hbm.map(|s| memory(MemoryKind::Hbm, s.0)));
            d.dma_mask_bits = spec.dma_mask_bits.as_ref().map(|m| *m.get_ref());
            Ok(())
        })?;
    }
    for spec in &t.accelerator {
        if spec.nvlinks.is_some() || spec.compute_capability.is_some() {
            return Err(Located::at(&spec.name, "nvlinks and compute_capability apply to GPUs, not accelerators"));
        }
        c.endpoints(spec.base(), DeviceKind::Accelerator, CLASS_ACCELERATOR, |d, _| {
            d.memory.extend(spec.hbm.map(|s| memory(MemoryKind::Hbm, s.0)));
            d.dma_mask_bits = spec.dma_mask_bits.as_ref().map(|m| *m.get_ref());
            Ok(())
        })?;
    }
    for spec in &t.nic {
        let idx = c.endpoints(spec.base(), DeviceKind::Nic, CLASS_NIC, |d, _| {
            if let Some(g) = spec.gbps {
                d.attrs.insert("port_gbps".to_owned(), g.to_string());
            }
            Ok(())
        })?;
        if let Some(rail) = &spec.rail {
            for (i, &x) in idx.iter().enumerate() {
                c.rail(x, rail, i as u64)?;
            }
        }
    }
    for spec in &t.nvme {
        c.endpoints(spec.base(), DeviceKind::Storage, CLASS_NVME, |d, _| {
            if let Some(s) = spec.capacity {
                d.attrs.insert("capacity_bytes".to_owned(), s.0.to_string());
            }
            Ok(())
        })?;
    }
    for spec in &t.nvswitch {
        c.endpoints(spec.base(), DeviceKind::NvSwitch, CLASS_BRIDGE_OTHER, |d, _| {
            if let Some(p) = spec.ports {
                d.attrs.insert("ports".to_owned(), p.to_string());
            }
            Ok(())
        })?;
    }
    let mut mem_index = 0u32;
    for spec in &t.cxl_memdev {
        if spec.dc_regions.is_some() != spec.dc_size.is_some() {
            return Err(Located::at(&spec.name, "dc_regions and dc_size go together"));
        }
        if spec.dc_regions.is_some_and(|n| n > 8) {
            return Err(Located::at(&spec.name, "a CXL device has at most 8 dynamic-capacity regions"));
        }
        c.endpoints(spec.base(), DeviceKind::CxlMemdev, CLASS_CXL_MEMDEV, |d, _| {
            let (ram, pmem) = (spec.ram.map(|s| s.0), spec.pmem.map(|s| s.0));
            d.memory.extend(ram.filter(|&s| s > 0).map(|s| memory(MemoryKind::CxlVolatile, s)));
            d.memory.extend(pmem.filter(|&s| s > 0).map(|s| memory(MemoryKind::CxlPersistent, s)));
            if let (Some(n), Some(size)) = (spec.dc_regions, spec.dc_size) {
                for _ in 0..n {
                    d.memory.push(memory(MemoryKind::CxlDynamic, size.0));
                }
            }
            d.cxl = Some(CxlMemdevInfo {
                serial: spec.serial,
                kernel_name: Some(format!("mem{mem_index}")),
                pci_address: d.pci_address(),
                ram_size: ram,
                pmem_size: pmem,
                firmware_version: spec.firmware.clone(),
                dc_regions: spec.dc_regions,
            });
            mem_index += 1;
            Ok(())
        })?;
    }
    Ok(())
}
