//! Pure codec properties: every message type round-trips through a whole frame with
//! arbitrary field values; every truncation of a valid frame or body is an error; random
//! bytes never panic; the header layout and one body encoding are pinned byte for byte.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use fabric_proto::wire::*;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::Union;

fn name() -> impl Strategy<Value = Name> {
    "\\PC{0,24}".prop_map(|s| Name::truncated(&s))
}

fn device() -> impl Strategy<Value = DeviceName> {
    prop_oneof!["\\PC{0,40}".prop_map(|s| DeviceName::truncated(&s)), Just(DeviceName::truncated(&"d".repeat(256)))]
}

fn text() -> impl Strategy<Value = ErrorText> {
    "\\PC{0,80}".prop_map(|s| ErrorText::truncated(&s))
}

fn list<T: std::fmt::Debug, const N: usize>(
    s: impl Strategy<Value = T>,
    max: usize,
) -> impl Strategy<Value = BoundedVec<T, N>> {
    vec(s, 0..=max).prop_map(|v| BoundedVec::new(v).unwrap())
}

fn version() -> impl Strategy<Value = Version> {
    any::<(u8, u8)>().prop_map(|(a, b)| Version::new(a, b))
}

fn range() -> impl Strategy<Value = VersionRange> {
    (version(), version()).prop_map(|(a, b)| VersionRange::new(a, b))
}

fn memory() -> impl Strategy<Value = MemoryClass> {
    prop_oneof![
        Just(MemoryClass::Hbm),
        Just(MemoryClass::Dram),
        Just(MemoryClass::CxlVolatile),
        Just(MemoryClass::CxlPersistent),
        Just(MemoryClass::CxlDynamic),
        Just(MemoryClass::HostExported),
    ]
}

fn resource() -> impl Strategy<Value = ResourceName> {
    (device(), memory(), any::<u16>()).prop_map(|(device, memory, ordinal)| ResourceName { device, memory, ordinal })
}

fn node() -> impl Strategy<Value = NodeId> {
    any::<[u8; 8]>().prop_map(NodeId)
}

fn handle() -> impl Strategy<Value = ExportHandle> {
    (proptest::option::of(node()), any::<(u64, u64, [u8; 16])>())
        .prop_map(|(node, (region, generation, s))| ExportHandle { node, region, generation, secret: Secret(s) })
}

/// A grant (1.5; with its coherence since 1.9) or none (an older connection's response).
fn grant() -> impl Strategy<Value = Option<Grant>> {
    let access = prop_oneof![Just(Access::Fd), Just(Access::Vendor), Just(Access::CopyOnly)];
    let coherence = proptest::option::of(prop_oneof![Just(Coherence::Hardware), Just(Coherence::Software)]);
    proptest::option::of((node(), access, coherence).prop_map(|(owner, access, coherence)| Grant {
        owner,
        access,
        coherence,
    }))
}

fn access() -> impl Strategy<Value = AccessMode> {
    prop_oneof![Just(AccessMode::ReadOnly), Just(AccessMode::ReadWrite)]
}

fn object() -> impl Strategy<Value = ObjectKind> {
    prop_oneof![
        Just(ObjectKind::CudaPosixFd),
        vec(any::<u8>(), 64).prop_map(|b| ObjectKind::CudaFabric(FabricHandleBytes(b.try_into().unwrap()))),
    ]
}

fn topics() -> impl Strategy<Value = Topics> {
    (0u8..16).prop_map(|b| Topics::from_bits(b).unwrap())
}

fn spec() -> impl Strategy<Value = PartitionSpec> {
    (name(), list(device(), 6), list(any::<u32>(), 6), list(any::<u32>(), 6))
        .prop_map(|(name, devices, uids, gids)| PartitionSpec { name, devices, uids, gids })
}

