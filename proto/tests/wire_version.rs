//! Version negotiation, export handles and the constant-time comparison.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use fabric_proto::wire::{
    Access, AllocResponse, DOMAIN, ErrorBody, ErrorCode, ErrorDetail, ErrorText, ExportHandle, ExportResponse, Grant,
    HandleError, NODE_IDENTITIES, NodeId, Opcode, PROTOCOL_VERSION, Response, SUPPORTED_VERSIONS, Secret, Version,
    VersionError, VersionRange, ct_eq, negotiate,
};
use proptest::prelude::*;

fn v(major: u8, minor: u8) -> Version {
    Version::new(major, minor)
}

fn r(a: Version, b: Version) -> VersionRange {
    VersionRange::new(a, b)
}

#[test]
fn negotiation_picks_the_highest_common_version() {
    let server = r(v(1, 0), v(1, 3));
    assert_eq!(negotiate(r(v(1, 0), v(1, 0)), server), Ok(v(1, 0)));
    assert_eq!(negotiate(r(v(1, 1), v(1, 5)), server), Ok(v(1, 3)));
    assert_eq!(negotiate(r(v(1, 2), v(2, 0)), server), Ok(v(1, 3)));
    assert_eq!(negotiate(r(v(0, 9), v(1, 1)), server), Ok(v(1, 1)));
    // Exactly touching at one end.
    assert_eq!(negotiate(r(v(1, 3), v(4, 0)), server), Ok(v(1, 3)));
    assert_eq!(negotiate(r(v(0, 0), v(1, 0)), server), Ok(v(1, 0)));
}

#[test]
fn negotiation_refuses_disjoint_and_empty_ranges() {
    let server = r(v(1, 0), v(1, 3));
    let too_new = r(v(1, 4), v(2, 0));
    assert_eq!(
        negotiate(too_new, server),
        Err(VersionError::UnsupportedVersion { offered: too_new, supported: server })
    );
    let too_old = r(v(0, 1), v(0, 9));
    assert_eq!(
        negotiate(too_old, server),
        Err(VersionError::UnsupportedVersion { offered: too_old, supported: server })
    );
    let empty = r(v(1, 2), v(1, 1));
    assert_eq!(negotiate(empty, server), Err(VersionError::EmptyRange { offered: empty }));
}

#[test]
fn a_refusal_becomes_a_typed_error_body() {
    let offered = r(v(2, 0), v(3, 0));
    let err = negotiate(offered, SUPPORTED_VERSIONS).unwrap_err();
    let body = ErrorBody::from(err);
    assert_eq!(body.code, ErrorCode::UnsupportedVersion);
    assert_eq!(body.detail, Some(ErrorDetail::Versions { offered, supported: SUPPORTED_VERSIONS }));
    assert!(body.message.contains("2.0"), "{}", body.message);
}

proptest! {
    #[test]
    fn negotiated_version_is_in_both_ranges_and_maximal(a in any::<(u8, u8, u8, u8)>(), b in any::<(u8, u8, u8, u8)>()) {
        let offered = r(v(a.0 % 4, a.1 % 4), v(a.2 % 4, a.3 % 4));
        let supported = r(v(b.0 % 4, b.1 % 4), v(b.2 % 4, b.3 % 4));
        prop_assume!(supported.is_valid());
        match negotiate(offered, supported) {
            Ok(chosen) => {
                prop_assert!(offered.contains(chosen) && supported.contains(chosen));
                // Nothing higher is in both.
                for major in 0..4 {
                    for minor in 0..4 {
                        let c = v(major, minor);
                        if offered.contains(c) && supported.contains(c) {
                            prop_assert!(c <= chosen);
                        }
                    }
                }
            }
            Err(_) => {
                for major in 0..4 {
                    for minor in 0..4 {
                        let c = v(major, minor);
                        prop_assert!(!(offered.contains(c) && supported.contains(c)), "{c} is common");
                    }
                }
            }
        }
    }

    #[test]
    fn handle_text_round_trips(region in any::<u64>(), generation in any::<u64>(), secret in any::<[u8; 16]>()) {
        let h = ExportHandle { node: None, region, generation, secret: Secret(secret) };
        let text = h.to_string();
        prop_assert_eq!(text.len(), 4 + 1 + 16 + 1 + 16 + 1 + 32);
        prop_assert_eq!(text.parse::<ExportHandle>(), Ok(h));
    }

    #[test]
    fn node_handle_text_round_trips(node in any::<[u8; 8]>(), region in any::<u64>(), generation in any::<u64>(), secret in any::<[u8; 16]>()) {
        let h = ExportHandle { node: Some(NodeId(node)), region, generation, secret: Secret(secret) };
        let text = h.to_string();
        prop_assert!(text.starts_with("fbh2-"));
        prop_assert_eq!(text.len(), 4 + 1 + 16 + 1 + 16 + 1 + 16 + 1 + 32);
        prop_assert_eq!(text.parse::<ExportHandle>(), Ok(h));
        // The node-less form of the same handle is the 1.4 text, which names no node.
        let old = ExportHandle { node: None, ..h }.to_string();
        prop_assert!(old.starts_with("fbh1-"));
        prop_assert_eq!(old.parse::<ExportHandle>().map(|h| h.node), Ok(None));
    }

    #[test]
    fn node_id_text_round_trips(node in any::<[u8; 8]>()) {
        let n = NodeId(node);
        prop_assert_eq!(n.to_string().parse::<NodeId>(), Ok(n));
    }

    #[test]
    fn handle_text_parser_is_total(s in "\\PC{0,80}") {
        let _ = s.parse::<ExportHandle>();
    }

    #[test]
    fn ct_eq_agrees_with_eq(a in proptest::collection::vec(any::<u8>(), 0..40), b in proptest::collection::vec(any::<u8>(), 0..40)) {
        prop_assert_eq!(ct_eq(&a, &b), a == b);
        prop_assert!(ct_eq(&a, &a));
    }
}

