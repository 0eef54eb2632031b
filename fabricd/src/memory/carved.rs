//! The registry's side of per-region DAX ([`super::carve`]): a region on a carved set gets
//! a DAX device of its own when it is allocated, loses it when it is freed, and finds it
//! again when the daemon restarts (devices outlive the daemon, like region files).

use std::fs::OpenOptions;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::alloc::AllocError;
use super::backing::DeviceBacking;
use super::backings::Backing;
use super::carve::{DaxRegion, Wanted, plan};
use super::reserve::Made;
use super::{Memory, MemoryError, State, io_err};

impl Memory {
    /// A device of its own for the range `[offset, offset + len)` of the set `b` backs,
    /// carved from `c` and opened read-write (see `Memory::make_backing`).
    pub(super) fn make_carved(b: &DeviceBacking, c: &DaxRegion, offset: u64, len: u64) -> Result<Made, MemoryError> {
        let at = b.file_offset(offset, len).ok_or(MemoryError::NoSpace(AllocError::NoSpace {
            len,
            align: b.align,
            capacity: b.len,
        }))?;
        let carved = c.carve(c.start + at, len).map_err(MemoryError::Carve)?;
        // The new device's range held its previous holder's bytes: zeroed before anyone
        // gets it.
        let opened = OpenOptions::new().read(true).write(true).open(&carved.path).map_err(io_err(&carved.path));
        let zeroed = opened.and_then(|f| super::zero::zero_range(&f, 0, len).map(|()| f).map_err(MemoryError::Zero));
        match zeroed {
            Ok(f) => {
                let backing = Backing::CarvedDax { path: carved.path, name: carved.name, from: c.clone() };
                Ok((OwnedFd::from(f), backing))
            }
            Err(e) => {
                if let Err(undo) = c.destroy(&carved.name) {
                    tracing::warn!(device = %carved.name, error = %undo, "cannot delete a DAX device nobody got");
                }
                Err(e)
            }
        }
    }
}

impl State {
    /// At start, after the journaled regions are back: gives each region on a carved set
    /// its device — the one found with exactly its range, else a new one at that range
    /// (device memory keeps its bytes, so it holds what it held) — and deletes every other
    /// device of the DAX region ([`plan`]). A region that gets no device is dropped with a
    /// `status` problem.
    pub(super) fn reconcile_carved(&mut self) {
        let carved: Vec<(String, DeviceBacking)> =
            self.set_backings.iter().filter(|(_, b)| b.carve.is_some()).map(|(s, b)| (s.clone(), b.clone())).collect();
        for (set, b) in carved {
            let Some(c) = &b.carve else { continue };
            let mut wanted = Vec::new();
            let mut ids: Vec<u64> = self.set_regions.iter().filter(|(_, s)| s.name == set).map(|(id, _)| *id).collect();
            ids.sort_unstable();
            for id in ids {
                let (Some(r), Some(s)) = (self.ledger.regions.get(&id), self.set_regions.get(&id)) else { continue };
                match b.file_offset(s.set_offset, r.len) {
                    Some(at) => wanted.push(Wanted { region: id, start: c.start + at, len: r.len }),
                    None => self.unrestore(id, &format!("its range is not inside {}'s DAX region", b.name)),
                }
            }
            let devices = match c.devices() {
                Ok(d) => d,
                Err(e) => {
                    for w in &wanted {
                        self.unrestore(
                            w.region,
                            &format!("the devices of {}'s DAX region are unreadable: {e}", b.name),
                        );
                    }
                    continue;
                }
            };
            let p = plan(&devices, &wanted);
            for o in &p.orphans {
                // A device bound to another driver (kmem: System RAM; anything else: someone's
                // device) is reported, never deleted.
                let foreign = devices
                    .iter()
                    .find(|d| &d.name == o)
                    .and_then(|d| d.driver.clone())
                    .filter(|drv| drv != "device_dax");
                if let Some(drv) = foreign {
                    tracing::warn!(device = %o, driver = %drv, "DAX device no region names is bound to another driver; left alone");
                    if self.problems.len() < 256 {
                        self.problems.push(format!(
                            "DAX device {o} (no region names it) is bound to {drv}: left alone, its range is not served"
                        ));
                    }
                    continue;
                }
                match c.destroy(o) {
                    Ok(()) => tracing::info!(device = %o, "DAX device no region names deleted"),
                    Err(e) => {
                        tracing::warn!(device = %o, error = %e, "cannot delete a DAX device no region names");
                        if self.problems.len() < 256 {
                            self.problems
                                .push(format!("DAX device {o} (no region names it) could not be deleted: {e}"));
                        }
                    }
                }
            }
            for (id, name) in &p.found {
                let bound = devices.iter().find(|d| &d.name == name).map(|d| c.bind(d));
                match bound {
                    Some(Ok(path)) => {
                        tracing::info!(region = id, device = %name, "region's DAX device found");
                        self.attach_carved(*id, name, path, c);
                    }
                    Some(Err(e)) => self.unrestore(*id, &format!("its DAX device {name}: {e}")),
                    None => self.unrestore(*id, &format!("its DAX device {name} vanished")),
                }
            }
            for w in wanted.iter().filter(|w| p.missing.contains(&w.region)) {
                match c.carve(w.start, w.len) {
                    Ok(d) => {
                        tracing::info!(region = w.region, device = %d.name, "region's DAX device was gone; carved again at its range");
                        self.attach_carved(w.region, &d.name, d.path, c);
                    }
                    Err(e) => {
                        self.unrestore(w.region, &format!("its DAX device is gone and cannot be carved again: {e}"))
                    }
                }
            }
        }
    }

    fn attach_carved(&mut self, id: u64, name: &str, path: PathBuf, from: &DaxRegion) {
        if let Some(r) = self.ledger.regions.get_mut(&id) {
            r.backing = Backing::CarvedDax { path, name: name.to_owned(), from: from.clone() };
        }
    }

    /// Takes region `id`, restored a moment ago, back out: its ranges and usage are given
    /// back and it is reported dropped.
    fn unrestore(&mut self, id: u64, why: &str) {
        if let Some(r) = self.ledger.unpublish_region(id) {
            self.resources[r.resource].ranges.free(r.offset);
            for i in self.set_regions.remove(&id).map(|s| s.others).unwrap_or_default() {
                self.resources[i].ranges.free(r.offset);
            }
        }
        self.lost(id, why);
    }
}
