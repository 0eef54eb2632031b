//! The bodies of the cross-node operations carried by the node link's request envelope
//! (postcard, read whole, every name checked): an importer's [`ImportAsk`] and the owner's
//! [`ImportGrant`] (for a vendor object, [`ObjectGrant`]), [`ReleaseAsk`], and the owner's
//! [`RevokeNotice`] to an importer node. Each fits its opcode's peer limit (256 bytes; a
//! grant 1 KiB). A copy chunk ([`CopyAsk`]) is a data frame: its small header, then
//! the bytes it writes (the answer to a read is the bytes).

use fabric_nodelink::{PeerError, PeerOp, PeerRequest, PeerResponse};
use fabric_proto::wire::{AccessMode, ObjectKind, Revocation};
use fabric_topology::MemoryKind;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The most partition names an [`ImportAsk`] claims.
pub const MAX_CLAIMS: usize = 2;

/// The longest name a body carries (a partition, a resource directory, a file).
pub const MAX_NAME: usize = 64;

/// An importer node asks the owner for a region by handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportAsk {
    /// The handle's region, generation and secret.
    pub region: u64,
    /// Its generation.
    pub generation: u64,
    /// Its secret (compared in constant time by the owner).
    pub secret: [u8; 16],
    /// The access asked for.
    pub access: AccessMode,
    /// The importing client's uid and gid on its node (used only where identities are
    /// shared across the domain).
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// The partitions the importing client is bound to on its node, as its node vouches.
    pub partitions: Vec<String>,
}

/// Where the region's bytes are on the shared sim fabric: `<shared_dir>/<owner>/<resource>/<file>`,
/// the owner's node name being the one the importer dialled, never the grant's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedFile {
    /// The resource's directory name.
    pub resource: String,
    /// The region file's name.
    pub file: String,
}

/// The most members a [`SharedCxl`] names (CXL's widest interleave).
pub const MAX_WAYS: usize = 16;

/// One member of a [`SharedCxl`] set: what names it on every host that reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlMember {
    /// The memory device's serial (its PCIe DSN): the same on every host.
    pub serial: u64,
    /// The kind of its capacity the set uses.
    pub kind: MemoryKind,
    /// Its ordinal among the device's resources of that kind.
    pub ordinal: u16,
}

/// A range of an interleave set of CXL memory that other hosts reach too (a device shared
/// by several hosts, or a multi-headed one), named by what is the same on every host: the
/// members in position order, the set's granularity and the range's offset in the set —
/// so the same DPAs of the same devices wherever it is mapped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedCxl {
    /// The members, in position order.
    pub members: Vec<CxlMember>,
    /// The set's interleave granularity.
    pub granularity: u64,
    /// The region's offset in the set.
    pub set_offset: u64,
}

/// Where an importer node reaches a granted region's bytes itself, with no copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Shared {
    /// Its file on the shared sim fabric.
    File(SharedFile),
    /// A range of shared CXL memory, through the importer's own DAX device over the same
    /// members.
    Cxl(SharedCxl),
}

/// The owner's grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportGrant {
    /// The owner's import id (what a release and a revocation name).
    pub import: u64,
    /// The region.
    pub region: u64,
    /// Its generation.
    pub generation: u64,
    /// Its bytes.
    pub len: u64,
    /// Its first byte's offset in the owner's file.
    pub offset: u64,
    /// Its GFA in the domain.
    pub gfa: Option<u64>,
    /// Where the importer reaches it itself; `None` (or a place the importer does not
    /// reach: it shares no fabric with the owner): copy-only, reached by [`CopyAsk`].
    pub shared: Option<Shared>,
}

/// One chunk of a copy between nodes, read from or written to the owner's region at
/// `gfa`, through `import` (the owner's import id, held by the asking node's incarnation).
/// On the wire the header is followed by the `len` bytes of a write; a read is answered
/// with the `len` bytes alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyAsk {
    /// The owner's import id.
    pub import: u64,
    /// The chunk's first byte, inside the imported region.
    pub gfa: u64,
    /// Its bytes: 1 to [`fabric_proto::wire::PEER_DATA_CHUNK`].
    pub len: u32,
    /// Whether the chunk writes (its bytes follow) or reads.
    pub write: bool,
}

