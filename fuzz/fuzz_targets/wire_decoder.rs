//! Fuzzes the sans-IO frame decoder: any bytes, pushed whole and in pieces whose lengths
//! the input chooses, under the server's and the client's limits: never a panic, the same
//! frames and refusals whatever the split, the buffer never past one frame; and with
//! descriptor stand-ins on some pushes, none held once the decoder and its frames are gone.
#![no_main]

use std::rc::Rc;

use fabric_proto::wire::{DecodeError, DecoderConfig, FrameDecoder, Header};
use libfuzzer_sys::fuzz_target;

type Outcome = Result<(Header, Vec<u8>), DecodeError>;

/// Decodes `data` pushed in pieces of the lengths in `cuts` (cycled; none: whole), with
/// clones of `fds` on every seventh push when given.
fn run(config: DecoderConfig, data: &[u8], cuts: &[u8], fds: Option<&Rc<()>>) -> Vec<Outcome> {
    let mut d = FrameDecoder::<Rc<()>>::new(config);
    let (mut out, mut at, mut i) = (Vec::new(), 0usize, 0usize);
    loop {
        while let Some(r) = d.next_frame() {
            let fatal = r.as_ref().is_err_and(DecodeError::is_fatal);
            out.push(r.map(|f| (f.header, f.body.to_vec())));
            if fatal {
                return out;
            }
        }
        assert!(d.capacity() <= config.max_frame(), "the buffer grew past one frame");
        if at == data.len() {
            return out;
        }
        let cut = cuts.get(i % cuts.len().max(1)).copied().unwrap_or(u8::MAX);
        i += 1;
        let end = (at + usize::from(cut).max(1)).min(data.len());
        let with = match fds {
            Some(fd) if i % 7 == 0 => vec![fd.clone(); usize::from(cut % 3)],
            _ => Vec::new(),
        };
        let n = d.push(&data[at..end], with, fds.is_some() && cut % 11 == 0);
        assert!(n > 0, "the decoder took nothing with no frame to hand out");
        at += n;
    }
}

fuzz_target!(|input: &[u8]| {
    let (cuts, data) = input.split_at(input.len().min(8));
    for config in [DecoderConfig::SERVER, DecoderConfig::CLIENT] {
        let whole = run(config, data, &[], None);
        assert_eq!(whole, run(config, data, cuts, None), "the split changed what decoded");
        let alive = Rc::new(());
        drop(run(config, data, cuts, Some(&alive)));
        assert_eq!(Rc::strong_count(&alive), 1, "a descriptor outlived the decoder and its frames");
    }
});
