//! Pure parsers for the text the CXL core prints in sysfs; total functions fit for fuzzing.
//!
//! Formats follow `drivers/cxl/core/{port,region,memdev}.c` (Linux 6.x) and
//! `Documentation/ABI/testing/sysfs-bus-cxl`: sizes and addresses are `%#llx` (`dpa_size` is
//! `%pa`, i.e. `0x` and 16 zero-padded digits), ways and granularity are `%d`, `target_list`
//! is `%d,%d,...` of dport ids, booleans (`cap_*`, `locked`, `commit`) are `0`/`1`. Every
//! parser returns `None` for anything else; none of them panics or allocates without bound.

use std::collections::BTreeMap;

use fabric_topology::cxl::CxlMode;

use crate::sysfs::{parse_dec_u64, parse_hex_u64};

/// Most targets a decoder can list: the CXL 3.x HDM decoder target list holds at most 16.
pub const MAX_TARGETS: usize = 16;

/// Attributes of one sysfs object, by file name (`"start"` -> `"0x290000000"`).
pub type RawAttrs = BTreeMap<String, String>;

/// Parses `target_list`: comma-separated decimal dport ids in interleave order. An empty
/// list (an endpoint or an uncommitted decoder) is `Some(vec![])`; garbage, a negative or
/// oversized id, or more than [`MAX_TARGETS`] entries is `None`.
pub fn parse_target_list(s: &str) -> Option<Vec<u32>> {
    let t = s.trim();
    if t.is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::new();
    for part in t.split(',') {
        if out.len() == MAX_TARGETS {
            return None;
        }
        out.push(u32::try_from(parse_dec_u64(part)?).ok()?);
    }
    Some(out)
}

/// Parses a sysfs boolean (`0`/`1`).
pub fn parse_bool01(s: &str) -> Option<bool> {
    match s.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

/// Parses a decoder or region `mode`. Known kernel words map to their mode; `mixed` (the
/// kernel's error indication) and any other short word map to [`CxlMode::Unknown`]; text
/// that is not a plain word is `None`.
///
/// Dynamic-capacity names differ between the DCD patch series (`dc`, `dc0`..`dc7`,
/// `dynamic_ram_a`, `dynamic_ram_1`); all of them are [`CxlMode::DynamicRam`].
pub fn parse_mode(s: &str) -> Option<CxlMode> {
    let t = s.trim();
    if t.is_empty() || t.len() > 32 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return None;
    }
    Some(match t {
        "ram" => CxlMode::Ram,
        "pmem" => CxlMode::Pmem,
        "none" => CxlMode::None,
        _ if is_dc_name(t) => CxlMode::DynamicRam,
        _ => CxlMode::Unknown,
    })
}

fn is_dc_name(t: &str) -> bool {
    t == "dc" || t.starts_with("dynamic_ram") || t.strip_prefix("dc").is_some_and(|n| parse_dec_u64(n).is_some())
}

/// Parses a power-of-two interleave granularity in bytes (256 B ..= 16 KiB per the CXL spec;
/// host bridges may print larger values for pass-through decoders, so up to 1 GiB is taken).
pub fn parse_granularity(s: &str) -> Option<u32> {
    let v = u32::try_from(parse_dec_u64(s)?).ok()?;
    (v.is_power_of_two() && (256..=1 << 30).contains(&v)).then_some(v)
}

/// Parses interleave ways: 1, 2, 3, 4, 6, 8, 12 or 16 (the encodings CXL 3.x defines).
pub fn parse_ways(s: &str) -> Option<u32> {
    let v = u32::try_from(parse_dec_u64(s)?).ok()?;
    matches!(v, 1 | 2 | 3 | 4 | 6 | 8 | 12 | 16).then_some(v)
}

/// Parses an address or size the kernel prints in hex (`%#llx` or `%pa`). Decimal is not
/// accepted: a value without `0x` is ambiguous and the kernel never prints one.
pub fn parse_hex_addr(s: &str) -> Option<u64> {
    let t = s.trim();
    if !(t.starts_with("0x") || t.starts_with("0X")) {
        return None;
    }
    parse_hex_u64(t)
}

/// Parses a size printed either way (memdev `ram/size` is `%#llx`; some DCD series print
/// decimal): `0x...` is hex, plain digits are decimal.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    if t.starts_with("0x") || t.starts_with("0X") { parse_hex_u64(t) } else { parse_dec_u64(t) }
}