/// The owner's grant of a vendor memory object to a node of the same NVLink domain: the
/// object itself (a CUDA fabric handle: bytes the importer's driver imports, never a
/// descriptor of the owner's host) and the GPU it lies on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectGrant {
    /// The owner's import id (what a release and a revocation name).
    pub import: u64,
    /// The region.
    pub region: u64,
    /// Its generation.
    pub generation: u64,
    /// Bytes of the object.
    pub size: u64,
    /// Its GFA in the domain.
    pub gfa: Option<u64>,
    /// The object.
    pub object: ObjectKind,
    /// The GPU whose memory it is (its fabric identity, `uuid:GPU-…` on real hosts).
    pub device: String,
}

/// The longest device name an [`ObjectGrant`] carries (the client protocol's bound).
pub const MAX_DEVICE: usize = 256;

/// An importer node releases an import the owner granted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseAsk {
    /// The owner's import id.
    pub import: u64,
}

/// The owner tells an importer node that an import it granted ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeNotice {
    /// The revocation, naming the owner's import id.
    pub revocation: Revocation,
}

/// A name a body may carry: 1 to [`MAX_NAME`] of `[A-Za-z0-9._-]`, not `.` or `..` (so a
/// resource or file name is one path component, never a way out of its directory).
pub fn check_name(what: &str, name: &str) -> Result<(), PeerError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(PeerError::Refused(format!("{what}: not a name"))) }
}

impl ImportAsk {
    /// Checks the names it carries.
    pub fn check(&self) -> Result<(), PeerError> {
        if self.partitions.len() > MAX_CLAIMS {
            return Err(PeerError::Refused(format!("more than {MAX_CLAIMS} partitions claimed")));
        }
        self.partitions.iter().try_for_each(|p| check_name("partition", p))
    }
}

impl ImportGrant {
    /// Checks what it carries: names that are one path component each; a CXL set of 1 to
    /// [`MAX_WAYS`] CXL members, a legal granularity and a range that does not wrap.
    pub fn check(&self) -> Result<(), PeerError> {
        match &self.shared {
            None => Ok(()),
            Some(Shared::File(f)) => {
                check_name("resource", &f.resource)?;
                check_name("file", &f.file)
            }
            Some(Shared::Cxl(c)) => {
                let cxl = |k: MemoryKind| {
                    matches!(k, MemoryKind::CxlVolatile | MemoryKind::CxlPersistent | MemoryKind::CxlDynamic)
                };
                if c.members.is_empty() || c.members.len() > MAX_WAYS || !c.members.iter().all(|m| cxl(m.kind)) {
                    return Err(PeerError::Refused(format!(
                        "a CXL set of {} members, not 1 to {MAX_WAYS} of CXL memory",
                        c.members.len()
                    )));
                }
                if !c.granularity.is_power_of_two() || !(256..=16384).contains(&c.granularity) {
                    return Err(PeerError::Refused(format!("interleave granularity {}", c.granularity)));
                }
                if c.set_offset.checked_add(self.len).is_none() {
                    return Err(PeerError::Refused("a CXL range past the end of the address space".into()));
                }
                Ok(())
            }
        }
    }
}

impl CopyAsk {
    /// The request of this chunk with the bytes it writes (`data` empty for a read).
    pub fn request(&self, data: &[u8]) -> PeerRequest {
        let mut body = postcard::to_stdvec(self).unwrap_or_default();
        body.extend_from_slice(data);
        PeerRequest { op: PeerOp::Copy, body }
    }

    /// The chunk a body asks for and the bytes it writes, checked: a length of 1 to
    /// [`fabric_proto::wire::PEER_DATA_CHUNK`], exactly that many bytes after a write's
    /// header and none after a read's.
    pub fn decode(body: &[u8]) -> Result<(Self, &[u8]), PeerError> {
        let (ask, data) = postcard::take_from_bytes::<CopyAsk>(body)
            .map_err(|e| PeerError::Refused(format!("copy header does not decode: {e}")))?;
        if ask.len == 0 || ask.len > fabric_proto::wire::PEER_DATA_CHUNK {
            return Err(PeerError::Refused(format!("a copy chunk of {} bytes", ask.len)));
        }
        let want = if ask.write { ask.len as usize } else { 0 };
        if data.len() != want {
            return Err(PeerError::Refused(format!("{} bytes after a copy header that wants {want}", data.len())));
        }
        Ok((ask, data))
    }
}

impl ObjectGrant {
    /// Checks what it carries: an object that is bytes (a descriptor cannot cross hosts)
    /// and a device name within bounds.
    pub fn check(&self) -> Result<(), PeerError> {
        if self.object.is_descriptor() {
            return Err(PeerError::Refused(format!("a {} cannot cross nodes", self.object.name())));
        }
        if self.device.is_empty() || self.device.len() > MAX_DEVICE {
            return Err(PeerError::Refused("device: not a device name".into()));
        }
        Ok(())
    }
}

