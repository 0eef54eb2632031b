//! Fuzzes the wire decoders: the frame header, then the body under every opcode and frame
//! kind. Whatever decodes must encode again and decode to the same value.
#![no_main]

use fabric_proto::wire::{
    FrameKind, HEADER_LEN, Header, Message, Opcode, decode_body, decode_error, decode_event, decode_header,
    decode_request, decode_response, encode_message,
};
use libfuzzer_sys::fuzz_target;

fn round_trip(opcode: Opcode, msg: Message) {
    let header = Header { fd_count: msg.fds_required(), ..Header::new(opcode, msg.kind(), 1) };
    let mut out = Vec::new();
    // A decoded body always fits its opcode's limit when re-encoded: it came from at most
    // that many bytes, except for non-minimal varints, which re-encode shorter.
    encode_message(&header, &msg, &mut out).expect("a decoded message encodes");
    let h = decode_header(&out).expect("an encoded header decodes");
    let again = decode_body(&h, &out[HEADER_LEN..]).expect("an encoded body decodes");
    assert_eq!(again, msg);
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_header(data) {
        let end = HEADER_LEN.saturating_add(h.body_len as usize).min(data.len());
        if let Ok(msg) = decode_body(&h, &data[HEADER_LEN..end]) {
            round_trip(h.opcode, msg);
        }
    }
    // The same bytes as a body of every opcode and kind.
    for op in Opcode::ALL {
        for kind in FrameKind::ALL {
            let decoded = match kind {
                FrameKind::Request => decode_request(op, data).map(Message::Request),
                FrameKind::Response => decode_response(op, data).map(Message::Response),
                FrameKind::Error => decode_error(op, data).map(Message::Error),
                FrameKind::Event => decode_event(op, data).map(Message::Event),
            };
            if let Ok(msg) = decoded
                && data.len() <= op.max_body(kind) as usize
            {
                round_trip(op, msg);
            }
        }
    }
});
