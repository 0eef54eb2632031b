//! The refusal log: every refused request or connection is counted, but only some get a
//! `warn` line of their own, so that a client sending refusals as fast as it can (110–206k
//! a second were measured) cannot flood the log or spend the daemon's time writing it.
//!
//! Refusals are grouped by who and what (uid — and node, for another node of the domain —,
//! operation, error code). The first refusal
//! of a group is logged at once; further ones within [`GROUP_INTERVAL`] are counted, and
//! the next line of that group (or the periodic summary, [`RefusalLog::summarise`]) says
//! how many were not logged. Across all groups at most [`LINES_PER_SECOND`] lines are
//! written a second; the refusals over that budget are counted too, and summarised. The
//! groups kept are bounded ([`MAX_GROUPS`]); refusals of groups beyond it are counted in
//! one overflow count. The decision is a short, I/O-free critical section: the line is
//! written after the lock is released.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A group logs at most one line per this long; refusals in between are counted.
pub const GROUP_INTERVAL: Duration = Duration::from_secs(10);
/// Lines written a second, all groups together.
pub const LINES_PER_SECOND: u32 = 20;
/// Groups remembered at once.
pub const MAX_GROUPS: usize = 4096;
/// The longest refusal message kept for a group's summary.
const MAX_KEPT_MESSAGE: usize = 256;

/// What a refusal is grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Group {
    /// The caller's uid.
    pub uid: u32,
    /// 0 for a process of this host; for another node of the domain, a key of its name
    /// ([`node_key`]): its uid is a stand-in (or, where identities are shared, a local
    /// user's), so neither another node's nor that user's lines are suppressed by its.
    pub node: u64,
    /// The operation refused (`"hello"`, an opcode's name, `"connect"`).
    pub op: &'static str,
    /// The error code.
    pub code: fabric_proto::wire::ErrorCode,
}

/// The [`Group::node`] of the domain's node `name` (never 0).
pub fn node_key(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish().max(1)
}

/// Whether to write a refusal's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Write it; `suppressed` refusals of its group since its last line were not written.
    Log {
        /// Refusals of the group counted without a line since its last line.
        suppressed: u64,
    },
    /// Count it only.
    Suppress,
}

/// A summary line: refusals of one group (or of the overflow, `group: None`) that got no
/// line of their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The group; `None` for refusals of groups past [`MAX_GROUPS`].
    pub group: Option<Group>,
    /// How many got no line.
    pub suppressed: u64,
    /// The last such refusal's message (cut to a bounded length).
    pub last_message: String,
}

#[derive(Debug)]
struct GroupState {
    last_line: Instant,
    suppressed: u64,
    last_message: String,
}

/// The pure state: no clock, no I/O (the caller passes `now`).
#[derive(Debug)]
pub struct RefusalState {
    second_start: Option<Instant>,
    lines_this_second: u32,
    groups: HashMap<Group, GroupState>,
    overflow: u64,
    overflow_message: String,
}

impl Default for RefusalState {
    fn default() -> Self {
        Self::new()
    }
}

