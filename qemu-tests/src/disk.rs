//! Disk images for guests: ext4 file systems made on the host with e2fsprogs
//! (`scripts/qemu-deps.sh` installs it), checked with `e2fsck` after the guest is done.

use std::path::Path;
use std::process::Command;

/// Why an image could not be made or did not check clean.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A tool could not be run.
    #[error("running {0}")]
    Run(&'static str, #[source] std::io::Error),
    /// A tool failed; its output.
    #[error("{0} failed: {1}")]
    Failed(&'static str, String),
}

fn run(tool: &'static str, cmd: &mut Command) -> Result<String, DiskError> {
    let out = cmd.output().map_err(|e| DiskError::Run(tool, e))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(text) } else { Err(DiskError::Failed(tool, format!("{}: {text}", out.status))) }
}

/// Makes `path` a fresh `mib`-MiB ext4 image (inode tables and journal initialised now,
/// so the guest does no background initialisation).
pub fn make_ext4(path: &Path, mib: u64) -> Result<(), DiskError> {
    let _ = std::fs::remove_file(path);
    run(
        "mkfs.ext4",
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg(path)
            .arg(format!("{mib}M")),
    )
    .map(|_| ())
}

/// `e2fsck -fn`: a full check that changes nothing; `Ok` with its report when clean.
pub fn fsck(path: &Path) -> Result<String, DiskError> {
    run("e2fsck", Command::new("e2fsck").args(["-f", "-n"]).arg(path))
}
