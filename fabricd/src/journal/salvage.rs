//! The operator's way out of a damaged journal: keep the longest intact prefix of the
//! history and move everything from the first damage on aside, never deleting a byte.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::format::HEADER_LEN;
use super::sys::{self, Entry};
use super::{JournalError, recover};

/// What [`salvage`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Salvage {
    /// The directory that received the moved and copied files (inside the journal
    /// directory); `None` when the journal was intact.
    pub aside: Option<PathBuf>,
    /// Each step, in order.
    pub actions: Vec<SalvageAction>,
}

/// One step of a salvage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SalvageAction {
    /// A segment was cut at the damage; its full bytes were copied aside first.
    Truncated {
        /// The segment.
        path: PathBuf,
        /// Its new length.
        offset: u64,
        /// The copy of its old bytes.
        copy: PathBuf,
    },
    /// A segment (damaged, or after the damage) was moved aside whole.
    MovedAside {
        /// Where it was.
        path: PathBuf,
        /// Where it is.
        to: PathBuf,
    },
}

/// Makes a journal that [`Journal::open`](super::Journal::open) refuses openable again, at
/// the cost of the records from the first damage on: the damaged segment is cut at the
/// damage (or moved aside if its header is damaged), and every later segment is moved
/// aside, into `salvaged-<unix seconds>/` in the journal directory. Records in the moved
/// bytes are lost to replay; the files are kept for analysis. Takes the journal's lock.
/// Errors that are not damage (I/O, lock) are returned as they are.
pub fn salvage(dir: &Path) -> Result<Salvage, JournalError> {
    recover::ensure_dir(dir)?;
    let _lock = sys::lock(dir)?;
    let mut report = Salvage::default();
    // Each round removes at least one damaged segment or cuts one short, so the number of
    // segments bounds the rounds.
    let rounds = recover::list(dir)?.0.len() + 1;
    for _ in 0..rounds {
        let err = match recover::recover(dir) {
            Ok(_) => return Ok(report),
            Err(e) => e,
        };
        let (path, offset) = match &err {
            JournalError::Corrupt { path, offset, .. } | JournalError::SealedDamage { path, offset, .. } => {
                (path.clone(), *offset)
            }
            JournalError::Discontinuous { path, .. } | JournalError::TooLarge { path, .. } => (path.clone(), 0),
            _ => return Err(err),
        };
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let Entry::Segment(number) = sys::classify(&name) else { return Err(err) };
        tracing::warn!(error = %err, "salvaging the journal: keeping what precedes the damage");
        let aside = match &report.aside {
            Some(a) => a.clone(),
            None => {
                let a = aside_dir(dir)?;
                report.aside = Some(a.clone());
                a
            }
        };
        let werr = |p: &Path| {
            let p = p.to_owned();
            move |source| JournalError::Write { path: p, source }
        };
        if offset > HEADER_LEN as u64 {
            let copy = aside.join(&name);
            fs::copy(&path, &copy).map_err(werr(&copy))?;
            fs::File::open(&copy).and_then(|f| f.sync_all()).map_err(werr(&copy))?;
            sys::sync_dir(&aside)?;
            let file = fs::OpenOptions::new().write(true).open(&path).map_err(werr(&path))?;
            file.set_len(offset).map_err(werr(&path))?;
            file.sync_all().map_err(|source| JournalError::Sync { path: path.clone(), source })?;
            report.actions.push(SalvageAction::Truncated { path, offset, copy });
        } else {
            report.actions.push(move_aside(&path, &aside)?);
        }
        for later in recover::list(dir)?.0.into_iter().filter(|&n| n > number) {
            report.actions.push(move_aside(&sys::segment_path(dir, later), &aside)?);
        }
        sys::sync_dir(&aside)?;
        sys::sync_dir(dir)?;
    }
    recover::recover(dir).map(|_| report)
}

fn aside_dir(dir: &Path) -> Result<PathBuf, JournalError> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut path = dir.join(format!("salvaged-{secs}"));
    let mut n = 1;
    while path.exists() {
        path = dir.join(format!("salvaged-{secs}-{n}"));
        n += 1;
    }
    fs::create_dir(&path).map_err(|source| JournalError::Write { path: path.clone(), source })?;
    Ok(path)
}

fn move_aside(path: &Path, aside: &Path) -> Result<SalvageAction, JournalError> {
    // Never over a file already set aside (the full copy of a segment cut in an earlier
    // round): each keeps its bytes.
    let name = path.file_name().unwrap_or_default();
    let mut to = aside.join(name);
    let mut n = 1;
    while to.exists() {
        to = aside.join(format!("{}.{n}", name.to_string_lossy()));
        n += 1;
    }
    fs::rename(path, &to).map_err(|source| JournalError::Write { path: to.clone(), source })?;
    Ok(SalvageAction::MovedAside { path: path.to_owned(), to })
}