fn request() -> impl Strategy<Value = Request> {
    let topo = || proptest::option::of(name()).prop_map(|node| TopologyRequest { node });
    let query = prop_oneof![
        any::<u64>().prop_map(TranslateQuery::Gfa),
        (resource(), any::<u64>()).prop_map(|(resource, offset)| TranslateQuery::Resource { resource, offset }),
    ];
    let target = prop_oneof![
        resource().prop_map(AllocTarget::Resource),
        (device(), memory()).prop_map(|(device, memory)| AllocTarget::Device { device, memory }),
        name().prop_map(AllocTarget::Set),
    ];
    let policy = (list(any::<u32>(), 8), list(any::<u32>(), 8), proptest::option::of(name()), access())
        .prop_map(|(uids, gids, partition, access)| ExportPolicy { uids, gids, partition, access });
    let source = prop_oneof![
        any::<u64>().prop_map(RegisterSource::Region),
        any::<u64>().prop_map(RegisterSource::Import),
        Just(RegisterSource::Fd),
        any::<u64>().prop_map(|addr| RegisterSource::Process { addr }),
    ];
    let partitions = prop_oneof![
        Just(PartitionsRequest::List),
        spec().prop_map(PartitionsRequest::Set),
        name().prop_map(|name| PartitionsRequest::Remove { name }),
    ];
    Union::new(vec![
        (range(), name(), proptest::option::of(any::<[u8; 16]>()))
            .prop_map(|(versions, client, t)| {
                Request::Hello(HelloRequest { versions, client, resume: t.map(SessionToken) })
            })
            .boxed(),
        Just(Request::Status(StatusRequest {})).boxed(),
        Just(Request::Ping).boxed(),
        topo().prop_map(Request::Topology).boxed(),
        topo().prop_map(Request::Devices).boxed(),
        topo().prop_map(Request::Map).boxed(),
        topo().prop_map(Request::Inventory).boxed(),
        any::<bool>().prop_map(|all| Request::Regions(RegionsRequest { all })).boxed(),
        list(query, 20).prop_map(|queries| Request::Translate(TranslateRequest { queries })).boxed(),
        (target.clone(), any::<u64>(), any::<u64>())
            .prop_map(|(target, size, align)| Request::Alloc(AllocRequest { target, size, align }))
            .boxed(),
        (target, any::<u64>(), object())
            .prop_map(|(target, size, object)| Request::Adopt(AdoptRequest { target, size, object }))
            .boxed(),
        (handle(), access())
            .prop_map(|(handle, access)| Request::ImportObject(ImportRequest { handle, access }))
            .boxed(),
        (any::<u64>(), proptest::option::of(node()))
            .prop_map(|(region, node)| Request::Free(FreeRequest { region, node }))
            .boxed(),
        (any::<u64>(), policy, proptest::option::of(node()))
            .prop_map(|(region, policy, node)| Request::Export(ExportRequest { region, policy, node }))
            .boxed(),
        handle().prop_map(|handle| Request::Revoke(RevokeRequest { handle })).boxed(),
        (handle(), access()).prop_map(|(handle, access)| Request::Import(ImportRequest { handle, access })).boxed(),
        any::<u64>().prop_map(|import| Request::Release(ReleaseRequest { import })).boxed(),
        (device(), source, any::<u64>(), any::<u64>(), access(), proptest::option::of(node()))
            .prop_map(|(device, source, offset, len, access, node)| {
                Request::Register(RegisterRequest { device, source, offset, len, access, node })
            })
            .boxed(),
        any::<u64>().prop_map(|registration| Request::Unregister(UnregisterRequest { registration })).boxed(),
        partitions.prop_map(Request::Partitions).boxed(),
        topics().prop_map(|topics| Request::Subscribe(SubscribeRequest { topics })).boxed(),
        prop_oneof![
            Just(DomainAction::Status),
            Just(DomainAction::Nodes),
            name().prop_map(|node| DomainAction::Gc { node }),
            (any::<u64>(), proptest::option::of(name()))
                .prop_map(|(revision, after)| DomainAction::NodesPage(PageRequest { revision, after })),
            (any::<u64>(), proptest::option::of(name()))
                .prop_map(|(revision, after)| DomainAction::MapPage(PageRequest { revision, after })),
        ]
        .prop_map(|action| Request::Domain(DomainRequest { action }))
        .boxed(),
        (copy_endpoint(), copy_endpoint(), any::<u64>())
            .prop_map(|(dst, src, len)| Request::Copy(CopyRequest { dst, src, len }))
            .boxed(),
        vec((copy_endpoint(), copy_endpoint(), any::<u64>()), 1..=MAX_BATCH)
            .prop_map(|v| {
                let copies = v.into_iter().map(|(dst, src, len)| CopyRequest { dst, src, len }).collect();
                Request::CopyBatch(CopyBatchRequest { copies: BoundedVec::new(copies).unwrap() })
            })
            .boxed(),
    ])
}

fn copy_endpoint() -> impl Strategy<Value = CopyEndpoint> {
    prop_oneof![
        any::<(u64, u64)>().prop_map(|(id, offset)| CopyEndpoint::Registration { id, offset }),
        any::<u64>().prop_map(CopyEndpoint::Gfa),
    ]
}

fn regions() -> impl Strategy<Value = RegionsResponse> {
    let region = (any::<(u64, u64, u32, i32, u64, u64)>(), resource()).prop_map(|(a, resource)| RegionInfo {
        region: a.0,
        generation: a.1,
        owner_uid: a.2,
        owner_pid: a.3,
        resource,
        offset: a.4,
        size: a.5,
    });
    let policy = (list(any::<u32>(), 4), list(any::<u32>(), 4), proptest::option::of(name()), access())
        .prop_map(|(uids, gids, partition, access)| ExportPolicy { uids, gids, partition, access });
    let export = (any::<(u64, u64, u32, bool)>(), policy).prop_map(|(a, policy)| ExportInfo {
        region: a.0,
        generation: a.1,
        owner_uid: a.2,
        policy,
        revoked: a.3,
    });
    let import = any::<(u64, u64, u64, u32)>().prop_map(|(import, region, generation, uid)| ImportInfo {
        import,
        region,
        generation,
        uid,
    });
    (list(region, 3), list(export, 3), list(import, 3), any::<bool>())
        .prop_map(|(regions, exports, imports, truncated)| RegionsResponse { regions, exports, imports, truncated })
}

