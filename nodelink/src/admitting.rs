//! The server's handshake slots, shared among the addresses connections come from: when
//! every slot is taken, a connection from an address that holds at least two fewer slots
//! than the address holding the most takes that address's oldest, so one address's flood
//! of silent connections cannot keep every other address's peers out, while addresses
//! holding one slot each (many peers reconnecting at once, or a flood from as many
//! addresses) keep their handshakes and the newcomer is closed, as before. The addresses
//! the domain's members advertise ([`Admitting::set_members`]) come first: a member's
//! connection takes the oldest slot of the unknown address holding the most, whatever it
//! holds, and an unknown address never takes one of a member address's first
//! [`MEMBER_SHARE`] slots, so a flood spread over many addresses cannot keep a member out
//! either — nor a flood from a member's own host everyone else. An IPv6 address counts as
//! its /64 (what one host is given).

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

/// Connections being admitted (TLS handshake and Hello), by source address.
#[derive(Debug)]
pub(crate) struct Admitting {
    max: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// Taken in this order; a slot's number tells the oldest of an address apart.
    next: u64,
    taken: usize,
    /// Each address's slots, oldest first, with the sender that ends one's handshake.
    by_addr: HashMap<IpAddr, VecDeque<(u64, oneshot::Sender<()>)>>,
    /// The sources the domain's members advertise.
    members: HashSet<IpAddr>,
}

/// Slots of one member address that no unknown address takes (a member's own dials: a
/// few links' handshakes at once); beyond them a member address is held to the rule every
/// address is, so that a member's host cannot keep everyone else out.
pub(crate) const MEMBER_SHARE: usize = 4;

impl Held {
    /// Whose oldest slot a newcomer from `addr` takes when every slot is taken. A member
    /// takes from the unknown address holding the most (any number) or, when members hold
    /// every slot, from the member holding at least two more than it. Anyone else takes
    /// from the address holding at least two more than it, a member's first
    /// [`MEMBER_SHARE`] slots not counted. Among equals, the one whose oldest slot is the
    /// oldest.
    fn victim(&self, addr: IpAddr) -> Option<IpAddr> {
        let own = self.by_addr.get(&addr).map_or(0, VecDeque::len);
        let is_member = |a: &IpAddr| self.members.contains(a);
        if is_member(&addr) {
            return self
                .most(|a, n| (!is_member(a)).then_some(n))
                .or_else(|| self.most(|_, n| Some(n)).filter(|&(n, _)| n > own + 1))
                .map(|(_, a)| a);
        }
        self.most(|a, n| Some(if is_member(a) { n.saturating_sub(MEMBER_SHARE) } else { n }))
            .filter(|&(n, _)| n > own + 1)
            .map(|(_, a)| a)
    }

    /// The address of the most slots as `count` weighs them (`None`: not a candidate),
    /// the one with the oldest slot among equals; with its weight.
    fn most(&self, count: impl Fn(&IpAddr, usize) -> Option<usize>) -> Option<(usize, IpAddr)> {
        self.by_addr
            .iter()
            .filter_map(|(a, slots)| Some((count(a, slots.len())?, std::cmp::Reverse(slots.front()?.0), *a)))
            .max()
            .map(|(n, _, a)| (n, a))
    }
}

/// What [`Admitting::take`] gave.
#[derive(Debug)]
pub(crate) enum Taken {
    /// A free slot.
    Free(Slot),
    /// Another address's oldest slot: that connection's handshake is ended.
    FromAnother(Slot, IpAddr),
    /// None: every slot is taken, none by an address holding more than this one.
    Full,
}

/// A connection's handshake slot, given back when dropped. `ended` resolves when another
/// address's connection took it.
#[derive(Debug)]
pub(crate) struct Slot {
    admitting: Arc<Admitting>,
    addr: IpAddr,
    number: u64,
    pub(crate) ended: oneshot::Receiver<()>,
}

impl Admitting {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max, held: Mutex::default() })
    }

    /// A slot for a connection from `addr`: a free one, or another address's oldest
    /// ([`Held::victim`] says whose).
    pub(crate) fn take(self: &Arc<Self>, addr: IpAddr) -> Taken {
        let addr = source(addr);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let mut from = None;
        if held.taken >= self.max {
            let Some(victim) = held.victim(addr) else { return Taken::Full };
            let slots = held.by_addr.get_mut(&victim).expect("the address just found");
            // Dropping the sender ends that connection's handshake.
            drop(slots.pop_front());
            if slots.is_empty() {
                held.by_addr.remove(&victim);
            }
            held.taken -= 1;
            from = Some(victim);
        }
        let (tx, ended) = oneshot::channel();
        let number = held.next;
        held.next += 1;
        held.taken += 1;
        held.by_addr.entry(addr).or_default().push_back((number, tx));
        drop(held);
        let slot = Slot { admitting: self.clone(), addr, number, ended };
        match from {
            Some(victim) => Taken::FromAnother(slot, victim),
            None => Taken::Free(slot),
        }
    }

    /// The addresses the domain's members advertise now (each replaces the last).
    pub(crate) fn set_members(&self, addrs: impl IntoIterator<Item = IpAddr>) {
        let members = addrs.into_iter().map(source).collect();
        self.held.lock().unwrap_or_else(PoisonError::into_inner).members = members;
    }

    /// How many member sources are known (an IPv6 /64 counts once).
    pub(crate) fn members(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).members.len()
    }

    #[cfg(test)]
    fn taken(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).taken
    }
}