/// Parses a region UUID (`%pUb`): 36 characters, hex and dashes at 8-4-4-4-12. An empty
/// value (RAM regions) is `Some(None)`.
pub fn parse_uuid(s: &str) -> Option<Option<String>> {
    let t = s.trim();
    if t.is_empty() {
        return Some(None);
    }
    let groups: Vec<&str> = t.split('-').collect();
    let ok = t.len() == 36
        && groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()));
    // The null UUID is a PMEM region's before one is set: no identity.
    let null = t.bytes().all(|b| b == b'0' || b == b'-');
    ok.then(|| (!null).then(|| t.to_ascii_lowercase()))
}

/// Splits a `decoderX.Y` name into the port id `X` and the decoder instance `Y`.
pub fn parse_decoder_name(s: &str) -> Option<(u32, u32)> {
    let (x, y) = s.trim().strip_prefix("decoder")?.split_once('.')?;
    Some((u32::try_from(parse_dec_u64(x)?).ok()?, u32::try_from(parse_dec_u64(y)?).ok()?))
}

/// Splits a name like `dport12` / `target3` / `mem0` into its prefix-stripped number.
pub fn parse_indexed(s: &str, prefix: &str) -> Option<u32> {
    u32::try_from(parse_dec_u64(s.strip_prefix(prefix)?)?).ok()
}

/// What a decoder's attributes say, every field `None` when absent or unparsable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecoderAttrs {
    /// `devtype` (`cxl_decoder_root`, `cxl_decoder_switch`, `cxl_decoder_endpoint`).
    pub devtype: Option<String>,
    /// `start`.
    pub start: Option<u64>,
    /// `size`.
    pub size: Option<u64>,
    /// `interleave_ways`.
    pub ways: Option<u32>,
    /// `interleave_granularity`.
    pub granularity: Option<u32>,
    /// `target_list`, as dport ids.
    pub targets: Option<Vec<u32>>,
    /// `mode` (endpoint decoders).
    pub mode: Option<CxlMode>,
    /// `dpa_resource` (endpoint decoders).
    pub dpa_resource: Option<u64>,
    /// `dpa_size` (endpoint decoders).
    pub dpa_size: Option<u64>,
    /// `locked`.
    pub locked: Option<bool>,
    /// `cap_ram`, `cap_pmem`, `cap_type2`, `cap_type3` (root decoders).
    pub cap_ram: Option<bool>,
    /// See `cap_ram`.
    pub cap_pmem: Option<bool>,
    /// See `cap_ram`.
    pub cap_type2: Option<bool>,
    /// See `cap_ram`.
    pub cap_type3: Option<bool>,
    /// `qos_class` (root decoders, 6.5+); `-1` means none and is `None`.
    pub qos_class: Option<u32>,
    /// Attribute names that were present but did not parse.
    pub invalid: Vec<String>,
}

/// Parses the attributes of a `decoderX.Y` directory.
pub fn parse_decoder(attrs: &RawAttrs) -> DecoderAttrs {
    let mut d = DecoderAttrs::default();
    let mut invalid = Vec::new();
    let mut get = |name: &str, ok: bool| {
        if !ok && attrs.contains_key(name) {
            invalid.push(name.to_owned());
        }
    };
    macro_rules! field {
        ($name:literal, $parse:expr) => {{
            let v = attrs.get($name).and_then(|s| $parse(s.as_str()));
            get($name, v.is_some());
            v
        }};
    }
    d.devtype = field!("devtype", |s: &str| {
        let t = s.trim();
        (t.len() <= 32 && t.starts_with("cxl_decoder_")).then(|| t.to_owned())
    });
    d.start = field!("start", parse_hex_addr);
    d.size = field!("size", parse_hex_addr);
    d.ways = field!("interleave_ways", parse_ways);
    d.granularity = field!("interleave_granularity", parse_granularity);
    d.targets = field!("target_list", parse_target_list);
    d.mode = field!("mode", parse_mode);
    // An endpoint decoder without an allocation prints RESOURCE_SIZE_MAX: valid, no value.
    d.dpa_resource = field!("dpa_resource", parse_hex_addr).filter(|&v| v != u64::MAX);
    d.dpa_size = field!("dpa_size", parse_hex_addr);
    d.locked = field!("locked", parse_bool01);
    d.cap_ram = field!("cap_ram", parse_bool01);
    d.cap_pmem = field!("cap_pmem", parse_bool01);
    d.cap_type2 = field!("cap_type2", parse_bool01);
    d.cap_type3 = field!("cap_type3", parse_bool01);
    // `qos_class` prints -1 (CXL_QOS_CLASS_INVALID) when the platform has none: valid, unknown.
    let qos = attrs.get("qos_class").map(|s| s.trim());
    d.qos_class = qos.and_then(parse_dec_u64).and_then(|v| u32::try_from(v).ok());
    get("qos_class", qos.is_none_or(|s| s == "-1" || d.qos_class.is_some()));
    d.invalid = invalid;
    d
}

