//! Opening a journal: check every live segment before touching anything, then clean up
//! what a crash left (temporaries, obsolete segments, a torn tail).

use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use super::format::{self, HEADER_LEN, SegmentHeader};
use super::sys::{self, Entry};
use super::{JournalError, MAX_SEGMENT_FILE, Record, Replay, Truncation};

/// The state a writer continues from.
#[derive(Debug)]
pub(crate) struct Recovered {
    pub replay: Replay,
    /// The newest segment, open for writing.
    pub file: File,
    pub segment: u64,
    pub first_segment: u64,
    pub generation: u64,
    pub len: u64,
    pub records_in_segment: u64,
    pub next_seq: u64,
}

/// A live segment, checked.
struct Checked {
    number: u64,
    path: PathBuf,
    header: SegmentHeader,
    valid_len: u64,
    records: u64,
    torn: Option<format::TornTail>,
}

/// Opens the journal in `dir`, which the caller has locked ([`sys::lock`]).
pub(crate) fn recover(dir: &Path) -> Result<Recovered, JournalError> {
    let (numbers, temps) = list(dir)?;
    if numbers.is_empty() {
        return create_first(dir, temps);
    }

    // The newest segment that starts with a snapshot supersedes every older one.
    let mut headers = Vec::with_capacity(numbers.len());
    for &n in &numbers {
        let path = sys::segment_path(dir, n);
        let header = read_header(&path)?;
        headers.push((n, path, header));
    }
    let base = headers.iter().filter(|(_, _, h)| h.as_ref().is_ok_and(|h| h.snapshot)).map(|(n, _, _)| *n).max();
    let split = base.map_or(0, |b| headers.iter().position(|(n, _, _)| *n == b).unwrap_or(0));
    let obsolete: Vec<PathBuf> = headers[..split].iter().map(|(_, p, _)| p.clone()).collect();

    let mut live = Vec::new();
    let mut replay = Replay::default();
    let mut prev: Option<(u64, u64, u64)> = None; // (number, generation, last seq)
    let count = headers.len() - split;
    for (i, (n, path, header)) in headers.into_iter().skip(split).enumerate() {
        let header = header.map_err(|source| corrupt(&path, source))?;
        let discontinuous = |what: String| JournalError::Discontinuous { path: path.clone(), what };
        if header.segment != n {
            return Err(discontinuous(format!("header says segment {}", header.segment)));
        }
        match prev {
            None if !header.snapshot && header.first_seq != 1 => {
                return Err(discontinuous(format!(
                    "oldest segment starts at sequence {} without a snapshot; older segments are missing",
                    header.first_seq
                )));
            }
            Some((pn, _, _)) if pn.checked_add(1) != Some(n) => {
                return Err(discontinuous(format!("segment {} is missing", pn.saturating_add(1))));
            }
            Some((_, pg, _)) if pg != header.generation => {
                return Err(discontinuous(format!("generation {} after generation {pg}", header.generation)));
            }
            Some((_, _, last)) if last.checked_add(1) != Some(header.first_seq) => {
                return Err(discontinuous(format!(
                    "starts at sequence {}, expected {}",
                    header.first_seq,
                    last.saturating_add(1)
                )));
            }
            _ => {}
        }
        let bytes = read_segment(&path)?;
        let decoded = format::decode_segment(&bytes).map_err(|source| corrupt(&path, source))?;
        let is_last = i + 1 == count;
        if let Some(t) = decoded.torn
            && !is_last
        {
            return Err(JournalError::SealedDamage { path, offset: t.offset, fault: t.fault });
        }
        // The decoder found the snapshot's records whole, at the start, and nowhere else.
        let parts = decoded.header.snapshot_records().min(decoded.records.len());
        let (snapshot, records) = decoded.records.split_at(parts);
        if let Some(last) = snapshot.last() {
            let mut payload = Vec::with_capacity(snapshot.iter().map(|r| r.payload.len()).sum());
            for part in snapshot {
                payload.extend_from_slice(part.payload);
            }
            replay.snapshot = Some(Record { seq: last.seq, kind: format::KIND_SNAPSHOT, payload });
        }
        for r in records {
            replay.records.push(Record { seq: r.seq, kind: r.kind, payload: r.payload.to_vec() });
        }
        prev = Some((n, header.generation, decoded.last_seq()));
        live.push(Checked {
            number: n,
            path,
            header,
            valid_len: decoded.valid_len,
            records: decoded.records.len() as u64,
            torn: decoded.torn,
        });
    }

    // Everything checked: now clean up.
    for path in temps.into_iter().chain(obsolete) {
        sys::remove(&path)?;
        tracing::info!(path = %path.display(), "removed a file left by an interrupted journal operation");
        replay.removed.push(path);
    }
    if !replay.removed.is_empty() {
        sys::sync_dir(dir)?;
    }
    let (Some(first), Some(last)) = (live.first(), live.last()) else {
        // Not reached: the segment chosen as base is live.
        return Err(JournalError::Discontinuous { path: dir.to_owned(), what: "no live segment".into() });
    };
    let first_segment = first.number;
    let file = crate::sys::privdir::open_nofollow(&last.path, true)
        .map_err(|source| JournalError::Write { path: last.path.clone(), source })?;
    if let Some(t) = last.torn {
        tracing::warn!(
            path = %last.path.display(), offset = t.offset, dropped = t.len, fault = %t.fault,
            "journal ends in a torn write (never acknowledged); cutting it off"
        );
        let werr = |source| JournalError::Write { path: last.path.clone(), source };
        file.set_len(t.offset).map_err(werr)?;
        file.sync_all().map_err(|source| JournalError::Sync { path: last.path.clone(), source })?;
        replay.truncated =
            Some(Truncation { path: last.path.clone(), offset: t.offset, dropped: t.len, fault: t.fault });
    }
    let next_seq = prev.map_or(1, |(_, _, last)| last).checked_add(1).ok_or(JournalError::Exhausted)?;
    tracing::info!(
        dir = %dir.display(), segments = live.len(), records = replay.records.len(),
        snapshot = replay.snapshot.as_ref().map(|s| s.seq), next_seq, "journal opened"
    );
    Ok(Recovered {
        replay,
        file,
        segment: last.number,
        first_segment,
        generation: last.header.generation,
        len: last.valid_len,
        records_in_segment: last.records,
        next_seq,
    })
}

