//! The copy engine's queue of chunks, served fairly: round robin over the uids with chunks
//! queued, and within a uid round robin over its sessions; each session's chunks in the
//! order queued. One engine taking one chunk is one turn, and a chunk is at most
//! `copy.chunk_bytes`, so a copy of a uid waits for at most one chunk of each other busy
//! uid per engine, however much they have queued. A session may be parked (its chunks
//! kept and counted, none taken: the engine's watchdog parks a session stalled in its own
//! memory), and so may a uid (all its sessions: one whose stalls took more than its share
//! of the engine's replacements). A plain value with no lock of its own: the engine holds
//! it under its mutex.

use std::collections::{HashMap, VecDeque};

/// Chunks by uid and session, taken in turn.
#[derive(Debug)]
pub struct FairQueue<T> {
    /// Uids with chunks queued, the next to serve first.
    uids: VecDeque<u32>,
    by_uid: HashMap<u32, Sessions<T>>,
    /// Parked sessions: how many times each was parked, and its chunks, out of the turns.
    parked: HashMap<(u32, u64), (u32, VecDeque<T>)>,
    /// Parked uids: their sessions' chunks stay queued (in `by_uid`) but out of the turns.
    parked_uids: std::collections::HashSet<u32>,
    len: usize,
}

/// One uid's sessions with chunks queued, the next to serve first.
#[derive(Debug)]
struct Sessions<T> {
    order: VecDeque<u64>,
    queues: HashMap<u64, VecDeque<T>>,
    /// Items queued in all of them.
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            uids: VecDeque::new(),
            by_uid: HashMap::new(),
            parked: HashMap::new(),
            parked_uids: std::collections::HashSet::new(),
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    /// Queues `items` of `session` of `uid` after that session's earlier ones.
    pub fn extend(&mut self, uid: u32, session: u64, items: impl IntoIterator<Item = T>) {
        let mut items = items.into_iter().peekable();
        if items.peek().is_none() {
            return;
        }
        if let Some((_, q)) = self.parked.get_mut(&(uid, session)) {
            let before = q.len();
            q.extend(items);
            self.len += q.len() - before;
            return;
        }
        let s = self.by_uid.entry(uid).or_insert_with(|| {
            if !self.parked_uids.contains(&uid) {
                self.uids.push_back(uid);
            }
            Sessions { order: VecDeque::new(), queues: HashMap::new(), len: 0 }
        });
        let q = s.queues.entry(session).or_insert_with(|| {
            s.order.push_back(session);
            VecDeque::new()
        });
        let before = q.len();
        q.extend(items);
        let added = q.len() - before;
        s.len += added;
        self.len += added;
    }

    /// The next chunk: the first of the next session of the next uid, which then go to the
    /// back of their turns (or leave them, with nothing more queued).
    pub fn pop(&mut self) -> Option<T> {
        let uid = self.uids.pop_front()?;
        let s = self.by_uid.get_mut(&uid)?;
        let session = s.order.pop_front()?;
        let q = s.queues.get_mut(&session)?;
        let item = q.pop_front();
        if item.is_some() {
            s.len -= 1;
        }
        if q.is_empty() {
            s.queues.remove(&session);
        } else {
            s.order.push_back(session);
        }
        if s.order.is_empty() {
            self.by_uid.remove(&uid);
        } else {
            self.uids.push_back(uid);
        }
        if item.is_some() {
            self.len -= 1;
        }
        item
    }

    /// Takes out the items of `session` of `uid` that `gone` picks (a stopped job's
    /// chunks, so that what they hold goes now, not when their turn comes); the others keep
    /// their order and turns. Answers how many went.
    pub fn remove(&mut self, uid: u32, session: u64, mut gone: impl FnMut(&T) -> bool) -> usize {
        if let Some((_, q)) = self.parked.get_mut(&(uid, session)) {
            let before = q.len();
            q.retain(|item| !gone(item));
            let removed = before - q.len();
            self.len -= removed;
            return removed;
        }
        let Some(s) = self.by_uid.get_mut(&uid) else { return 0 };
        let Some(q) = s.queues.get_mut(&session) else { return 0 };
        let before = q.len();
        q.retain(|item| !gone(item));
        let removed = before - q.len();
        s.len -= removed;
        if q.is_empty() {
            s.queues.remove(&session);
            s.order.retain(|&o| o != session);
        }
        if s.order.is_empty() {
            self.by_uid.remove(&uid);
            self.uids.retain(|&u| u != uid);
        }
        self.len -= removed;
        removed
    }

