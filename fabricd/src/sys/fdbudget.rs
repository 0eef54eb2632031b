//! How the daemon's open-file table (`RLIMIT_NOFILE`) is shared, so that no client, uid or
//! set of uids can fill it: descriptors kept back for the daemon itself, the connections
//! it serves (at most half of the rest), and descriptors that objects keep while they live
//! (an adopted CUDA export, a DMA registration's pinned file or pidfd), counted per uid, per
//! connection and for all uids together, with a share only root and the daemon's own uid
//! may use.
//!
//! Without it, every adopted object and registration kept a descriptor limited only by
//! `limits.objects_per_uid` (4,096): five uids filled a 20,000-descriptor table and root
//! could no longer connect.

/// Descriptors one connection holds: its socket and its thread's current-thread runtime
/// (an epoll instance and the duplicate tokio's I/O driver keeps of it, the eventfd that
/// wakes it, and the duplicate of tokio's signal pipe every I/O driver registers: 5 in
/// all, counted in `/proc/PID/fd` by `tests/daemon_hostile.rs`), plus one a read brings
/// (each `recvmsg` makes room for one: `inbox.rs`) and one an answer sends (a region's
/// file).
pub const FDS_PER_CONNECTION: u64 = 7;
/// Descriptors kept back from connections and objects: the journal, its lock and
/// segments, the log, the listener, metrics connections (64, `http::MAX_CONNECTIONS`), the copy engine's kept region
/// files (256), device files (DAX, BARs, VFIO), the uevent socket.
pub const RESERVED_FDS: u64 = 512;

/// The table's shares (`u64::MAX` for a share the limit does not bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Connections served at once.
    pub clients: u32,
    /// Descriptors objects may keep, all uids together (root's and the daemon's count).
    pub held: u64,
    /// Of `held`, what uids other than root and the daemon's own may keep together: the
    /// rest (an eighth) is theirs alone, so they can always work.
    pub held_unprivileged: u64,
    /// What one uid other than root and the daemon's may keep.
    pub held_per_uid: u64,
    /// What one connection's session may keep, whoever's.
    pub held_per_connection: u64,
}

impl Budget {
    /// No open-file limit: only `clients` bounds anything.
    pub const fn unlimited(clients: u32) -> Self {
        Self {
            clients,
            held: u64::MAX,
            held_unprivileged: u64::MAX,
            held_per_uid: u64::MAX,
            held_per_connection: u64::MAX,
        }
    }
}

/// The shares of `open_files` (`None`: unlimited) with `clients` configured
/// (`limits.clients`): after [`RESERVED_FDS`], connections get at most half (as many as
/// that holds up to `clients`, at least one); objects get the rest, an eighth of it kept
/// for root and the daemon's uid; one other uid may keep an eighth of the others' share,
/// and one connection as much as one uid.
pub fn budget(clients: u32, open_files: Option<u64>) -> Budget {
    let Some(limit) = open_files else { return Budget::unlimited(clients) };
    let available = limit.saturating_sub(RESERVED_FDS);
    let fit = available / 2 / FDS_PER_CONNECTION;
    let clients = u32::try_from(fit).unwrap_or(u32::MAX).clamp(1, clients.max(1));
    let held = available.saturating_sub(u64::from(clients) * FDS_PER_CONNECTION);
    let held_unprivileged = held - held / 8;
    let held_per_uid = held_unprivileged / 8;
    Budget { clients, held, held_unprivileged, held_per_uid, held_per_connection: held_per_uid }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_the_open_file_limit() {
        // The systemd unit's LimitNOFILE: every configured client, and room for objects
        // that objects_per_uid (4,096) binds before the uid's share does.
        let b = budget(1024, Some(65_536));
        assert_eq!(b.clients, 1024);
        assert_eq!(b.held, 65_536 - 512 - 1024 * 7);
        assert_eq!((b.held_unprivileged, b.held_per_uid), (50_624, 6_328));
        assert_eq!(b.held_per_connection, b.held_per_uid);
        // The common soft default: half of what is left after the reserve for connections.
        let b = budget(1024, Some(1024));
        assert_eq!((b.clients, b.held), (36, 512 - 36 * 7));
        // The table of the attack: five uids at their share leave most of it.
        let b = budget(1024, Some(20_000));
        assert!(5 * b.held_per_uid < b.held_unprivileged);
        // Never no client; a configured number below what fits is kept.
        assert_eq!(budget(1024, Some(16)).clients, 1);
        assert_eq!(budget(8, Some(1 << 20)).clients, 8);
        assert_eq!(budget(1024, None), Budget::unlimited(1024));
    }

    #[test]
    fn no_share_overflows_the_table() {
        for limit in [0, 1, 512, 513, 600, 1024, 4096, 20_000, 65_536, 1 << 20, u64::MAX] {
            for clients in [1, 8, 1024, u32::MAX] {
                let b = budget(clients, Some(limit));
                let used =
                    RESERVED_FDS.saturating_add(u64::from(b.clients) * FDS_PER_CONNECTION).saturating_add(b.held);
                assert!(used <= limit.max(RESERVED_FDS + FDS_PER_CONNECTION), "{limit} {clients}: {b:?}");
                assert!(b.held_per_uid <= b.held_unprivileged && b.held_unprivileged <= b.held);
            }
        }
    }
}
