//! `gpu_check summarize OUTDIR`: turns what scripts/gpu-check.sh left in OUTDIR (steps.tsv,
//! the step logs and the JSON of each step) into summary.json and the script's exit code:
//! 0 every step passed, 3 no GPU here (and nothing else failed), 1 a step failed.

use std::path::Path;

use serde_json::{Value, json};

/// Steps whose failure is recorded but does not fail the check (informational outputs).
const INFORMATIONAL: &[&str] = &["smi-nvlink", "smi-query", "smi-list", "topology", "gpu-compare-table"];

/// What nvidia-smi prints when the driver is not loaded.
const NO_DRIVER: &str = "couldn't communicate with the NVIDIA driver";

/// The outcome of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Skipped(String),
    NotPresent(String),
    TimedOut,
    Failed(String),
}

impl Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::Skipped(_) => "skipped",
            Outcome::NotPresent(_) => "not_present",
            Outcome::TimedOut => "timeout",
            Outcome::Failed(_) => "failed",
        }
    }
}

fn last_line(text: &str) -> String {
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_owned()
}

/// Classifies one line of steps.tsv, given the step's log and its JSON output (if any).
pub fn classify(name: &str, exit: &str, note: &str, log: &str, output: Option<&Value>) -> Outcome {
    let reason = output.and_then(|v| v["reason"].as_str()).map(str::to_owned);
    match exit {
        "skipped" => Outcome::Skipped(note.to_owned()),
        "0" => Outcome::Passed,
        "124" | "137" => Outcome::TimedOut,
        "127" => Outcome::NotPresent(if note.ends_with("not found") { note.to_owned() } else { last_line(log) }),
        "3" if name.starts_with("cuda-") => {
            Outcome::NotPresent(reason.unwrap_or_else(|| "CUDA not present: (no reason recorded)".into()))
        }
        _ if name.starts_with("smi-") && log.contains(NO_DRIVER) => {
            Outcome::NotPresent(format!("nvidia-smi: {}", last_line(log)))
        }
        code => Outcome::Failed(format!("exit {code}: {}", reason.unwrap_or_else(|| last_line(log)))),
    }
}

fn read_json(dir: &Path, file: &str) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(dir.join(file)).ok()?).ok()
}

/// The discovery backends' states from topology.json, as `NVML not present: …` lines.
fn backend_lines(topology: Option<&Value>) -> (Value, Vec<String>) {
    let Some(backends) = topology.and_then(|t| t["backends"].as_array()) else { return (Value::Null, Vec::new()) };
    let mut absent = Vec::new();
    let list = backends
        .iter()
        .filter(|b| matches!(b["backend"].as_str(), Some("nvml" | "cuda" | "pci")))
        .map(|b| {
            let (name, state) = (b["backend"].as_str().unwrap_or("?"), b["state"].as_str().unwrap_or("?"));
            if state == "not_present" && name != "pci" {
                let label = if name == "nvml" { "NVML" } else { "CUDA" };
                absent.push(format!("{label} not present: {}", b["reason"].as_str().unwrap_or("no reason given")));
            }
            json!({ "backend": name, "state": state, "reason": b["reason"], "devices": b["devices"] })
        })
        .collect();
    (Value::Array(list), absent)
}

/// The exporter's host<->device copy figures (registered against pageable memory).
fn host_figures(memory: &Value) -> Option<Value> {
    let steps = memory["steps"].as_array()?;
    let s = steps.iter().find(|s| s["step"].as_str().is_some_and(|n| n.starts_with("host<->device copies")))?;
    Some(s["detail"].clone())
}

