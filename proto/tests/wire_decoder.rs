//! Properties of the sans-IO frame decoder: any split of a stream decodes to the same
//! frames and refusals; any bytes never panic and never grow the buffer past one frame;
//! and descriptors, delivered the way the kernel delivers `SCM_RIGHTS` on a stream, reach
//! exactly the frame they were sent with, and none is held once the frames are taken.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use std::rc::Rc;

use fabric_proto::wire::*;
use proptest::prelude::*;

/// A descriptor stand-in that knows how many of its kind are alive (held anywhere).
#[derive(Debug, Clone)]
struct Token(u32, #[allow(dead_code)] Rc<()>);

fn frame(opcode: Opcode, kind: FrameKind, id: u64, body: &[u8], fds: u8) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(&Header { fd_count: fds, ..Header::new(opcode, kind, id) }, body, &mut out).unwrap();
    out
}

/// A valid frame a client may receive: (opcode, kind, body length, descriptors).
fn any_frame() -> impl Strategy<Value = (Opcode, FrameKind, usize, u8)> {
    prop_oneof![
        (0..300usize).prop_map(|n| (Opcode::Status, FrameKind::Response, n, 0)),
        (0..200usize, 0..=1u8).prop_map(|(n, f)| (Opcode::Alloc, FrameKind::Response, n, f)),
        (0..100usize).prop_map(|n| (Opcode::Subscribe, FrameKind::Event, n, 0)),
        (0..100usize).prop_map(|n| (Opcode::Free, FrameKind::Error, n, 0)),
        Just((Opcode::Ping, FrameKind::Request, 0, 0)),
    ]
}

/// The frames' bytes, and where each starts.
fn stream(frames: &[(Opcode, FrameKind, usize, u8)]) -> (Vec<u8>, Vec<usize>) {
    let (mut bytes, mut starts) = (Vec::new(), Vec::new());
    for (i, &(op, kind, len, fds)) in frames.iter().enumerate() {
        starts.push(bytes.len());
        let body: Vec<u8> = (0..len).map(|k| (i + k) as u8).collect();
        bytes.extend_from_slice(&frame(op, kind, i as u64 + 1, &body, fds));
    }
    (bytes, starts)
}

type Outcome = Result<(Header, Vec<u8>), DecodeError>;

/// Pushes `bytes` in pieces of the given lengths (cycled; 0 counts as 1), taking out every
/// frame and refusal as it comes, until a fatal one.
fn decode_split(config: DecoderConfig, bytes: &[u8], cuts: &[usize]) -> (Vec<Outcome>, usize) {
    let mut d = FrameDecoder::<Token>::new(config);
    let (mut out, mut at, mut i, mut largest) = (Vec::new(), 0, 0, 0);
    loop {
        while let Some(r) = d.next_frame() {
            let fatal = r.as_ref().is_err_and(DecodeError::is_fatal);
            out.push(r.map(|f| (f.header, f.body.to_vec())));
            if fatal {
                return (out, largest);
            }
        }
        if at == bytes.len() {
            return (out, largest);
        }
        let piece = cuts.get(i % cuts.len().max(1)).copied().unwrap_or(usize::MAX).max(1);
        i += 1;
        let end = at.saturating_add(piece).min(bytes.len());
        let n = d.push(&bytes[at..end], Vec::new(), false);
        assert!(n > 0, "the decoder took nothing with no frame to hand out");
        at += n;
        largest = largest.max(d.capacity());
    }
}