fn response() -> impl Strategy<Value = Response> {
    let doc = || (name(), "\\PC{0,200}").prop_map(|(schema, json)| Document { schema, json });
    let translation = prop_oneof![
        (resource(), any::<u64>(), proptest::option::of(name()))
            .prop_map(|(resource, offset, set)| Translation::Resource { resource, offset, set }),
        any::<u64>().prop_map(Translation::Gfa),
        Just(Translation::Unmapped),
        device().prop_map(|owner| Translation::Hole { owner }),
        Just(Translation::NotInPartition),
        Just(Translation::UnknownResource),
        (name(), any::<bool>(), proptest::option::of(resource()), proptest::option::of(name()), any::<u64>())
            .prop_map(|(node, live, resource, set, offset)| Translation::Remote { node, live, resource, set, offset }),
    ];
    let problem = (
        prop_oneof![
            Just(ProblemKind::BackendMissing),
            Just(ProblemKind::BackendFailed),
            Just(ProblemKind::DeviceMissing),
            Just(ProblemKind::DeviceFailed),
            Just(ProblemKind::LinkDown),
            Just(ProblemKind::LinkDegraded),
            Just(ProblemKind::Other),
        ],
        device(),
        text(),
        proptest::option::of(any::<u16>()),
    )
        .prop_map(|(kind, subject, detail, bandwidth_permille)| Problem {
            kind,
            subject,
            detail,
            bandwidth_permille,
        });
    let status = (any::<(bool, u64, u32, u32, u32)>(), any::<(u64, u64, u64, u64, u64, u64, u64)>(), list(problem, 5))
        .prop_map(|(a, b, problems)| StatusResponse {
            ready: a.0,
            uptime_s: a.1,
            devices: a.2,
            links: a.3,
            sessions: a.4,
            regions: b.0,
            exports: b.1,
            imports: b.2,
            registrations: b.3,
            allocated_bytes: b.4,
            pinned_bytes: b.5,
            map_generation: b.6,
            problems,
        });
    Union::new(vec![
        (version(), name(), any::<u64>(), any::<u32>(), any::<u8>(), proptest::option::of(any::<[u8; 16]>()))
            .prop_map(|(version, server, session, max_request_body, max_fds, t)| {
                let token = t.map(SessionToken);
                Response::Hello(HelloResponse { version, server, session, max_request_body, max_fds, token })
            })
            .boxed(),
        status.prop_map(Response::Status).boxed(),
        doc().prop_map(Response::Topology).boxed(),
        doc().prop_map(Response::Devices).boxed(),
        doc().prop_map(Response::Map).boxed(),
        doc().prop_map(Response::Inventory).boxed(),
        regions().prop_map(Response::Regions).boxed(),
        list(translation, 20).prop_map(|results| Response::Translate(TranslateResponse { results })).boxed(),
        (any::<(u64, u64, u64, u64)>(), proptest::option::of(any::<u64>()), grant())
            .prop_map(|((region, generation, size, offset), gfa, grant)| {
                Response::Alloc(AllocResponse { region, generation, size, gfa, offset, grant })
            })
            .boxed(),
        (any::<(u64, u64, u64)>(), proptest::option::of(any::<u64>()), grant())
            .prop_map(|((region, generation, size), gfa, grant)| {
                Response::Adopt(AllocResponse { region, generation, size, gfa, offset: 0, grant })
            })
            .boxed(),
        (any::<(u64, u64, u64, u64)>(), proptest::option::of(any::<u64>()), access(), device(), object(), grant())
            .prop_map(|((import, region, generation, size), gfa, access, device, object, grant)| {
                Response::ImportObject(ImportObjectResponse {
                    import,
                    region,
                    generation,
                    size,
                    gfa,
                    access,
                    object,
                    device,
                    grant,
                })
            })
            .boxed(),
        Just(Response::Free).boxed(),
        Just(Response::Ping).boxed(),
        handle().prop_map(|handle| Response::Export(ExportResponse { handle })).boxed(),
        Just(Response::Revoke).boxed(),
        (any::<(u64, u64, u64, u64, u64)>(), proptest::option::of(any::<u64>()), access(), grant())
            .prop_map(|((import, region, generation, size, offset), gfa, access, grant)| {
                Response::Import(ImportResponse { import, region, generation, size, gfa, offset, access, grant })
            })
            .boxed(),
        Just(Response::Release).boxed(),
        any::<(u64, u64, u64)>()
            .prop_map(|(registration, iova, len)| Response::Register(RegisterResponse { registration, iova, len }))
            .boxed(),
        Just(Response::Unregister).boxed(),
        list(spec(), 4).prop_map(|partitions| Response::Partitions(PartitionsResponse { partitions })).boxed(),
        topics().prop_map(|topics| Response::Subscribe(SubscribeResponse { topics })).boxed(),
        any::<u64>().prop_map(|copy| Response::Copy(CopyResponse { copy })).boxed(),
        any::<u64>().prop_map(|copy| Response::CopyBatch(CopyResponse { copy })).boxed(),
        doc().prop_map(Response::Domain).boxed(),
    ])
}

fn error_body() -> impl Strategy<Value = ErrorBody> {
    let codes = [
        ErrorCode::BadFrame,
        ErrorCode::UnknownOpcode,
        ErrorCode::UnsupportedVersion,
        ErrorCode::NotNegotiated,
        ErrorCode::BadRequest,
        ErrorCode::PermissionDenied,
        ErrorCode::AdminRequired,
        ErrorCode::NotFound,
        ErrorCode::InvalidHandle,
        ErrorCode::Revoked,
        ErrorCode::LimitExceeded,
        ErrorCode::NoSpace,
        ErrorCode::BadFds,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
        ErrorCode::NotImplemented,
        ErrorCode::WrongNode,
    ];
    let detail = proptest::option::of(prop_oneof![
        (range(), range()).prop_map(|(offered, supported)| ErrorDetail::Versions { offered, supported }),
        (name(), any::<(u64, u64, u64)>()).prop_map(|(what, (used, requested, max))| ErrorDetail::Limit {
            what,
            used,
            requested,
            max
        }),
        node().prop_map(|node| ErrorDetail::Node { node }),
    ]);
    (proptest::sample::select(codes.to_vec()), text(), detail).prop_map(|(code, message, detail)| ErrorBody {
        code,
        message,
        detail,
    })
}

