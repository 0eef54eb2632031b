//! The KFD topology tree (`sys/class/kfd/kfd/topology/nodes/N/`): `properties`, `io_links`,
//! `p2p_links` and `mem_banks`, parsed strictly and read with bounds.
//!
//! KFD node numbers are the kernel's enumeration order and change when a GPU is added,
//! removed or repartitioned: they are kept here only to join links to nodes, never shown
//! as an identity.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::Path;

use crate::sysfs::{AttrError, list_dir};

/// Where the tree lives under the sysfs root.
pub const KFD_NODES: &str = "sys/class/kfd/kfd/topology/nodes";

/// Most KFD nodes read (MI300X in CPX mode has 8 × 8 GPU nodes plus CPUs; this leaves room
/// for far larger machines while bounding a hostile tree).
pub const MAX_NODES: usize = 4096;
/// Most `io_links`/`p2p_links` entries read per node (one per other node at most).
pub const MAX_LINKS_PER_NODE: usize = MAX_NODES;
/// Most `mem_banks` read per node.
pub const MAX_MEM_BANKS: usize = 64;
/// Most lines in a `properties` file (kernels print about 40).
pub const MAX_PROPERTY_LINES: usize = 512;
/// Longest property key accepted.
const MAX_KEY_LEN: usize = 64;

/// `io_links`/`p2p_links` `type`: PCI Express (`CRAT_IOLINK_TYPE_PCIEXPRESS`).
pub const IOLINK_PCIE: u32 = 2;
/// `io_links`/`p2p_links` `type`: xGMI (`CRAT_IOLINK_TYPE_XGMI`).
pub const IOLINK_XGMI: u32 = 11;

/// `mem_banks` `heap_type` values that are the device's own memory (frame buffer, public
/// and private: `HSA_MEM_HEAP_TYPE_FB_PUBLIC`/`_PRIVATE`).
pub const HEAP_FB: [u64; 2] = [1, 2];

/// Why a KFD `properties` file was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KfdParseError {
    /// A line is not `key value` with a lower-case key and a decimal value.
    #[error("line {line}: not `key value`")]
    ParseLine {
        /// 1-based line number.
        line: usize,
    },
    /// The same key appears twice.
    #[error("line {line}: duplicate key {key}")]
    DuplicateKey {
        /// 1-based line number.
        line: usize,
        /// The key.
        key: String,
    },
    /// More lines than any kernel writes.
    #[error("more than {MAX_PROPERTY_LINES} lines")]
    TooManyLines,
}

/// A parsed `properties` file: key → value. Keys come and go between kernels, so the
/// map keeps every key and readers ask for the ones they know.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties(BTreeMap<String, u64>);

impl Properties {
    /// The value of `key`, when the file has it.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.0.get(key).copied()
    }

    /// The value of `key` as a `u32`, when present and in range.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key).and_then(|v| u32::try_from(v).ok())
    }

    /// Every `(key, value)`, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.0.iter().map(|(k, &v)| (k.as_str(), v))
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when the file had no keys.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Parses a KFD `properties` file: one `key value` per line, the value a decimal `u64`
/// (the kernel prints every property with `%llu`/`%u`). Blank lines are skipped.
pub fn parse_properties(text: &str) -> Result<Properties, KfdParseError> {
    let mut map = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if line > MAX_PROPERTY_LINES {
            return Err(KfdParseError::TooManyLines);
        }
        let l = raw.trim();
        if l.is_empty() {
            continue;
        }
        let mut parts = l.split_ascii_whitespace();
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(KfdParseError::ParseLine { line });
        };
        let key_ok = !key.is_empty()
            && key.len() <= MAX_KEY_LEN
            && key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        let value = crate::sysfs::parse_dec_u64(value).filter(|_| key_ok).ok_or(KfdParseError::ParseLine { line })?;
        if map.insert(key.to_owned(), value).is_some() {
            return Err(KfdParseError::DuplicateKey { line, key: key.to_owned() });
        }
    }
    Ok(Properties(map))
}

/// One `io_links/N` or `p2p_links/N` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KfdLink {
    /// `type` (2 PCIe, 11 xGMI, ...).
    pub link_type: u32,
    /// `node_to`: the KFD node at the far end.
    pub node_to: u32,
    /// `weight`: the kernel's relative distance (xGMI 15 per hop, PCIe 20, ...).
    pub weight: u32,
    /// `min_bandwidth` in MB/s (one xGMI link's bandwidth; 0 when unknown).
    pub min_bandwidth: u64,
    /// `max_bandwidth` in MB/s (all links to the peer; 0 for an indirect peer).
    pub max_bandwidth: u64,
}