/// What a region's attributes say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegionAttrs {
    /// `uuid` (`None` when empty, as for RAM regions, or invalid).
    pub uuid: Option<String>,
    /// `mode` (6.3+).
    pub mode: Option<CxlMode>,
    /// `resource`.
    pub resource: Option<u64>,
    /// `size`.
    pub size: Option<u64>,
    /// `interleave_ways`.
    pub ways: Option<u32>,
    /// `interleave_granularity`.
    pub granularity: Option<u32>,
    /// `commit`.
    pub committed: Option<bool>,
    /// `targetN` values (endpoint decoder names) by position; empty positions are left out.
    pub targets: BTreeMap<u32, String>,
    /// Attribute names that were present but did not parse.
    pub invalid: Vec<String>,
}

/// Parses the attributes of a `regionN` directory. `targetN` positions at or beyond
/// [`MAX_TARGETS`] are ignored.
pub fn parse_region(attrs: &RawAttrs) -> RegionAttrs {
    let mut r = RegionAttrs::default();
    let mut check = |name: &str, present: bool, ok: bool| {
        if present && !ok {
            r.invalid.push(name.to_owned());
        }
    };
    let uuid = attrs.get("uuid").map(|s| parse_uuid(s));
    check("uuid", uuid.is_some(), uuid.as_ref().is_some_and(Option::is_some));
    let uuid = uuid.flatten().flatten();
    macro_rules! field {
        ($name:literal, $parse:expr) => {{
            let v = attrs.get($name).and_then(|s| $parse(s.as_str()));
            check($name, attrs.contains_key($name), v.is_some());
            v
        }};
    }
    let mode = field!("mode", parse_mode);
    // `-1ULL`: no address range assigned yet (a region not yet sized).
    let resource = field!("resource", parse_hex_addr).filter(|&v| v != u64::MAX);
    let size = field!("size", parse_hex_addr);
    let ways = field!("interleave_ways", parse_ways);
    let granularity = field!("interleave_granularity", parse_granularity);
    let committed = field!("commit", parse_bool01);
    let mut targets = BTreeMap::new();
    for (k, v) in attrs {
        let Some(pos) = parse_indexed(k, "target").filter(|&p| (p as usize) < MAX_TARGETS) else { continue };
        let v = v.trim();
        if v.is_empty() {
            continue;
        }
        match parse_decoder_name(v) {
            Some(_) => {
                targets.insert(pos, v.to_owned());
            }
            None => check("target", true, false),
        }
    }
    RegionAttrs { uuid, mode, resource, size, ways, granularity, committed, targets, invalid: r.invalid }
}

/// A dynamic-capacity partition a memdev reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DcPartition {
    /// Partition name as the kernel shows it (`dc0`, `dynamic_ram_a`, `region1`).
    pub name: String,
    /// Capacity in bytes.
    pub size: u64,
}