fn event() -> impl Strategy<Value = Event> {
    let device_change = prop_oneof![
        Just(DeviceChange::Added),
        Just(DeviceChange::Removed),
        Just(DeviceChange::Failed),
        Just(DeviceChange::Recovered)
    ];
    let link_change = prop_oneof![
        Just(LinkChange::Up),
        Just(LinkChange::Down),
        any::<u16>().prop_map(|bandwidth_permille| LinkChange::Degraded { bandwidth_permille }),
    ];
    let reason = prop_oneof![
        Just(RevocationReason::Revoked),
        Just(RevocationReason::Freed),
        Just(RevocationReason::OwnerExited),
        Just(RevocationReason::DeviceLost),
    ];
    prop_oneof![
        (device(), device_change).prop_map(|(device, change)| Event::Device { device, change }),
        (device(), device(), name(), link_change).prop_map(|(a, b, kind, change)| Event::Link { a, b, kind, change }),
        any::<(u64, u32, u32, u32)>().prop_map(|(generation, added, holed, removed)| Event::Map(MapChange {
            generation,
            added,
            holed,
            removed
        })),
        (any::<(u64, u64, u64)>(), reason).prop_map(|((region, generation, import), reason)| {
            Event::Revocation(Revocation { region, generation, import, reason })
        }),
        (any::<(u64, u64)>(), proptest::option::of(error_body())).prop_map(|((copy, bytes), failed)| {
            let result = match failed {
                None => CopyResult::Ok,
                Some(e) => CopyResult::Failed { code: e.code, message: e.message },
            };
            Event::CopyDone(CopyDone { copy, result, bytes })
        }),
    ]
}

/// A message with the header it travels under.
fn framed() -> impl Strategy<Value = (Header, Message)> {
    let msg = prop_oneof![
        request().prop_map(Message::Request),
        response().prop_map(Message::Response),
        error_body().prop_map(Message::Error),
        event().prop_map(Message::Event),
    ];
    (msg, any::<u64>(), any::<u8>(), proptest::sample::select(Opcode::ALL.to_vec())).prop_map(
        |(msg, id, minor, any_op)| {
            let opcode = msg.opcode().unwrap_or(any_op);
            let header = Header {
                version: Version::new(1, minor),
                fd_count: msg.fds_required(),
                ..Header::new(opcode, msg.kind(), id)
            };
            (header, msg)
        },
    )
}

/// The length of the trailing extension `msg` carries, if any.
/// How many bytes at the end of `msg`'s body each of its older forms leaves out: none, or
/// its trailer — and for a grant with its coherence (1.9), also just that byte (the 1.5
/// grant).
fn older_forms(msg: &Message) -> Vec<usize> {
    let grant = |g: &Option<Grant>| match g {
        Some(Grant { coherence: Some(_), .. }) => vec![Grant::LEN_COHERENCE, 1],
        Some(_) => vec![Grant::LEN],
        None => Vec::new(),
    };
    match msg {
        Message::Response(Response::Alloc(a) | Response::Adopt(a)) => grant(&a.grant),
        Message::Response(Response::Import(i)) => grant(&i.grant),
        Message::Response(Response::ImportObject(i)) => grant(&i.grant),
        _ => trailer_len(msg).into_iter().collect(),
    }
}

/// The length of `msg`'s trailer other than a grant, when it has one.
fn trailer_len(msg: &Message) -> Option<usize> {
    let node = |h: &ExportHandle| h.node.map(|_| NodeId::LEN);
    match msg {
        Message::Request(Request::Hello(h)) => h.resume.map(|_| 16),
        Message::Response(Response::Hello(h)) => h.token.map(|_| 16),
        Message::Request(Request::Import(i) | Request::ImportObject(i)) => node(&i.handle),
        Message::Request(Request::Revoke(r)) => node(&r.handle),
        Message::Request(Request::Free(f)) => f.node.map(|_| NodeId::LEN),
        Message::Request(Request::Export(e)) => e.node.map(|_| NodeId::LEN),
        Message::Request(Request::Register(r)) => r.node.map(|_| NodeId::LEN),
        Message::Response(Response::Export(e)) => node(&e.handle),
        _ => None,
    }
}