impl KfdLink {
    /// A link from parsed properties; `None` when a key it needs is missing.
    pub fn from_properties(p: &Properties) -> Option<Self> {
        Some(Self {
            link_type: p.get_u32("type")?,
            node_to: p.get_u32("node_to")?,
            weight: p.get_u32("weight")?,
            min_bandwidth: p.get("min_bandwidth").unwrap_or(0),
            max_bandwidth: p.get("max_bandwidth").unwrap_or(0),
        })
    }
}

/// One KFD node as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KfdNode {
    /// The kernel's node number (internal: joins links to nodes).
    pub id: u32,
    /// `properties`.
    pub props: Properties,
    /// Direct links.
    pub io_links: Vec<KfdLink>,
    /// Indirect routes (peer-to-peer through other nodes).
    pub p2p_links: Vec<KfdLink>,
    /// `(heap_type, size_in_bytes)` of each memory bank.
    pub mem_banks: Vec<(u64, u64)>,
    /// True when any `mem_banks` entry could not be read (so a sum would be short).
    pub mem_banks_incomplete: bool,
}

impl KfdNode {
    /// A GPU node has SIMDs (`gpu_id` is missing on some kernels' dumps).
    pub fn is_gpu(&self) -> bool {
        self.props.get("simd_count").is_some_and(|s| s > 0)
    }
}

/// What reading the tree found.
#[derive(Debug, Default)]
pub struct KfdTree {
    /// Nodes whose `properties` were read and parsed, by node number.
    pub nodes: Vec<KfdNode>,
    /// Node numbers the kernel refused to show (EPERM: a device cgroup without the GPU).
    pub hidden: Vec<u32>,
    /// Lines for the backend report: entries that could not be read or parsed.
    pub notes: Vec<String>,
}

/// Reads an attribute file (the sysfs reader, or a test's).
pub type ReadFn<'a> = &'a dyn Fn(&Path) -> Result<String, AttrError>;

/// True when a read error is the kernel hiding the node: KFD answers `EPERM` for a GPU the
/// caller's device cgroup does not allow, and containers often show `EACCES` the same way.
pub fn is_hidden(err: &AttrError) -> bool {
    matches!(err, AttrError::Unreadable { source, .. } if source.kind() == ErrorKind::PermissionDenied)
}

fn numbered(dir: &Path, max: usize, notes: &mut Vec<String>) -> Vec<u32> {
    let names = match list_dir(dir) {
        Ok(n) => n,
        Err(e) => {
            notes.push(e.to_string());
            return Vec::new();
        }
    };
    // The kernel names nodes by their number alone: `+1` or `01` would read node 1 twice.
    let canonical = |n: &str| n == "0" || (!n.starts_with('0') && n.bytes().all(|b| b.is_ascii_digit()));
    let mut ids: Vec<u32> =
        names.iter().filter(|n| canonical(n)).filter_map(|n| n.parse::<u32>().ok().filter(|_| n.len() <= 10)).collect();
    ids.sort_unstable();
    if ids.len() > max {
        notes.push(format!("{}: {} entries, only the first {max} read", dir.display(), ids.len()));
        ids.truncate(max);
    }
    ids
}

