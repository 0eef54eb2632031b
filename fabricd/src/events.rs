//! The event bus: per-session subscriptions with bounded queues. Publishing never waits:
//! a subscriber whose queue is full loses its subscription (and its connection is closed
//! once the queued events are written), so a slow reader never blocks the daemon.
//! A subscriber bound to partitions sees only the device and link events of their devices;
//! a client's bindings are looked up for each event ([`Viewer::Client`]), so one an admin
//! binds or unbinds is treated so from the next event on.
//! A sink ([`EventBus::sink`]) is a subscriber inside the daemon that takes each event at
//! once and never overflows (the node link's queue of revocations for an importer node).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use fabric_proto::wire::{Event, Topics};
use tokio::sync::mpsc;

/// Events queued per subscriber before it is dropped.
pub const QUEUE: usize = 256;

/// Which device and link events a subscriber may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Every device's: an admin, or a client no partition binds.
    All,
    /// Those of the member devices of these partitions (resolved when an event is
    /// published, so a partition's new device set applies at once); none for no names.
    Partitions(Vec<String>),
}

/// Whose reach a subscription has.
#[derive(Debug, Clone)]
pub enum Viewer {
    /// Fixed when it subscribed: the daemon's own sinks.
    Fixed(Reach),
    /// A client: its reach is what the bindings current when an event is published give
    /// it (the publisher resolves it: [`EventBus::publish`]).
    Client(std::sync::Arc<crate::ops::principal::Client>),
}

/// Takes an event under the bus's lock: it must not block or do I/O.
pub type Sink = std::sync::Arc<dyn Fn(Event) + Send + Sync>;

/// Where a subscriber's events go.
enum Tx {
    Queue(mpsc::Sender<Event>),
    Sink(Sink),
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tx::Queue(_) => "Queue",
            Tx::Sink(_) => "Sink",
        })
    }
}

#[derive(Debug)]
struct Sub {
    topics: Topics,
    viewer: Viewer,
    tx: Tx,
}

/// Whether a subscriber whose partitions hold `members` may see `ev`: device events of a
/// member, link events with a member at either end; map events (a generation and counts)
/// and the per-session events to all.
fn visible(ev: &Event, members: &HashSet<String>) -> bool {
    match ev {
        Event::Device { device, .. } => members.contains(device.as_str()),
        Event::Link { a, b, .. } => members.contains(a.as_str()) || members.contains(b.as_str()),
        Event::Map(_) | Event::Revocation(_) | Event::CopyDone(_) => true,
    }
}

/// The subscribers, by session.
#[derive(Debug, Default)]
pub struct EventBus {
    subs: Mutex<HashMap<u64, Sub>>,
}