fn encode(header: &Header, msg: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    encode_message(header, msg, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 6 } else { 512 }, ..ProptestConfig::default() })]

    #[test]
    fn every_message_round_trips_through_a_frame((header, msg) in framed()) {
        let bytes = encode(&header, &msg);
        let decoded = decode_header(&bytes).unwrap();
        prop_assert_eq!(decoded, Header { body_len: (bytes.len() - HEADER_LEN) as u32, ..header });
        prop_assert_eq!(decode_body(&decoded, &bytes[HEADER_LEN..]).unwrap(), msg);
    }

    #[test]
    fn every_truncation_of_a_frame_is_an_error((header, msg) in framed()) {
        let bytes = encode(&header, &msg);
        // Under Miri every 31st cut (each decode is interpreted).
        for cut in (0..bytes.len()).step_by(if cfg!(miri) { 31 } else { 1 }) {
            let prefix = &bytes[..cut];
            let result = decode_header(prefix).map_err(|_| ()).and_then(|h| decode_body(&h, &prefix[HEADER_LEN..]).map_err(|_| ()));
            prop_assert!(result.is_err(), "prefix of {cut} bytes decoded");
        }
        // The body alone: no proper prefix decodes as the same opcode and kind either,
        // except the older forms of a body that carries a trailer (the 1.1 token of a
        // hello, the 1.5 node of a handle or grant of a response, the 1.8 node of a
        // region, the 1.9 coherence of a grant).
        let body = &bytes[HEADER_LEN..];
        let older: Vec<usize> = older_forms(&msg).into_iter().map(|t| body.len() - t).collect();
        for cut in (0..body.len()).step_by(if cfg!(miri) { 31 } else { 1 }).filter(|c| !older.contains(c)) {
            let short = Header { body_len: cut as u32, ..decode_header(&bytes).unwrap() };
            prop_assert!(decode_body(&short, &body[..cut]).is_err(), "body prefix of {cut} bytes decoded");
        }
    }

    #[test]
    fn trailing_bytes_are_refused((header, msg) in framed(), extra in vec(any::<u8>(), 1..8)) {
        // One byte after a 1.5 grant is a 1.9 grant's coherence, not trailing.
        let grant = match &msg {
            Message::Response(Response::Alloc(a) | Response::Adopt(a)) => a.grant,
            Message::Response(Response::Import(i)) => i.grant,
            Message::Response(Response::ImportObject(i)) => i.grant,
            _ => None,
        };
        prop_assume!(!(extra.len() == 1 && grant.is_some_and(|g| g.coherence.is_none())));
        let mut body = Vec::new();
        encode_body(&msg, &mut body).unwrap();
        body.extend_from_slice(&extra);
        let h = Header { body_len: body.len() as u32, ..header };
        let is_trailing = matches!(decode_body(&h, &body), Err(BodyError::TrailingBytes { .. }));
        prop_assert!(is_trailing);
    }

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..600)) {
        let _ = decode_header(&bytes);
        for op in Opcode::ALL {
            let _ = decode_request(op, &bytes);
            let _ = decode_response(op, &bytes);
            let _ = decode_error(op, &bytes);
            let _ = decode_event(op, &bytes);
        }
    }

    #[test]
    fn random_bodies_under_a_valid_header_never_panic(
        op in proptest::sample::select(Opcode::ALL.to_vec()),
        kind in proptest::sample::select(FrameKind::ALL.to_vec()),
        body in vec(any::<u8>(), 0..300),
    ) {
        let mut frame = Header { body_len: body.len() as u32, ..Header::new(op, kind, 1) }.to_raw();
        frame.body_len = (body.len() as u32).into();
        let mut bytes = zerocopy::IntoBytes::as_bytes(&frame).to_vec();
        bytes.extend_from_slice(&body);
        if let Ok(h) = decode_header(&bytes) {
            let _ = decode_body(&h, &bytes[HEADER_LEN..]);
        }
    }

    #[test]
    fn mutated_frames_never_panic((header, msg) in framed(), flips in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let mut bytes = encode(&header, &msg);
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        if let Ok(h) = decode_header(&bytes) {
            let end = (HEADER_LEN + h.body_len as usize).min(bytes.len());
            let _ = decode_body(&h, &bytes[HEADER_LEN..end]);
        }
    }
}

#[test]
fn header_layout_is_pinned() {
    let h = Header {
        version: Version::new(1, 2),
        opcode: Opcode::Import,
        kind: FrameKind::Response,
        request_id: 0x0102_0304_0506_0708,
        body_len: 0,
        fd_count: 1,
    };
    let mut out = Vec::new();
    encode_frame(&h, &[0xee; 3], &mut out).unwrap();
    #[rustfmt::skip]
    let want: [u8; 35] = [
        b'F', b'B', b'R', b'C',  // magic
        1, 2,                    // major, minor
        0x24, 0x00,              // opcode (Import)
        0x09, 0x00,              // flags: RESPONSE | HAS_FDS
        1, 0,                    // fd_count, reserved
        3, 0, 0, 0,              // body_len
        8, 7, 6, 5, 4, 3, 2, 1,  // request_id
        0, 0, 0, 0, 0, 0, 0, 0,  // reserved
        0xee, 0xee, 0xee,
    ];
    assert_eq!(out, want);
    assert_eq!(HEADER_LEN, 32);
    assert_eq!(size_of::<RawHeader>(), HEADER_LEN);
    assert_eq!(decode_header(&out).unwrap(), Header { body_len: 3, ..h });
}

#[test]
fn hello_body_encoding_is_pinned() {
    let msg = Message::Request(Request::Hello(HelloRequest {
        versions: VersionRange::new(Version::new(1, 0), Version::new(1, 3)),
        client: Name::new("ctl").unwrap(),
        resume: None,
    }));
    let mut body = Vec::new();
    encode_body(&msg, &mut body).unwrap();
    assert_eq!(body, [1, 0, 1, 3, 3, b'c', b't', b'l']);
    // 1.1: the resume token is a trailing extension of exactly 16 bytes; the 1.0 form
    // stays a prefix, so a 1.0 body still decodes.
    let Message::Request(Request::Hello(mut hello)) = msg else { unreachable!() };
    hello.resume = Some(SessionToken([7; 16]));
    let mut ext = Vec::new();
    encode_body(&Message::Request(Request::Hello(hello.clone())), &mut ext).unwrap();
    assert_eq!(&ext[..8], &body[..]);
    assert_eq!(&ext[8..], &[7; 16]);
    assert_eq!(decode_request(Opcode::Hello, &ext).unwrap(), Request::Hello(hello));
    assert!(matches!(decode_request(Opcode::Hello, &ext[..20]), Err(BodyError::TrailingBytes { extra: 12, .. })));
    let mut long = ext.clone();
    long.push(0);
    assert!(matches!(decode_request(Opcode::Hello, &long), Err(BodyError::TrailingBytes { extra: 17, .. })));
    let mut body = Vec::new();
    encode_body(&Message::Request(Request::Free(FreeRequest { region: 300, node: None })), &mut body).unwrap();
    assert_eq!(body, [0xac, 0x02], "u64 fields are varints");
}