    /// Chunks queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Chunks of `uid` queued, parked ones included.
    pub fn len_of(&self, uid: u32) -> usize {
        let parked: usize = self.parked.iter().filter(|((u, _), _)| *u == uid).map(|(_, (_, q))| q.len()).sum();
        self.by_uid.get(&uid).map_or(0, |s| s.len) + parked
    }

    /// Parks `session` of `uid`: none of its chunks, queued or to come, is taken until it
    /// is unparked as many times as it was parked. Its chunks keep their order and count.
    pub fn park(&mut self, uid: u32, session: u64) {
        if let Some((times, _)) = self.parked.get_mut(&(uid, session)) {
            *times += 1;
            return;
        }
        let mut items = VecDeque::new();
        if let Some(s) = self.by_uid.get_mut(&uid)
            && let Some(q) = s.queues.remove(&session)
        {
            s.len -= q.len();
            s.order.retain(|&o| o != session);
            if s.order.is_empty() {
                self.by_uid.remove(&uid);
                self.uids.retain(|&u| u != uid);
            }
            items = q;
        }
        self.parked.insert((uid, session), (1, items));
    }

    /// Parks every session of `uid`, those to come included: none of their chunks is taken
    /// until [`FairQueue::unpark_uid`]. Their chunks keep their order and count.
    pub fn park_uid(&mut self, uid: u32) {
        if self.parked_uids.insert(uid) {
            self.uids.retain(|&u| u != uid);
        }
    }

    /// Undoes [`FairQueue::park_uid`]: the uid's chunks go back in the turns, at the back.
    pub fn unpark_uid(&mut self, uid: u32) {
        if self.parked_uids.remove(&uid) && self.by_uid.contains_key(&uid) {
            self.uids.push_back(uid);
        }
    }

