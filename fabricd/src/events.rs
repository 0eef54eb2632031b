//! The event bus: per-session subscriptions with bounded queues. Publishing never waits:
//! a subscriber whose queue is full loses its subscription (and its connection is closed
//! once the queued events are written), so a slow reader never blocks the daemon.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use fabric_proto::wire::{Event, Topics};
use tokio::sync::mpsc;

/// Events queued per subscriber before it is dropped.
pub const QUEUE: usize = 256;

#[derive(Debug)]
struct Sub {
    topics: Topics,
    tx: mpsc::Sender<Event>,
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
    pub fn subscribe(&self, session: u64, topics: Topics) -> Option<mpsc::Receiver<Event>> {
        let mut subs = self.subs();
        if topics == Topics::NONE {
            subs.remove(&session);
            return None;
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        subs.insert(session, Sub { topics, tx });
        Some(rx)
    }

    /// Ends the subscription of `session`, if any.
    pub fn unsubscribe(&self, session: u64) {
        self.subs().remove(&session);
    }

    /// Whether `session` subscribed to `topics`.
    pub fn subscribed(&self, session: u64, topics: Topics) -> bool {
        self.subs().get(&session).is_some_and(|s| s.topics.contains(topics))
    }

    /// Sends `ev` to every subscriber of its topic.
    pub fn publish(&self, ev: &Event) {
        let topic = ev.topic();
        if topic == Topics::NONE {
            return;
        }
        self.subs().retain(|session, s| !s.topics.contains(topic) || deliver(*session, s, ev.clone()));
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
    match s.tx.try_send(ev) {
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
    use fabric_proto::wire::MapChange;

    fn map_ev(g: u64) -> Event {
        Event::Map(MapChange { generation: g, added: 0, holed: 0, removed: 0 })
    }

    #[test]
    fn topics_filter_and_overflow_drops_the_subscriber() {
        let bus = EventBus::default();
        let mut map_rx = bus.subscribe(1, Topics::MAP).unwrap();
        let mut dev_rx = bus.subscribe(2, Topics::DEVICE).unwrap();
        bus.publish(&map_ev(1));
        assert_eq!(map_rx.try_recv().unwrap(), map_ev(1));
        assert!(dev_rx.try_recv().is_err());
        for g in 0..QUEUE as u64 {
            bus.publish(&map_ev(g));
        }
        assert!(bus.subscribed(1, Topics::MAP));
        bus.publish(&map_ev(999));
        assert!(!bus.subscribed(1, Topics::MAP), "overflow drops the subscriber");
        for _ in 0..QUEUE {
            map_rx.try_recv().unwrap();
        }
        assert_eq!(map_rx.try_recv(), Err(mpsc::error::TryRecvError::Disconnected));
        assert!(bus.subscribed(2, Topics::DEVICE), "others are unaffected");
        assert!(bus.subscribe(2, Topics::NONE).is_none());
        assert!(!bus.subscribed(2, Topics::DEVICE));
    }
}
