//! Malformed sim fabrics give errors that name the file, the line and the key.

use fabric_drivers::sim::{self, SimError};

/// A small valid fabric; tests splice mistakes into it.
const BASE: &str = r#"[fabric]
name = "t"

[templates.box]

[[templates.box.numa]]
cpus = "0-7"

[[templates.box.host_bridge]]
bus = "0000:00"
numa = 0

[[templates.box.gpu]]
name = "gpu{i}"
count = 2
parent = "pci0000:00"

[[templates.box.nvswitch]]
name = "nvs0"

[[templates.box.link]]
kind = "nvlink"
from = "gpu{i}"
to = "nvs0"
i = 2
count = 6
generation = 4

[[node]]
name = "n0"
template = "box"
"#;

fn err(text: &str) -> SimError {
    match sim::parse(text, "bad.toml") {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e,
    }
}

/// Asserts the message names the file, the 1-based line of `needle` in `text`, and `key`.
fn assert_located(e: &SimError, text: &str, needle: &str, key: &str) {
    let msg = e.to_string();
    let offset = text.find(needle).unwrap_or_else(|| panic!("{needle:?} not in text"));
    let line = text[..offset].matches('\n').count() + 1;
    assert!(msg.starts_with(&format!("bad.toml:{line}:")), "want line {line}: {msg}");
    assert!(msg.contains(&format!("key `{key}`")), "want key {key}: {msg}");
    assert_eq!(e.key(), Some(key));
    assert_eq!(e.line(), Some(line));
}

#[test]
fn base_is_valid() {
    let inv = sim::parse(BASE, "base.toml").expect("valid");
    assert_eq!(inv.devices.len(), 1 + 1 + 2 + 2 + 1);
}

#[test]
fn unknown_key_is_named() {
    let text = BASE.replace("count = 2\n", "count = 2\ncolour = \"red\"\n");
    let e = err(&text);
    assert!(matches!(e, SimError::Parse { .. }));
    assert_located(&e, &text, "colour", "templates.box.gpu[0].colour");
    assert!(e.to_string().contains("unknown field `colour`"), "{e}");

    let text = BASE.replace("name = \"t\"\n", "name = \"t\"\nversion = 2\n");
    assert_located(&err(&text), &text, "version", "fabric.version");
}

#[test]
fn wrong_type_is_named() {
    let text = BASE.replace("count = 2\n", "count = \"two\"\n");
    let e = err(&text);
    assert_located(&e, &text, "\"two\"", "templates.box.gpu[0].count");
    assert!(e.to_string().contains("invalid type"), "{e}");

    let text = BASE.replace("kind = \"nvlink\"", "kind = \"nvlinc\"");
    assert_located(&err(&text), &text, "\"nvlinc\"", "templates.box.link[0].kind");
}

#[test]
fn bad_count_is_named() {
    for bad in ["0", "-3", "5000000"] {
        let text = BASE.replace("count = 2\n", &format!("count = {bad}\n"));
        let e = err(&text);
        assert_located(&e, &text, &format!("count = {bad}"), "templates.box.gpu[0].count");
        assert!(e.to_string().contains("count must be between 1 and"), "{e}");
    }
    let text = BASE.replace("i = 2\n", "i = 0\n");
    assert_located(&err(&text), &text, "i = 0", "templates.box.link[0].i");
}

#[test]
fn duplicate_ids_are_named() {
    let text = BASE.replace("name = \"nvs0\"", "name = \"gpu1\"");
    let e = err(&text);
    assert!(matches!(e, SimError::Invalid { .. }));
    assert_located(&e, &text, "\"gpu1\"", "templates.box.nvswitch[0].name");
    assert!(e.to_string().contains("duplicate device name `gpu1`"), "{e}");

    let text = format!("{BASE}\n[[node]]\nname = \"n0\"\ntemplate = \"box\"\n");
    let e = err(&text);
    let second = text.rfind("name = \"n0\"").expect("second node");
    assert!(e.to_string().contains("duplicate node name `n0`"), "{e}");
    assert_eq!(e.line(), Some(text[..second].matches('\n').count() + 1));
    assert_eq!(e.key(), Some("node[1].name"));

    // Explicit PCI addresses that clash.
    let text = BASE.replace("parent = \"pci0000:00\"\n", "parent = \"pci0000:00\"\nbdf = \"0000:05:00.0\"\n");
    let e = err(&text);
    assert!(e.to_string().contains("duplicate PCI address 0000:05:00.0"), "{e}");
    assert_eq!(e.key(), Some("templates.box.gpu[0].name"));
}

