//! Who may link to this node: a live member of the domain at the incarnation its member
//! record states, while this node itself is joined. Answered from the domain view the
//! watch keeps (memory only, never etcd), on the connection's task.

use std::sync::Weak;

use fabric_domain::DomainView;
use fabric_nodelink::{NodeIdentity, PeerPolicy, Refusal};

use crate::tasks::domain::{Domain, Standing};

/// The [`PeerPolicy`] of a domain node.
#[derive(Debug)]
pub struct MemberPolicy {
    domain: Weak<Domain>,
}

impl MemberPolicy {
    /// Over `domain` (weak: the domain owns the listener that owns this).
    pub fn new(domain: Weak<Domain>) -> Self {
        Self { domain }
    }
}

impl PeerPolicy for MemberPolicy {
    fn admit(&self, node: &NodeIdentity, incarnation: u64) -> Result<(), Refusal> {
        let Some(domain) = self.domain.upgrade() else {
            return Err(Refusal::Unavailable("the daemon is stopping".to_owned()));
        };
        admit(&domain.view(), &domain.status().standing, &node.node, incarnation)
    }
}

/// The decision: this node must be joined (a fenced node serves no peer: its view may be
/// stale and its grants would outlive its membership), and `node` must be a member whose
/// record states `incarnation`.
pub fn admit(view: &DomainView, standing: &Standing, node: &str, incarnation: u64) -> Result<(), Refusal> {
    match standing {
        Standing::Joined => {}
        Standing::Fenced(why) => return Err(Refusal::Unavailable(format!("fenced: {why}"))),
        Standing::Unreachable(why) => return Err(Refusal::Unavailable(format!("not joined: {why}"))),
    }
    let member = view.members().find(|m| m.name == node).ok_or_else(|| Refusal::NotMember(node.to_owned()))?;
    if member.incarnation != incarnation {
        return Err(Refusal::StaleIncarnation { node: node.to_owned(), offered: incarnation });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fabric_domain::records::{RECORD_VERSION, encode};
    use fabric_domain::{Keys, MemberRecord, RecordLimits};

    use super::*;

    fn view(members: &[(&str, u64)]) -> DomainView {
        let keys = Keys::new("lab");
        let records: Vec<(Vec<u8>, Vec<u8>)> = members
            .iter()
            .map(|(name, incarnation)| {
                let m = MemberRecord {
                    version: RECORD_VERSION,
                    name: (*name).to_owned(),
                    incarnation: *incarnation,
                    peer_address: "127.0.0.1:7471".to_owned(),
                    capabilities: vec![],
                    groups: vec![],
                    software: "test".to_owned(),
                    node_id: None,
                };
                (keys.member(name).into_bytes(), encode(&m))
            })
            .collect();
        DomainView::load(keys, RecordLimits::default(), records.iter().map(|(k, v)| (&k[..], &v[..])), 1)
    }

    #[test]
    fn only_a_member_at_its_current_incarnation_is_admitted_by_a_joined_node() {
        let v = view(&[("n1", 7), ("n2", 9)]);
        assert_eq!(admit(&v, &Standing::Joined, "n1", 7), Ok(()));
        assert_eq!(
            admit(&v, &Standing::Joined, "n1", 6),
            Err(Refusal::StaleIncarnation { node: "n1".into(), offered: 6 })
        );
        assert_eq!(admit(&v, &Standing::Joined, "n3", 7), Err(Refusal::NotMember("n3".into())));
        let fenced = admit(&v, &Standing::Fenced("lease lost".into()), "n1", 7);
        assert!(matches!(fenced, Err(Refusal::Unavailable(ref why)) if why.contains("lease lost")), "{fenced:?}");
        assert!(matches!(admit(&v, &Standing::Unreachable("x".into()), "n1", 7), Err(Refusal::Unavailable(_))));
    }
}
