//! Reading sysfs attributes under an injectable root, with typed errors.
//!
//! Every backend that reads `/sys` goes through [`SysfsRoot`], so the same code runs on the
//! live host (`/`), on extracted fixture trees, and inside QEMU guests. Attribute files are
//! untrusted input: sizes are bounded and contents are parsed strictly; a missing or
//! unparsable attribute is an error the caller turns into "unknown".

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most bytes read from one attribute file (sysfs pages are 4 KiB; `resource` on a
/// device with many BARs stays far below this).
pub const MAX_ATTR_BYTES: u64 = 64 * 1024;

/// Most symlinks [`SysfsRoot::resolve`] follows on one path (Linux's own bound, `ELOOP`).
pub const MAX_LINKS: usize = 40;

/// Why an attribute could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AttrError {
    /// The file does not exist (the kernel or dump does not expose it).
    #[error("{path}: missing")]
    Missing {
        /// The attribute path.
        path: PathBuf,
    },
    /// The file exists but could not be read (permissions, I/O).
    #[error("{path}: unreadable")]
    Unreadable {
        /// The attribute path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file holds more than [`MAX_ATTR_BYTES`]: no attribute does, and a value cut
    /// there would read as another.
    #[error("{path}: longer than {MAX_ATTR_BYTES} bytes")]
    TooLong {
        /// The attribute path.
        path: PathBuf,
    },
    /// The contents did not parse.
    #[error("{path}: invalid value {value:?}")]
    Invalid {
        /// The attribute path.
        path: PathBuf,
        /// What was read (truncated).
        value: String,
    },
}

impl AttrError {
    /// True when the attribute simply does not exist.
    pub fn is_missing(&self) -> bool {
        matches!(self, AttrError::Missing { .. })
    }
}

/// A sysfs tree rooted somewhere (`/` on a live host), plus the name of the node it
/// describes.
#[derive(Debug, Clone)]
pub struct SysfsRoot {
    root: PathBuf,
    node: String,
}

impl SysfsRoot {
    /// A root directory and the node name to qualify identities with.
    pub fn new(root: impl Into<PathBuf>, node: impl Into<String>) -> Self {
        Self { root: root.into(), node: node.into() }
    }

    /// A root with the node named from its `proc/sys/kernel/hostname` (or `etc/hostname`),
    /// falling back to `localhost`.
    pub fn with_hostname(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        let node = ["proc/sys/kernel/hostname", "etc/hostname"]
            .iter()
            .find_map(|p| read_bounded(&root.join(p)).ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty() && s.len() <= 253 && s.bytes().all(|b| b.is_ascii_graphic() && b != b'/'))
            .unwrap_or_else(|| "localhost".to_owned());
        Self { root, node }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Resolves a path like `sys/bus/pci/devices` under the root. Absolute inputs are
    /// re-rooted, never escaped to the live `/`.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        let rel = rel.as_ref();
        self.root.join(rel.strip_prefix("/").unwrap_or(rel))
    }

    /// Resolves `rel` under the root as a process chrooted there would: every symlink on
    /// the way is followed (the last component's too), an absolute target from the root
    /// (a dump made with absolute links must not lead into the live `/sys`), `..` never
    /// above the root; `None` past [`MAX_LINKS`] links (a loop: `ELOOP`) or at a link that
    /// cannot be read (it is never left for the host to follow). From the first
    /// component that does not exist the rest is appended as is (reading there then says
    /// `Missing`). For the live root (`/`) this is the kernel's own resolution.
    pub fn resolve(&self, rel: impl AsRef<Path>) -> Option<PathBuf> {
        use std::ffi::OsString;
        use std::path::Component;
        // Components still to walk, the next one last.
        fn push(todo: &mut Vec<OsString>, p: &Path) {
            for c in p.components().rev() {
                match c {
                    Component::Normal(n) => todo.push(n.to_owned()),
                    Component::ParentDir => todo.push("..".into()),
                    Component::RootDir | Component::Prefix(_) | Component::CurDir => {}
                }
            }
        }
        let mut todo = Vec::new();
        push(&mut todo, rel.as_ref());
        let (mut at, mut depth, mut links) = (self.root.clone(), 0usize, 0usize);
        while let Some(name) = todo.pop() {
            if name == ".." {
                if depth > 0 {
                    at.pop();
                    depth -= 1;
                }
                continue;
            }
            let next = at.join(&name);
            let target = match fs::symlink_metadata(&next) {
                Ok(m) if m.file_type().is_symlink() => {
                    if links == MAX_LINKS {
                        return None;
                    }
                    // A link that cannot be read is not handed to the host to follow.
                    Some(fs::read_link(&next).ok()?)
                }
                Ok(_) => None,
                Err(_) => {
                    // Missing: the rest cannot resolve either.
                    at = next;
                    while let Some(rest) = todo.pop() {
                        at.push(rest);
                    }
                    break;
                }
            };
            match target {
                Some(target) => {
                    links += 1;
                    if target.is_absolute() {
                        at = self.root.clone();
                        depth = 0;
                    }
                    push(&mut todo, &target);
                }
                None => {
                    at = next;
                    depth += 1;
                }
            }
        }
        Some(at)
    }

    /// Whether `p` lies under the root (e.g. a symlink target resolved inside the tree).
    pub fn contains(&self, p: &Path) -> bool {
        p.starts_with(&self.root)
    }
}

/// Reads an attribute of at most [`MAX_ATTR_BYTES`], which must be a regular file, itself
/// no symlink (sysfs attributes never are): a FIFO or device node where an attribute should
/// be (a hostile or broken tree) is refused before it is opened — opening some devices acts
/// (a watchdog starts) —, and a link is not followed out of the tree (a dump's `vendor ->
/// /etc/shadow` would put the file's first bytes into a report). The file opened is checked
/// to be the one looked at.
fn read_bounded(path: &Path) -> Result<String, AttrError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let unreadable = |source| AttrError::Unreadable { path: path.to_owned(), source };
    let refused = |why: &str| unreadable(std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_owned()));
    let missing_or = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => AttrError::Missing { path: path.to_owned() },
        _ => unreadable(e),
    };
    let seen = fs::symlink_metadata(path).map_err(missing_or)?;
    if seen.file_type().is_symlink() {
        return Err(refused("a symlink where an attribute should be"));
    }
    if !seen.is_file() {
        return Err(refused("not a regular file"));
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW)
        .open(path)
        .map_err(missing_or)?;
    let opened = file.metadata().map_err(unreadable)?;
    if !opened.is_file() || (opened.dev(), opened.ino()) != (seen.dev(), seen.ino()) {
        return Err(refused("replaced while being opened"));
    }
    let mut buf = Vec::new();
    file.take(MAX_ATTR_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| AttrError::Unreadable { path: path.to_owned(), source: e })?;
    if buf.len() as u64 > MAX_ATTR_BYTES {
        return Err(AttrError::TooLong { path: path.to_owned() });
    }
    String::from_utf8(buf).map_err(|e| AttrError::Invalid {
        path: path.to_owned(),
        value: String::from_utf8_lossy(&e.into_bytes()[..]).chars().take(64).collect(),
    })
}

