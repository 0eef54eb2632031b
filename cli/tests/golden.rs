//! Golden outputs for every sim fabric in `configs/sim/*.toml` and every output format.
//!
//! A missing or different golden fails with a diff; `UPDATE_GOLDEN=1 cargo test -p
//! fabric-cli --test golden` (re)writes them. The formats whose size grows with the fabric
//! (json, dot, devices) are kept as goldens only up to 300 devices, checked for
//! well-formedness up to 5,000, and skipped beyond; table, tree and NCCL XML always have
//! goldens. The test fails when `configs/sim` holds no fabric, so it cannot pass
//! vacuously.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fabric_cli::render;
use fabric_cli::source::Source;
use fabric_cli::view::View;

/// Above this many devices only the table, tree and NCCL XML are rendered.
const BIG: usize = 5_000;

/// Above this many devices the formats that grow with the fabric are rendered and checked
/// for well-formedness, but not kept as goldens (they would be megabytes of repository).
const GOLDEN_MAX: usize = 300;

const FORMATS: &[(&str, bool)] =
    &[("table", false), ("tree", false), ("json", true), ("dot", true), ("nccl-xml", false), ("devices", true)];

fn render_fmt(view: &View, fmt: &str) -> String {
    let mut buf: Vec<u8> = Vec::new();
    let w: &mut dyn Write = &mut buf;
    let r = match fmt {
        "table" => render::matrix::render(view, w),
        "tree" => render::tree::render(view, w),
        "json" => render::json::render_topology(view, w),
        "dot" => render::dot::render(view, w),
        "devices" => render::devices::render(view, w),
        "nccl-xml" => match view.single_node() {
            Ok(node) => render::nccl::render(view, node, w),
            Err(e) => writeln!(w, "error: {e}"),
        },
        other => panic!("unknown format {other}"),
    };
    r.expect("rendering into memory");
    String::from_utf8(buf).expect("utf-8")
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

fn sim_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn sim_fabrics_match_their_goldens() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let configs = manifest.join("../configs/sim");
    let golden_dir = manifest.join("tests/golden");
    let files = sim_files(&configs);
    assert!(!files.is_empty(), "no sim fabrics in {}: the golden test needs configs/sim/*.toml", configs.display());
    let update = std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1");
    let mut failures = Vec::new();
    for file in files {
        let stem = file.file_stem().and_then(|s| s.to_str()).expect("file stem").to_owned();
        let t0 = Instant::now();
        let fabric = match Source::Sim(file.clone()).load() {
            Ok(f) => f,
            Err(e) => {
                let chain: Vec<String> = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
                    .map(ToString::to_string)
                    .collect();
                failures.push(format!("{stem}: {}", chain.join(": ")));
                continue;
            }
        };
        let view = View::new(fabric, None).expect("view without node filter");
        let big = view.fabric.len() > BIG;
        eprintln!("{stem}: {} devices loaded in {:?}", view.fabric.len(), t0.elapsed());
        for &(fmt, grows) in FORMATS {
            if big && grows {
                continue;
            }
            let t = Instant::now();
            let got = render_fmt(&view, fmt);
            eprintln!("  {fmt}: {} bytes in {:?}", got.len(), t.elapsed());
            assert!(!got.is_empty(), "{stem}.{fmt} rendered nothing");
            if grows && view.fabric.len() > GOLDEN_MAX {
                if fmt == "json" {
                    serde_json::from_str::<serde_json::Value>(&got).expect("well-formed JSON");
                }
                continue;
            }
            let path = golden_dir.join(format!("{stem}.{fmt}"));
            if update {
                std::fs::create_dir_all(&golden_dir).expect("golden dir");
                std::fs::write(&path, &got).expect("write golden");
                continue;
            }
            match std::fs::read_to_string(&path) {
                Ok(want) if want == got => {}
                Ok(want) => failures.push(format!("{}: differs\n{}", path.display(), diff(&want, &got))),
                Err(_) => failures.push(format!("{}: missing (run with UPDATE_GOLDEN=1 to create it)", path.display())),
            }
        }
    }
    assert!(failures.is_empty(), "{} golden failures:\n{}", failures.len(), failures.join("\n"));
}
