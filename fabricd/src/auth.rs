//! Who may do what: the admin check for partition changes. Identity comes only from
//! `SO_PEERCRED`; supplementary groups are read from `/proc/<pid>/status`.

use fabric_proto::wire::PeerCred;

/// Whether `cred` may run admin operations: uid 0, or `admin_gid` as the primary group or
/// among the supplementary `groups` (asked for only when needed).
pub fn is_admin(cred: &PeerCred, admin_gid: Option<u32>, groups: impl FnOnce() -> Vec<u32>) -> bool {
    if cred.uid == 0 {
        return true;
    }
    let Some(gid) = admin_gid else { return false };
    cred.gid == gid || groups().contains(&gid)
}

/// The supplementary groups in a `/proc/<pid>/status` text (`Groups:` line).
pub fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|v| v.split_whitespace().filter_map(|g| g.parse().ok()).collect())
        .unwrap_or_default()
}

/// The supplementary groups of process `pid`, or none when it cannot be read (the process
/// exited): a check then falls back to the primary gid only.
pub fn proc_groups(pid: i32) -> Vec<u32> {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(s) => parse_groups(&s),
        Err(e) => {
            tracing::debug!(pid, error = %e, "cannot read the peer's supplementary groups");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(uid: u32, gid: u32) -> PeerCred {
        PeerCred { pid: 1, uid, gid }
    }

    #[test]
    fn root_primary_and_supplementary_admins_pass_others_do_not() {
        assert!(is_admin(&cred(0, 0), None, Vec::new));
        assert!(!is_admin(&cred(1000, 1000), None, || vec![1000, 4242]));
        assert!(is_admin(&cred(1000, 4242), Some(4242), Vec::new));
        assert!(is_admin(&cred(1000, 1000), Some(4242), || vec![27, 4242]));
        assert!(!is_admin(&cred(1000, 1000), Some(4242), || vec![27, 100]));
    }

    #[test]
    fn groups_line_parses() {
        let s = "Name:\tbash\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 27 1000 \nNgid:\t0\n";
        assert_eq!(parse_groups(s), vec![4, 24, 27, 1000]);
        assert_eq!(parse_groups("Groups:\t\n"), Vec::<u32>::new());
        assert_eq!(parse_groups("Name: x\n"), Vec::<u32>::new());
    }
}
