//! What a registry change leaves to do outside the registry lock: the slow steps
//! (removing a region file, deleting a carved DAX device, unmapping and unpinning a
//! registration, closing an ended region's descriptors) that a change decides on under the lock and that run after it, and the
//! commit that waits for the journal.
//!
//! Every operation ends with [`Memory::finish`]: what it queued is taken out under its own
//! lock as one [`Aftermath`], which runs with the lock released: its effects, then what it
//! ended handed to the daemon's hook ([`Memory::on_end`]): the copies that depended on it
//! stopped, then the freed device ranges given back or parked (no copy reaches them any
//! more), then its revocations told; a compaction it became due for is handed to the
//! compaction thread. An operation
//! that must publish something first (a device lost, whose events say why) takes its
//! aftermath under the lock too and delivers it itself: nothing one operation queued is
//! ever left for another to deliver.

use std::path::PathBuf;
use std::sync::MutexGuard;

use super::carve::DaxRegion;
use super::{Memory, MemoryError, State};
use crate::journal::Ticket;

/// One slow step a change left to do.
#[derive(Debug)]
pub(super) enum Effect {
    /// A freed region's sim file (or NUMA file).
    RemoveFile(PathBuf),
    /// A freed region's carved DAX device: deleted, then its ranges (`offset` in each of
    /// `resources`) are free again — or quarantined while other nodes may still map them
    /// (`holders`: their own devices over the same DPAs); if the kernel refuses, they stay
    /// taken until a restart.
    Uncarve {
        /// The region.
        region: u64,
        /// Its bytes.
        len: u64,
        /// The nodes that may still map it, with the acknowledgements awaited from each
        /// ([`super::quarantine::Parked::nodes`]); empty: none.
        holders: std::collections::BTreeMap<String, u32>,
        /// The DAX region the device was carved from.
        carve: DaxRegion,
        /// The device.
        device: String,
        /// The resources whose range at `offset` the device holds.
        resources: Vec<usize>,
        /// The range's offset in each of them.
        offset: u64,
    },
    /// A detached registration: unmapped (VFIO) and unpinned, then its IOVA range freed and
    /// its accounting given back ([`Memory::undo_registration`]).
    Unregister {
        /// The registration's id.
        id: u64,
        /// The registration.
        registration: Box<crate::dma::Registration>,
    },
    /// A freed region's range of a device file (a DAX device's or a BAR's), given back —
    /// or quarantined while other nodes may still map it (`holders`) — only once the end
    /// hook stopped the copies through it: the kernel does not take a kept mapping of
    /// such a file away, so a copy still running would write into (or read) whatever the
    /// range is handed out for next.
    ReleaseRange {
        /// The region.
        region: u64,
        /// Its bytes.
        len: u64,
        /// As [`Effect::Uncarve`]'s.
        holders: std::collections::BTreeMap<String, u32>,
        /// The resources whose range at `offset` the region held.
        resources: Vec<usize>,
        /// The range's offset in each of them.
        offset: u64,
    },
    /// Something whose drop may be slow, let go of outside the lock: an ended region's
    /// vendor object (closing the last descriptor of a CUDA export, or of a large memfd,
    /// frees its memory in `close`) or a cached copy file.
    Release(Box<dyn std::fmt::Debug + Send>),
}

impl Effect {
    /// Whether the step runs only once the copies through the region were stopped: a
    /// device range given back (the kernel leaves a copy's mapping of the device file in
    /// place), and a carved DAX device deleted with its range (its mapping would fault
    /// under the copy, which would end `Internal` rather than `NotFound`, and the range is
    /// free again at once).
    fn waits_for_copies(&self) -> bool {
        matches!(self, Effect::ReleaseRange { .. } | Effect::Uncarve { .. })
    }
}

