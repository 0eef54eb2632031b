//! Golden outputs: every sim fabric in `configs/sim/*.toml` in every output format of
//! `fabricctl topology` (table, tree, json, dot, nccl-xml), `fabricctl devices` (table,
//! json) and `fabricctl path` (table, json; from the fabric's first matrix label to its
//! last, which crosses the network on the multi-node fabrics).
//!
//! Each output is written by the functions `fabricctl` itself calls
//! (`fabric_cli::write_topology`, `write_devices`, `write_path`) and compared with
//! `tests/golden/STEM.OUTPUT`, the full text, when it is at most [`FULL_MAX`] bytes. A
//! larger one (the 1,024-accelerator pod's JSON; the 100,000-GPU cluster's JSON, DOT and
//! device lists, up to 1.3 GB) would be megabytes to gigabytes of repository, so it is
//! compared with `STEM.OUTPUT.digest` instead: the command, byte and line counts, the
//! FNV-1a 64 hash of the whole text and of its first k × [`CHECKPOINT_LINES`] lines for
//! every k (the first checkpoint that differs says where the first change is), and its
//! first and last [`EDGE_LINES`] lines. FNV-1a because it is fixed by its definition
//! (std's hashers are not), needs no dependency, and is cheap per byte in a debug build.
//!
//! `UPDATE_GOLDEN=1 cargo nextest run -p fabric-cli --test golden` (re)writes them and
//! removes a golden of the other kind; review the diff. The outputs are deterministic: no
//! time, no host data, every collection in the stable device order or sorted.
//!
//! Time. The 100,000-GPU cluster is most of it: in a debug build its outputs take about
//! 3 CPU-minutes (the JSON document, 56 million lines, about 110 s; the devices document
//! 90 s; the DOT graph 25 s; loading it 12 s), the other fabrics 3 s together. That is not a
//! renderer bug: every output streams in one pass with bounded extra memory, and a profile
//! of the JSON is all serde_json's pretty printer making ~8 small writes a line, each
//! through the debug build's checked copies: the cost is per byte written. So the big
//! fabric has a test of its own, [`big_fabrics_match_their_goldens`], ignored by a plain
//! `cargo test` and run by `scripts/test.sh` (CI) as a step of its own:
//! `cargo nextest run -p fabric-cli --test golden --run-ignored all` runs both (with
//! `UPDATE_GOLDEN=1`, rewrites both). Each fabric's outputs render on threads of their own,
//! so with idle cores to spare the big test takes about as long as its JSON.

// The timings of each output go to the test's log.
#![allow(clippy::print_stderr)]

use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::ValueEnum;
use fabric_cli::args::{ListFormat, TopologyFormat};
use fabric_cli::source::Source;
use fabric_cli::view::View;

/// Outputs up to this size are kept whole; larger ones as a digest.
const FULL_MAX: usize = 1 << 20;

/// A digest records the hash of the text up to every this many lines.
const CHECKPOINT_LINES: u64 = 250_000;

/// A digest keeps this many lines from each end of the text.
const EDGE_LINES: usize = 20;

/// What `fabricctl` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Topology(TopologyFormat),
    Devices(ListFormat),
    Path(ListFormat),
}

/// Every output, with the suffix of its golden file.
const OUTPUTS: &[(&str, Output)] = &[
    ("table", Output::Topology(TopologyFormat::Table)),
    ("tree", Output::Topology(TopologyFormat::Tree)),
    ("json", Output::Topology(TopologyFormat::Json)),
    ("dot", Output::Topology(TopologyFormat::Dot)),
    ("nccl-xml", Output::Topology(TopologyFormat::NcclXml)),
    ("devices", Output::Devices(ListFormat::Table)),
    ("devices-json", Output::Devices(ListFormat::Json)),
    ("path", Output::Path(ListFormat::Table)),
    ("path-json", Output::Path(ListFormat::Json)),
];

/// The `-o` value of a format, as clap spells it.
fn flag<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value().expect("no hidden formats").get_name().to_owned()
}

/// The two devices the path outputs route between: the first and the last matrix label.
fn path_ends(view: &View) -> (String, String) {
    let labels = view.labels.entries();
    assert!(labels.len() >= 2, "a sim fabric needs two matrix devices for its path golden");
    (labels[0].0.clone(), labels[labels.len() - 1].0.clone())
}

