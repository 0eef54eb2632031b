//! Fuzzes the bodies of the cross-node operations a peer sends over the node link
//! (`fabricd::peer::wire`): any bytes decoded as each body, never a panic; whatever
//! decodes encodes back to a body that decodes to the same value, a decoded ask or grant
//! that passes its checks carries only names that are one plain path component (and a
//! shared CXL range of 1 to 16 members that does not wrap), and a body with a byte after
//! it is refused.
#![no_main]

use fabric_nodelink::PeerOp;
use fabricd::peer::wire::{self, ImportAsk, ImportGrant, ReleaseAsk, RevokeNotice, Shared};
use libfuzzer_sys::fuzz_target;

/// One component, no way out of its directory.
fn one_component(name: &str) {
    let mut parts = std::path::Path::new(name).components();
    assert!(matches!(parts.next(), Some(std::path::Component::Normal(_))), "{name:?}");
    assert!(parts.next().is_none(), "{name:?}");
}

/// Decodes `data` as a `$t`; what decodes round-trips and refuses a trailing byte.
macro_rules! body {
    ($t:ty, $data:expr) => {{
        match wire::decode::<$t>($data) {
            Err(_) => None,
            Ok(value) => {
                let again = wire::request(PeerOp::Import, &value).body;
                assert_eq!(wire::decode::<$t>(&again).as_ref(), Ok(&value));
                let mut longer = again;
                longer.push(0);
                assert!(wire::decode::<$t>(&longer).is_err(), "a trailing byte is refused");
                Some(value)
            }
        }
    }};
}

fuzz_target!(|data: &[u8]| {
    if let Some(ask) = body!(ImportAsk, data)
        && ask.check().is_ok()
    {
        assert!(ask.partitions.len() <= wire::MAX_CLAIMS);
        ask.partitions.iter().for_each(|p| one_component(p));
    }
    if let Some(grant) = body!(ImportGrant, data)
        && grant.check().is_ok()
    {
        match &grant.shared {
            Some(Shared::File(f)) => {
                one_component(&f.resource);
                one_component(&f.file);
            }
            Some(Shared::Cxl(c)) => {
                assert!((1..=wire::MAX_WAYS).contains(&c.members.len()));
                assert!(c.set_offset.checked_add(grant.len).is_some());
            }
            None => {}
        }
    }
    let _ = body!(ReleaseAsk, data);
    let _ = body!(RevokeNotice, data);
});