/// What one operation left to do once the registry lock is released: its slow steps, the
/// registrations it detached, the revocations it caused (each with the session to tell)
/// and whether it ended anything a copy may depend on. Taken out of the registry under the
/// operation's own lock (`State::aftermath`) and carried by that operation to
/// [`Memory::deliver`]: what one operation ended is never delivered by another.
#[derive(Debug, Default)]
#[must_use = "an operation's aftermath is delivered with `Memory::deliver`"]
pub struct Aftermath {
    effects: Vec<Effect>,
    unregistered: Vec<(u64, crate::dma::Registration)>,
    revocations: Vec<(u64, fabric_proto::wire::Revocation)>,
    ended: bool,
}

impl Aftermath {
    /// Whether it holds nothing to do.
    pub fn is_empty(&self) -> bool {
        self.effects.is_empty() && self.unregistered.is_empty() && self.revocations.is_empty() && !self.ended
    }

    /// The revocations it will deliver, each with the session to tell.
    pub fn revocations(&self) -> &[(u64, fabric_proto::wire::Revocation)] {
        &self.revocations
    }

    /// Adds `other`'s, after its own (one delivery for several operations that a caller
    /// holds back together, as a rescan does for every device it lost).
    pub fn append(&mut self, other: Aftermath) {
        self.effects.extend(other.effects);
        self.unregistered.extend(other.unregistered);
        self.revocations.extend(other.revocations);
        self.ended |= other.ended;
    }
}

impl State {
    /// Takes what the operation holding the lock queued (its effects, and the ledger's
    /// detached registrations, revocations and end mark), leaving the queues empty for the
    /// next one.
    pub(super) fn aftermath(&mut self) -> Aftermath {
        Aftermath {
            effects: std::mem::take(&mut self.effects),
            unregistered: std::mem::take(&mut self.ledger.unregistered),
            revocations: std::mem::take(&mut self.ledger.revocations),
            ended: std::mem::take(&mut self.ledger.ended),
        }
    }

    /// Whether nothing is queued: true whenever no operation holds the lock.
    #[cfg(test)]
    pub(super) fn nothing_queued(&self) -> bool {
        self.effects.is_empty()
            && self.ledger.unregistered.is_empty()
            && self.ledger.revocations.is_empty()
            && !self.ledger.ended
    }
}

impl Memory {
    /// Waits (outside the lock) for `ticket`'s record to be durable, then takes the lock
    /// again, with the outcome: the caller publishes its change, or undoes its reservation.
    pub(super) fn commit(&self, ticket: Option<Ticket>) -> (MutexGuard<'_, State>, Result<(), MemoryError>) {
        let waited = ticket.map(Ticket::wait);
        let mut st = self.state();
        let done = match waited {
            None => Ok(()),
            Some(w) => {
                st.settle(&w);
                w.map_err(MemoryError::Journal)
            }
        };
        (st, done)
    }

    /// Ends an operation: takes what it left to do ([`State::aftermath`]) and queues a
    /// compaction if one is due under the operation's own lock, releases the lock, delivers
    /// the aftermath and hands the compaction to the compaction thread (`compactor.rs`);
    /// waits for it only where that thread could not be started.
    pub(super) fn finish(&self, mut st: MutexGuard<'_, State>) {
        let compaction = st.maybe_compact();
        let after = st.aftermath();
        drop(st);
        self.deliver(after);
        if let Some(t) = compaction {
            self.compact(t);
        }
    }

    fn compact(&self, ticket: Ticket) {
        let compactor = self.compactor.get_or_init(|| {
            super::compactor::Compactor::start(std::sync::Arc::downgrade(&self.state))
                .inspect_err(
                    |e| tracing::warn!(error = %e, "no journal compaction thread; requests wait for compactions"),
                )
                .ok()
        });
        let handed = match compactor {
            Some(c) => c.hand(ticket),
            None => Err(ticket),
        };
        let Err(ticket) = handed else { return };
        let waited = ticket.wait();
        super::compactor::log_outcome(&waited);
        self.state().settle(&waited);
    }