impl Output {
    /// The command line that prints this output (for digests and messages).
    fn command(self, config: &str, view: &View) -> String {
        match self {
            Output::Topology(f) => format!("fabricctl topology --sim {config} -o {}", flag(&f)),
            Output::Devices(f) => format!("fabricctl devices --sim {config} -o {}", flag(&f)),
            Output::Path(f) => {
                let (a, b) = path_ends(view);
                format!("fabricctl path --sim {config} {a} {b} -o {}", flag(&f))
            }
        }
    }

    fn write(self, view: &View, w: &mut dyn Write) -> anyhow::Result<()> {
        match self {
            Output::Topology(f) => fabric_cli::write_topology(view, f, w),
            Output::Devices(f) => Ok(fabric_cli::write_devices(view, f, w)?),
            Output::Path(f) => {
                let (a, b) = path_ends(view);
                fabric_cli::write_path(view, &a, &b, f, w)
            }
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Takes an output as it streams: the text while it is at most [`FULL_MAX`] bytes, and the
/// digest whatever its size, so a 1.3 GB document is never held in memory.
struct Capture {
    text: Option<Vec<u8>>,
    bytes: u64,
    lines: u64,
    hash: u64,
    checkpoints: Vec<(u64, u64)>,
    head: Vec<u8>,
    tail: Vec<u8>,
}

/// Bytes of the end of the text kept to find its last lines in.
const TAIL_WINDOW: usize = 1 << 16;

impl Capture {
    fn new() -> Self {
        Self {
            text: Some(Vec::new()),
            bytes: 0,
            lines: 0,
            hash: FNV_OFFSET,
            checkpoints: Vec::new(),
            head: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// The digest's text: `command` first, then counts, hashes and the edge lines.
    fn digest(&self, command: &str) -> String {
        let mut s = format!(
            "{command}\n\
             # A digest of the output, which is over {FULL_MAX} bytes (see cli/tests/golden.rs).\n\
             bytes {}\nlines {}\nfnv1a64 {:016x}\n",
            self.bytes, self.lines, self.hash
        );
        for (line, hash) in &self.checkpoints {
            s.push_str(&format!("fnv1a64 of lines 1-{line} {hash:016x}\n"));
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let head: Vec<String> = text(&self.head).lines().take(EDGE_LINES).map(str::to_owned).collect();
        let window = text(&self.tail);
        let tail: Vec<&str> = window.lines().collect();
        // The window may start inside a line: only its whole lines count.
        let whole = if self.tail.len() as u64 == self.bytes { &tail[..] } else { &tail[1.min(tail.len())..] };
        let tail = &whole[whole.len().saturating_sub(EDGE_LINES)..];
        s.push_str(&format!("first {} lines:\n", head.len()));
        for l in head {
            s.push_str(&format!("| {l}\n"));
        }
        s.push_str(&format!("last {} lines:\n", tail.len()));
        for l in tail {
            s.push_str(&format!("| {l}\n"));
        }
        s
    }
}

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(text) = &mut self.text {
            if text.len() + buf.len() <= FULL_MAX {
                text.extend_from_slice(buf);
            } else {
                self.text = None;
            }
        }
        if (self.lines as usize) < EDGE_LINES {
            self.head.extend_from_slice(buf);
        }
        self.tail.extend_from_slice(buf);
        if self.tail.len() > 2 * TAIL_WINDOW {
            self.tail.drain(..self.tail.len() - TAIL_WINDOW);
        }
        for &b in buf {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(FNV_PRIME);
            if b == b'\n' {
                self.lines += 1;
                if self.lines.is_multiple_of(CHECKPOINT_LINES) {
                    self.checkpoints.push((self.lines, self.hash));
                }
            }
        }
        self.bytes += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The first difference with a few lines of context.
fn diff(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let first = w.iter().zip(&g).position(|(a, b)| a != b).unwrap_or(w.len().min(g.len()));
    let mut out =
        format!("first difference at line {} (golden {} lines, output {} lines)\n", first + 1, w.len(), g.len());
    let lo = first.saturating_sub(3);
    for (i, l) in w.iter().enumerate().skip(lo).take(10) {
        out.push_str(&format!("- {:5} {l}\n", i + 1));
    }
    for (i, l) in g.iter().enumerate().skip(lo).take(10) {
        out.push_str(&format!("+ {:5} {l}\n", i + 1));
    }
    out
}

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn golden_dir() -> PathBuf {
    manifest().join("tests/golden")
}

fn sim_files() -> Vec<PathBuf> {
    let dir = manifest().join("../configs/sim");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect()
        })
        .unwrap_or_default();
    files.sort();
    assert!(!files.is_empty(), "no sim fabrics in {}: the golden test needs configs/sim/*.toml", dir.display());
    files
}

fn stem(file: &Path) -> String {
    file.file_stem().and_then(|s| s.to_str()).expect("file stem").to_owned()
}

fn update() -> bool {
    std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1")
}

/// Checks (or, updating, writes) one output's golden; a failure is its message.
fn check(stem: &str, suffix: &str, got: &Capture, command: &str) -> Result<(), String> {
    let (full, digest) =
        (golden_dir().join(format!("{stem}.{suffix}")), golden_dir().join(format!("{stem}.{suffix}.digest")));
    let (path, stale, want) = match &got.text {
        Some(text) => (full, digest, String::from_utf8(text.clone()).map_err(|e| format!("{command}: {e}"))?),
        None => (digest, full, got.digest(command)),
    };
    if update() {
        std::fs::create_dir_all(golden_dir()).expect("golden dir");
        std::fs::write(&path, &want).expect("write golden");
        if stale.exists() {
            std::fs::remove_file(&stale).expect("remove the golden of the other kind");
        }
        return Ok(());
    }
    if stale.exists() {
        return Err(format!(
            "{}: stale: the output now has a golden of the other kind (UPDATE_GOLDEN=1)",
            stale.display()
        ));
    }
    match std::fs::read_to_string(&path) {
        Ok(golden) if golden == want => Ok(()),
        Ok(golden) => Err(format!("{} ({command}): differs\n{}", path.display(), diff(&golden, &want))),
        Err(_) => Err(format!("{}: missing (run with UPDATE_GOLDEN=1 to create it)", path.display())),
    }
}

/// Loads one sim fabric and checks all its outputs, each rendered on its own thread.
fn check_fabric(file: &Path, failures: &mut Vec<String>) {
    let stem = stem(file);
    let config = format!("configs/sim/{}", file.file_name().and_then(|n| n.to_str()).expect("file name"));
    let t0 = Instant::now();
    let fabric = match Source::Sim(file.to_owned()).load() {
        Ok(f) => f,
        Err(e) => {
            let chain: Vec<String> = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
                .map(ToString::to_string)
                .collect();
            failures.push(format!("{stem}: {}", chain.join(": ")));
            return;
        }
    };
    let view = View::new(fabric, None).expect("view without node filter");
    eprintln!("{stem}: {} devices loaded in {:?}", view.fabric.len(), t0.elapsed());
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let threads: Vec<_> = OUTPUTS
            .iter()
            .map(|&(suffix, output)| {
                let (view, stem, config) = (&view, &stem, &config);
                s.spawn(move || {
                    let t = Instant::now();
                    let command = output.command(config, view);
                    let mut w = BufWriter::with_capacity(1 << 16, Capture::new());
                    output.write(view, &mut w).map_err(|e| format!("{command}: {e:#}"))?;
                    let got = w.into_inner().map_err(|e| format!("{command}: {e}"))?;
                    eprintln!("  {suffix}: {} bytes, {} lines in {:?}", got.bytes, got.lines, t.elapsed());
                    if got.bytes == 0 {
                        return Err(format!("{command}: printed nothing"));
                    }
                    check(stem, suffix, &got, &command)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err("a renderer panicked".to_owned()))).collect()
    });
    failures.extend(results.into_iter().filter_map(Result::err));
}

/// Sim fabrics too big to wait for beside the others (see the module docs), by file stem.
const BIG_FABRICS: &[&str] = &["cluster-100k"];

/// Checks the sim fabrics that are (or are not) in [`BIG_FABRICS`].
fn check_fabrics(big: bool) {
    let mut failures = Vec::new();
    let mut checked = Vec::new();
    for file in sim_files() {
        if BIG_FABRICS.contains(&stem(&file).as_str()) == big {
            check_fabric(&file, &mut failures);
            checked.push(stem(&file));
        }
    }
    if big {
        assert_eq!(checked, BIG_FABRICS, "BIG_FABRICS names a fabric configs/sim does not have");
    }
    assert!(!checked.is_empty(), "no sim fabric to check");
    assert!(failures.is_empty(), "{} golden failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn sim_fabrics_match_their_goldens() {
    check_fabrics(false);
}

#[test]
#[ignore = "about 3 CPU-minutes in a debug build; scripts/test.sh runs it (see the module docs)"]
fn big_fabrics_match_their_goldens() {
    check_fabrics(true);
}

/// Every `-o` value of `topology`, `devices` and `path` has a golden output.
#[test]
fn every_output_format_has_goldens() {
    for f in TopologyFormat::value_variants() {
        assert!(OUTPUTS.iter().any(|(_, o)| *o == Output::Topology(*f)), "topology -o {} has no golden", flag(f));
    }
    for f in ListFormat::value_variants() {
        assert!(OUTPUTS.iter().any(|(_, o)| *o == Output::Devices(*f)), "devices -o {} has no golden", flag(f));
        assert!(OUTPUTS.iter().any(|(_, o)| *o == Output::Path(*f)), "path -o {} has no golden", flag(f));
    }
}

/// Every file in `tests/golden/` belongs to a sim fabric and an output, so a golden of a
/// removed fabric or format does not linger untested.
#[test]
fn every_golden_belongs_to_a_fabric_and_an_output() {
    let stems: Vec<String> = sim_files().iter().map(|f| stem(f)).collect();
    let mut stray = Vec::new();
    for e in std::fs::read_dir(golden_dir()).expect("tests/golden").filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue; // .gitkeep
        }
        let base = name.strip_suffix(".digest").unwrap_or(&name);
        let known = stems.iter().any(|s| {
            base.strip_prefix(s.as_str())
                .and_then(|r| r.strip_prefix('.'))
                .is_some_and(|suffix| OUTPUTS.iter().any(|(x, _)| *x == suffix))
        });
        if !known {
            stray.push(name);
        }
    }
    assert!(stray.is_empty(), "goldens of no sim fabric or output (remove them): {stray:?}");
}

/// The digest is FNV-1a 64 as published (test vectors of the reference implementation),
/// its checkpoints fall on line boundaries, and its edges are whole lines.
#[test]
fn digests_hash_count_and_keep_the_edges() {
    let digest = |text: &[u8]| {
        let mut c = Capture::new();
        for chunk in text.chunks(7) {
            c.write_all(chunk).expect("in memory");
        }
        c
    };
    assert_eq!(digest(b"").hash, 0xcbf2_9ce4_8422_2325);
    assert_eq!(digest(b"a").hash, 0xaf63_dc4c_8601_ec8c);
    assert_eq!(digest(b"foobar").hash, 0x8594_4171_f739_67e8);

    let lines: Vec<String> = (0..CHECKPOINT_LINES + 5).map(|i| format!("line {i}\n")).collect();
    let text = lines.concat();
    let c = digest(text.as_bytes());
    assert!(c.text.is_none(), "over FULL_MAX");
    assert_eq!((c.bytes, c.lines), (text.len() as u64, CHECKPOINT_LINES + 5));
    let prefix = lines[..CHECKPOINT_LINES as usize].concat();
    assert_eq!(c.checkpoints, [(CHECKPOINT_LINES, digest(prefix.as_bytes()).hash)]);
    let d = c.digest("cmd");
    assert!(d.starts_with("cmd\n"), "{d}");
    assert!(d.contains("first 20 lines:\n| line 0\n"), "{d}");
    assert!(d.contains(&format!("last 20 lines:\n| line {}\n", CHECKPOINT_LINES - 15)), "{d}");
    assert!(d.ends_with(&format!("| line {}\n", CHECKPOINT_LINES + 4)), "{d}");
}