    /// Undoes one [`FairQueue::park`] of `session`; the last one puts its chunks back in
    /// the turns, at the back.
    pub fn unpark(&mut self, uid: u32, session: u64) {
        let Some((times, _)) = self.parked.get_mut(&(uid, session)) else { return };
        *times -= 1;
        if *times > 0 {
            return;
        }
        let Some((_, items)) = self.parked.remove(&(uid, session)) else { return };
        self.len -= items.len();
        self.extend(uid, session, items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_items_leave_the_rest_in_order_and_an_emptied_session_its_turn() {
        let mut q = FairQueue::default();
        q.extend(1, 10, [(1, 10, 0), (1, 10, 1), (1, 10, 2)]);
        q.extend(1, 11, [(1, 11, 0)]);
        q.extend(2, 20, [(2, 20, 0)]);
        assert_eq!(q.remove(1, 10, |&(_, _, i)| i != 1), 2);
        assert_eq!(q.remove(1, 11, |_| true), 1, "session 11 emptied");
        assert_eq!(q.remove(9, 10, |_| true), 0, "no such uid");
        assert_eq!((q.len(), q.len_of(1), q.len_of(2), q.len_of(9)), (2, 1, 1, 0));
        assert_eq!(drain(&mut q), [(1, 10, 1), (2, 20, 0)]);
        q.extend(3, 30, [(3, 30, 0)]);
        assert_eq!(q.remove(3, 30, |_| true), 1);
        assert_eq!((q.len(), q.pop()), (0, None), "an emptied uid leaves its turn");
    }

    #[test]
    fn a_parked_uid_keeps_its_chunks_counted_and_gives_up_its_turns_until_unparked() {
        let mut q = FairQueue::default();
        q.extend(1, 10, [(1, 10, 0)]);
        q.extend(2, 20, [(2, 20, 0), (2, 20, 1)]);
        q.park_uid(1);
        q.park_uid(1);
        q.extend(1, 11, [(1, 11, 0)]);
        q.park(1, 12);
        q.extend(1, 12, [(1, 12, 0)]);
        q.unpark(1, 12);
        assert_eq!((q.len(), q.len_of(1)), (5, 3));
        assert_eq!(q.pop(), Some((2, 20, 0)));
        assert_eq!(q.pop(), Some((2, 20, 1)), "only the other uid is served");
        assert_eq!((q.pop(), q.len()), (None, 3));
        assert_eq!(q.remove(1, 11, |_| true), 1, "a stopped job's chunks go, parked or not");
        q.unpark_uid(1);
        assert_eq!(drain(&mut q), [(1, 10, 0), (1, 12, 0)]);
        q.unpark_uid(1);
        q.extend(1, 10, [(1, 10, 1)]);
        assert_eq!(q.pop(), Some((1, 10, 1)), "unparked once is unparked");
        q.park_uid(3);
        q.unpark_uid(3);
        assert_eq!((q.pop(), q.len()), (None, 0), "a uid with nothing queued is in no turn");
    }

    #[test]
    fn a_parked_session_keeps_its_chunks_counted_and_gives_up_its_turns_until_unparked() {
        let mut q = FairQueue::default();
        q.extend(1, 10, [(1, 10, 0), (1, 10, 1)]);
        q.extend(1, 11, [(1, 11, 0)]);
        q.extend(2, 20, [(2, 20, 0)]);
        q.park(1, 10);
        q.park(1, 10);
        q.extend(1, 10, [(1, 10, 2)]);
        q.park(3, 30);
        assert_eq!((q.len(), q.len_of(1), q.len_of(2)), (5, 4, 1));
        assert_eq!(drain(&mut q), [(1, 11, 0), (2, 20, 0)], "the parked session's chunks are not taken");
        assert_eq!(q.remove(1, 10, |&(_, _, i)| i == 1), 1, "a stopped job's chunks go, parked or not");
        assert_eq!((q.len(), q.len_of(1)), (2, 2));
        q.unpark(1, 10);
        assert_eq!(q.pop(), None, "parked twice, unparked once");
        q.unpark(1, 10);
        q.unpark(3, 30);
        q.unpark(9, 90);
        assert_eq!(drain(&mut q), [(1, 10, 0), (1, 10, 2)], "back in the turns, in order");
        assert_eq!(q.len(), 0);
        assert!(q.parked.is_empty() && q.by_uid.is_empty() && q.uids.is_empty());
    }

    fn drain(q: &mut FairQueue<(u32, u64, u32)>) -> Vec<(u32, u64, u32)> {
        std::iter::from_fn(|| q.pop()).collect()
    }

    #[test]
    fn uids_take_turns_whatever_each_has_queued() {
        let mut q = FairQueue::default();
        q.extend(1, 10, (0..1000).map(|i| (1, 10, i)));
        q.extend(2, 20, [(2, 20, 0)]);
        assert_eq!(q.len(), 1001);
        // The late uid's one chunk comes second, not after the thousand.
        assert_eq!(q.pop(), Some((1, 10, 0)));
        assert_eq!(q.pop(), Some((2, 20, 0)));
        assert_eq!(q.pop(), Some((1, 10, 1)));
        assert_eq!(q.len(), 998);
    }

    #[test]
    fn sessions_of_a_uid_take_turns_within_its_turn_and_keep_their_order() {
        let mut q = FairQueue::default();
        q.extend(1, 10, (0..3).map(|i| (1, 10, i)));
        q.extend(1, 11, (0..2).map(|i| (1, 11, i)));
        q.extend(2, 20, (0..2).map(|i| (2, 20, i)));
        let got = drain(&mut q);
        assert_eq!(got, vec![(1, 10, 0), (2, 20, 0), (1, 11, 0), (2, 20, 1), (1, 10, 1), (1, 11, 1), (1, 10, 2)]);
        assert_eq!(q.len(), 0);
        assert!(q.by_uid.is_empty() && q.uids.is_empty(), "nothing kept for idle uids");
    }

    #[test]
    fn a_session_queueing_again_joins_the_back_of_the_turns() {
        let mut q = FairQueue::default();
        q.extend(1, 10, [(1, 10, 0)]);
        q.extend(1, 10, std::iter::empty());
        assert_eq!(q.len(), 1);
        q.extend(2, 20, [(2, 20, 0), (2, 20, 1)]);
        assert_eq!(q.pop(), Some((1, 10, 0)));
        q.extend(1, 10, [(1, 10, 1)]);
        assert_eq!(drain(&mut q), vec![(2, 20, 0), (1, 10, 1), (2, 20, 1)]);
        assert_eq!(q.pop(), None);
    }
}
