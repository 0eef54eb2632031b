//! The power-loss test's model: what the guest's workload said the daemon acknowledged
//! (lines on the data port, `guest_probe/power.rs`), and the check of what a restarted
//! daemon holds against it.
//!
//! The rules: every acknowledged region is there, with its generation, size and file, and
//! its pages are the pattern (when the workload's `msync` returned before the power went)
//! or, page by page, the pattern or zeros (when not); an acknowledged free stays freed;
//! acknowledged exports import (with the region's bytes) unless an acknowledged revoke
//! says otherwise; nothing the daemon never acknowledged is there, except the effect of
//! the one change the workload had sent when the power went (its `T` line without an
//! answer), which may or may not have happened. After a check the model takes on what it
//! found for that one change ([`Model::settle`]).

use std::collections::{BTreeMap, BTreeSet};

/// Page size the workload writes and the observer reads in.
pub const PAGE: u64 = 4096;
/// Pages of a region the workload writes (spread over the region).
pub const WRITTEN_PAGES: u64 = 16;

/// The pattern seed of a region.
pub fn region_seed(region: u64, generation: u64) -> u64 {
    region.wrapping_mul(0x1_0000_01b3) ^ generation.rotate_left(32) ^ 0x70_6f77_6572
}

/// The pages of a `len`-byte region the workload writes.
pub fn written_pages(len: u64) -> impl Iterator<Item = u64> {
    let pages = len / PAGE;
    let n = WRITTEN_PAGES.min(pages);
    (0..n).map(move |i| i * pages / n)
}

/// One page read back at byte `offset` of a region: `Some(true)` when it is a written page
/// holding the pattern, `Some(false)` when it is all zeros, `None` for anything else (a
/// written page with other bytes, or an unwritten page that is not zero).
pub fn page_class(buf: &[u8], seed: u64, offset: u64, written: bool) -> Option<bool> {
    if buf.iter().all(|&b| b == 0) {
        return Some(false);
    }
    let pattern = written
        && buf
            .chunks_exact(8)
            .enumerate()
            .all(|(i, w)| w == crate::pattern::word(seed, offset + i as u64 * 8).to_le_bytes());
    pattern.then_some(true)
}

/// The change the workload had sent when the power went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pending {
    /// An allocation.
    Alloc,
    /// An export of this region.
    Export(u64),
    /// A revocation of this handle.
    Revoke(String),
    /// A free of this region.
    Free(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Region {
    generation: u64,
    len: u64,
    /// The workload's msync of its pages returned.
    synced: bool,
    /// Exports whose handle the host never saw (an export the power cut short, found done).
    unknown_exports: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Handle {
    region: u64,
    revoked: bool,
}

/// Counts for the test's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Acknowledged changes seen.
    pub acknowledged: u64,
    /// Regions checked present (sum over checks).
    pub regions_checked: u64,
    /// Of those, regions whose synced contents were checked.
    pub contents_checked: u64,
    /// Acknowledged frees checked gone (sum over checks).
    pub frees_checked: u64,
    /// Imports of handles checked (sum over checks).
    pub imports_checked: u64,
    /// Power cuts that found a change in flight.
    pub in_flight: u64,
    /// Of those, changes that turned out to have happened.
    pub in_flight_done: u64,
}

/// The acknowledged state of the registry, from the workload's lines of every boot.
#[derive(Debug, Clone, Default)]
pub struct Model {
    regions: BTreeMap<u64, Region>,
    freed: BTreeSet<u64>,
    handles: BTreeMap<String, Handle>,
    pending: Option<Pending>,
    /// The last workload's session token (hex), for the next one to resume.
    pub token: Option<String>,
    /// Counts for the report.
    pub stats: Stats,
}

/// What the observer found (its JSON, `guest_probe/power.rs`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct Observed {
    /// Every region the daemon holds.
    pub regions: Vec<ObservedRegion>,
    /// Every export.
    pub exports: Vec<ObservedExport>,
    /// Region files no region names.
    pub stray_files: Vec<u64>,
    /// The import of each handle the host listed: `{"ok": [pattern, zero, bad]}` or
    /// `{"refused": "Code"}`.
    pub imports: BTreeMap<String, serde_json::Value>,
    /// `status` problems.
    pub problems: Vec<String>,
}

