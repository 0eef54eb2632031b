//! What a registry change leaves to do outside the registry lock: the slow steps
//! (removing a region file, deleting a carved DAX device, unmapping and unpinning a
//! registration, closing an ended region's descriptors) that a change decides on under the lock and that run after it, and the
//! commit that waits for the journal.
//!
//! Every operation ends with [`Memory::finish`]: the effects it queued run, with the
//! lock released, what it ended is told to the daemon's hook (revocations to importers,
//! copies that depended on it stopped: [`Memory::on_end`]), and a compaction it became due
//! for is waited on.

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
    /// Something whose drop may be slow, let go of outside the lock: an ended region's
    /// vendor object (closing the last descriptor of a CUDA export, or of a large memfd,
    /// frees its memory in `close`) or a cached copy file.
    Release(Box<dyn std::fmt::Debug + Send>),
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

    /// Ends an operation: queues a compaction if one is due, releases the lock, runs the
    /// effects the operation left and waits for the compaction.
    pub(super) fn finish(&self, mut st: MutexGuard<'_, State>) {
        let compaction = st.maybe_compact();
        // Registrations the operation detached first: unmapped before a backing they
        // reach is removed or its DAX device deleted.
        let unregistered = std::mem::take(&mut st.ledger.unregistered).into_iter();
        let mut effects: Vec<Effect> =
            unregistered.map(|(id, r)| Effect::Unregister { id, registration: Box::new(r) }).collect();
        effects.append(&mut st.effects);
        let hook =
            self.ended_hook.get().filter(|_| std::mem::take(&mut st.ledger.ended) || !st.ledger.revocations.is_empty());
        let revocations = hook.map(|_| std::mem::take(&mut st.ledger.revocations)).unwrap_or_default();
        drop(st);
        self.run(effects);
        if let Some(tell) = hook {
            // Importers told and copies stopped before the operation answers.
            (tell.0)(self, revocations);
        }
        if let Some(t) = compaction {
            let waited = t.wait();
            if let Err(e) = &waited {
                tracing::warn!(error = %crate::error_chain(e), "journal compaction failed; reopened before the next change");
            }
            self.state().settle(&waited);
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
                Effect::Unregister { id, registration } => self.undo_registration(id, *registration),
                Effect::Release(what) => drop(what),
            }
        }
    }
}
