//! Who may do what: the admin check for partition changes. Identity comes only from what
//! the kernel recorded when the client connected (`SO_PEERCRED`, `SO_PEERGROUPS`; see
//! [`crate::transport::peer`]), never from `/proc`, whose pid may since name another process.

use crate::memory::Identity;

/// Whether `who` may run admin operations: uid 0, or `admin_gid` as the primary group or
/// among the supplementary `groups` (those of the connection, fixed at connect).
pub fn is_admin(who: &Identity, admin_gid: Option<u32>, groups: &[u32]) -> bool {
    if who.uid == 0 {
        return true;
    }
    let Some(gid) = admin_gid else { return false };
    who.gid == gid || groups.contains(&gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(uid: u32, gid: u32) -> Identity {
        Identity { pid: 1, uid, gid }
    }

    #[test]
    fn root_primary_and_supplementary_admins_pass_others_do_not() {
        assert!(is_admin(&cred(0, 0), None, &[]));
        assert!(!is_admin(&cred(1000, 1000), None, &[1000, 4242]));
        assert!(is_admin(&cred(1000, 4242), Some(4242), &[]));
        assert!(is_admin(&cred(1000, 1000), Some(4242), &[27, 4242]));
        assert!(!is_admin(&cred(1000, 1000), Some(4242), &[27, 100]));
    }
}