fn kept(message: &str) -> String {
    let mut end = message.len().min(MAX_KEPT_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message[..end].to_owned()
}

impl RefusalState {
    /// No refusal seen yet.
    pub fn new() -> Self {
        Self {
            second_start: None,
            lines_this_second: 0,
            groups: HashMap::new(),
            overflow: 0,
            overflow_message: String::new(),
        }
    }

    /// Takes one line from this second's budget, if any is left.
    fn take_line(&mut self, now: Instant) -> bool {
        let fresh = self.second_start.is_none_or(|s| now.saturating_duration_since(s) >= Duration::from_secs(1));
        if fresh {
            self.second_start = Some(now);
            self.lines_this_second = 0;
        }
        if self.lines_this_second >= LINES_PER_SECOND {
            return false;
        }
        self.lines_this_second += 1;
        true
    }

    /// Decides about one refusal of `group` with `message`, at `now`.
    pub fn decide(&mut self, now: Instant, group: Group, message: &str) -> Decision {
        if !self.groups.contains_key(&group) && self.groups.len() >= MAX_GROUPS {
            self.overflow += 1;
            self.overflow_message = kept(message);
            return Decision::Suppress;
        }
        let due = self.groups.get(&group).is_none_or(|g| now.saturating_duration_since(g.last_line) >= GROUP_INTERVAL);
        if due && self.take_line(now) {
            let g = self.groups.entry(group).or_insert_with(|| GroupState {
                last_line: now,
                suppressed: 0,
                last_message: String::new(),
            });
            g.last_line = now;
            let suppressed = std::mem::take(&mut g.suppressed);
            g.last_message.clear();
            return Decision::Log { suppressed };
        }
        let g = self.groups.entry(group).or_insert_with(|| GroupState {
            // Never logged (over the budget): due again as soon as the budget allows.
            last_line: now.checked_sub(GROUP_INTERVAL).unwrap_or(now),
            suppressed: 0,
            last_message: String::new(),
        });
        g.suppressed += 1;
        g.last_message = kept(message);
        Decision::Suppress
    }

    /// The summaries of every group with refusals not yet written (their counts reset),
    /// and forgets groups that have been quiet for a whole [`GROUP_INTERVAL`].
    pub fn summarise(&mut self, now: Instant) -> Vec<Summary> {
        let mut out = Vec::new();
        self.groups.retain(|group, g| {
            if g.suppressed > 0 {
                out.push(Summary {
                    group: Some(*group),
                    suppressed: std::mem::take(&mut g.suppressed),
                    last_message: std::mem::take(&mut g.last_message),
                });
                g.last_line = now;
                return true;
            }
            now.saturating_duration_since(g.last_line) < GROUP_INTERVAL
        });
        if self.overflow > 0 {
            out.push(Summary {
                group: None,
                suppressed: std::mem::take(&mut self.overflow),
                last_message: std::mem::take(&mut self.overflow_message),
            });
        }
        out.sort_by_key(|s| s.group.map(|g| (g.uid, g.op)));
        out
    }
}

/// The daemon's refusal log: [`RefusalState`] behind a mutex held only to decide.
#[derive(Debug, Default)]
pub struct RefusalLog {
    state: Mutex<RefusalState>,
}

impl RefusalLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one refusal; writes its `warn` line unless it is counted only. `pid` is
    /// the caller's, written on the line but not part of the group.
    pub fn refused(&self, group: Group, pid: i32, message: &str) {
        let decision = match self.state.lock() {
            Ok(mut s) => s.decide(Instant::now(), group, message),
            Err(p) => p.into_inner().decide(Instant::now(), group, message),
        };
        if let Decision::Log { suppressed } = decision {
            if suppressed > 0 {
                tracing::warn!(
                    uid = group.uid,
                    pid,
                    op = group.op,
                    code = ?group.code,
                    not_logged = suppressed,
                    "refused: {message} (and {suppressed} more like it not logged)"
                );
            } else {
                tracing::warn!(uid = group.uid, pid, op = group.op, code = ?group.code, "refused: {message}");
            }
        }
    }

    /// Writes the summary lines of the refusals not logged so far (see
    /// [`RefusalState::summarise`]); called periodically.
    pub fn summarise(&self) {
        let summaries = match self.state.lock() {
            Ok(mut s) => s.summarise(Instant::now()),
            Err(p) => p.into_inner().summarise(Instant::now()),
        };
        for s in summaries {
            match s.group {
                Some(g) => tracing::warn!(
                    uid = g.uid,
                    op = g.op,
                    code = ?g.code,
                    not_logged = s.suppressed,
                    "{} refusals not logged (rate limit); the last: {}",
                    s.suppressed,
                    s.last_message
                ),
                None => tracing::warn!(
                    not_logged = s.suppressed,
                    "{} refusals of callers past the {MAX_GROUPS} remembered not logged (rate limit); the last: {}",
                    s.suppressed,
                    s.last_message
                ),
            }
        }
    }
}

