//! The amdgpu driver's attributes on a GPU's PCI function (`sys/bus/pci/devices/ADDR/`):
//! identity, xGMI hive, VRAM size and partition modes, as `amdgpu_device.c`,
//! `amdgpu_xgmi.c`, `amdgpu_vram_mgr.c` and `amdgpu_gfx.c` print them.

use std::path::Path;

use crate::sysfs::{AttrError, parse_dec_u64, parse_hex_u64};

use super::kfd::ReadFn;

/// What the PCI function told us; `None` where the attribute is absent (older kernels,
/// GPUs without xGMI or partitions, dumps without the PCI tree).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmdgpuAttrs {
    /// `unique_id`: the chip's unique id, printed as hex (`%016llx`).
    pub unique_id: Option<u64>,
    /// `xgmi_hive_info/xgmi_hive_id` (decimal).
    pub hive_id: Option<u64>,
    /// `xgmi_device_id`: the GPU's node id in its hive (decimal).
    pub xgmi_device_id: Option<u64>,
    /// `xgmi_physical_id`: its physical position in the hive (decimal).
    pub xgmi_physical_id: Option<u64>,
    /// `mem_info_vram_total`: VRAM bytes (decimal).
    pub vram_total: Option<u64>,
    /// `current_compute_partition` (`SPX`, `DPX`, `TPX`, `QPX`, `CPX`).
    pub compute_partition: Option<String>,
    /// `current_memory_partition` (`NPS1`, `NPS2`, `NPS4`, `NPS8`).
    pub memory_partition: Option<String>,
}

/// Partition mode names are short upper-case words; anything else is refused rather than
/// shown.
fn parse_mode(s: &str) -> Option<String> {
    let t = s.trim();
    (!t.is_empty() && t.len() <= 8 && t.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit()))
        .then(|| t.to_owned())
}

/// How many compute partitions a mode makes, where the mode alone says: `CPX` makes one per
/// XCC, which depends on the part, so it gives `None`.
pub fn partitions_of_mode(mode: &str) -> Option<u32> {
    match mode {
        "SPX" => Some(1),
        "DPX" => Some(2),
        "TPX" => Some(3),
        "QPX" => Some(4),
        _ => None,
    }
}

/// Reads the attributes of the function at `dir`. Missing attributes are `None`; one that
/// exists but cannot be read or parsed is `None` and named in `notes`.
pub fn read(dir: &Path, read: ReadFn<'_>, notes: &mut Vec<String>) -> AmdgpuAttrs {
    let mut get = |name: &str, parse: &dyn Fn(&str) -> Option<String>| -> Option<String> {
        let path = dir.join(name);
        match read(&path) {
            Ok(s) => {
                let v = parse(&s);
                if v.is_none() {
                    notes.push(format!(
                        "{}: invalid value {:?}",
                        path.display(),
                        s.chars().take(32).collect::<String>()
                    ));
                }
                v
            }
            Err(AttrError::Missing { .. }) => None,
            Err(e) => {
                notes.push(e.to_string());
                None
            }
        }
    };
    let hex = |s: &str| parse_hex_u64(s).map(|v| v.to_string());
    let dec = |s: &str| parse_dec_u64(s).map(|v| v.to_string());
    let num = |v: Option<String>| v.and_then(|s| s.parse::<u64>().ok());
    AmdgpuAttrs {
        unique_id: num(get("unique_id", &hex)),
        hive_id: num(get("xgmi_hive_info/xgmi_hive_id", &dec)),
        xgmi_device_id: num(get("xgmi_device_id", &dec)),
        xgmi_physical_id: num(get("xgmi_physical_id", &dec)),
        vram_total: num(get("mem_info_vram_total", &dec)),
        compute_partition: get("current_compute_partition", &parse_mode),
        memory_partition: get("current_memory_partition", &parse_mode),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_words_and_counts_come_only_from_fixed_modes() {
        assert_eq!(parse_mode("CPX\n").as_deref(), Some("CPX"));
        assert_eq!(parse_mode("NPS4").as_deref(), Some("NPS4"));
        assert_eq!(parse_mode("cpx"), None);
        assert_eq!(parse_mode(""), None);
        assert_eq!(partitions_of_mode("QPX"), Some(4));
        assert_eq!(partitions_of_mode("CPX"), None);
    }
}