    /// Carries out, without the lock, what one operation left to do: its effects run
    /// (registrations it detached unmapped first, before a backing they reach is removed
    /// or its DAX device deleted), then, if it ended anything, the end hook
    /// ([`Memory::on_end`]) tells its revocations' importers and stops the copies that
    /// depended on it. Without a hook, its revocations have no one to tell.
    pub fn deliver(&self, after: Aftermath) {
        let Aftermath { effects, unregistered, revocations, ended } = after;
        // Drained last: an access to a client's memory can stall for as long as the client
        // likes, and nothing else the operation does (files removed, ranges given back,
        // importers told) may wait for it.
        let drains: Vec<_> = unregistered.iter().filter_map(|(_, r)| r.client_gate()).collect();
        let mut steps: Vec<Effect> =
            unregistered.into_iter().map(|(id, r)| Effect::Unregister { id, registration: Box::new(r) }).collect();
        let (after_copies, now): (Vec<_>, Vec<_>) = effects.into_iter().partition(Effect::waits_for_copies);
        steps.extend(now);
        self.run(steps);
        let hook = self.ended_hook.get().filter(|_| ended || !revocations.is_empty());
        // Copies stopped and importers told before the operation answers.
        if let Some(h) = hook {
            (h.0.stop_copies)(self);
        }
        // No copy reaches the freed device ranges any more: they may be handed out, or
        // parked for the importer nodes before those are told (their acknowledgement
        // must find them parked).
        self.run(after_copies);
        if let Some(h) = hook {
            (h.0.tell)(revocations);
        }
        // No byte of an unregistered client's memory moves once this returns.
        for gate in drains {
            gate.drain();
        }
    }

    /// Runs `effects`, in order, without the lock (taking it briefly to give back what a
    /// deleted device or an undone registration held).
    pub(super) fn run(&self, effects: Vec<Effect>) {
        for e in effects {
            match e {
                Effect::RemoveFile(path) => {
                    if let Err(e) = std::fs::remove_file(&path) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove a region file");
                    }
                }
                Effect::Uncarve { region, len, holders, carve, device, resources, offset } => {
                    match carve.destroy(&device) {
                        // Parked before the importers are told (after the effects): an
                        // acknowledgement always finds the range parked.
                        Ok(()) => self.state().release_range(region, holders, resources, offset, len),
                        Err(e) => {
                            tracing::warn!(region, device = %device, error = %e, "cannot delete a freed region's DAX device; its range stays taken until a restart");
                            let mut st = self.state();
                            if st.problems.len() < 256 {
                                st.problems
                                    .push(format!("region {region}'s DAX device {device} could not be deleted: {e}"));
                            }
                        }
                    }
                }
                Effect::ReleaseRange { region, len, holders, resources, offset } => {
                    self.state().release_range(region, holders, resources, offset, len);
                }
                Effect::Unregister { id, registration } => self.undo_registration(id, *registration),
                Effect::Release(what) => drop(what),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::carve::tests::{BASE, M, open, tree};
    use super::*;

    /// A freed region's device range, carved or not, is given back only after its copies
    /// were stopped; a file is removed at once. Before, a carved device was deleted (and
    /// its range freed) before the copies through it stopped.
    #[test]
    fn device_ranges_wait_for_the_copies_and_files_do_not() {
        let (t, root) = tree(0, true, &[(1, BASE, 4 * M)]);
        let carve = open(&t, &root, "dax0.0").unwrap();
        let holders = std::collections::BTreeMap::new();
        let uncarve = Effect::Uncarve {
            region: 1,
            len: 4 * M,
            holders: holders.clone(),
            carve,
            device: "dax0.1".into(),
            resources: vec![0],
            offset: 0,
        };
        let release = Effect::ReleaseRange { region: 2, len: 4 * M, holders, resources: vec![0], offset: 4 * M };
        assert!(uncarve.waits_for_copies() && release.waits_for_copies());
        assert!(!Effect::RemoveFile("/nowhere".into()).waits_for_copies());
    }
}