/// One region the daemon holds, and its file.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ObservedRegion {
    /// Id.
    pub id: u64,
    /// Generation.
    pub generation: u64,
    /// Bytes.
    pub size: u64,
    /// Its file's size, if there is one.
    pub file_size: Option<u64>,
    /// Written pages with the pattern, written pages that are zero, bad pages.
    pub pages: Option<[u64; 3]>,
}

/// One export the daemon holds.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ObservedExport {
    /// Its region.
    pub region: u64,
    /// Revoked.
    pub revoked: bool,
}

impl Model {
    /// Applies one boot's workload lines. Only whole lines count: the power may cut the
    /// last one short.
    pub fn apply_log(&mut self, log: &str) -> Result<(), String> {
        let log = log.replace('\r', "");
        let whole = match log.rfind('\n') {
            Some(i) => &log[..i],
            None => "",
        };
        let mut in_blob = false;
        self.pending = None;
        for line in whole.lines() {
            if line.starts_with("FABRIC-BLOB-BEGIN") {
                in_blob = true;
            } else if line.starts_with("FABRIC-BLOB-END") {
                in_blob = false;
            }
            if in_blob {
                continue;
            }
            self.apply_line(line).map_err(|e| format!("workload line {line:?}: {e}"))?;
        }
        Ok(())
    }

