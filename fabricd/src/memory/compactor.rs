//! Journal compaction off the request path: the snapshot an operation queued
//! ([`super::State::maybe_compact`]) is written and synced by a thread of its own, which
//! settles it in the registry, so that the operation that crossed `memory.compact_records`
//! answers without waiting for it.

use std::sync::mpsc::{self, Sender};
use std::sync::{Mutex, Weak};
use std::thread::JoinHandle;

use super::State;
use crate::journal::{JournalError, Ticket};

/// Says what became of a compaction (before it is settled, outside the registry lock).
pub(super) fn log_outcome(waited: &Result<(), JournalError>) {
    match waited {
        Ok(()) => {}
        Err(e) if e.wrote_nothing() => {
            tracing::warn!(error = %crate::error_chain(e), "registry snapshot not written (it does not encode, or is larger than a record); not compacting: the journal keeps every record until the registry shrinks");
        }
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(e), "journal compaction failed; reopened before the next change");
        }
    }
}

/// The thread that waits for queued snapshots; stopped (after the ones handed to it) when
/// dropped.
#[derive(Debug)]
pub(super) struct Compactor {
    tx: Option<Sender<Ticket>>,
    thread: Option<JoinHandle<()>>,
}

impl Compactor {
    /// Starts the thread, which settles each snapshot's outcome in `state` while that lives.
    pub(super) fn start(state: Weak<Mutex<State>>) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Ticket>();
        let thread = std::thread::Builder::new().name("fabricd-compact".into()).spawn(move || {
            for ticket in rx {
                // A waiter with no write in progress leads the group commit: this thread
                // writes the snapshot, with any records queued beside it.
                // Settled whatever happens in the wait: an unsettled snapshot would keep
                // every later compaction (and a reopen after a failure) waiting for it.
                let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ticket.wait()))
                    .unwrap_or(Err(JournalError::Poisoned));
                log_outcome(&waited);
                if let Some(state) = state.upgrade() {
                    state.lock().unwrap_or_else(|p| p.into_inner()).settle(&waited);
                }
            }
        })?;
        Ok(Self { tx: Some(tx), thread: Some(thread) })
    }

    /// Hands `ticket` to the thread; back when the thread is gone.
    pub(super) fn hand(&self, ticket: Ticket) -> Result<(), Ticket> {
        match &self.tx {
            Some(tx) => tx.send(ticket).map_err(|e| e.0),
            None => Err(ticket),
        }
    }
}

impl Drop for Compactor {
    fn drop(&mut self) {
        // The thread ends once it has written what it was handed.
        drop(self.tx.take());
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::warn!("the journal compaction thread panicked");
        }
    }
}
