//! This daemon's node id — drawn at random on first start and kept in the state directory
//! (`node-id`), so that it and every handle it made survive restarts — and the check that
//! the handle or region a request names is this node's, or why not (`docs/protocol.md`,
//! "Node identities").

use std::io::Read;
use std::path::{Path, PathBuf};

use fabric_proto::wire::{
    ErrorBody, ErrorCode, ErrorDetail, ErrorText, ExportHandle, NODE_IDENTITIES, NodeId, QUALIFIED_REGIONS,
    RegisterSource, Request, Version,
};

/// The file in the state directory: the id's 16 hex digits and a newline.
pub const FILE_NAME: &str = "node-id";

/// The most bytes read from the file (the id, a newline and some slack for editors).
const MAX_FILE_LEN: u64 = 64;

/// Why the node id could not be read or made.
#[derive(Debug, thiserror::Error)]
pub enum NodeIdFileError {
    /// The file exists but could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file does not hold an id. It is not replaced: a new id would orphan every
    /// handle the old one named.
    #[error("{path} does not hold a node id (16 hex digits); restore it or remove it to draw a new one")]
    Malformed {
        /// The file.
        path: PathBuf,
    },
    /// No random bytes for a new id.
    #[error("drawing a node id from /dev/urandom")]
    Random(#[source] std::io::Error),
    /// The new id could not be saved.
    #[error("saving the node id")]
    Save(#[source] crate::journal::JournalError),
}

/// The node id kept in `state_dir` (the daemon's private directory), drawn and saved (all
/// or nothing) when there is none yet.
pub fn load_or_create(state_dir: &Path) -> Result<NodeId, NodeIdFileError> {
    let path = state_dir.join(FILE_NAME);
    match crate::sys::privdir::open_nofollow(&path, false) {
        Ok(f) => {
            let mut text = String::new();
            f.take(MAX_FILE_LEN)
                .read_to_string(&mut text)
                .map_err(|source| NodeIdFileError::Read { path: path.clone(), source })?;
            text.trim_end().parse::<NodeId>().map_err(|_| NodeIdFileError::Malformed { path })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = NodeId(crate::sys::random_bytes().map_err(NodeIdFileError::Random)?);
            crate::journal::sys::create_whole(state_dir, &path, format!("{id}\n").as_bytes())
                .map_err(NodeIdFileError::Save)?;
            tracing::info!(node = %id, file = %path.display(), "drew this node's id");
            Ok(id)
        }
        Err(source) => Err(NodeIdFileError::Read { path, source }),
    }
}

/// Checks the node that `req` names, if any, against this node, `local`, for a
/// connection that negotiated `version`: the handle of `Import`, `ImportObject` and
/// `Revoke` (`check_handle`) and the region of `Free`, `Export` and `Register`
/// (`check_region`). Where this node `asks_owners` (a domain node with a node link), an
/// import of another node's handle passes: the dispatch asks that node
/// (`crate::peer::importer`); a revocation is only ever its owner's.
pub fn check_node(local: NodeId, req: &Request, version: Version, asks_owners: bool) -> Result<(), ErrorBody> {
    match req {
        Request::Import(i) | Request::ImportObject(i) => match i.handle.node {
            Some(node) if asks_owners && node != local && version >= NODE_IDENTITIES => Ok(()),
            _ => check_handle(local, &i.handle, version),
        },
        Request::Revoke(r) => check_handle(local, &r.handle, version),
        Request::Free(f) => check_region(local, f.region, f.node, version),
        Request::Export(e) => check_region(local, e.region, e.node, version),
        Request::Register(r) => match r.source {
            RegisterSource::Region(id) => check_region(local, id, r.node, version),
            _ if r.node.is_some() => {
                refuse(ErrorCode::BadRequest, "a registration names a node only for a region source".to_owned(), None)
            }
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

fn refuse(code: ErrorCode, message: String, detail: Option<ErrorDetail>) -> Result<(), ErrorBody> {
    Err(ErrorBody { code, message: ErrorText::truncated(&message), detail })
}

/// A handle:
/// - before 1.5 it is node-less and means this node; one that names a node (bytes an
///   older client cannot have meant) is a bad request;
/// - since 1.5 it must name a node: this one is served, another is refused with
///   `WrongNode` naming it (unless [`check_node`] was told this node asks owners), and a
///   node-less
///   (`fbh1`) handle is a bad request, so that no handle is ever taken for this node's by
///   default.
fn check_handle(local: NodeId, handle: &ExportHandle, version: Version) -> Result<(), ErrorBody> {
    match handle.node {
        None if version < NODE_IDENTITIES => Ok(()),
        Some(_) if version < NODE_IDENTITIES => refuse(
            ErrorCode::BadRequest,
            format!("a handle that names its node needs protocol {NODE_IDENTITIES}; this connection speaks {version}"),
            None,
        ),
        None => refuse(
            ErrorCode::BadRequest,
            format!(
                "a node-less (fbh1) handle: since protocol {NODE_IDENTITIES} a handle names its node (this is node {local})"
            ),
            None,
        ),
        Some(node) if node == local => Ok(()),
        Some(node) => refuse(
            ErrorCode::WrongNode,
            format!(
                "the handle names node {node}; this is node {local}, which has no node link to ask it (a domain node with [peer] credentials imports across nodes)"
            ),
            Some(ErrorDetail::Node { node }),
        ),
    }
}

/// The region `id` of a request about a session's own region, with the node it names:
/// - a bare id (every version) is this node's: a session's regions live on the daemon
///   it is connected to, and every client older than 1.8 sends them so;
/// - since 1.8 it may name its node: this one is served, another is refused with
///   `WrongNode` naming it, before anything is looked up — so that an id a client got
///   from another daemon never acts on this one's region of the same number;
/// - before 1.8 a node is bytes the client cannot have meant: a bad request.
fn check_region(local: NodeId, id: u64, node: Option<NodeId>, version: Version) -> Result<(), ErrorBody> {
    match node {
        None => Ok(()),
        Some(_) if version < QUALIFIED_REGIONS => refuse(
            ErrorCode::BadRequest,
            format!(
                "a region that names its node needs protocol {QUALIFIED_REGIONS}; this connection speaks {version}"
            ),
            None,
        ),
        Some(node) if node == local => Ok(()),
        Some(node) => refuse(
            ErrorCode::WrongNode,
            format!(
                "region {id} is node {node}'s; this is node {local} (a region is freed, exported and registered through the daemon that owns it)"
            ),
            Some(ErrorDetail::Node { node }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use fabric_proto::wire::{AccessMode, ExportHandle, ImportRequest, RevokeRequest, Secret};

    use super::*;

    const HERE: NodeId = NodeId([1; 8]);
    const THERE: NodeId = NodeId([2; 8]);

    fn import(node: Option<NodeId>) -> Request {
        let handle = ExportHandle { node, region: 1, generation: 1, secret: Secret([0; 16]) };
        Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly })
    }

    fn code(r: Result<(), ErrorBody>) -> Option<ErrorCode> {
        r.err().map(|e| e.code)
    }

    #[test]
    fn every_pair_of_version_and_handle_node_has_one_answer() {
        let old = Version::new(1, 4);
        let new = NODE_IDENTITIES;
        assert_eq!(code(check_node(HERE, &import(None), old, false)), None, "1.4: node-less is local");
        assert_eq!(code(check_node(HERE, &import(Some(HERE)), old, false)), Some(ErrorCode::BadRequest));
        assert_eq!(code(check_node(HERE, &import(Some(THERE)), old, false)), Some(ErrorCode::BadRequest));
        assert_eq!(code(check_node(HERE, &import(Some(HERE)), new, false)), None);
        assert_eq!(code(check_node(HERE, &import(None), new, false)), Some(ErrorCode::BadRequest));
        let wrong = check_node(HERE, &import(Some(THERE)), new, false).unwrap_err();
        assert_eq!(wrong.code, ErrorCode::WrongNode);
        assert_eq!(wrong.detail, Some(ErrorDetail::Node { node: THERE }));
        assert!(wrong.message.contains(&THERE.to_string()), "{}", wrong.message);
        let revoke = Request::Revoke(RevokeRequest {
            handle: ExportHandle { node: Some(THERE), region: 1, generation: 1, secret: Secret([0; 16]) },
        });
        assert_eq!(code(check_node(HERE, &revoke, new, false)), Some(ErrorCode::WrongNode));
        assert_eq!(code(check_node(HERE, &Request::Ping, new, false)), None);
        // A node that asks owners passes another node's import on, never its revocation,
        // and never a handle an older connection could not have meant.
        assert_eq!(code(check_node(HERE, &import(Some(THERE)), new, true)), None);
        assert_eq!(code(check_node(HERE, &import(Some(THERE)), old, true)), Some(ErrorCode::BadRequest));
        assert_eq!(code(check_node(HERE, &import(None), new, true)), Some(ErrorCode::BadRequest));
        assert_eq!(code(check_node(HERE, &revoke, new, true)), Some(ErrorCode::WrongNode));
    }

    #[test]
    fn a_region_request_is_this_nodes_when_bare_or_named_so() {
        use fabric_proto::wire::{DeviceName, FreeRequest, RegisterRequest};
        let free = |node| Request::Free(FreeRequest { region: 7, node });
        let register = |source, node| {
            Request::Register(RegisterRequest {
                device: DeviceName::truncated("gpu0"),
                source,
                offset: 0,
                len: 1,
                access: AccessMode::ReadOnly,
                node,
            })
        };
        let (old, new) = (Version::new(1, 7), QUALIFIED_REGIONS);
        for v in [Version::new(1, 0), old, new] {
            assert_eq!(code(check_node(HERE, &free(None), v, false)), None, "{v}: a bare id is this node's");
        }
        assert_eq!(code(check_node(HERE, &free(Some(HERE)), old, false)), Some(ErrorCode::BadRequest));
        assert_eq!(code(check_node(HERE, &free(Some(HERE)), new, false)), None);
        let wrong = check_node(HERE, &free(Some(THERE)), new, false).unwrap_err();
        assert_eq!(wrong.code, ErrorCode::WrongNode);
        assert_eq!(wrong.detail, Some(ErrorDetail::Node { node: THERE }));
        assert!(wrong.message.contains(&THERE.to_string()) && wrong.message.contains("region 7"), "{}", wrong.message);
        let region = register(RegisterSource::Region(7), Some(THERE));
        assert_eq!(code(check_node(HERE, &region, new, false)), Some(ErrorCode::WrongNode));
        assert_eq!(code(check_node(HERE, &register(RegisterSource::Region(7), Some(HERE)), new, false)), None);
        let import = register(RegisterSource::Import(7), Some(HERE));
        assert_eq!(
            code(check_node(HERE, &import, new, false)),
            Some(ErrorCode::BadRequest),
            "only a region has a node"
        );
        assert_eq!(code(check_node(HERE, &register(RegisterSource::Fd, None), new, false)), None);
    }

    #[test]
    fn the_id_is_drawn_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        assert_eq!(load_or_create(dir.path()).unwrap(), first);
        let other = tempfile::tempdir().unwrap();
        assert_ne!(load_or_create(other.path()).unwrap(), first, "two state dirs, two nodes");
        std::fs::write(dir.path().join(FILE_NAME), "not an id\n").unwrap();
        assert!(matches!(load_or_create(dir.path()), Err(NodeIdFileError::Malformed { .. })));
    }
}