#[test]
fn handle_verification_needs_every_part() {
    let h = ExportHandle { node: None, region: 7, generation: 3, secret: Secret([0xab; 16]) };
    assert!(h.verify(&h));
    let mut s = [0xab; 16];
    s[15] ^= 1;
    assert!(!h.verify(&ExportHandle { secret: Secret(s), ..h }));
    let mut s = [0xab; 16];
    s[0] ^= 0x80;
    assert!(!h.verify(&ExportHandle { secret: Secret(s), ..h }));
    assert!(!h.verify(&ExportHandle { node: None, region: 8, ..h }));
    assert!(!h.verify(&ExportHandle { generation: 2, ..h }));
    assert_ne!(h, ExportHandle { generation: 2, ..h });
}

#[test]
fn malformed_handle_texts_are_refused() {
    let good = ExportHandle { node: None, region: 1, generation: 2, secret: Secret([0x5a; 16]) }.to_string();
    assert!(good.parse::<ExportHandle>().is_ok());
    let bad = [
        String::new(),
        good.replacen("fbh1", "fbh2", 1),
        good[..good.len() - 1].to_owned(),
        format!("{good}0"),
        format!("{good}-00"),
        good.replacen('-', "+", 1),
        // A sign is accepted by from_str_radix but not here.
        format!("fbh1-+{}", &good[6..]),
        good.replacen("5a", "zz", 1),
        // Multi-byte characters where hex digits belong.
        format!("{}é{}", &good[..good.len() - 2], ""),
    ];
    for s in bad {
        assert_eq!(s.parse::<ExportHandle>(), Err(HandleError::Malformed), "{s:?}");
    }
}

#[test]
fn malformed_node_handle_texts_are_refused() {
    let node = Some(NodeId([0xc3; 8]));
    let good = ExportHandle { node, region: 1, generation: 2, secret: Secret([0x5a; 16]) }.to_string();
    assert!(good.parse::<ExportHandle>().is_ok());
    let bad = [
        // A node where the 1.4 form has none, and none where 1.5 has one.
        good.replacen("fbh2", "fbh1", 1),
        good.replacen("-c3c3c3c3c3c3c3c3", "", 1),
        good.replacen("c3c3c3c3c3c3c3c3", "c3c3c3c3c3c3c3", 1),
        good.replacen("c3c3c3c3c3c3c3c3", "+3c3c3c3c3c3c3c3", 1),
        good.replacen("c3c3", "éé", 1),
        "fbh2".to_owned(),
        "fbh2-".to_owned(),
    ];
    for s in bad {
        assert_eq!(s.parse::<ExportHandle>(), Err(HandleError::Malformed), "{s:?}");
    }
}

#[test]
fn an_older_connection_gets_what_it_understood() {
    let node = NodeId([1; 8]);
    let handle = ExportHandle { node: Some(node), region: 1, generation: 2, secret: Secret([3; 16]) };
    let export = Response::Export(ExportResponse { handle });
    let grant = Some(Grant::new(node, Access::Fd));
    let alloc = Response::Alloc(AllocResponse { region: 1, generation: 1, size: 2, gfa: None, offset: 0, grant });
    for old in [Version::new(1, 0), Version::new(1, 4)] {
        let Response::Export(e) = export.clone().for_version(old) else { unreachable!() };
        assert_eq!(e.handle, ExportHandle { node: None, ..handle }, "node-less before 1.5");
        let Response::Alloc(a) = alloc.clone().for_version(old) else { unreachable!() };
        assert_eq!(a.grant, None);
        assert_eq!(Response::Alloc(a).fds_required(), 1, "before 1.5 an alloc always carries its descriptor");
        let wrong = ErrorBody {
            code: ErrorCode::WrongNode,
            message: ErrorText::truncated("elsewhere"),
            detail: Some(ErrorDetail::Node { node }),
        };
        let e = wrong.for_version(old);
        assert_eq!((e.code, e.detail), (ErrorCode::InvalidHandle, None), "1.4 cannot decode WrongNode");
    }
    assert_eq!(export.clone().for_version(NODE_IDENTITIES), export);
    assert_eq!(alloc.clone().for_version(PROTOCOL_VERSION), alloc);
    assert_eq!(NODE_IDENTITIES, Version::new(1, 5));
}

#[test]
fn secrets_never_print() {
    let h = ExportHandle { node: None, region: 1, generation: 2, secret: Secret([0x5a; 16]) };
    let dbg = format!("{h:?}");
    assert!(!dbg.contains("5a") && !dbg.contains("90"), "{dbg}");
}

#[test]
fn the_domain_comes_with_1_6() {
    assert_eq!(DOMAIN, Version::new(1, 6));
    assert!(PROTOCOL_VERSION >= DOMAIN);
    assert_eq!(Opcode::Domain.since(), DOMAIN);
    assert!(Opcode::Domain.may_need_admin());
    // Older opcodes keep their versions: a 1.5 client is unaffected.
    assert_eq!(Opcode::Translate.since(), Version::new(1, 0));
    assert_eq!(Opcode::from_code(0x0060), Some(Opcode::Domain));
}