/// Reads an attribute file and trims trailing whitespace.
pub fn read_attr(path: &Path) -> Result<String, AttrError> {
    Ok(read_bounded(path)?.trim_end().to_owned())
}

/// Reads and parses an attribute with `parse`, which returns `None` for bad contents.
pub fn parse_attr<T>(path: &Path, parse: impl FnOnce(&str) -> Option<T>) -> Result<T, AttrError> {
    let s = read_attr(path)?;
    parse(s.trim()).ok_or_else(|| AttrError::Invalid { path: path.to_owned(), value: s.chars().take(64).collect() })
}

/// Parses `0x1234` / `1234` hexadecimal.
pub fn parse_hex_u64(s: &str) -> Option<u64> {
    let t = s.trim();
    let t = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    // Digits only: `from_str_radix` would take a sign (`0x+10de`).
    if t.is_empty() || t.len() > 16 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(t, 16).ok()
}

/// Parses a decimal unsigned integer.
pub fn parse_dec_u64(s: &str) -> Option<u64> {
    let t = s.trim();
    if t.is_empty() || t.len() > 20 || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse().ok()
}

/// Parses a `numa_node` value: `-1` means "no NUMA affinity" and yields `Ok(None)`.
pub fn parse_numa_node(s: &str) -> Option<Option<u32>> {
    match s.trim() {
        "-1" => Some(None),
        t => parse_dec_u64(t).and_then(|v| u32::try_from(v).ok()).filter(|&v| v < 65_536).map(Some),
    }
}

/// Lists the entry names of a directory, sorted (so discovery order is deterministic).
/// A missing directory is an empty list.
pub fn list_dir(path: &Path) -> Result<Vec<String>, AttrError> {
    let rd = match fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(AttrError::Unreadable { path: path.to_owned(), source: e }),
    };
    let mut names: Vec<String> = rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).collect();
    names.sort();
    Ok(names)
}