fn corrupt(path: &Path, source: format::FormatError) -> JournalError {
    JournalError::Corrupt { path: path.to_owned(), offset: source.offset(), source }
}

/// Creates the journal directory (and a missing state directory above it) durably: a
/// power loss right after the first acknowledged append must not forget the directory
/// that holds it.
/// It must be the daemon's own (`crate::sys::privdir`): segments name export secrets and
/// resume tokens.
pub(crate) fn ensure_dir(dir: &Path) -> Result<(), JournalError> {
    crate::sys::privdir::PrivateDir::create(dir).map(|_| ()).map_err(JournalError::Dir)
}

/// Segment numbers (sorted) and temporaries in `dir`.
pub(crate) fn list(dir: &Path) -> Result<(Vec<u64>, Vec<PathBuf>), JournalError> {
    let lerr = |source| JournalError::ListDir { path: dir.to_owned(), source };
    let mut numbers = Vec::new();
    let mut temps = Vec::new();
    for entry in fs::read_dir(dir).map_err(lerr)? {
        let entry = entry.map_err(lerr)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        match sys::classify(name) {
            Entry::Segment(n) => numbers.push(n),
            Entry::Temp => temps.push(entry.path()),
            Entry::Other => {}
        }
    }
    numbers.sort_unstable();
    temps.sort();
    Ok((numbers, temps))
}

fn create_first(dir: &Path, temps: Vec<PathBuf>) -> Result<Recovered, JournalError> {
    let mut replay = Replay::default();
    for path in temps {
        sys::remove(&path)?;
        replay.removed.push(path);
    }
    let header = SegmentHeader { segment: 1, generation: 0, first_seq: 1, snapshot: false, snapshot_parts: 0 };
    let file = sys::create_whole(dir, &sys::segment_path(dir, 1), &header.encode())?;
    tracing::info!(dir = %dir.display(), "journal created");
    Ok(Recovered {
        replay,
        file,
        segment: 1,
        first_segment: 1,
        generation: 0,
        len: HEADER_LEN as u64,
        records_in_segment: 0,
        next_seq: 1,
    })
}

/// The header of a segment, or what is wrong with it.
fn read_header(path: &Path) -> Result<Result<SegmentHeader, format::FormatError>, JournalError> {
    let rerr = |source| JournalError::Read { path: path.to_owned(), source };
    let mut file = crate::sys::privdir::open_nofollow(path, false).map_err(rerr)?;
    let mut buf = Vec::with_capacity(HEADER_LEN);
    file.by_ref().take(HEADER_LEN as u64).read_to_end(&mut buf).map_err(rerr)?;
    Ok(SegmentHeader::decode(&buf))
}

fn read_segment(path: &Path) -> Result<Vec<u8>, JournalError> {
    let rerr = |source| JournalError::Read { path: path.to_owned(), source };
    // Every live segment is read here once at open: not through a symlink, the daemon's
    // own, and 0600 from here on (one an earlier daemon left readable is tightened).
    let file = crate::sys::privdir::open_nofollow(path, false).map_err(rerr)?;
    crate::sys::privdir::check_file(&file, path).map_err(rerr)?;
    let len = file.metadata().map_err(rerr)?.len();
    if len > MAX_SEGMENT_FILE {
        return Err(JournalError::TooLarge { path: path.to_owned(), len });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_SEGMENT_FILE).read_to_end(&mut bytes).map_err(rerr)?;
    Ok(bytes)
}