/// What slots are counted by: an IPv4 address (an IPv4-mapped IPv6 one as such), or an
/// IPv6 address's /64.
fn source(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(v6.to_bits() & !((1u128 << 64) - 1))),
        v4 => v4,
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.admitting.held.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(slots) = held.by_addr.get_mut(&self.addr) else { return };
        // Gone already when another address took it.
        let Some(at) = slots.iter().position(|(n, _)| *n == self.number) else { return };
        slots.remove(at);
        if slots.is_empty() {
            held.by_addr.remove(&self.addr);
        }
        held.taken -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    fn slot(t: Taken) -> Slot {
        match t {
            Taken::Free(s) | Taken::FromAnother(s, _) => s,
            Taken::Full => panic!("no slot"),
        }
    }

    #[test]
    fn one_address_holding_every_slot_gives_its_oldest_to_another() {
        let a = Admitting::new(3);
        let mut flood: Vec<Slot> = (0..3).map(|_| slot(a.take(ip(2)))).collect();
        assert!(matches!(a.take(ip(2)), Taken::Full), "the flooding address gets no more");
        let Taken::FromAnother(mut peer, victim) = a.take(ip(1)) else { panic!("the peer gets a slot") };
        assert_eq!(victim, ip(2));
        assert_eq!(a.taken(), 3);
        // The oldest of the flood was ended, the others not.
        assert!(flood[0].ended.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Closed));
        assert!(flood[1].ended.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Empty));
        assert!(peer.ended.try_recv().is_err_and(|e| e == oneshot::error::TryRecvError::Empty));
        // Dropping the ended slot gives nothing back twice.
        drop(flood.remove(0));
        assert_eq!(a.taken(), 3);
        let third = a.take(ip(3));
        assert!(matches!(third, Taken::FromAnother(_, v) if v == ip(2)), "2 holds two, 3 none");
        drop(peer);
        assert_eq!(a.taken(), 2);
        assert!(matches!(a.take(ip(1)), Taken::Free(_)));
    }

    #[test]
    fn equal_holders_keep_their_slots_and_the_oldest_goes_first() {
        let a = Admitting::new(4);
        let held: Vec<Slot> = [2, 3, 3, 2].into_iter().map(|l| slot(a.take(ip(l)))).collect();
        assert!(matches!(a.take(ip(2)), Taken::Full), "2 holds as many as any other");
        let four = a.take(ip(4));
        assert!(matches!(four, Taken::FromAnother(_, v) if v == ip(2)), "2's oldest is the oldest");
        let five = a.take(ip(5));
        assert!(matches!(five, Taken::FromAnother(_, v) if v == ip(3)));
        // Everyone holds one: a handshake in progress is not ended for a newcomer.
        assert!(matches!(a.take(ip(6)), Taken::Full));
        assert!(matches!(a.take(ip(4)), Taken::Full));
        drop(held);
        assert_eq!(a.taken(), 2, "4's and 5's");
        drop((four, five));
        assert_eq!(a.taken(), 0);
    }

    #[test]
    fn a_member_takes_an_unknown_addresss_slot_and_keeps_its_share() {
        let a = Admitting::new(6);
        a.set_members([ip(1), ip(9)]);
        // A flood from as many addresses as there are slots: one each.
        let flood: Vec<Slot> = (2..8).map(|l| slot(a.take(ip(l)))).collect();
        assert!(matches!(a.take(ip(20)), Taken::Full), "one each: an unknown newcomer waits");
        let member = a.take(ip(1));
        assert!(matches!(member, Taken::FromAnother(_, v) if v == ip(2)), "the oldest unknown slot");
        let second = a.take(ip(9));
        assert!(matches!(second, Taken::FromAnother(_, v) if v == ip(3)));
        // Within its share, a member's slots are taken by no unknown address.
        let more: Vec<Slot> = (0..3).map(|_| slot(a.take(ip(1)))).collect();
        assert_eq!(a.taken(), 6, "1 holds 4, 9 one, 7 one");
        assert!(matches!(a.take(ip(7)), Taken::Full), "7 holds one; 1 holds no more than its share");
        // The members set is replaced, not added to: 1 is one address among others now.
        a.set_members([ip(9)]);
        assert!(matches!(a.take(ip(20)), Taken::FromAnother(_, v) if v == ip(1)), "1 holds four");
        drop((flood, member, second, more));
    }

    #[test]
    fn a_member_address_holding_every_slot_does_not_keep_everyone_out() {
        let a = Admitting::new(MEMBER_SHARE + 3);
        a.set_members([ip(1), ip(9)]);
        let flood: Vec<Slot> = (0..MEMBER_SHARE + 3).map(|_| slot(a.take(ip(1)))).collect();
        // A stranger takes a slot beyond the member's share; another member takes the
        // stranger's first, then the member's, which holds two more than it.
        let stranger = a.take(ip(2));
        assert!(matches!(stranger, Taken::FromAnother(_, v) if v == ip(1)));
        let member = a.take(ip(9));
        assert!(matches!(member, Taken::FromAnother(_, v) if v == ip(2)));
        assert!(matches!(a.take(ip(9)), Taken::FromAnother(_, v) if v == ip(1)));
        drop((flood, member));
    }

    #[test]
    fn an_ipv6_address_counts_as_its_64() {
        let a = Admitting::new(2);
        let host = |last: u16| IpAddr::from(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, last));
        let _held = (slot(a.take(host(1))), slot(a.take(host(2))));
        assert!(matches!(a.take(host(3)), Taken::Full), "one /64 holds both");
        let other = IpAddr::from(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 1));
        assert!(matches!(a.take(other), Taken::FromAnother(..)));
    }

    #[test]
    fn mapped_ipv6_is_its_ipv4_address() {
        let a = Admitting::new(1);
        let _held = slot(a.take(ip(2)));
        let mapped = IpAddr::from(std::net::Ipv4Addr::new(127, 0, 0, 2).to_ipv6_mapped());
        assert!(matches!(a.take(mapped), Taken::Full));
    }
}