/// The final component of a symlink's target (e.g. the driver name from `driver`).
pub fn link_name(path: &Path) -> Result<String, AttrError> {
    let target = fs::read_link(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AttrError::Missing { path: path.to_owned() },
        _ => AttrError::Unreadable { path: path.to_owned(), source: e },
    })?;
    target
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| AttrError::Invalid { path: path.to_owned(), value: target.display().to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers_accept_kernel_formats_and_reject_garbage() {
        assert_eq!(parse_hex_u64("0x10de"), Some(0x10de));
        assert_eq!(parse_hex_u64("ffff"), Some(0xffff));
        assert_eq!(parse_hex_u64("0x"), None);
        assert_eq!(parse_hex_u64("0x12345678901234567"), None);
        // A sign is no hex digit (before, `0x+10de` read as 0x10de).
        assert_eq!(parse_hex_u64("0x+10de"), None);
        assert_eq!(parse_hex_u64("-1"), None);
        assert_eq!(parse_dec_u64("42\n"), Some(42));
        assert_eq!(parse_dec_u64("-1"), None);
        assert_eq!(parse_numa_node("-1"), Some(None));
        assert_eq!(parse_numa_node("1"), Some(Some(1)));
        assert_eq!(parse_numa_node("x"), None);
    }

    #[test]
    fn resolve_follows_links_inside_the_root_only() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let root = SysfsRoot::new(dir.path(), "n");
        let real = dir.path().join("sys/devices/pci0000:00/0000:00:01.0");
        fs::create_dir_all(&real).unwrap();
        fs::create_dir_all(dir.path().join("sys/bus/pci/devices")).unwrap();
        fs::create_dir_all(dir.path().join("sys/class")).unwrap();
        // Absolute: re-rooted. Relative with `..`: from the link's directory.
        symlink("/sys/devices/pci0000:00/0000:00:01.0", dir.path().join("sys/bus/pci/devices/a")).unwrap();
        symlink("../../../devices/pci0000:00/0000:00:01.0", dir.path().join("sys/bus/pci/devices/r")).unwrap();
        // `..` past the root stays at the root.
        symlink("../../../../../../sys/devices", dir.path().join("sys/class/up")).unwrap();
        symlink("loop", dir.path().join("sys/class/loop")).unwrap();
        assert_eq!(root.resolve("sys/bus/pci/devices/a").unwrap(), real);
        assert_eq!(root.resolve("/sys/bus/pci/devices/a/vendor").unwrap(), real.join("vendor"));
        assert_eq!(root.resolve("sys/bus/pci/devices/r").unwrap(), real);
        assert_eq!(root.resolve("sys/class/up/pci0000:00").unwrap(), dir.path().join("sys/devices/pci0000:00"));
        assert_eq!(root.resolve("sys/class/loop/x"), None);
        assert_eq!(root.resolve("sys/none/a/b").unwrap(), dir.path().join("sys/none/a/b"));
        assert_eq!(root.resolve("sys/./devices/../devices").unwrap(), dir.path().join("sys/devices"));
    }

    #[test]
    fn attributes_are_bounded_and_typed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        fs::write(&p, vec![b'a'; MAX_ATTR_BYTES as usize]).unwrap();
        assert_eq!(read_attr(&p).unwrap().len(), MAX_ATTR_BYTES as usize);
        // One byte more is an error, not a value cut short (`size 5153` of `size 51539…`).
        let mut long = vec![b' '; MAX_ATTR_BYTES as usize - 6];
        long.extend_from_slice(b"x 123456789\n");
        fs::write(&p, long).unwrap();
        assert!(matches!(read_attr(&p), Err(AttrError::TooLong { .. })));
        assert!(read_attr(&dir.path().join("nope")).unwrap_err().is_missing());
        fs::write(dir.path().join("bin"), [0xff, 0xfe]).unwrap();
        assert!(matches!(read_attr(&dir.path().join("bin")), Err(AttrError::Invalid { .. })));
        assert!(list_dir(&dir.path().join("absent")).unwrap().is_empty());
    }

    #[test]
    fn an_attribute_that_is_no_regular_file_is_refused_without_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("serial");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        let at = fifo.clone();
        std::thread::spawn(move || tx.send(read_attr(&at).map_err(|e| e.to_string())).unwrap());
        let read = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("reading a FIFO waited for a writer");
        assert!(read.unwrap_err().contains("unreadable"));
        assert!(matches!(read_attr(dir.path()), Err(AttrError::Unreadable { .. })), "a directory");
    }

    #[test]
    fn absolute_paths_stay_under_the_root() {
        let r = SysfsRoot::new("/tmp/x", "n");
        assert_eq!(r.path("/sys/bus"), PathBuf::from("/tmp/x/sys/bus"));
    }
}
