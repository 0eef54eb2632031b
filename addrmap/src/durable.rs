//! Checksummed files written all or nothing: the one frame (magic, version, encoding,
//! generation, length, two CRC-32Cs) and the one whole-file write (temporary file, fsync,
//! rename, fsync of the directory) that the address map state, fabricd's map record and
//! fabricd's journal segments share.
//!
//! Frame layout (integers little-endian):
//!
//! | bytes  | field                          |
//! |--------|--------------------------------|
//! | 0..8   | magic (the file kind's own)    |
//! | 8..12  | format version                 |
//! | 12..16 | payload encoding               |
//! | 16..24 | generation                     |
//! | 24..32 | payload length in bytes        |
//! | 32..36 | CRC-32C of the payload         |
//! | 36..40 | CRC-32C of bytes 0..36         |
//! | 40..   | payload                        |

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Frame header length.
pub const FRAME_HEADER_LEN: usize = 40;
/// Suffix of the temporary file a whole-file write goes through; such a file is garbage
/// after a crash.
pub const TEMP_SUFFIX: &str = ".tmp";

/// A frame's header fields (checked against its CRC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Format version.
    pub version: u32,
    /// Payload encoding.
    pub encoding: u32,
    /// Generation.
    pub generation: u64,
    /// Payload length in bytes.
    pub payload_len: u64,
}

/// What is wrong with a frame's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Shorter than its header says (or than a header).
    #[error("truncated: {len} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        len: u64,
        /// Bytes needed.
        need: u64,
    },
    /// Another kind of file.
    #[error("bad magic")]
    BadMagic,
    /// Header bytes damaged.
    #[error("header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    HeaderChecksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// Written by another (newer or unknown) format version.
    #[error("unsupported format version {0}")]
    Version(u32),
    /// Unknown payload encoding.
    #[error("unsupported payload encoding {0}")]
    Encoding(u32),
    /// The payload is larger than the file kind allows.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Length in the header.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Bytes after the payload.
    #[error("{extra} unexpected bytes after the payload")]
    TrailingBytes {
        /// How many.
        extra: u64,
    },
    /// Payload bytes damaged.
    #[error("payload checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    PayloadChecksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
}

/// The frame of `payload`.
pub fn encode_frame(magic: &[u8; 8], version: u32, encoding: u32, generation: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&encoding.to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&out);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

/// Checks a frame's magic and header CRC and returns its header; the payload is not
/// looked at (see [`frame_payload`]), so that a caller can check the version first.
pub fn decode_frame_header(magic: &[u8; 8], bytes: &[u8]) -> Result<FrameHeader, FrameError> {
    let len = bytes.len() as u64;
    let Some(header) = bytes.get(..FRAME_HEADER_LEN) else {
        if !magic.starts_with(&bytes[..bytes.len().min(magic.len())]) {
            return Err(FrameError::BadMagic);
        }
        return Err(FrameError::Truncated { len, need: FRAME_HEADER_LEN as u64 });
    };
    if header[..8] != *magic {
        return Err(FrameError::BadMagic);
    }
    let stored = u32_at(header, 36);
    let computed = crc32c::crc32c(&header[..36]);
    if stored != computed {
        return Err(FrameError::HeaderChecksum { stored, computed });
    }
    Ok(FrameHeader {
        version: u32_at(header, 8),
        encoding: u32_at(header, 12),
        generation: u64_at(header, 16),
        payload_len: u64_at(header, 24),
    })
}

/// The payload of a frame whose header [`decode_frame_header`] returned: its length (at
/// most `max`) and CRC checked. Nothing is allocated.
pub fn frame_payload<'a>(bytes: &'a [u8], header: &FrameHeader, max: u64) -> Result<&'a [u8], FrameError> {
    if header.payload_len > max {
        return Err(FrameError::TooLarge { len: header.payload_len, max });
    }
    let len = bytes.len() as u64;
    let need = (FRAME_HEADER_LEN as u64).saturating_add(header.payload_len);
    if len < need {
        return Err(FrameError::Truncated { len, need });
    }
    if len > need {
        return Err(FrameError::TrailingBytes { extra: len - need });
    }
    let payload = bytes.get(FRAME_HEADER_LEN..).unwrap_or_default();
    let stored = u32_at(bytes, 32);
    let computed = crc32c::crc32c(payload);
    if stored != computed {
        return Err(FrameError::PayloadChecksum { stored, computed });
    }
    Ok(payload)
}

/// Checks a whole frame of one file kind — `magic`, then the header CRC, `version` and
/// `encoding`, then the payload's length (at most `max`) and CRC — and returns its
/// generation and payload. Pure and total: suitable for fuzzing.
pub fn decode_frame<'a>(
    magic: &[u8; 8],
    version: u32,
    encoding: u32,
    max: u64,
    bytes: &'a [u8],
) -> Result<(u64, &'a [u8]), FrameError> {
    let header = decode_frame_header(magic, bytes)?;
    if header.version != version {
        return Err(FrameError::Version(header.version));
    }
    if header.encoding != encoding {
        return Err(FrameError::Encoding(header.encoding));
    }
    Ok((header.generation, frame_payload(bytes, &header, max)?))
}

