//! The on-disk format of journal segments, and a pure decoder over bytes.
//!
//! All integers are little-endian. docs/journal.md has the same tables and the reasoning.
//!
//! Segment header ([`HEADER_LEN`] = 48 bytes):
//!
//! | bytes  | field                                                  |
//! |--------|--------------------------------------------------------|
//! | 0..8   | magic `89 46 4a 4c 0d 0a 1a 0a` (`\x89FJL\r\n\x1a\n`)  |
//! | 8..12  | format version (1)                                     |
//! | 12..16 | flags: bit 0 = the segment starts with a snapshot      |
//! | 16..24 | segment number (equals the number in the file name)    |
//! | 24..32 | generation (compactions before this segment was made)  |
//! | 32..40 | sequence number of the segment's first record (>= 1)   |
//! | 40..44 | snapshot parts: records the snapshot takes, when over one (else 0) |
//! | 44..48 | CRC-32C of bytes 0..44                                 |
//!
//! Record frame ([`FRAME_LEN`] = 20 bytes, then the payload):
//!
//! | bytes  | field                                                  |
//! |--------|--------------------------------------------------------|
//! | 0..4   | payload length (at most [`MAX_PAYLOAD`])               |
//! | 4..8   | CRC-32C of bytes 8..20+length (sequence, kind, reserved, payload) |
//! | 8..16  | sequence number                                        |
//! | 16..18 | record kind                                            |
//! | 18..20 | reserved, zero                                         |
//! | 20..   | payload                                                |

/// Segment magic: like PNG's, it catches text-mode and 7-bit damage.
pub const MAGIC: [u8; 8] = *b"\x89FJL\r\n\x1a\n";
/// The format version this code writes and reads.
pub const VERSION: u32 = 1;
/// Segment header length.
pub const HEADER_LEN: usize = 48;
/// Record frame length before the payload.
pub const FRAME_LEN: usize = 20;
/// Largest payload of one record: 16 MiB. A larger snapshot is written as several
/// records ([`MAX_SNAPSHOT_PARTS`]).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Most records one snapshot is written as.
pub const MAX_SNAPSHOT_PARTS: u32 = 64;
/// Largest snapshot: [`MAX_SNAPSHOT_PARTS`] records of [`MAX_PAYLOAD`] (1 GiB).
pub const MAX_SNAPSHOT: usize = MAX_SNAPSHOT_PARTS as usize * MAX_PAYLOAD;
/// Header flag: the segment's first record is a snapshot, and older segments are obsolete.
pub const FLAG_SNAPSHOT: u32 = 1;
/// Record kind of a snapshot written by compaction. Kinds from [`RESERVED_KINDS`] up are
/// the journal's own.
pub const KIND_SNAPSHOT: u16 = 0xffff;
/// First record kind reserved for the journal itself.
pub const RESERVED_KINDS: u16 = 0xff00;

/// The forward scan that tells a torn tail from damage in the middle hashes at most this
/// many bytes per byte of tail (plus [`SCAN_SLACK`]); past that the tail is called damage.
const SCAN_BUDGET_PER_BYTE: usize = 32;
/// Fixed part of the scan budget.
const SCAN_SLACK: usize = 1 << 20;