fn raw(opcode: u16, flags: u16, fd_count: u8, body_len: u32) -> RawHeader {
    let mut r = Header::new(Opcode::Hello, FrameKind::Request, 9).to_raw();
    r.opcode = opcode.into();
    r.flags = flags.into();
    r.fd_count = fd_count;
    r.body_len = body_len.into();
    r
}

fn bytes(r: &RawHeader) -> Vec<u8> {
    zerocopy::IntoBytes::as_bytes(r).to_vec()
}

#[test]
fn bad_headers_get_typed_errors() {
    let ok = raw(0x0001, 0, 0, 10);
    assert!(decode_header(&bytes(&ok)).is_ok());

    let mut r = ok;
    r.magic = *b"FBRD";
    assert_eq!(decode_header(&bytes(&r)), Err(FrameError::BadMagic { found: *b"FBRD" }));

    for major in [0, 2, 255] {
        let mut r = ok;
        r.major = major;
        assert!(matches!(
            decode_header(&bytes(&r)),
            Err(FrameError::UnsupportedVersion { offered, .. }) if offered.major == major
        ));
    }
    // Any minor of a known major is accepted: minors only add.
    let mut r = ok;
    r.minor = 200;
    assert!(decode_header(&bytes(&r)).is_ok());

    let mut r = ok;
    r.reserved0 = 1;
    assert_eq!(decode_header(&bytes(&r)), Err(FrameError::ReservedNotZero));
    for i in 0..8 {
        let mut r = ok;
        r.reserved1[i] = 0x80;
        assert_eq!(decode_header(&bytes(&r)), Err(FrameError::ReservedNotZero));
    }

    // Unknown bits, ERROR without RESPONSE, EVENT with RESPONSE, HAS_FDS disagreeing.
    for (flags, fds) in [(0x10, 0), (0x8000, 0), (0x2, 0), (0x5, 0), (0x8, 0), (0x0, 1)] {
        assert_eq!(decode_header(&bytes(&raw(1, flags, fds, 0))), Err(FrameError::BadFlags { flags, fd_count: fds }));
    }

    assert_eq!(
        decode_header(&bytes(&raw(0x7777, 0, 0, 12))),
        Err(FrameError::UnknownOpcode { code: 0x7777, request_id: 9, body_len: 12 })
    );

    // Hello requests carry no descriptors.
    assert!(matches!(
        decode_header(&bytes(&raw(0x0001, 0x8, 1, 0))),
        Err(FrameError::TooManyFds { opcode: Opcode::Hello, count: 1, max: 0, .. })
    ));
    // An import response may carry one, not two.
    assert!(decode_header(&bytes(&raw(0x0024, 0x9, 1, 0))).is_ok());
    assert!(matches!(decode_header(&bytes(&raw(0x0024, 0x9, 2, 0))), Err(FrameError::TooManyFds { max: 1, .. })));
    // Events only under Subscribe.
    assert!(matches!(decode_header(&bytes(&raw(0x0001, 0x4, 0, 1))), Err(FrameError::BodyTooLarge { max: 0, .. })));
    let h = decode_header(&bytes(&raw(0x0001, 0x4, 0, 0))).unwrap();
    assert_eq!(decode_body(&h, &[]), Err(BodyError::NotAnEventOpcode { opcode: Opcode::Hello }));
}