    fn apply_line(&mut self, line: &str) -> Result<(), String> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok()).ok_or("bad number");
        let acked = |m: &mut Self| {
            m.pending = None;
            m.stats.acknowledged += 1;
        };
        match f.first().copied() {
            Some("H") => self.token = f.get(1).map(|s| (*s).to_owned()),
            Some("T") => {
                self.pending = Some(match f.get(1).copied() {
                    Some("A") => Pending::Alloc,
                    Some("E") => Pending::Export(num(2)?),
                    Some("V") => Pending::Revoke(f.get(2).ok_or("no handle")?.to_string()),
                    Some("F") => Pending::Free(num(2)?),
                    _ => return Err("unknown change".into()),
                })
            }
            Some("A") => {
                let (id, generation, len) = (num(1)?, num(2)?, num(3)?);
                if self.regions.contains_key(&id) || self.freed.contains(&id) {
                    return Err(format!("region {id} acknowledged twice"));
                }
                self.regions.insert(id, Region { generation, len, synced: false, unknown_exports: 0 });
                acked(self);
            }
            Some("S") => {
                self.regions.get_mut(&num(1)?).ok_or("unknown region")?.synced = true;
            }
            Some("E") => {
                let id = num(1)?;
                self.regions.get(&id).ok_or("unknown region")?;
                self.handles.insert(f.get(3).ok_or("no handle")?.to_string(), Handle { region: id, revoked: false });
                acked(self);
            }
            Some("V") => {
                self.handles.get_mut(f.get(1).copied().ok_or("no handle")?).ok_or("unknown handle")?.revoked = true;
                acked(self);
            }
            Some("F") => {
                let id = num(1)?;
                self.regions.remove(&id).ok_or("unknown region")?;
                self.freed.insert(id);
                acked(self);
            }
            _ => {}
        }
        Ok(())
    }

    /// The change in flight when the power went, if any.
    pub fn pending(&self) -> Option<&Pending> {
        self.pending.as_ref()
    }

    /// Every handle the workload was given, one per line, for the observer to import.
    pub fn handles(&self) -> String {
        self.handles.keys().map(|h| format!("{h}\n")).collect()
    }

    /// Live regions the model holds.
    pub fn live(&self) -> usize {
        self.regions.len()
    }

    /// Compares what a restarted daemon holds with the acknowledged state; each
    /// disagreement is one line.
    pub fn check(&mut self, obs: &Observed) -> Vec<String> {
        let mut diffs = Vec::new();
        let pending = self.pending.clone();
        // The sim fabric has problems of its own (a degraded link); the registry's are about
        // `memory` (a region dropped at start) or the journal.
        for p in obs.problems.iter().filter(|p| p.contains(" memory:") || p.to_lowercase().contains("journal")) {
            diffs.push(format!("status reports a problem: {p}"));
        }
        if !obs.stray_files.is_empty() {
            diffs.push(format!("region files no region names: {:?}", obs.stray_files));
        }
        let found: BTreeMap<u64, &ObservedRegion> = obs.regions.iter().map(|r| (r.id, r)).collect();
        for (id, r) in &self.regions {
            let Some(o) = found.get(id) else {
                if pending != Some(Pending::Free(*id)) {
                    diffs.push(format!("acknowledged region {id} is gone"));
                }
                continue;
            };
            self.stats.regions_checked += 1;
            if (o.generation, o.size) != (r.generation, r.len) {
                diffs.push(format!(
                    "region {id}: generation {} size {}, acknowledged {} {}",
                    o.generation, o.size, r.generation, r.len
                ));
            }
            diffs.extend(check_file(o, r.synced));
            if r.synced {
                self.stats.contents_checked += 1;
            }
        }
        let extra: Vec<&&ObservedRegion> =
            found.iter().filter(|(id, _)| !self.regions.contains_key(id)).map(|(_, r)| r).collect();
        for o in &extra {
            if self.freed.contains(&o.id) {
                diffs.push(format!("region {} was freed (acknowledged) and is back", o.id));
            } else if pending != Some(Pending::Alloc) || extra.len() > 1 {
                diffs.push(format!("region {} is there but was never acknowledged", o.id));
            } else {
                diffs.extend(check_file(o, false));
            }
        }
        self.stats.frees_checked += self.freed.len() as u64;
        for (id, r) in &self.regions {
            let exports: Vec<&ObservedExport> = obs.exports.iter().filter(|e| e.region == *id).collect();
            let known: Vec<&Handle> = self.handles.values().filter(|h| h.region == *id).collect();
            let want = known.len() as u64 + r.unknown_exports;
            let maybe = u64::from(pending == Some(Pending::Export(*id)));
            let got = exports.len() as u64;
            if found.contains_key(id) && !(want..=want + maybe).contains(&got) {
                diffs.push(format!("region {id}: {got} exports, acknowledged {want}"));
            }
            let revoked = exports.iter().filter(|e| e.revoked).count() as u64;
            let want_revoked = known.iter().filter(|h| h.revoked).count() as u64;
            let maybe_revoked = u64::from(
                matches!(&pending, Some(Pending::Revoke(h)) if self.handles.get(h).is_some_and(|x| x.region == *id)),
            );
            if found.contains_key(id) && !(want_revoked..=want_revoked + maybe_revoked).contains(&revoked) {
                diffs.push(format!("region {id}: {revoked} exports revoked, acknowledged {want_revoked}"));
            }
        }
        for (h, handle) in &self.handles {
            self.stats.imports_checked += 1;
            let got = obs.imports.get(h);
            let refused = got.and_then(|g| g["refused"].as_str());
            let pages = got.and_then(|g| serde_json::from_value::<[u64; 3]>(g["ok"].clone()).ok());
            let present = found.contains_key(&handle.region);
            let maybe_revoked = pending == Some(Pending::Revoke(h.clone()));
            let ok = match (present, refused, pages) {
                (false, Some("InvalidHandle" | "NotFound"), _) => true,
                (true, Some("Revoked"), _) => handle.revoked || maybe_revoked,
                (true, None, Some(p)) if !handle.revoked => {
                    let r = self.regions.get(&handle.region);
                    let written = r.map_or(0, |r| written_pages(r.len).count() as u64);
                    p[2] == 0 && (!r.is_some_and(|r| r.synced) || p[0] == written)
                }
                _ => false,
            };
            if !ok {
                let state = if !present {
                    "its region is freed"
                } else if handle.revoked {
                    "it is revoked"
                } else {
                    "it is live"
                };
                diffs.push(format!("import of {h} ({state}): {got:?}"));
            }
        }
        diffs
    }

    /// Takes on what the check found for the change in flight (it happened or not), so
    /// the next boot is checked against it.
    pub fn settle(&mut self, obs: &Observed) {
        let Some(p) = self.pending.take() else { return };
        self.stats.in_flight += 1;
        let found: BTreeMap<u64, &ObservedRegion> = obs.regions.iter().map(|r| (r.id, r)).collect();
        let done = match &p {
            Pending::Alloc => match obs.regions.iter().find(|r| !self.regions.contains_key(&r.id)) {
                Some(o) => {
                    let r = Region { generation: o.generation, len: o.size, synced: false, unknown_exports: 0 };
                    self.regions.insert(o.id, r);
                    true
                }
                None => false,
            },
            Pending::Free(id) => {
                let gone = !found.contains_key(id);
                if gone {
                    self.regions.remove(id);
                    self.freed.insert(*id);
                }
                gone
            }
            Pending::Export(id) => {
                let known = self.handles.values().filter(|h| h.region == *id).count() as u64;
                let got = obs.exports.iter().filter(|e| e.region == *id).count() as u64;
                match self.regions.get_mut(id) {
                    Some(r) if got > known + r.unknown_exports => {
                        r.unknown_exports += 1;
                        true
                    }
                    _ => false,
                }
            }
            Pending::Revoke(h) => {
                let revoked = obs.imports.get(h).and_then(|g| g["refused"].as_str()) == Some("Revoked");
                if let Some(x) = self.handles.get_mut(h).filter(|_| revoked) {
                    x.revoked = true;
                }
                revoked
            }
        };
        if done {
            self.stats.in_flight_done += 1;
        }
    }
}

