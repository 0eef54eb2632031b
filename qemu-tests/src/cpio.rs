//! A minimal `newc` cpio writer: the per-test overlay archive the harness appends to the
//! base initramfs (the kernel unpacks concatenated archives in order, later files winning).

use std::io::{self, Write};

/// One entry of the archive.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A directory.
    Dir(String),
    /// A regular file with its mode bits (e.g. `0o755`).
    File(String, Vec<u8>, u32),
}

/// Writes `entries` and the trailer as one `newc` archive.
pub fn write_archive(entries: &[Entry], out: &mut dyn Write) -> io::Result<()> {
    for (ino, e) in entries.iter().enumerate() {
        let (name, mode, data): (&str, u32, &[u8]) = match e {
            Entry::Dir(n) => (n, 0o040_755, &[]),
            Entry::File(n, d, m) => (n, 0o100_000 | (m & 0o7777), d),
        };
        header(out, ino as u32 + 1, mode, data.len(), name)?;
        out.write_all(data)?;
        pad(out, data.len())?;
    }
    header(out, 0, 0, 0, "TRAILER!!!")
}

fn header(out: &mut dyn Write, ino: u32, mode: u32, size: usize, name: &str) -> io::Result<()> {
    let namesize = name.len() + 1;
    let size = u32::try_from(size).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file over 4 GiB"))?;
    write!(
        out,
        "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
        0, 0, 1, 0, 0, 0, 0, 0, 0
    )?;
    out.write_all(name.as_bytes())?;
    out.write_all(&[0])?;
    pad(out, 110 + namesize)
}

fn pad(out: &mut dyn Write, len: usize) -> io::Result<()> {
    let n = (4 - len % 4) % 4;
    out.write_all(&[0u8; 3][..n])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_terminated() {
        let mut buf = Vec::new();
        write_archive(
            &[Entry::Dir("fabric".into()), Entry::File("fabric/a".into(), b"hello".to_vec(), 0o755)],
            &mut buf,
        )
        .expect("write");
        assert!(buf.starts_with(b"070701"));
        assert_eq!(buf.len() % 4, 0);
        let text = String::from_utf8_lossy(&buf);
        assert!(text.contains("fabric/a\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!\0"));
        // The second header starts on a 4-byte boundary right after the first entry.
        let second = text.find("070701").and_then(|i| text[i + 6..].find("070701").map(|j| i + 6 + j));
        assert_eq!(second.map(|s| s % 4), Some(0));
    }
}