/// Reads dynamic-capacity partitions from a memdev's attributes, whichever DCD layout the
/// kernel uses (none is mainline as of 6.12; all are from the posted DCD series):
/// `dcN/size` (v8, Dec 2024), `dynamic_ram_a/size` / `dynamic_ram_1/size` (2025-26), or
/// `dc/region_count` + `dc/regionN_size` (v2-v3, 2023-24). Keys are relative paths
/// (`dc0/size`). Partitions of size 0 are kept: the kernel showed them.
pub fn parse_dc_partitions(attrs: &RawAttrs) -> Vec<DcPartition> {
    let mut out = Vec::new();
    for (k, v) in attrs {
        let Some((dir, file)) = k.split_once('/') else { continue };
        let name = if file == "size" && (is_dc_name(dir) && dir != "dc") {
            dir.to_owned()
        } else if dir == "dc" {
            match file.strip_suffix("_size").and_then(|r| parse_indexed(r, "region")) {
                Some(n) => format!("region{n}"),
                None => continue,
            }
        } else {
            continue;
        };
        if let Some(size) = parse_size(v) {
            out.push(DcPartition { name, size });
        }
        if out.len() == 8 {
            break; // CXL 3.x: at most 8 DC regions.
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(kv: &[(&str, &str)]) -> RawAttrs {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn target_lists_parse_strictly() {
        assert_eq!(parse_target_list("12\n"), Some(vec![12]));
        assert_eq!(parse_target_list("0,1,2,3"), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_target_list(""), Some(vec![]));
        assert_eq!(parse_target_list("0,,1"), None);
        assert_eq!(parse_target_list("0,-1"), None);
        assert_eq!(parse_target_list("4294967296"), None);
        let seventeen = vec!["1"; 17].join(",");
        assert_eq!(parse_target_list(&seventeen), None);
        assert_eq!(parse_target_list(&vec!["1"; 16].join(",")).map(|v| v.len()), Some(16));
    }

    #[test]
    fn scalar_parsers_accept_kernel_formats_only() {
        assert_eq!(parse_hex_addr("0x0000000010000000"), Some(0x1000_0000));
        assert_eq!(parse_hex_addr("268435456"), None);
        assert_eq!(parse_ways("3"), Some(3));
        assert_eq!(parse_ways("5"), None);
        assert_eq!(parse_granularity("256"), Some(256));
        assert_eq!(parse_granularity("300"), None);
        assert_eq!(parse_granularity("128"), None);
        assert_eq!(parse_mode("ram"), Some(CxlMode::Ram));
        assert_eq!(parse_mode("mixed"), Some(CxlMode::Unknown));
        assert_eq!(parse_mode("dc3"), Some(CxlMode::DynamicRam));
        assert_eq!(parse_mode("dynamic_ram_a"), Some(CxlMode::DynamicRam));
        assert_eq!(parse_mode("r a m"), None);
        assert_eq!(parse_uuid(""), Some(None));
        assert_eq!(
            parse_uuid("A9B1C2D3-0000-4000-8000-00000000CAFE"),
            Some(Some("a9b1c2d3-0000-4000-8000-00000000cafe".into()))
        );
        assert_eq!(parse_uuid("not-a-uuid"), None);
        assert_eq!(parse_decoder_name("decoder12.3"), Some((12, 3)));
        assert_eq!(parse_decoder_name("decoder.3"), None);
    }

    #[test]
    fn decoder_attributes_report_what_did_not_parse() {
        let d = parse_decoder(&attrs(&[
            ("start", "0x290000000"),
            ("size", "banana"),
            ("interleave_ways", "2"),
            ("target_list", "0,1"),
            ("qos_class", "-1"),
        ]));
        assert_eq!(d.start, Some(0x2_9000_0000));
        assert_eq!(d.size, None);
        assert_eq!(d.ways, Some(2));
        assert_eq!(d.targets, Some(vec![0, 1]));
        assert_eq!(d.qos_class, None);
        assert_eq!(d.invalid, vec!["size".to_owned()]);
    }

    #[test]
    fn region_targets_are_positional_and_validated() {
        let r = parse_region(&attrs(&[
            ("target0", "decoder3.0"),
            ("target1", "decoder4.0\n"),
            ("target2", ""),
            ("target3", "../../etc/passwd"),
            ("uuid", ""),
        ]));
        assert_eq!(r.targets.len(), 2);
        assert_eq!(r.targets[&1], "decoder4.0");
        assert_eq!(r.uuid, None);
        assert_eq!(r.invalid, vec!["target".to_owned()]);
    }

    #[test]
    fn a_region_not_yet_sized_has_no_address_and_a_null_uuid_no_identity() {
        let r = parse_region(&attrs(&[
            ("resource", "0xffffffffffffffff"),
            ("size", "0x0"),
            ("uuid", "00000000-0000-0000-0000-000000000000\n"),
        ]));
        assert_eq!((r.resource, r.size, r.uuid), (None, Some(0), None));
        assert!(r.invalid.is_empty(), "{:?}", r.invalid);
        assert_eq!(parse_region(&attrs(&[("resource", "0x2090000000")])).resource, Some(0x20_9000_0000));
    }

    #[test]
    fn dc_partitions_in_every_posted_layout() {
        let p = parse_dc_partitions(&attrs(&[("dc0/size", "0x10000000"), ("dc1/size", "0x0"), ("ram/size", "0x0")]));
        assert_eq!(p.len(), 2);
        assert_eq!(p[0], DcPartition { name: "dc0".into(), size: 0x1000_0000 });
        let p = parse_dc_partitions(&attrs(&[("dynamic_ram_a/size", "0x40000000")]));
        assert_eq!(p, vec![DcPartition { name: "dynamic_ram_a".into(), size: 0x4000_0000 }]);
        let p = parse_dc_partitions(&attrs(&[("dc/region_count", "1"), ("dc/region0_size", "268435456")]));
        assert_eq!(p, vec![DcPartition { name: "region0".into(), size: 268_435_456 }]);
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(s in ".{0,80}") {
            let _ = parse_target_list(&s);
            let _ = parse_mode(&s);
            let _ = parse_uuid(&s);
            let _ = parse_decoder_name(&s);
            let a = attrs(&[("target_list", &s), ("start", &s), ("target0", &s), ("dc0/size", &s), ("mode", &s)]);
            let _ = parse_decoder(&a);
            let _ = parse_region(&a);
            let _ = parse_dc_partitions(&a);
        }
    }
}