fn read_props(path: &Path, read: ReadFn<'_>) -> Result<Properties, String> {
    let text = read(path).map_err(|e| e.to_string())?;
    parse_properties(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn read_links(dir: &Path, read: ReadFn<'_>, notes: &mut Vec<String>) -> Vec<KfdLink> {
    let mut out = Vec::new();
    for i in numbered(dir, MAX_LINKS_PER_NODE, notes) {
        let path = dir.join(i.to_string()).join("properties");
        match read_props(&path, read) {
            Ok(p) => match KfdLink::from_properties(&p) {
                Some(l) => out.push(l),
                None => notes.push(format!("{}: type, node_to or weight missing", path.display())),
            },
            Err(e) => notes.push(e),
        }
    }
    out
}

/// Reads every node under `nodes_dir`.
pub fn read_tree(nodes_dir: &Path, read: ReadFn<'_>) -> KfdTree {
    let mut tree = KfdTree::default();
    for id in numbered(nodes_dir, MAX_NODES, &mut tree.notes) {
        let dir = nodes_dir.join(id.to_string());
        let path = dir.join("properties");
        let props = match read(&path) {
            Ok(text) => match parse_properties(&text) {
                Ok(p) => p,
                Err(e) => {
                    tree.notes.push(format!("{}: {e}", path.display()));
                    continue;
                }
            },
            Err(e) if is_hidden(&e) => {
                tree.hidden.push(id);
                continue;
            }
            Err(e) => {
                tree.notes.push(e.to_string());
                continue;
            }
        };
        let io_links = read_links(&dir.join("io_links"), read, &mut tree.notes);
        let p2p_links = read_links(&dir.join("p2p_links"), read, &mut tree.notes);
        let mut node = KfdNode { id, props, io_links, p2p_links, ..KfdNode::default() };
        let banks = dir.join("mem_banks");
        for b in numbered(&banks, MAX_MEM_BANKS, &mut tree.notes) {
            let path = banks.join(b.to_string()).join("properties");
            match read_props(&path, read) {
                Ok(p) => match (p.get("heap_type"), p.get("size_in_bytes")) {
                    (Some(h), Some(s)) => node.mem_banks.push((h, s)),
                    _ => {
                        node.mem_banks_incomplete = true;
                        tree.notes.push(format!("{}: heap_type or size_in_bytes missing", path.display()));
                    }
                },
                Err(e) => {
                    node.mem_banks_incomplete = true;
                    tree.notes.push(e);
                }
            }
        }
        tree.nodes.push(node);
    }
    tree
}

/// The GFX target name from KFD's `gfx_target_version` (`major * 10000 + minor * 100 +
/// stepping`, as ROCr decodes it): 90402 → `gfx942`, 90010 → `gfx90a`. Minor and stepping
/// are single hex digits in the name.
pub fn gfx_target(version: u64) -> Option<String> {
    let (major, minor, step) = (version / 10_000, (version / 100) % 100, version % 100);
    (major > 0 && major < 100 && minor < 16 && step < 16).then(|| format!("gfx{major}{minor:x}{step:x}"))
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn properties_parse_strictly() {
        let p = parse_properties("simd_count 416\nhive_id 12609507387757274807\n\n").unwrap();
        assert_eq!(p.get("simd_count"), Some(416));
        assert_eq!(p.get("hive_id"), Some(12_609_507_387_757_274_807));
        assert_eq!(p.get_u32("hive_id"), None, "out of u32 range");
        assert_eq!(parse_properties("a 1 2"), Err(KfdParseError::ParseLine { line: 1 }));
        assert_eq!(parse_properties("a -1"), Err(KfdParseError::ParseLine { line: 1 }));
        assert_eq!(parse_properties("A 1"), Err(KfdParseError::ParseLine { line: 1 }));
        assert_eq!(parse_properties("x 1\nx 2"), Err(KfdParseError::DuplicateKey { line: 2, key: "x".into() }));
        let long: String = (0..=MAX_PROPERTY_LINES).map(|i| format!("k{i} 1\n")).collect();
        assert_eq!(parse_properties(&long), Err(KfdParseError::TooManyLines));
        assert!(parse_properties("").unwrap().is_empty());
    }

    /// Only the kernel's own spelling of a node number counts: before, `+1` and `01` were
    /// read as node 1 again.
    #[test]
    fn node_directories_count_by_their_canonical_number_only() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["0", "1", "10", "+1", "01", "00", "x", "-2"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        let mut notes = Vec::new();
        assert_eq!(numbered(dir.path(), 64, &mut notes), vec![0, 1, 10]);
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn gfx_targets_decode_like_rocr() {
        assert_eq!(gfx_target(90402).as_deref(), Some("gfx942"));
        assert_eq!(gfx_target(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_target(90008).as_deref(), Some("gfx908"));
        assert_eq!(gfx_target(0), None);
        assert_eq!(gfx_target(91700), None);
    }

    #[test]
    fn permission_denied_is_hidden_other_errors_are_not() {
        let unreadable = |k| AttrError::Unreadable { path: PathBuf::from("p"), source: io::Error::from(k) };
        assert!(is_hidden(&unreadable(ErrorKind::PermissionDenied)));
        // EPERM, what KFD's node_show returns, maps to PermissionDenied too.
        let eperm = AttrError::Unreadable { path: PathBuf::from("p"), source: io::Error::from_raw_os_error(1) };
        assert!(is_hidden(&eperm));
        assert!(!is_hidden(&unreadable(ErrorKind::Other)));
        assert!(!is_hidden(&AttrError::Missing { path: PathBuf::from("p") }));
    }
}