#[test]
#[cfg_attr(miri, ignore = "builds bodies of up to 16 MiB: hours under Miri")]
fn every_body_limit_is_enforced_at_the_boundary() {
    for op in Opcode::ALL {
        for kind in FrameKind::ALL {
            let max = op.max_body(kind);
            assert!(max <= MAX_BODY);
            // A client's requests; a node link's data frames are apart (its decoder's limit).
            if kind == FrameKind::Request && op != Opcode::PeerData {
                assert!(max <= MAX_REQUEST_BODY, "{op}");
            }
            assert!(op.max_fds(kind) <= MAX_FDS);
            let flags = [0u16, 0x1, 0x3, 0x4][FrameKind::ALL.iter().position(|k| *k == kind).unwrap()];
            let at = decode_header(&bytes(&raw(op.code(), flags, 0, max))).unwrap();
            assert_eq!((at.opcode, at.kind, at.body_len), (op, kind, max));
            assert_eq!(
                decode_header(&bytes(&raw(op.code(), flags, 0, max + 1))),
                Err(FrameError::BodyTooLarge { opcode: op, kind, len: u64::from(max) + 1, max })
            );
            assert!(matches!(
                decode_header(&bytes(&raw(op.code(), flags, 0, u32::MAX))),
                Err(FrameError::BodyTooLarge { .. })
            ));
            // The encoder refuses what the decoder would.
            let mut out = vec![7];
            let big = vec![0u8; max as usize + 1];
            assert!(matches!(
                encode_frame(&Header::new(op, kind, 1), &big, &mut out),
                Err(FrameError::BodyTooLarge { .. })
            ));
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "builds over-long lists: too slow under Miri")]
fn over_long_fields_are_refused_on_both_sides() {
    assert!(Name::new("x".repeat(64)).is_ok());
    assert_eq!(Name::new("x".repeat(65)), Err(BoundedError::TooLong { len: 65, max: 64 }));
    assert_eq!(Name::truncated(&"é".repeat(40)).len(), 64);
    assert!(BoundedVec::<u32, 64>::new(vec![0; 65]).is_err());

    // A hello whose client name is 65 bytes long, written by hand.
    let mut body = vec![1, 0, 1, 0, 65];
    body.extend(std::iter::repeat_n(b'a', 65));
    assert!(matches!(decode_request(Opcode::Hello, &body), Err(BodyError::Decode { .. })));
    body[4] = 64;
    body.pop();
    assert!(decode_request(Opcode::Hello, &body).is_ok());

    // A translate request announcing 1,025 queries, all present.
    let mut body = vec![0x81, 0x08];
    body.extend(std::iter::repeat_n([0u8, 0], 1025).flatten());
    assert!(matches!(decode_request(Opcode::Translate, &body), Err(BodyError::Decode { .. })));
    // 1,024 is fine.
    let mut body = vec![0x80, 0x08];
    body.extend(std::iter::repeat_n([0u8, 0], 1024).flatten());
    let Ok(Request::Translate(t)) = decode_request(Opcode::Translate, &body) else { panic!("1024 queries refused") };
    assert_eq!(t.queries.len(), 1024);

    // Unknown topic bits.
    assert!(decode_request(Opcode::Subscribe, &[0x10]).is_err());
    assert!(decode_request(Opcode::Subscribe, &[0x0f]).is_ok());
}

#[test]
fn encode_message_checks_header_against_message() {
    let msg = Message::Request(Request::Free(FreeRequest { region: 1, node: None }));
    let mut out = vec![1, 2, 3];
    let wrong_op = Header::new(Opcode::Alloc, FrameKind::Request, 1);
    assert!(matches!(encode_message(&wrong_op, &msg, &mut out), Err(BodyError::HeaderMismatch { .. })));
    let wrong_kind = Header::new(Opcode::Free, FrameKind::Response, 1);
    assert!(matches!(encode_message(&wrong_kind, &msg, &mut out), Err(BodyError::HeaderMismatch { .. })));
    assert_eq!(out, [1, 2, 3], "nothing appended on error");
}

#[test]
fn node_trailers_are_pinned() {
    // 1.5: the handle's node trails the frozen import body as 8 raw bytes, and a grant
    // trails the frozen response as the node and one byte of access; without them the
    // body is the 1.4 one, byte for byte.
    let node = NodeId([1, 2, 3, 4, 5, 6, 7, 8]);
    let handle = ExportHandle { node: None, region: 1, generation: 2, secret: Secret([9; 16]) };
    let import = |handle| Message::Request(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }));
    let (mut old, mut new) = (Vec::new(), Vec::new());
    encode_body(&import(handle), &mut old).unwrap();
    encode_body(&import(ExportHandle { node: Some(node), ..handle }), &mut new).unwrap();
    assert_eq!(old.len(), 1 + 1 + 16 + 1);
    assert_eq!(&new[..old.len()], &old[..]);
    assert_eq!(&new[old.len()..], &node.0);
    let Request::Import(i) = decode_request(Opcode::Import, &new).unwrap() else { unreachable!() };
    assert_eq!(i.handle.node, Some(node));
    let Request::Import(i) = decode_request(Opcode::Import, &old).unwrap() else { unreachable!() };
    assert_eq!(i.handle.node, None, "a 1.4 body is a node-less handle");
    assert!(matches!(
        decode_request(Opcode::Import, &new[..new.len() - 1]),
        Err(BodyError::TrailingBytes { extra: 7, .. })
    ));
    let alloc = |grant| {
        let a = AllocResponse { region: 5, generation: 5, size: 4096, gfa: None, offset: 0, grant };
        let mut body = Vec::new();
        encode_body(&Message::Response(Response::Alloc(a)), &mut body).unwrap();
        body
    };
    let (old, new) = (alloc(None), alloc(Some(Grant::new(node, Access::CopyOnly))));
    assert_eq!(&new[..old.len()], &old[..]);
    assert_eq!(&new[old.len()..], &[1, 2, 3, 4, 5, 6, 7, 8, 2]);
    let Response::Alloc(a) = decode_response(Opcode::Alloc, &new).unwrap() else { unreachable!() };
    assert_eq!(a.grant, Some(Grant::new(node, Access::CopyOnly)));
    assert_eq!(Response::Alloc(a.clone()).fds_required(), 0, "a copy-only grant carries no descriptor");
    let mut bad = new.clone();
    if let Some(b) = bad.last_mut() {
        *b = 3;
    }
    assert!(matches!(decode_response(Opcode::Alloc, &bad), Err(BodyError::Decode { .. })), "no access 3");
    // 1.9: the coherence's code is one byte after the 1.5 grant.
    let software = Grant::new(node, Access::Fd).with_coherence(Coherence::Software);
    let coherent = alloc(Some(software));
    assert_eq!(&coherent[old.len()..], &[1, 2, 3, 4, 5, 6, 7, 8, 0, 1]);
    let Response::Alloc(a) = decode_response(Opcode::Alloc, &coherent).unwrap() else { unreachable!() };
    assert_eq!(a.grant, Some(software));
    let hardware = alloc(Some(Grant::new(node, Access::Fd).with_coherence(Coherence::Hardware)));
    assert_eq!(hardware.last(), Some(&0));
    let mut bad = coherent.clone();
    if let Some(b) = bad.last_mut() {
        *b = 2;
    }
    assert!(matches!(decode_response(Opcode::Alloc, &bad), Err(BodyError::Decode { .. })), "no coherence 2");
    let mut long = coherent.clone();
    long.push(0);
    assert!(matches!(decode_response(Opcode::Alloc, &long), Err(BodyError::TrailingBytes { extra: 11, .. })));
    // An older connection gets the 1.5 grant, and one before 1.5 none.
    let Response::Alloc(a) = Response::Alloc(a).for_version(Version::new(1, 8)) else { unreachable!() };
    assert_eq!(a.grant, Some(Grant::new(node, Access::Fd)));
    let Response::Alloc(a) = Response::Alloc(a).for_version(Version::new(1, 4)) else { unreachable!() };
    assert_eq!(a.grant, None);
}