/// What is wrong with a segment's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Shorter than a header. Segments are created whole (written aside, then renamed),
    /// so a crash cannot leave a short header.
    #[error("{len} bytes, shorter than the {HEADER_LEN}-byte segment header")]
    ShortHeader {
        /// Bytes present.
        len: usize,
    },
    /// Not a journal segment.
    #[error("bad magic (not a fabric journal segment)")]
    BadMagic,
    /// Header bytes damaged.
    #[error("header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    HeaderChecksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// Written by another format version.
    #[error("unsupported format version {0} (this build reads {VERSION})")]
    Version(u32),
    /// Unknown flags, a snapshot part count out of range (or without a snapshot) or a
    /// first sequence of zero.
    #[error("invalid header field {field} = {value:#x}")]
    HeaderField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A damaged record with an intact record after it: not a torn write.
    #[error("damaged record at byte {offset} ({fault}), but an intact record follows at byte {next_valid}")]
    Damaged {
        /// Offset of the damaged record in the segment.
        offset: u64,
        /// What is wrong with it.
        fault: RecordFault,
        /// Offset of the intact record found after it.
        next_valid: u64,
    },
    /// A damaged tail that is too costly to prove torn (adversarial bytes); treated as damage.
    #[error("damaged record at byte {offset} ({fault}) and the tail after it could not be checked")]
    Undecidable {
        /// Offset of the damaged record.
        offset: u64,
        /// What is wrong with it.
        fault: RecordFault,
    },
    /// An intact record whose sequence number is not the next one.
    #[error("record at byte {offset} has sequence {found}, expected {expected}")]
    Sequence {
        /// Offset of the record.
        offset: u64,
        /// The next sequence number.
        expected: u64,
        /// The one found.
        found: u64,
    },
    /// A segment flagged as starting with a snapshot holds no intact record.
    #[error("segment flagged as a snapshot holds no intact snapshot record")]
    MissingSnapshot,
    /// A first record that is not a snapshot in a segment flagged as starting with one,
    /// or a snapshot record anywhere else.
    #[error("record at byte {offset} has kind {kind:#06x}, which does not belong there")]
    Misplaced {
        /// Offset of the record.
        offset: u64,
        /// Its kind.
        kind: u16,
    },
}

impl FormatError {
    /// Byte offset of the damage in the segment (0 for the header).
    pub fn offset(&self) -> u64 {
        match self {
            Self::Damaged { offset, .. }
            | Self::Undecidable { offset, .. }
            | Self::Sequence { offset, .. }
            | Self::Misplaced { offset, .. } => *offset,
            Self::MissingSnapshot => HEADER_LEN as u64,
            _ => 0,
        }
    }
}

/// Why one record frame does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecordFault {
    /// The frame or payload runs past the end of the segment.
    #[error("runs past the end of the segment")]
    Truncated,
    /// The length field exceeds [`MAX_PAYLOAD`].
    #[error("length {0} exceeds the maximum")]
    Length(u32),
    /// Reserved bytes are not zero.
    #[error("reserved bytes are not zero")]
    Reserved,
    /// The checksum does not match.
    #[error("checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
}

/// A segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Segment number; also in the file name.
    pub segment: u64,
    /// Compactions done before this segment was created.
    pub generation: u64,
    /// Sequence number of the first record in this segment.
    pub first_seq: u64,
    /// Whether the first record is a snapshot that supersedes all older segments.
    pub snapshot: bool,
    /// Records the snapshot is split into when it takes more than one (2 up to
    /// [`MAX_SNAPSHOT_PARTS`]); 0 otherwise. Their payloads, joined, are the snapshot.
    pub snapshot_parts: u32,
}

impl SegmentHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.snapshot { FLAG_SNAPSHOT } else { 0 };
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.segment.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.first_seq.to_le_bytes());
        b[40..44].copy_from_slice(&self.snapshot_parts.to_le_bytes());
        let crc = crc32c::crc32c(&b[..44]);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and checks a header from the start of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let Some(b) = bytes.get(..HEADER_LEN) else {
            return Err(FormatError::ShortHeader { len: bytes.len() });
        };
        if b[..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = u32_at(b, 44);
        let computed = crc32c::crc32c(&b[..44]);
        if stored != computed {
            return Err(FormatError::HeaderChecksum { stored, computed });
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(FormatError::Version(version));
        }
        let flags = u32_at(b, 12);
        if flags & !FLAG_SNAPSHOT != 0 {
            return Err(FormatError::HeaderField { field: "flags", value: u64::from(flags) });
        }
        let snapshot = flags & FLAG_SNAPSHOT != 0;
        // Split only when over one record, and only a snapshot: one part is written as 0.
        let snapshot_parts = u32_at(b, 40);
        if snapshot_parts != 0 && (!snapshot || !(2..=MAX_SNAPSHOT_PARTS).contains(&snapshot_parts)) {
            return Err(FormatError::HeaderField { field: "snapshot_parts", value: u64::from(snapshot_parts) });
        }
        let first_seq = u64_at(b, 32);
        if first_seq == 0 {
            return Err(FormatError::HeaderField { field: "first_seq", value: 0 });
        }
        Ok(Self { segment: u64_at(b, 16), generation: u64_at(b, 24), first_seq, snapshot, snapshot_parts })
    }

    /// How many records at the segment's start are its snapshot: 0 without one.
    pub fn snapshot_records(&self) -> usize {
        match (self.snapshot, self.snapshot_parts) {
            (false, _) => 0,
            (true, 0) => 1,
            (true, n) => n as usize,
        }
    }
}