/// A region's file: there, of its size, no bad page, and (`synced`) every written page
/// holding the pattern.
fn check_file(o: &ObservedRegion, synced: bool) -> Vec<String> {
    let id = o.id;
    if o.file_size != Some(o.size) {
        return vec![format!("region {id}: file size {:?}, region size {}", o.file_size, o.size)];
    }
    let Some([pattern, _zero, bad]) = o.pages else { return vec![format!("region {id}: pages not read")] };
    let written = written_pages(o.size).count() as u64;
    let mut diffs = Vec::new();
    if bad > 0 {
        diffs.push(format!("region {id}: {bad} pages hold neither the pattern nor zeros"));
    }
    if synced && pattern != written {
        diffs.push(format!("region {id}: {pattern} of {written} msynced pages hold the pattern"));
    }
    diffs
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB2: u64 = 2 << 20;

    /// A way to damage what the observer found, and what the check must then say.
    type Damage = (&'static str, Box<dyn Fn(&mut Observed)>);

    fn region(id: u64, pages: [u64; 3]) -> ObservedRegion {
        ObservedRegion { id, generation: id, size: MIB2, file_size: Some(MIB2), pages: Some(pages) }
    }

    fn ok_import(pages: [u64; 3]) -> serde_json::Value {
        serde_json::json!({ "ok": pages })
    }

    /// Region 1 written and synced and exported (handle h1), region 2 never written,
    /// region 3 freed; the power went while region 2 was being freed.
    fn model() -> Model {
        let mut m = Model::default();
        let log = "H 00112233445566778899aabbccddeeff\nT A\nA 1 1 2097152\nS 1\nT E 1\nE 1 1 h1\nT A\nA 2 2 2097152\n\
                   T A\nA 3 3 2097152\nT F 3\nF 3\nT F 2\nA 9 9 20";
        m.apply_log(log).expect("log");
        m
    }

    fn observed() -> Observed {
        let mut imports = BTreeMap::new();
        imports.insert("h1".to_owned(), ok_import([16, 0, 0]));
        Observed {
            regions: vec![region(1, [16, 0, 0]), region(2, [0, 16, 0])],
            exports: vec![ObservedExport { region: 1, revoked: false }],
            imports,
            ..Observed::default()
        }
    }

    #[test]
    fn pages_are_told_apart() {
        let seed = region_seed(4, 4);
        let mut page: Vec<u8> =
            (0..PAGE / 8).flat_map(|i| crate::pattern::word(seed, PAGE + i * 8).to_le_bytes()).collect();
        assert_eq!(page_class(&page, seed, PAGE, true), Some(true));
        assert_eq!(page_class(&page, seed, 2 * PAGE, true), None, "the pattern of another offset");
        assert_eq!(page_class(&page, seed, PAGE, false), None, "an unwritten page must be zero");
        page[100] ^= 1;
        assert_eq!(page_class(&page, seed, PAGE, true), None);
        assert_eq!(page_class(&[0; PAGE as usize], seed, PAGE, true), Some(false));
        assert_eq!(written_pages(MIB2).count() as u64, WRITTEN_PAGES);
        assert!(written_pages(MIB2).all(|p| p < MIB2 / PAGE));
    }

    #[test]
    fn the_acknowledged_state_checks_clean_and_a_cut_line_does_not_count() {
        let mut m = model();
        assert_eq!(m.pending(), Some(&Pending::Free(2)));
        assert_eq!(m.token.as_deref(), Some("00112233445566778899aabbccddeeff"));
        assert_eq!(m.live(), 2, "the cut-off line `A 9 9 20` is not an acknowledgement");
        assert_eq!(m.check(&observed()), Vec::<String>::new());
        // The free in flight may have happened.
        let mut o = observed();
        o.regions.retain(|r| r.id != 2);
        assert_eq!(m.check(&o), Vec::<String>::new());
        m.settle(&o);
        assert_eq!(m.live(), 1);
        assert_eq!(m.stats.in_flight_done, 1);
    }

    #[test]
    fn each_kind_of_loss_is_caught() {
        let cases: Vec<Damage> = vec![
            ("is gone", Box::new(|o| o.regions.retain(|r| r.id != 1))),
            ("was freed (acknowledged) and is back", Box::new(|o| o.regions.push(region(3, [0, 16, 0])))),
            ("never acknowledged", Box::new(|o| o.regions.push(region(7, [0, 16, 0])))),
            ("msynced pages hold the pattern", Box::new(|o| o.regions[0].pages = Some([15, 1, 0]))),
            ("neither the pattern nor zeros", Box::new(|o| o.regions[1].pages = Some([0, 15, 1]))),
            ("file size", Box::new(|o| o.regions[1].file_size = None)),
            ("exports, acknowledged", Box::new(|o| o.exports.clear())),
            (
                "import of h1",
                Box::new(|o| drop(o.imports.insert("h1".into(), serde_json::json!({"refused": "Revoked"})))),
            ),
            ("status reports a problem", Box::new(|o| o.problems.push("Other memory: region 1 dropped".into()))),
            ("region files no region names", Box::new(|o| o.stray_files.push(5))),
        ];
        for (want, damage) in cases {
            let mut o = observed();
            damage(&mut o);
            let diffs = model().check(&o);
            assert!(diffs.iter().any(|d| d.contains(want)), "{want:?} not caught: {diffs:?}");
        }
        // A sim fabric's own problems are not the registry's.
        let mut o = observed();
        o.problems.push("LinkDegraded pci:x<->y: running at half speed".into());
        assert_eq!(model().check(&o), Vec::<String>::new());
    }

    #[test]
    fn an_allocation_in_flight_may_be_found_and_is_then_tracked() {
        let mut m = Model::default();
        m.apply_log("T A\nA 1 1 2097152\nT A\n").expect("log");
        let mut o = Observed { regions: vec![region(1, [0, 16, 0]), region(2, [0, 16, 0])], ..Observed::default() };
        assert_eq!(m.check(&o), Vec::<String>::new());
        m.settle(&o);
        assert_eq!(m.live(), 2);
        // From now on it is as good as acknowledged.
        m.apply_log("H x\n").expect("log");
        o.regions.pop();
        assert!(m.check(&o).iter().any(|d| d.contains("region 2 is gone")));
    }

    #[test]
    fn revocations_hold() {
        let mut m = Model::default();
        m.apply_log("T A\nA 1 1 2097152\nT E 1\nE 1 1 h1\nT V h1\nV h1\n").expect("log");
        let mut imports = BTreeMap::new();
        imports.insert("h1".to_owned(), ok_import([0, 16, 0]));
        let mut o = Observed {
            regions: vec![region(1, [0, 16, 0])],
            exports: vec![ObservedExport { region: 1, revoked: true }],
            imports,
            ..Observed::default()
        };
        assert!(m.check(&o).iter().any(|d| d.contains("import of h1 (it is revoked)")));
        o.imports.insert("h1".into(), serde_json::json!({"refused": "Revoked"}));
        assert_eq!(m.check(&o), Vec::<String>::new());
        o.exports[0].revoked = false;
        assert!(m.check(&o).iter().any(|d| d.contains("exports revoked")));
    }
}