/// Writes the refusal summaries every [`GROUP_INTERVAL`] until `shutdown`, and once more
/// at the end.
pub async fn run(daemon: std::sync::Arc<crate::Daemon>, shutdown: tokio_util::sync::CancellationToken) {
    let mut tick = tokio::time::interval(GROUP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = tick.tick() => daemon.refusals.summarise(),
        }
    }
    daemon.refusals.summarise();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(uid: u32, op: &'static str) -> Group {
        Group { uid, node: 0, op, code: fabric_proto::wire::ErrorCode::BadRequest }
    }

    #[test]
    fn another_nodes_refusals_are_a_group_of_their_own() {
        let mut s = RefusalState::new();
        let t0 = Instant::now();
        let local = group(65534, "import");
        let (n1, n2) = (node_key("tray1"), node_key("tray2"));
        assert!(n1 != 0 && n1 != n2 && n1 == node_key("tray1"));
        assert_eq!(s.decide(t0, Group { node: n1, ..local }, "a"), Decision::Log { suppressed: 0 });
        // Same uid and operation: another node's first refusal, and the local user's, still
        // get their lines.
        assert_eq!(s.decide(t0, Group { node: n2, ..local }, "b"), Decision::Log { suppressed: 0 });
        assert_eq!(s.decide(t0, local, "c"), Decision::Log { suppressed: 0 });
        assert_eq!(s.decide(t0, Group { node: n1, ..local }, "d"), Decision::Suppress);
    }

    #[test]
    fn a_group_logs_once_per_interval_and_counts_the_rest() {
        let mut s = RefusalState::new();
        let t0 = Instant::now();
        assert_eq!(s.decide(t0, group(1, "alloc"), "m0"), Decision::Log { suppressed: 0 });
        for i in 1..=1000u64 {
            let t = t0 + Duration::from_micros(i);
            assert_eq!(s.decide(t, group(1, "alloc"), "m"), Decision::Suppress);
        }
        // After the interval: one line, carrying the count.
        assert_eq!(s.decide(t0 + GROUP_INTERVAL, group(1, "alloc"), "m"), Decision::Log { suppressed: 1000 });
        assert!(s.summarise(t0 + GROUP_INTERVAL).is_empty());
    }

    #[test]
    fn lines_per_second_bound_all_groups_together_and_the_rest_is_summarised() {
        let mut s = RefusalState::new();
        let t0 = Instant::now();
        let mut logged = 0;
        for uid in 0..1000u32 {
            if s.decide(t0, group(uid, "ping"), "x") != Decision::Suppress {
                logged += 1;
            }
        }
        assert_eq!(logged, LINES_PER_SECOND);
        // A new second: budget again; a group counted only (never logged) is due at once,
        // and its line carries the count.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(s.decide(t1, group(999, "ping"), "y"), Decision::Log { suppressed: 1 });
        let sums = s.summarise(t1 + Duration::from_millis(10));
        assert_eq!(sums.len(), 1000 - LINES_PER_SECOND as usize - 1);
        assert!(sums.iter().all(|x| x.suppressed == 1 && x.last_message == "x"));
    }

    #[test]
    fn groups_are_bounded_and_the_overflow_is_counted() {
        let mut s = RefusalState::new();
        let t0 = Instant::now();
        for uid in 0..(MAX_GROUPS as u32 + 10) {
            s.decide(t0 + Duration::from_secs(u64::from(uid)), group(uid, "alloc"), "z");
        }
        let sums = s.summarise(t0 + Duration::from_secs(MAX_GROUPS as u64 + 10));
        let overflow: Vec<_> = sums.iter().filter(|x| x.group.is_none()).collect();
        assert_eq!(overflow.len(), 1);
        assert_eq!(overflow[0].suppressed, 10);
        // Quiet groups are forgotten: room again.
        let later = t0 + Duration::from_secs(MAX_GROUPS as u64 + 10) + GROUP_INTERVAL * 2;
        assert!(s.summarise(later).is_empty());
        assert_eq!(s.decide(later, group(u32::MAX, "alloc"), "w"), Decision::Log { suppressed: 0 });
    }

    #[test]
    fn kept_messages_are_cut_on_a_character_boundary() {
        let m = "é".repeat(300);
        let k = kept(&m);
        assert!(k.len() <= MAX_KEPT_MESSAGE && k.chars().all(|c| c == 'é'));
    }
}