/// Builds summary.json from OUTDIR and returns it with the exit code.
pub fn summarize(dir: &Path, elapsed_s: Option<u64>) -> (Value, u8) {
    let tsv = std::fs::read_to_string(dir.join("steps.tsv")).unwrap_or_default();
    let mut steps = Vec::new();
    let (mut failed, mut absent) = (Vec::new(), Vec::new());
    for line in tsv.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        let [name, exit, seconds, output] = f[..] else { continue };
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        let json_out = match name {
            "cuda-probe" => read_json(dir, "probe.json"),
            "cuda-memory" => read_json(dir, "memory.json"),
            "cuda-memory-direct" => read_json(dir, "memory-direct.json"),
            "cuda-memory-fabric" => read_json(dir, "memory-fabric.json"),
            _ if output.ends_with(".json") => read_json(dir, output),
            _ => None,
        };
        let outcome = classify(name, exit, output, &log, json_out.as_ref());
        let informational = INFORMATIONAL.contains(&name);
        match &outcome {
            Outcome::NotPresent(why) => absent.push(why.clone()),
            Outcome::Failed(_) | Outcome::TimedOut if !informational => failed.push(name.to_owned()),
            _ => {}
        }
        let detail = match &outcome {
            Outcome::Skipped(s) | Outcome::NotPresent(s) | Outcome::Failed(s) => json!(s),
            _ => Value::Null,
        };
        steps.push(
            json!({ "step": name, "status": outcome.name(), "exit": exit, "seconds": seconds.parse::<u64>().ok(),
                           "output": output, "detail": detail, "informational": informational }),
        );
    }
    let topology = read_json(dir, "topology.json");
    let (backends, backend_absent) = backend_lines(topology.as_ref());
    absent.extend(backend_absent);
    absent.sort();
    absent.dedup();
    let compare = read_json(dir, "gpu-compare.json");
    let memory = read_json(dir, "memory.json");
    let direct = read_json(dir, "memory-direct.json");
    let (status, code) = if !failed.is_empty() || steps.is_empty() {
        ("failed", 1)
    } else if !absent.is_empty() {
        ("not_present", 3)
    } else {
        ("passed", 0)
    };
    let doc = json!({
        "schema": "fabric.gpu-check/v1",
        "status": status,
        "exit": code,
        "elapsed_s": elapsed_s,
        "failed_steps": failed,
        "not_present": absent,
        "discovery_backends": backends,
        "gpu_compare_differences": compare.as_ref().map(|c| c["differences"].clone()),
        "cuda_memory_status": memory.as_ref().map(|m| m["status"].clone()),
        "figures": memory.as_ref().map(|m| m["importer"]["figures"].clone()),
        "figures_direct": direct.as_ref().map(|m| m["importer"]["figures"].clone()),
        "figures_fabric": read_json(dir, "memory-fabric.json").map(|m| m["importer"]["figures"].clone()),
        "figures_host": memory.as_ref().and_then(host_figures),
        "steps": steps,
    });
    (doc, code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_and_logs_classify_steps() {
        assert_eq!(classify("smi-topo", "0", "smi-topo.txt", "", None), Outcome::Passed);
        assert_eq!(classify("cuda-memory", "124", "m", "", None), Outcome::TimedOut);
        assert_eq!(
            classify("smi-list", "127", "smi-list.txt", "nvidia-smi: not found", None),
            Outcome::NotPresent("nvidia-smi: not found".into())
        );
        let probe = json!({ "status": "not_present", "reason": "CUDA not present: libcuda.so.1: cannot open" });
        assert_eq!(
            classify("cuda-probe", "3", "probe.stdout", "", Some(&probe)),
            Outcome::NotPresent("CUDA not present: libcuda.so.1: cannot open".into())
        );
        let log = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure...\n";
        assert!(matches!(classify("smi-query-xml", "9", "x", log, None), Outcome::NotPresent(_)));
        // The same exit 3 from another step is a failure, not an absence.
        assert!(matches!(classify("gpu-compare", "3", "x", "boom\n", None), Outcome::Failed(m) if m == "exit 3: boom"));
        assert!(matches!(classify("gpu-compare", "skipped", "no nvidia-smi output", "", None), Outcome::Skipped(_)));
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn a_machine_without_gpu_is_not_present_with_reasons() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "steps.tsv",
            "step\texit\tseconds\toutput\nsmi-list\t127\t0\tsmi-list.txt\ntopology-json\t0\t1\ttopology.json\n\
             gpu-compare\tskipped\t0\tno nvidia-smi output\ncuda-probe\t3\t0\tprobe.stdout\n",
        );
        write(d.path(), "smi-list.log", "nvidia-smi: not found\n");
        write(d.path(), "probe.json", r#"{"status":"not_present","reason":"CUDA not present: no libcuda"}"#);
        write(
            d.path(),
            "topology.json",
            r#"{"backends":[{"backend":"nvml","state":"not_present","reason":"libnvidia-ml.so.1 not found","devices":0},
                            {"backend":"pci","state":"present","reason":null,"devices":3}]}"#,
        );
        let (doc, code) = summarize(d.path(), Some(4));
        assert_eq!(code, 3);
        assert_eq!(doc["status"], "not_present");
        let absent: Vec<&str> = doc["not_present"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(
            absent,
            ["CUDA not present: no libcuda", "NVML not present: libnvidia-ml.so.1 not found", "nvidia-smi: not found"]
        );
        assert_eq!(doc["steps"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn a_failed_or_timed_out_step_fails_the_check() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "steps.tsv",
            "step\texit\tseconds\toutput\nsmi-nvlink\t1\t0\tsmi-nvlink.txt\ncuda-memory\t124\t300\tmemory.stdout\n",
        );
        let (doc, code) = summarize(d.path(), None);
        assert_eq!((code, doc["status"].as_str()), (1, Some("failed")));
        assert_eq!(doc["failed_steps"], json!(["cuda-memory"]), "smi-nvlink is informational");
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "steps.tsv", "step\texit\tseconds\toutput\nsmi-topo\t0\t0\tsmi-topo.txt\n");
        assert_eq!(summarize(d.path(), None).1, 0);
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(summarize(empty.path(), None).1, 1, "no steps recorded is a failure");
    }
}
