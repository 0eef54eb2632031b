//! `fabricctl gpu-compare` on the HGX sim against hand-written nvidia-smi outputs
//! (tests/data/nvidia-smi/README.md): agreement exits 0; each kind of difference is found,
//! named and exits 1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nvidia-smi");
const SIM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sim/hgx-h100-8gpu.toml");

fn fixture(name: &str) -> String {
    std::fs::read_to_string(Path::new(DATA).join(name)).expect("fixture")
}

fn run(xml: &str, topo: &str, dir: &Path) -> (Output, serde_json::Value) {
    let (x, t): (PathBuf, PathBuf) = (dir.join("q.xml"), dir.join("topo.txt"));
    std::fs::write(&x, xml).expect("write xml");
    std::fs::write(&t, topo).expect("write topo");
    let o = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
        .args(["gpu-compare", "--sim", SIM, "-o", "json", "--smi-xml"])
        .arg(&x)
        .arg("--smi-topo")
        .arg(&t)
        .env_remove("RUST_LOG")
        .output()
        .expect("runs");
    let doc = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    (o, doc)
}

fn problems(doc: &serde_json::Value) -> Vec<String> {
    doc["gpus"]
        .as_array()
        .expect("gpus")
        .iter()
        .flat_map(|g| g["problems"].as_array().expect("problems").iter().map(|p| p.as_str().expect("text").to_owned()))
        .collect()
}

#[test]
fn matching_outputs_agree() {
    let dir = tempfile::tempdir().unwrap();
    let (o, doc) = run(&fixture("hgx-h100-8gpu.query.xml"), &fixture("hgx-h100-8gpu.topo.txt"), dir.path());
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(doc["schema"], "fabric.gpu-compare/v1");
    assert_eq!(doc["differences"], 0);
    assert_eq!(doc["driver_version"], "550.54.15");
    let gpus = doc["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert_eq!(gpus[2]["label"], "GPU2");
    assert_eq!(gpus[2]["bus_id"], "0000:3a:00.0");
    assert_eq!(gpus[2]["smi_memory_mib"], 81559);
    assert_eq!(gpus[2]["memory_mib"], 81920);
    let cells = doc["matrix"].as_array().unwrap();
    assert_eq!(cells.len(), 64, "every GPU pair, NIC columns left out");
    assert!(cells.iter().all(|c| c["ok"] == true));
    assert!(cells.iter().any(|c| c["a"] == "GPU3" && c["b"] == "GPU5" && c["smi"] == "NV18"));
}

#[test]
fn each_kind_of_difference_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut xml = fixture("hgx-h100-8gpu.query.xml")
        // GPU1 moved to another bus, GPU7 an unknown board.
        .replace("<pci_bus_id>00000000:19:00.0</pci_bus_id>", "<pci_bus_id>00000000:1A:00.0</pci_bus_id>")
        .replace("GPU-093976e5-9e70-8db7-8c63-19385c7abcd9", "GPU-00000000-0000-0000-0000-000000000000")
        .replace("00000000:BB:00.0", "00000000:CC:00.0");
    // GPU2 with half the memory.
    let at = xml.find("GPU-eaa94950").unwrap();
    let total = at + xml[at..].find("<total>81559 MiB</total>").unwrap();
    xml.replace_range(total..total + "<total>81559 MiB</total>".len(), "<total>40000 MiB</total>");
    let topo = fixture("hgx-h100-8gpu.topo.txt").replacen("GPU0\t X \tNV18", "GPU0\t X \tSYS", 1);
    let (o, doc) = run(&xml, &topo, dir.path());
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("difference(s) between discovery and nvidia-smi"), "{err}");
    let p = problems(&doc);
    assert!(p.iter().any(|p| p == "PCI address differs: 0000:1a:00.0 vs 0000:19:00.0"), "{p:?}");
    assert!(p.iter().any(|p| p.starts_with("memory differs: ")), "{p:?}");
    assert!(p.iter().any(|p| p == "not discovered"), "{p:?}");
    assert!(p.iter().any(|p| p == "not listed by nvidia-smi"), "{p:?}");
    let bad: Vec<_> = doc["matrix"].as_array().unwrap().iter().filter(|c| c["ok"] == false).collect();
    // GPU0->GPU1 changed, and every cell of the unknown GPU7 has no discovered peer.
    assert!(bad.iter().any(|c| c["a"] == "GPU0" && c["b"] == "GPU1" && c["smi"] == "SYS" && c["fabric"] == "NV18"));
    assert!(bad.iter().filter(|c| c["a"] == "GPU7").all(|c| c["fabric"].is_null()));
    assert_eq!(doc["differences"].as_u64().unwrap() as usize, p.len() + bad.len());
}

/// Differences found exit 1 even when the report's reader went away (`| grep -q`): before,
/// the closed output made every error exit 0.
#[test]
fn differences_exit_1_though_the_reports_reader_is_gone() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let (x, t) = (dir.path().join("q.xml"), dir.path().join("topo.txt"));
    std::fs::write(&x, fixture("hgx-h100-8gpu.query.xml")).unwrap();
    let topo = fixture("hgx-h100-8gpu.topo.txt").replacen("GPU0\t X \tNV18", "GPU0\t X \tSYS", 1);
    std::fs::write(&t, topo).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
        .args(["gpu-compare", "--sim", SIM, "--smi-xml"])
        .arg(&x)
        .arg("--smi-topo")
        .arg(&t)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("difference(s) between discovery and nvidia-smi"), "{err}");
}

#[test]
fn unreadable_inputs_exit_1_with_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    let (o, _) = run("<html/>", &fixture("hgx-h100-8gpu.topo.txt"), dir.path());
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no <nvidia_smi_log> element") && err.contains("hint:"), "{err}");
}