/// A stream as the kernel hands it out: the sender's `sendmsg` segments, each with its
/// descriptors, read with the room the decoder offers; a read that takes a segment's first
/// byte takes its descriptors (at most `room` installed, the rest reported) and ends with
/// that segment; `stops` ends some reads early (bytes still in flight).
fn kernel_reads(
    d: &mut FrameDecoder<Token>,
    bytes: &[u8],
    segments: &[(usize, usize, Vec<Token>)],
    stops: &[usize],
) -> Vec<Result<(Header, Vec<Token>), DecodeError>> {
    let room = usize::from(d.config().fds_per_read);
    let (mut out, mut at, mut seg, mut i) = (Vec::new(), 0usize, 0usize, 0usize);
    loop {
        while let Some(r) = d.next_frame() {
            out.push(r.map(|f| (f.header, f.fds)));
        }
        if at == bytes.len() {
            return out;
        }
        let dst = d.read_buf(true);
        let stop = stops.get(i % stops.len().max(1)).copied().unwrap_or(usize::MAX).max(1);
        i += 1;
        let mut n = 0;
        let (mut fds, mut truncated) = (Vec::new(), false);
        while n < dst.len().min(stop) && at + n < bytes.len() {
            let (s, e, carried) = &segments[seg];
            if at + n == *s && !carried.is_empty() {
                if n > 0 && !fds.is_empty() {
                    break;
                }
                fds = carried.iter().take(room).cloned().collect();
                truncated = carried.len() > room;
            }
            let take = (e - (at + n)).min(dst.len().min(stop) - n);
            dst[n..n + take].copy_from_slice(&bytes[at + n..at + n + take]);
            n += take;
            if at + n == *e {
                seg += 1;
                if !carried.is_empty() {
                    break;
                }
            }
        }
        d.filled(n, fds, truncated);
        at += n;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn any_split_of_a_valid_stream_gives_the_same_frames(
        frames in prop::collection::vec(any_frame(), 0..20),
        cuts in prop::collection::vec(0..400usize, 0..30),
    ) {
        // No descriptors travel here, so frames that announce some are refused the same
        // way whatever the split.
        let (bytes, _) = stream(&frames);
        let (whole, _) = decode_split(DecoderConfig::CLIENT, &bytes, &[]);
        let (split, _) = decode_split(DecoderConfig::CLIENT, &bytes, &cuts);
        prop_assert_eq!(&whole, &split);
        prop_assert_eq!(whole.len(), frames.len());
        for (got, &(op, kind, len, fds)) in whole.iter().zip(&frames) {
            match got {
                Ok((h, body)) => prop_assert_eq!((h.opcode, h.kind, body.len(), fds), (op, kind, len, 0)),
                Err(DecodeError::MissingFds { announced, received: 0, .. }) => prop_assert_eq!(*announced, fds),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
    }

    #[test]
    fn any_bytes_decode_the_same_under_any_split_without_panic_or_growth(
        frames in prop::collection::vec(any_frame(), 0..8),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        garbage in prop::collection::vec(any::<u8>(), 0..200),
        cuts in prop::collection::vec(0..100usize, 0..20),
        server in any::<bool>(),
    ) {
        let (mut bytes, _) = stream(&frames);
        bytes.extend_from_slice(&garbage);
        if !bytes.is_empty() {
            for (at, v) in flips {
                let i = at.index(bytes.len());
                bytes[i] = v;
            }
        }
        let config = if server { DecoderConfig::SERVER } else { DecoderConfig::CLIENT };
        let (whole, big) = decode_split(config, &bytes, &[]);
        let (split, small) = decode_split(config, &bytes, &cuts);
        prop_assert_eq!(whole, split);
        prop_assert!(big <= config.max_frame() && small <= config.max_frame());
    }

    #[test]
    fn descriptors_reach_the_frame_they_were_sent_with(
        frames in prop::collection::vec(any_frame(), 1..20),
        pieces in prop::collection::vec(1..200usize, 1..20),
        stops in prop::collection::vec(1..500usize, 0..10),
        extra in 0..12usize,
        server_room in any::<bool>(),
    ) {
        // The sender's rule: a frame with descriptors goes in one sendmsg, which carries
        // them; other frames in any pieces. One frame carries `extra` more than announced.
        let (bytes, starts) = stream(&frames);
        let alive = Rc::new(());
        let mut segments = Vec::new();
        let mut p = 0;
        let mut sent: Vec<usize> = Vec::new();
        for (i, &(_, _, _, fds)) in frames.iter().enumerate() {
            let (s, e) = (starts[i], starts.get(i + 1).copied().unwrap_or(bytes.len()));
            let n = usize::from(fds) + if i == 0 { extra } else { 0 };
            sent.push(n);
            if n > 0 {
                let tokens = (0..n).map(|k| Token((i * 100 + k) as u32, alive.clone())).collect();
                segments.push((s, e, tokens));
                continue;
            }
            let mut at = s;
            while at < e {
                let end = (at + pieces[p % pieces.len()]).min(e);
                p += 1;
                segments.push((at, end, Vec::new()));
                at = end;
            }
        }
        let config = if server_room { DecoderConfig { fds_per_read: 1, ..DecoderConfig::CLIENT } } else { DecoderConfig::CLIENT };
        let room = usize::from(config.fds_per_read);
        let mut d = FrameDecoder::<Token>::new(config);
        let got = kernel_reads(&mut d, &bytes, &segments, &stops);
        drop(segments);
        prop_assert_eq!(got.len(), frames.len());
        for (i, (r, &(_, _, _, fds))) in got.iter().zip(&frames).enumerate() {
            match r {
                Ok((h, tokens)) => {
                    prop_assert_eq!(h.request_id, i as u64 + 1);
                    prop_assert!(sent[i] <= room && sent[i] >= usize::from(fds));
                    prop_assert_eq!(tokens.len(), usize::from(fds));
                    prop_assert!(tokens.iter().all(|t| t.0 as usize / 100 == i), "another frame's descriptor");
                }
                Err(DecodeError::FdsTruncated { header, .. }) => {
                    prop_assert_eq!(header.request_id, i as u64 + 1);
                    prop_assert!(sent[i] > room);
                }
                Err(e) => prop_assert!(false, "frame {}: {}", i, e),
            }
        }
        drop(got);
        prop_assert_eq!(Rc::strong_count(&alive), 1, "the decoder still holds descriptors");
        drop(d);
    }
}