#[test]
fn dangling_links_are_named() {
    let text = BASE.replace("to = \"nvs0\"", "to = \"nvs9\"");
    let e = err(&text);
    assert_located(&e, &text, "\"nvs9\"", "templates.box.link[0].to");
    assert!(e.to_string().contains("link end `nvs9` is not a device of template box"), "{e}");

    let text = BASE.replace("to = \"nvs0\"", "to = \"fabric/sw0\"");
    assert_located(&err(&text), &text, "\"fabric/sw0\"", "templates.box.link[0].to");

    let text = BASE.replace("parent = \"pci0000:00\"", "parent = \"pci0000:99\"");
    let e = err(&text);
    assert_located(&e, &text, "\"pci0000:99\"", "templates.box.gpu[0].parent");

    let text = format!("{BASE}\n[[degraded]]\ndevice = \"n0/gpu7\"\nlink = \"pcie\"\nwidth = 8\n");
    assert_located(&err(&text), &text, "\"n0/gpu7\"", "degraded[0].device");
}

#[test]
fn unknown_template_is_named() {
    let text = BASE.replace("template = \"box\"", "template = \"crate\"");
    let e = err(&text);
    assert_located(&e, &text, "\"crate\"", "node[0].template");
    assert!(e.to_string().contains("unknown template `crate` (defined: box)"), "{e}");
}

#[test]
fn syntax_errors_have_positions() {
    let text = BASE.replace("name = \"t\"", "name = \"t");
    let e = err(&text);
    let line = text[..text.find("name = \"t").expect("x")].matches('\n').count() + 1;
    assert!(e.to_string().starts_with(&format!("bad.toml:{line}:")), "{e}");
}

#[test]
fn degradations_are_checked() {
    let text = format!("{BASE}\n[[degraded]]\ndevice = \"n0/gpu0\"\nlink = \"nvlink\"\ndown = 7\n");
    let e = err(&text);
    assert_located(&e, &text, "down = 7", "degraded[0].down");
    let text = format!("{BASE}\n[[degraded]]\ndevice = \"n0/gpu0\"\nlink = \"nvlink\"\nwidth = 4\n");
    assert_located(&err(&text), &text, "width = 4", "degraded[0].width");
    let ok = format!("{BASE}\n[[degraded]]\ndevice = \"n0/gpu0\"\nlink = \"nvlink\"\ndown = 2\n");
    let inv = sim::parse(&ok, "ok.toml").expect("valid");
    let degraded: Vec<_> = inv.links.iter().filter(|l| l.bandwidth.is_degraded()).collect();
    assert_eq!(degraded.len(), 1);
    assert_eq!(degraded[0].bandwidth.current_mbps, Some(4 * 25_000));
    assert_eq!(degraded[0].bandwidth.max_mbps, Some(6 * 25_000));
}

#[test]
fn oversized_fabrics_are_refused_before_allocating() {
    let text = BASE.replace("[[node]]\nname = \"n0\"", "[[node]]\ncount = 1000000\nname = \"n{i}\"");
    let e = err(&text);
    assert!(e.to_string().contains("limit"), "{e}");
    assert_eq!(e.key(), Some("node[0].name"));
}

#[test]
fn missing_file_is_a_read_error() {
    let e = sim::load(std::path::Path::new("/nonexistent/fabric.toml")).expect_err("missing");
    assert!(matches!(e, SimError::Read { .. }));
    assert!(e.to_string().contains("/nonexistent/fabric.toml"));
}

#[test]
fn a_cxl_region_whose_size_overflows_is_an_error_not_a_panic() {
    // Four memdevs of 5e18 bytes each: a 4-way region of their whole capacity is more
    // than 2^64 bytes.
    // BASE's template, with a CXL host bridge, its memdevs and a region (TOML takes the
    // tables after BASE's [[node]]).
    let text = format!(
        r#"{BASE}
[[templates.box.host_bridge]]
bus = "0000:0c"
numa = 0
cxl = true
window = {{ base = 0, size = 9000000000000000000, capabilities = ["ram"] }}

[[templates.box.cxl_memdev]]
name = "mem{{i}}"
count = 4
parent = "pci0000:0c"
ram = 5000000000000000000

[[templates.box.cxl_region]]
name = "region0"
mode = "ram"
targets = ["mem0", "mem1", "mem2", "mem3"]
granularity = 4096
"#
    );
    let e = err(&text);
    assert!(e.to_string().contains("larger than the address space"), "{e}");
}