/// The request envelope of `op` with `body`.
pub fn request<T: Serialize>(op: PeerOp, body: &T) -> PeerRequest {
    PeerRequest { op, body: postcard::to_stdvec(body).unwrap_or_default() }
}

/// The response envelope of `op` with `body`.
pub fn response<T: Serialize>(op: PeerOp, body: &T) -> PeerResponse {
    PeerResponse { op, body: postcard::to_stdvec(body).unwrap_or_default() }
}

/// The owner's import id an [`ImportGrant`] or [`ObjectGrant`] body carries (the first
/// field of both), for giving back a grant that came too late to be used.
pub fn granted_import(body: &[u8]) -> Option<u64> {
    postcard::take_from_bytes::<u64>(body).ok().map(|(import, _)| import)
}

/// The whole of `body` as one `T`, no byte left over.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, PeerError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| PeerError::Refused(format!("body does not decode: {e}")))?;
    if rest.is_empty() { Ok(value) } else { Err(PeerError::Refused(format!("{} bytes after the body", rest.len()))) }
}

#[cfg(test)]
mod tests {
    use fabric_nodelink::{PEER_DECODER, PeerMessage};
    use fabric_proto::wire::RevocationReason;

    use super::*;

    fn fits(message: PeerMessage) {
        let mut out = Vec::new();
        message.encode(1, &mut out).expect("fits its opcode's limit");
        assert!(out.len() as u32 <= PEER_DECODER.max_body + 32);
    }

    /// Both grants carry the owner's import id first, where a late answer finds it.
    #[test]
    fn a_grants_import_id_is_read_from_either_kind_of_grant() {
        let import = ImportGrant {
            import: 300,
            region: 5,
            generation: 5,
            len: 1 << 21,
            offset: 0,
            gfa: Some(1 << 40),
            shared: None,
        };
        assert_eq!(granted_import(&response(PeerOp::Import, &import).body), Some(300));
        let object = ObjectGrant {
            import: 1 << 40,
            region: 5,
            generation: 5,
            size: 1 << 21,
            gfa: None,
            object: ObjectKind::CudaFabric(fabric_proto::wire::FabricHandleBytes([1; 64])),
            device: "uuid:GPU-1".into(),
        };
        assert_eq!(granted_import(&response(PeerOp::ImportObject, &object).body), Some(1 << 40));
        assert_eq!(granted_import(&[]), None);
    }

    #[test]
    fn the_largest_bodies_fit_their_frames_and_round_trip() {
        let long = "p".repeat(MAX_NAME);
        let ask = ImportAsk {
            region: u64::MAX,
            generation: u64::MAX,
            secret: [0xff; 16],
            access: AccessMode::ReadWrite,
            uid: u32::MAX,
            gid: u32::MAX,
            partitions: vec![long.clone(); MAX_CLAIMS],
        };
        assert_eq!(ask.check(), Ok(()));
        fits(PeerMessage::Request(request(PeerOp::Import, &ask)));
        assert_eq!(decode::<ImportAsk>(&request(PeerOp::Import, &ask).body), Ok(ask));
        let grant = ImportGrant {
            import: u64::MAX,
            region: u64::MAX,
            generation: u64::MAX,
            len: u64::MAX,
            offset: u64::MAX,
            gfa: Some(u64::MAX),
            shared: Some(Shared::File(SharedFile { resource: long.clone(), file: long })),
        };
        fits(PeerMessage::Response(response(PeerOp::Import, &grant)));
        let member = CxlMember { serial: u64::MAX, kind: MemoryKind::CxlPersistent, ordinal: u16::MAX };
        let cxl = SharedCxl { members: vec![member; MAX_WAYS], granularity: 16384, set_offset: u64::MAX - (1 << 40) };
        let grant = ImportGrant { shared: Some(Shared::Cxl(cxl)), ..grant };
        assert_eq!(grant.check(), Err(PeerError::Refused("a CXL range past the end of the address space".into())));
        let grant = ImportGrant { len: 1 << 40, ..grant };
        assert_eq!(grant.check(), Ok(()));
        fits(PeerMessage::Response(response(PeerOp::Import, &grant)));
        assert_eq!(decode::<ImportGrant>(&response(PeerOp::Import, &grant).body), Ok(grant));
        let object = ObjectGrant {
            import: u64::MAX,
            region: u64::MAX,
            generation: u64::MAX,
            size: u64::MAX,
            gfa: Some(u64::MAX),
            object: ObjectKind::CudaFabric(fabric_proto::wire::FabricHandleBytes([0xff; 64])),
            device: "d".repeat(MAX_DEVICE),
        };
        assert_eq!(object.check(), Ok(()));
        fits(PeerMessage::Response(response(PeerOp::ImportObject, &object)));
        assert_eq!(decode::<ObjectGrant>(&response(PeerOp::ImportObject, &object).body), Ok(object));
        let chunk = fabric_proto::wire::PEER_DATA_CHUNK;
        let ask = CopyAsk { import: u64::MAX, gfa: u64::MAX, len: chunk, write: true };
        let data = vec![7u8; chunk as usize];
        fits(PeerMessage::Request(ask.request(&data)));
        assert_eq!(CopyAsk::decode(&ask.request(&data).body), Ok((ask, &data[..])));
        // A full chunk is a data frame: as a control operation's body it is refused.
        let mut out = Vec::new();
        let control = PeerMessage::Request(PeerRequest { op: PeerOp::Release, body: data });
        assert!(control.encode(1, &mut out).is_err());
        let notice = RevokeNotice {
            revocation: Revocation { region: 1, generation: 2, import: 3, reason: RevocationReason::Freed },
        };
        fits(PeerMessage::Request(request(PeerOp::Revoke, &notice)));
    }