impl EventBus {
    fn subs(&self) -> MutexGuard<'_, HashMap<u64, Sub>> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Subscribes `session` to `topics` (replacing any earlier subscription) and returns
    /// the queue its events arrive on; `None` (and no subscription) for no topics. When
    /// the returned receiver reports the channel closed, the subscriber overflowed.
    pub fn subscribe(&self, session: u64, topics: Topics, viewer: Viewer) -> Option<mpsc::Receiver<Event>> {
        let mut subs = self.subs();
        if topics == Topics::NONE {
            subs.remove(&session);
            return None;
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        subs.insert(session, Sub { topics, viewer, tx: Tx::Queue(tx) });
        Some(rx)
    }

    /// Subscribes `session` to `topics` with a sink (replacing any earlier subscription):
    /// each event is handed to `sink` as it is published, never dropped.
    pub fn sink(&self, session: u64, topics: Topics, reach: Reach, sink: Sink) {
        if topics == Topics::NONE {
            self.subs().remove(&session);
            return;
        }
        self.subs().insert(session, Sub { topics, viewer: Viewer::Fixed(reach), tx: Tx::Sink(sink) });
    }

    /// Ends the subscription of `session`, if any.
    pub fn unsubscribe(&self, session: u64) {
        self.subs().remove(&session);
    }

    /// Whether `session` subscribed to `topics`.
    pub fn subscribed(&self, session: u64, topics: Topics) -> bool {
        self.subs().get(&session).is_some_and(|s| s.topics.contains(topics))
    }

    /// Sends `ev` to every subscriber of its topic that may see it; `reach_of` gives a
    /// client's reach under the current bindings, `members` the member devices (identities
    /// in text form) of a set of partitions, asked once per distinct set. Both run under
    /// the bus's lock: no blocking, no I/O.
    pub fn publish(
        &self,
        ev: &Event,
        reach_of: &dyn Fn(&std::sync::Arc<crate::ops::principal::Client>) -> Reach,
        members: &dyn Fn(&[String]) -> HashSet<String>,
    ) {
        let topic = ev.topic();
        if topic == Topics::NONE {
            return;
        }
        let mut known: HashMap<Vec<String>, HashSet<String>> = HashMap::new();
        self.subs().retain(|session, s| {
            if !s.topics.contains(topic) {
                return true;
            }
            let resolved;
            let reach = match &s.viewer {
                Viewer::Fixed(r) => r,
                Viewer::Client(c) => {
                    resolved = reach_of(c);
                    &resolved
                }
            };
            if let Reach::Partitions(names) = reach
                && !visible(ev, known.entry(names.clone()).or_insert_with(|| members(names)))
            {
                return true;
            }
            deliver(*session, s, ev.clone())
        });
    }

    /// Sends `ev` to `session` if it subscribed to the event's topic.
    pub fn send_to(&self, session: u64, ev: Event) {
        let mut subs = self.subs();
        if ev.topic() != Topics::NONE
            && let Some(s) = subs.get(&session)
            && s.topics.contains(ev.topic())
            && !deliver(session, s, ev)
        {
            subs.remove(&session);
        }
    }
}

/// Queues `ev`; false when the subscriber must be dropped (queue full or gone).
fn deliver(session: u64, s: &Sub, ev: Event) -> bool {
    let tx = match &s.tx {
        Tx::Queue(tx) => tx,
        Tx::Sink(sink) => {
            sink(ev);
            return true;
        }
    };
    match tx.try_send(ev) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            tracing::warn!(session, queue = QUEUE, "subscriber does not keep up with its events; dropping it");
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use fabric_proto::wire::{DeviceChange, DeviceName, LinkChange, MapChange, Name};

    fn none(_: &[String]) -> HashSet<String> {
        HashSet::new()
    }

    fn everything(_: &std::sync::Arc<crate::ops::principal::Client>) -> Reach {
        Reach::All
    }

    fn map_ev(g: u64) -> Event {
        Event::Map(MapChange { generation: g, added: 0, holed: 0, removed: 0 })
    }

    #[test]
    fn topics_filter_and_overflow_drops_the_subscriber() {
        let bus = EventBus::default();
        let mut map_rx = bus.subscribe(1, Topics::MAP, Viewer::Fixed(Reach::All)).unwrap();
        let mut dev_rx = bus.subscribe(2, Topics::DEVICE, Viewer::Fixed(Reach::All)).unwrap();
        bus.publish(&map_ev(1), &everything, &none);
        assert_eq!(map_rx.try_recv().unwrap(), map_ev(1));
        assert!(dev_rx.try_recv().is_err());
        for g in 0..QUEUE as u64 {
            bus.publish(&map_ev(g), &everything, &none);
        }
        assert!(bus.subscribed(1, Topics::MAP));
        bus.publish(&map_ev(999), &everything, &none);
        assert!(!bus.subscribed(1, Topics::MAP), "overflow drops the subscriber");
        for _ in 0..QUEUE {
            map_rx.try_recv().unwrap();
        }
        assert_eq!(map_rx.try_recv(), Err(mpsc::error::TryRecvError::Disconnected));
        assert!(bus.subscribed(2, Topics::DEVICE), "others are unaffected");
        assert!(bus.subscribe(2, Topics::NONE, Viewer::Fixed(Reach::All)).is_none());
        assert!(!bus.subscribed(2, Topics::DEVICE));
    }

    #[test]
    fn a_sink_takes_every_event_past_the_queue_bound() {
        let bus = EventBus::default();
        let got = std::sync::Arc::new(Mutex::new(Vec::new()));
        let into = got.clone();
        bus.sink(1, Topics::MAP, Reach::All, std::sync::Arc::new(move |ev| into.lock().unwrap().push(ev)));
        for g in 0..2 * QUEUE as u64 {
            bus.publish(&map_ev(g), &everything, &none);
        }
        bus.send_to(1, map_ev(7));
        assert!(bus.subscribed(1, Topics::MAP));
        assert_eq!(got.lock().unwrap().len(), 2 * QUEUE + 1);
        bus.sink(1, Topics::NONE, Reach::All, std::sync::Arc::new(|_| {}));
        assert!(!bus.subscribed(1, Topics::MAP));
    }

    /// A client's reach is asked for each event: bound to partition "a" when it
    /// subscribed, it sees gpu0's events; unbound by an admin (now bound to "b"), it sees
    /// gpu1's and no longer gpu0's.
    #[test]
    fn a_clients_reach_follows_its_bindings_from_the_next_event() {
        use crate::ops::principal::{Client, PeerNode};
        let bus = EventBus::default();
        let client = std::sync::Arc::new(Client::node(PeerNode {
            node: "n1".into(),
            incarnation: 1,
            claims: Vec::new(),
            uid: 1000,
            gid: 1000,
            shared_identities: false,
        }));
        let mut rx = bus.subscribe(1, Topics::ALL, Viewer::Client(client)).unwrap();
        let bound = Mutex::new("a".to_owned());
        let reach_of = |_: &std::sync::Arc<Client>| Reach::Partitions(vec![bound.lock().unwrap().clone()]);
        let members = |names: &[String]| -> HashSet<String> {
            match names.first().map(String::as_str) {
                Some("a") => ["gpu0".to_owned()].into(),
                Some("b") => ["gpu1".to_owned()].into(),
                _ => HashSet::new(),
            }
        };
        bus.publish(&dev_ev("gpu0"), &reach_of, &members);
        bus.publish(&dev_ev("gpu1"), &reach_of, &members);
        *bound.lock().unwrap() = "b".to_owned();
        bus.publish(&dev_ev("gpu0"), &reach_of, &members);
        bus.publish(&dev_ev("gpu1"), &reach_of, &members);
        let got: Vec<Event> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(got, vec![dev_ev("gpu0"), dev_ev("gpu1")]);
    }

    fn dev_ev(name: &str) -> Event {
        Event::Device { device: DeviceName::truncated(name), change: DeviceChange::Removed }
    }

    #[test]
    fn a_bound_subscriber_sees_only_its_partitions_devices_and_links() {
        let bus = EventBus::default();
        let mut all = bus.subscribe(1, Topics::ALL, Viewer::Fixed(Reach::All)).unwrap();
        let mut a = bus.subscribe(2, Topics::ALL, Viewer::Fixed(Reach::Partitions(vec!["a".into()]))).unwrap();
        let mut nothing =
            bus.subscribe(3, Topics::from_bits(0b0101).unwrap(), Viewer::Fixed(Reach::Partitions(Vec::new()))).unwrap();
        let asked = std::cell::Cell::new(0);
        let members = |names: &[String]| {
            asked.set(asked.get() + 1);
            if names == ["a".to_owned()] { ["gpu0".to_owned()].into_iter().collect() } else { HashSet::new() }
        };
        let link = |x: &str, y: &str| Event::Link {
            a: DeviceName::truncated(x),
            b: DeviceName::truncated(y),
            kind: Name::truncated("nvlink"),
            change: LinkChange::Down,
        };
        for ev in [dev_ev("gpu0"), dev_ev("gpu1"), link("gpu1", "gpu0"), link("gpu1", "gpu2"), map_ev(7)] {
            bus.publish(&ev, &everything, &members);
        }
        let drain = |rx: &mut mpsc::Receiver<Event>| std::iter::from_fn(|| rx.try_recv().ok()).collect::<Vec<_>>();
        assert_eq!(drain(&mut all).len(), 5, "an unbound subscriber sees everything");
        assert_eq!(drain(&mut a), vec![dev_ev("gpu0"), link("gpu1", "gpu0"), map_ev(7)]);
        assert_eq!(drain(&mut nothing), vec![map_ev(7)], "bound to nothing: no device events");
        assert!(asked.get() <= 2 * 5, "members asked once per set and event");
    }
}