#[test]
fn region_node_trailers_are_pinned() {
    // 1.8: the node of the region a `Free`, `Export` or `Register` names trails the
    // frozen body as 8 raw bytes; without it the body is the 1.7 one, byte for byte.
    let node = NodeId([8, 7, 6, 5, 4, 3, 2, 1]);
    let free = |node| {
        let mut body = Vec::new();
        encode_body(&Message::Request(Request::Free(FreeRequest { region: 300, node })), &mut body).unwrap();
        body
    };
    let (old, new) = (free(None), free(Some(node)));
    assert_eq!(old, [0xac, 0x02], "300 as a varint");
    assert_eq!(&new[..2], &old[..]);
    assert_eq!(&new[2..], &node.0);
    assert_eq!(
        decode_request(Opcode::Free, &new).unwrap(),
        Request::Free(FreeRequest { region: 300, node: Some(node) })
    );
    assert_eq!(decode_request(Opcode::Free, &old).unwrap(), Request::Free(FreeRequest { region: 300, node: None }));
    assert!(matches!(decode_request(Opcode::Free, &new[..9]), Err(BodyError::TrailingBytes { extra: 7, .. })));
    let register = |node| {
        let req = RegisterRequest {
            device: DeviceName::new("g").unwrap(),
            source: RegisterSource::Region(1),
            offset: 0,
            len: 1,
            access: AccessMode::ReadWrite,
            node,
        };
        let mut body = Vec::new();
        encode_body(&Message::Request(Request::Register(req)), &mut body).unwrap();
        body
    };
    let (old, new) = (register(None), register(Some(node)));
    assert_eq!(&new[..old.len()], &old[..]);
    assert_eq!(&new[old.len()..], &node.0);
    let Request::Register(r) = decode_request(Opcode::Register, &new).unwrap() else { unreachable!() };
    assert_eq!(r.node, Some(node));
}

#[test]
fn adopt_object_encoding_is_pinned() {
    let adopt = |object| {
        let target = AllocTarget::Resource(ResourceName {
            device: DeviceName::new("g").unwrap(),
            memory: MemoryClass::Hbm,
            ordinal: 0,
        });
        let mut body = Vec::new();
        encode_body(&Message::Request(Request::Adopt(AdoptRequest { target, size: 2, object })), &mut body).unwrap();
        body
    };
    let fd = adopt(ObjectKind::CudaPosixFd);
    // The 1.3 form is unchanged: the kind is the last byte, 0.
    assert_eq!(fd.last(), Some(&0));
    let mut bytes = [0u8; 64];
    bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let fabric = adopt(ObjectKind::CudaFabric(FabricHandleBytes(bytes)));
    // 1.4: kind 1, then the 64 bytes raw (no length prefix).
    assert_eq!(&fabric[..fd.len() - 1], &fd[..fd.len() - 1]);
    assert_eq!(fabric[fd.len() - 1], 1);
    assert_eq!(&fabric[fd.len()..], &bytes[..]);
    let short = &fabric[..fabric.len() - 1];
    assert!(decode_request(Opcode::Adopt, short).is_err(), "63 bytes of handle");
    assert_eq!(format!("{:?}", FabricHandleBytes(bytes)), "FabricHandleBytes(..)");
    assert_eq!(ObjectKind::CudaFabric(FabricHandleBytes(bytes)).since(), Version::new(1, 4));
}

#[test]
fn a_node_links_data_frames_are_no_clients_requests() {
    // Decoded as a client's request or answer: refused, whatever the body.
    let h = decode_header(&bytes(&raw(Opcode::PeerData.code(), 0, 0, 3))).unwrap();
    assert_eq!(decode_body(&h, &[1, 2, 3]), Err(BodyError::PeerOnly { opcode: Opcode::PeerData }));
    let h = decode_header(&bytes(&raw(Opcode::PeerData.code(), 0x1, 0, 0))).unwrap();
    assert_eq!(decode_body(&h, &[]), Err(BodyError::PeerOnly { opcode: Opcode::PeerData }));
    // Its limit is a chunk's, apart from the control operations' 256 bytes.
    assert_eq!(Opcode::PeerData.max_body(FrameKind::Request), fabric_proto::wire::PEER_DATA_BODY);
    const { assert!(fabric_proto::wire::PEER_DATA_BODY > fabric_proto::wire::PEER_DATA_CHUNK) };
    assert_eq!(Opcode::Copy.max_body(FrameKind::Request), 256);
}