    proptest::proptest! {
        /// Any bytes a peer sends: never a panic; whatever decodes and passes its checks
        /// encodes back to a body that decodes to the same value, and a checked grant's
        /// names are one plain path component each (never a way out of the shared dir).
        #[test]
        fn any_body_decodes_or_is_refused_and_checked_names_stay_in_their_directory(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            if let Ok(ask) = decode::<ImportAsk>(&body) {
                proptest::prop_assert_eq!(decode::<ImportAsk>(&request(PeerOp::Import, &ask).body), Ok(ask.clone()));
                let _ = ask.check();
            }
            if let Ok(grant) = decode::<ImportGrant>(&body) {
                if grant.check().is_ok() && let Some(Shared::File(f)) = &grant.shared {
                    for name in [&f.resource, &f.file] {
                        let mut parts = std::path::Path::new(name).components();
                        proptest::prop_assert!(matches!(parts.next(), Some(std::path::Component::Normal(_))));
                        proptest::prop_assert!(parts.next().is_none());
                    }
                }
                proptest::prop_assert_eq!(decode::<ImportGrant>(&response(PeerOp::Import, &grant).body), Ok(grant));
            }
            if let Ok(object) = decode::<ObjectGrant>(&body) {
                if object.check().is_ok() {
                    proptest::prop_assert!(!object.object.is_descriptor());
                }
                proptest::prop_assert_eq!(decode::<ObjectGrant>(&response(PeerOp::ImportObject, &object).body), Ok(object));
            }
            let _ = decode::<ReleaseAsk>(&body);
            let _ = decode::<RevokeNotice>(&body);
            if let Ok((ask, data)) = CopyAsk::decode(&body) {
                let want = if ask.write { ask.len as usize } else { 0 };
                proptest::prop_assert!(ask.len > 0 && data.len() == want);
            }
        }
    }

    #[test]
    fn names_that_leave_their_directory_and_trailing_bytes_are_refused() {
        for bad in ["", ".", "..", "a/b", "../x", "a\0", &"x".repeat(MAX_NAME + 1)] {
            assert!(check_name("file", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("file", "r12").is_ok());
        let mut body = postcard::to_stdvec(&ReleaseAsk { import: 5 }).unwrap();
        body.push(0);
        assert!(decode::<ReleaseAsk>(&body).is_err());
        let read = CopyAsk { import: 1, gfa: 2, len: 3, write: false };
        assert!(CopyAsk::decode(&read.request(&[0]).body).is_err(), "a read carries no bytes");
        let write = CopyAsk { write: true, ..read };
        assert!(CopyAsk::decode(&write.request(&[0, 0]).body).is_err(), "a write carries exactly len bytes");
        let huge = CopyAsk { len: fabric_proto::wire::PEER_DATA_CHUNK + 1, ..read };
        assert!(CopyAsk::decode(&huge.request(&[]).body).is_err());
        assert!(CopyAsk::decode(&CopyAsk { len: 0, ..read }.request(&[]).body).is_err());
    }
}