/// Appends one framed record to `out`. The caller checks the payload bound.
pub fn encode_record(out: &mut Vec<u8>, seq: u64, kind: u16, payload: &[u8]) {
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    let start = out.len();
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(payload);
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Bytes one record takes on disk.
pub fn record_len(payload_len: usize) -> usize {
    FRAME_LEN + payload_len
}

/// One intact record, borrowed from the segment bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRef<'a> {
    /// Byte offset of the frame in the segment.
    pub offset: u64,
    /// Sequence number.
    pub seq: u64,
    /// Record kind.
    pub kind: u16,
    /// Payload.
    pub payload: &'a [u8],
}

/// A damaged tail: bytes after the last intact record that hold no intact record. A crash
/// during an append leaves one; only the caller knows whether one is allowed here (it is
/// in the newest segment only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TornTail {
    /// Offset where the tail starts (the end of the last intact record).
    pub offset: u64,
    /// Bytes in the tail.
    pub len: u64,
    /// What is wrong with the first frame of the tail.
    pub fault: RecordFault,
}

/// A decoded segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedSegment<'a> {
    /// The header.
    pub header: SegmentHeader,
    /// Intact records in order; sequence numbers run from `header.first_seq` without gaps.
    pub records: Vec<RecordRef<'a>>,
    /// Length of the header and intact records: where the next record goes.
    pub valid_len: u64,
    /// The torn tail, if any.
    pub torn: Option<TornTail>,
}

impl DecodedSegment<'_> {
    /// Sequence number of the last intact record, or `first_seq - 1` when there is none.
    pub fn last_seq(&self) -> u64 {
        self.records.last().map_or(self.header.first_seq - 1, |r| r.seq)
    }
}

/// Decodes a whole segment. A pure function of the bytes: never panics, allocates at most
/// one entry per [`FRAME_LEN`] bytes of input, and hashes a bounded number of bytes.
pub fn decode_segment(bytes: &[u8]) -> Result<DecodedSegment<'_>, FormatError> {
    let header = SegmentHeader::decode(bytes)?;
    let mut records = Vec::new();
    // A fault inside the snapshot's records is the whole segment's: without all of them
    // there is no snapshot, and no prefix of the segment to keep (`salvage` moves it
    // aside whole rather than cut it where the damage is).
    let whole = |records: &Vec<RecordRef<'_>>, e: FormatError| {
        if records.len() < header.snapshot_records() { FormatError::MissingSnapshot } else { e }
    };
    let mut pos = HEADER_LEN;
    let mut expected = header.first_seq;
    let mut torn = None;
    while pos < bytes.len() {
        let frame = match parse_frame(bytes, pos) {
            Ok(f) => f,
            Err(fault) => {
                check_tail(bytes, pos, expected, fault).map_err(|e| whole(&records, e))?;
                torn = Some(TornTail { offset: pos as u64, len: (bytes.len() - pos) as u64, fault });
                break;
            }
        };
        if frame.seq != expected {
            return Err(whole(&records, FormatError::Sequence { offset: pos as u64, expected, found: frame.seq }));
        }
        if (frame.kind == KIND_SNAPSHOT) != (records.len() < header.snapshot_records()) {
            return Err(whole(&records, FormatError::Misplaced { offset: pos as u64, kind: frame.kind }));
        }
        records.push(RecordRef { offset: pos as u64, seq: frame.seq, kind: frame.kind, payload: frame.payload });
        pos = frame.end;
        expected = expected.saturating_add(1);
    }
    if records.len() < header.snapshot_records() {
        // A snapshot segment is written whole with its snapshot, then renamed into place,
        // so a crash cannot leave it without one, or with a part of one.
        return Err(FormatError::MissingSnapshot);
    }
    Ok(DecodedSegment { header, records, valid_len: pos as u64, torn })
}