/// Which step of a whole-file write failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStep {
    /// Creating (or checking) the temporary file.
    Create,
    /// Writing its bytes.
    Write,
    /// `fsync` of the file.
    Sync,
    /// Renaming it into place.
    Rename,
    /// `fsync` of the directory.
    SyncDir,
}

/// A whole-file write that failed; the file at the path is the old one (or none) — except
/// after a failed [`WriteStep::SyncDir`]: the new file is in place then (a restart reads
/// it), not known to survive a power loss until the directory is synced again.
#[derive(Debug, thiserror::Error)]
#[error("{step:?} of {path}")]
pub struct WriteError {
    /// The step.
    pub step: WriteStep,
    /// The path it was done to.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// `path` with `suffix` appended to its name.
pub fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// `fsync` of a directory: its entries (creations, renames, removals) become durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir).and_then(|d| d.sync_all())
}

/// Creates or replaces `path` with exactly `bytes`, all or nothing: writes
/// `<path>.tmp` (mode 0600 whatever the umask, not through a symlink, a regular file
/// owned by this process's euid), fsyncs it, renames it over `path` and fsyncs the
/// directory. A crash at any point leaves the old file or the new one. Returns the new
/// file, open for reading and writing.
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<File, WriteError> {
    write_whole_with(path, bytes, sync_dir)
}

/// [`write_whole`] with the directory synced by `sync` (tests make it fail).
pub fn write_whole_with(
    path: &Path,
    bytes: &[u8],
    sync: impl FnOnce(&Path) -> io::Result<()>,
) -> Result<File, WriteError> {
    let tmp = suffixed(path, TEMP_SUFFIX);
    let fail = |step: WriteStep, p: &Path| {
        let path = p.to_owned();
        move |source| WriteError { step, path, source }
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|f| check_own_file(&f).map(|()| f))
        .map_err(fail(WriteStep::Create, &tmp))?;
    file.write_all(bytes).map_err(fail(WriteStep::Write, &tmp))?;
    file.sync_all().map_err(fail(WriteStep::Sync, &tmp))?;
    std::fs::rename(&tmp, path).map_err(fail(WriteStep::Rename, path))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    sync(dir).map_err(fail(WriteStep::SyncDir, dir))?;
    Ok(file)
}

/// A temporary file someone else left (another owner, not a regular file) is refused; an
/// existing one of ours keeps its mode on open, so it is set to 0600 through the descriptor.
fn check_own_file(f: &File) -> io::Result<()> {
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "not a regular file"));
    }
    let euid = crate::sys::euid();
    if meta.uid() != euid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("owned by uid {}, not this process's {euid}", meta.uid()),
        ));
    }
    if meta.mode() & 0o7777 != 0o600 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MAGIC: [u8; 8] = *b"TESTFRAM";

    #[test]
    fn frames_round_trip_and_every_damage_is_typed() {
        let good = encode_frame(&MAGIC, 3, 1, 42, b"payload");
        let h = decode_frame_header(&MAGIC, &good).unwrap();
        assert_eq!(h, FrameHeader { version: 3, encoding: 1, generation: 42, payload_len: 7 });
        assert_eq!(frame_payload(&good, &h, 7).unwrap(), b"payload");
        assert_eq!(frame_payload(&good, &h, 6), Err(FrameError::TooLarge { len: 7, max: 6 }));
        assert_eq!(decode_frame(&MAGIC, 3, 1, 7, &good), Ok((42, &b"payload"[..])));
        assert_eq!(decode_frame(&MAGIC, 4, 1, 7, &good), Err(FrameError::Version(3)));
        assert_eq!(decode_frame(&MAGIC, 3, 2, 7, &good), Err(FrameError::Encoding(1)));
        assert_eq!(decode_frame_header(&MAGIC, b"TEST"), Err(FrameError::Truncated { len: 4, need: 40 }));
        assert_eq!(decode_frame_header(&MAGIC, b"nope"), Err(FrameError::BadMagic));
        assert_eq!(decode_frame_header(b"OTHERMAG", &good), Err(FrameError::BadMagic));
        let short = &good[..good.len() - 1];
        assert!(matches!(frame_payload(short, &h, 100), Err(FrameError::Truncated { .. })));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(frame_payload(&long, &h, 100), Err(FrameError::TrailingBytes { extra: 1 }));
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x01;
            let r = decode_frame_header(&MAGIC, &bad).and_then(|h| frame_payload(&bad, &h, 100).map(|_| h));
            assert!(r.is_err(), "flipping byte {i} went unnoticed");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "checks file ownership: Miri's emulated uid is not the files' owner")]
    fn whole_writes_replace_and_tighten_a_left_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        write_whole(&path, b"one").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let tmp = suffixed(&path, TEMP_SUFFIX);
        std::fs::write(&tmp, b"left by a crash").unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_whole(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(!tmp.exists());
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o600);
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &tmp).unwrap();
        let e = write_whole(&path, b"three").unwrap_err();
        assert_eq!(e.step, WriteStep::Create);
        assert!(!dir.path().join("elsewhere").exists(), "the symlink was followed");
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
    }
}
