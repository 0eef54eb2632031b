//! Fuzzes the node link's message decoder: any bytes, pushed whole and in pieces whose
//! lengths the input chooses, into the frame decoder under the peer limits, each frame read
//! as a peer message: never a panic, the same messages and refusals whatever the split, and
//! every message that decodes encodes again to a frame that decodes to the same message;
//! a copy chunk's body (`fabricd::peer::wire::CopyAsk`) is refused or checked.
#![no_main]

use std::os::fd::OwnedFd;

use fabric_nodelink::{PEER_DECODER, PeerMessage};
use fabric_proto::wire::{FrameDecoder, decode_header};
use libfuzzer_sys::fuzz_target;

type Outcome = Result<(u64, PeerMessage), String>;

fn run(data: &[u8], cuts: &[u8]) -> Vec<Outcome> {
    let mut d = FrameDecoder::<OwnedFd>::new(PEER_DECODER);
    let (mut out, mut at, mut i) = (Vec::new(), 0usize, 0usize);
    loop {
        while let Some(r) = d.next_frame() {
            let frame = match r {
                Ok(f) => f,
                Err(e) => {
                    out.push(Err(e.to_string()));
                    // The link closes on any refused frame.
                    return out;
                }
            };
            let message = PeerMessage::decode(&frame.header, frame.body);
            out.push(message.map(|m| (frame.header.request_id, m)).map_err(|e| e.to_string()));
        }
        assert!(d.capacity() <= PEER_DECODER.max_frame(), "the buffer grew past one frame");
        if at == data.len() {
            return out;
        }
        let cut = cuts.get(i % cuts.len().max(1)).copied().unwrap_or(u8::MAX);
        i += 1;
        let end = (at + usize::from(cut).max(1)).min(data.len());
        let n = d.push(&data[at..end], Vec::new(), false);
        assert!(n > 0, "the decoder took nothing with no frame to hand out");
        at += n;
    }
}

fuzz_target!(|input: &[u8]| {
    let (cuts, data) = input.split_at(input.len().min(8));
    let whole = run(data, &[]);
    assert_eq!(whole, run(data, cuts), "the split changed what decoded");
    for (id, message) in whole.into_iter().flatten() {
        // A copy chunk's header and bytes, as the owner reads them: refused or checked.
        if let PeerMessage::Request(r) = &message
            && r.op == fabric_nodelink::PeerOp::Copy
            && let Ok((ask, bytes)) = fabricd::peer::wire::CopyAsk::decode(&r.body)
        {
            assert!(ask.len > 0 && bytes.len() == if ask.write { ask.len as usize } else { 0 });
        }
        let mut bytes = Vec::new();
        message.encode(id, &mut bytes).expect("a decoded message encodes");
        let header = decode_header(&bytes).expect("its header decodes");
        let again = PeerMessage::decode(&header, &bytes[fabric_proto::wire::HEADER_LEN..]).expect("and its body");
        assert_eq!(again, message);
    }
});