struct Frame<'a> {
    seq: u64,
    kind: u16,
    payload: &'a [u8],
    end: usize,
}

fn parse_frame(bytes: &[u8], pos: usize) -> Result<Frame<'_>, RecordFault> {
    let rest = &bytes[pos..];
    let Some(head) = rest.get(..FRAME_LEN) else {
        return Err(RecordFault::Truncated);
    };
    let len = u32_at(head, 0);
    if len as usize > MAX_PAYLOAD {
        return Err(RecordFault::Length(len));
    }
    let Some(body) = rest.get(8..FRAME_LEN + len as usize) else {
        return Err(RecordFault::Truncated);
    };
    if head[18..20] != [0; 2] {
        return Err(RecordFault::Reserved);
    }
    let stored = u32_at(head, 4);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(RecordFault::Checksum { stored, computed });
    }
    let kind = u16::from_le_bytes([head[16], head[17]]);
    Ok(Frame { seq: u64_at(head, 8), kind, payload: &body[12..], end: pos + FRAME_LEN + len as usize })
}

/// A damaged frame at `start` is a torn tail only if no intact frame starts anywhere after
/// it: a crash tears the last write, but damage in the middle leaves intact records behind.
fn check_tail(bytes: &[u8], start: usize, expected: u64, fault: RecordFault) -> Result<(), FormatError> {
    let tail = bytes.len() - start;
    let mut budget = tail.saturating_mul(SCAN_BUDGET_PER_BYTE).saturating_add(SCAN_SLACK);
    for at in start + 1..bytes.len().saturating_sub(FRAME_LEN - 1) {
        let head = &bytes[at..at + FRAME_LEN];
        let len = u32_at(head, 0) as usize;
        // Cheap filters first: a plausible length, zero reserved bytes, a sequence number
        // no earlier than the damaged record's.
        if len > MAX_PAYLOAD || len > bytes.len() - at - FRAME_LEN || head[18..20] != [0; 2] {
            continue;
        }
        if u64_at(head, 8) < expected {
            continue;
        }
        let hashed = len + 12;
        if hashed > budget {
            return Err(FormatError::Undecidable { offset: start as u64, fault });
        }
        budget -= hashed;
        if parse_frame(bytes, at).is_ok() {
            return Err(FormatError::Damaged { offset: start as u64, fault, next_valid: at as u64 });
        }
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(first_seq: u64, snapshot: bool, records: &[(u16, &[u8])]) -> Vec<u8> {
        let header = SegmentHeader { segment: 7, generation: 2, first_seq, snapshot, snapshot_parts: 0 };
        let mut out = header.encode().to_vec();
        for (i, (kind, payload)) in records.iter().enumerate() {
            encode_record(&mut out, first_seq + i as u64, *kind, payload);
        }
        out
    }

    #[test]
    fn records_round_trip() {
        let bytes = segment(5, false, &[(1, b"one"), (2, b""), (3, &[0xaa; 1000])]);
        let d = decode_segment(&bytes).expect("decodes");
        assert_eq!(
            d.header,
            SegmentHeader { segment: 7, generation: 2, first_seq: 5, snapshot: false, snapshot_parts: 0 }
        );
        let got: Vec<_> = d.records.iter().map(|r| (r.seq, r.kind, r.payload.len())).collect();
        assert_eq!(got, [(5, 1, 3), (6, 2, 0), (7, 3, 1000)]);
        assert_eq!(d.records[0].payload, b"one");
        assert_eq!(d.valid_len, bytes.len() as u64);
        assert_eq!(d.torn, None);
        assert_eq!(d.last_seq(), 7);
    }

    #[test]
    fn frame_layout_is_as_documented() {
        let mut out = Vec::new();
        encode_record(&mut out, 0x0102_0304_0506_0708, 0x0a0b, b"xyz");
        assert_eq!(out.len(), FRAME_LEN + 3);
        assert_eq!(&out[0..4], &3u32.to_le_bytes());
        assert_eq!(&out[4..8], &crc32c::crc32c(&out[8..]).to_le_bytes());
        assert_eq!(&out[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&out[16..18], &0x0a0bu16.to_le_bytes());
        assert_eq!(&out[18..20], &[0, 0]);
        assert_eq!(&out[20..], b"xyz");
    }

    #[test]
    fn header_faults_are_named() {
        let good = segment(1, false, &[]);
        assert_eq!(decode_segment(&good[..47]), Err(FormatError::ShortHeader { len: 47 }));
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert_eq!(decode_segment(&bad), Err(FormatError::BadMagic));
        let mut bad = good.clone();
        bad[20] ^= 1;
        assert!(matches!(decode_segment(&bad), Err(FormatError::HeaderChecksum { .. })));
        let mut v2 = good.clone();
        v2[8] = 2;
        let crc = crc32c::crc32c(&v2[..44]);
        v2[44..48].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_segment(&v2), Err(FormatError::Version(2)));
        let zero_seq =
            SegmentHeader { segment: 1, generation: 0, first_seq: 0, snapshot: false, snapshot_parts: 0 }.encode();
        assert!(matches!(decode_segment(&zero_seq), Err(FormatError::HeaderField { field: "first_seq", .. })));
    }

    #[test]
    fn zero_filled_and_cut_tails_are_torn() {
        let full = segment(1, false, &[(1, b"aaaa"), (1, b"bbbb")]);
        let first_end = HEADER_LEN + FRAME_LEN + 4;
        let mut zeroed = full[..first_end].to_vec();
        zeroed.resize(full.len() + 4096, 0);
        let d = decode_segment(&zeroed).expect("torn tail is not an error");
        assert_eq!(d.records.len(), 1);
        assert_eq!(d.valid_len, first_end as u64);
        assert_eq!(d.torn.map(|t| (t.offset, t.len)), Some((first_end as u64, (zeroed.len() - first_end) as u64)));
        let d = decode_segment(&full[..full.len() - 1]).expect("cut tail");
        assert_eq!(d.torn.map(|t| t.fault), Some(RecordFault::Truncated));
    }

    #[test]
    fn damage_before_an_intact_record_is_an_error() {
        let mut bytes = segment(1, false, &[(1, b"aaaa"), (1, b"bbbb"), (1, b"cccc")]);
        let second = HEADER_LEN + FRAME_LEN + 4;
        bytes[second + FRAME_LEN] ^= 0x40;
        match decode_segment(&bytes) {
            Err(FormatError::Damaged { offset, next_valid, fault: RecordFault::Checksum { .. } }) => {
                assert_eq!(offset, second as u64);
                assert_eq!(next_valid, (second + FRAME_LEN + 4) as u64);
            }
            other => panic!("expected damage, got {other:?}"),
        }
    }

    #[test]
    fn sequence_and_snapshot_placement_are_checked() {
        let mut bytes = segment(1, false, &[(1, b"a")]);
        encode_record(&mut bytes, 3, 1, b"b");
        assert!(matches!(decode_segment(&bytes), Err(FormatError::Sequence { expected: 2, found: 3, .. })));
        let snap_in_middle = segment(1, false, &[(1, b"a"), (KIND_SNAPSHOT, b"s")]);
        assert!(matches!(decode_segment(&snap_in_middle), Err(FormatError::Misplaced { kind: KIND_SNAPSHOT, .. })));
        let no_snap = segment(1, true, &[(1, b"a")]);
        assert_eq!(decode_segment(&no_snap), Err(FormatError::MissingSnapshot));
        assert_eq!(decode_segment(&segment(1, true, &[])), Err(FormatError::MissingSnapshot));
        let ok = segment(4, true, &[(KIND_SNAPSHOT, b"s"), (1, b"a")]);
        assert_eq!(decode_segment(&ok).map(|d| d.records.len()), Ok(2));
    }

    fn split_segment(parts: u32, records: &[(u16, &[u8])]) -> Vec<u8> {
        let header = SegmentHeader { segment: 3, generation: 1, first_seq: 10, snapshot: true, snapshot_parts: parts };
        let mut out = header.encode().to_vec();
        for (i, (kind, payload)) in records.iter().enumerate() {
            encode_record(&mut out, 10 + i as u64, *kind, payload);
        }
        out
    }

    #[test]
    fn a_snapshot_split_over_records_is_whole_or_refused() {
        let s = KIND_SNAPSHOT;
        let ok = split_segment(3, &[(s, b"one"), (s, b"two"), (s, b"three"), (1, b"after")]);
        let d = decode_segment(&ok).expect("split snapshot");
        assert_eq!((d.header.snapshot_parts, d.header.snapshot_records()), (3, 3));
        assert_eq!(d.records.iter().map(|r| r.kind).collect::<Vec<_>>(), [s, s, s, 1]);
        // Fewer parts than the header says, whole records or a torn one: never a prefix.
        assert_eq!(decode_segment(&split_segment(3, &[(s, b"one"), (s, b"two")])), Err(FormatError::MissingSnapshot));
        let cut = &ok[..HEADER_LEN + 2 * FRAME_LEN + 6 + 2];
        assert_eq!(decode_segment(cut), Err(FormatError::MissingSnapshot));
        // A part that is no snapshot, or one part too many.
        let short = split_segment(3, &[(s, b"one"), (1, b"two"), (s, b"three")]);
        assert_eq!(decode_segment(&short), Err(FormatError::MissingSnapshot), "the whole segment's fault");
        // A damaged part with intact records after it: the whole segment's too (offset at
        // the header), never a cut inside the snapshot.
        let mut damaged = ok.clone();
        damaged[HEADER_LEN + FRAME_LEN + 3 + FRAME_LEN] ^= 1;
        let e = decode_segment(&damaged).unwrap_err();
        assert_eq!((e.clone(), e.offset()), (FormatError::MissingSnapshot, HEADER_LEN as u64));
        let long = split_segment(2, &[(s, b"one"), (s, b"two"), (s, b"three")]);
        assert!(matches!(decode_segment(&long), Err(FormatError::Misplaced { kind: KIND_SNAPSHOT, .. })));
        // A part count of one, past the bound, or without a snapshot is no header of ours.
        for (snapshot, parts) in [(true, 1), (true, MAX_SNAPSHOT_PARTS + 1), (false, 2)] {
            let h = SegmentHeader { segment: 1, generation: 0, first_seq: 1, snapshot, snapshot_parts: parts };
            let r = SegmentHeader::decode(&h.encode());
            assert!(matches!(r, Err(FormatError::HeaderField { field: "snapshot_parts", .. })), "{parts}: {r:?}");
        }
    }

    #[test]
    fn hostile_tail_scan_stops_within_budget() {
        // Every 20 bytes of the tail look like a frame whose payload runs to the end:
        // hashing each would be quadratic, so the scan gives up and calls it damage.
        let mut bytes = segment(1, false, &[(1, b"a")]);
        let start = bytes.len();
        let n = 200_000;
        bytes.resize(start + n, 0);
        for at in (start..start + n - FRAME_LEN).step_by(FRAME_LEN) {
            let len = (start + n - at - FRAME_LEN) as u32;
            bytes[at..at + 4].copy_from_slice(&len.to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        }
        let t = std::time::Instant::now();
        let r = decode_segment(&bytes);
        assert!(matches!(r, Err(FormatError::Undecidable { .. })), "{r:?}");
        assert!(t.elapsed() < std::time::Duration::from_secs(20));
    }
}
