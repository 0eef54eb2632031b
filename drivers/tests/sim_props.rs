//! Property tests: random small generator parameters never panic and give the counts the
//! parameters imply; random edits of a valid file never panic the parser.

use fabric_drivers::sim;
use fabric_topology::{DeviceKind, Fabric, HopClass};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Params {
    sockets: u32,
    switches: u32,
    gpus_per_switch: u32,
    nics_per_switch: u32,
    nvswitches: u32,
    links_per_nvswitch: u16,
    nodes: u32,
    rails: u32,
    leaf_radix: u32,
    spines: u32,
    rail_optimized: bool,
}

fn params() -> impl Strategy<Value = Params> {
    (
        1u32..=3,
        1u32..=4,
        1u32..=4,
        1u32..=3,
        0u32..=4,
        1u16..=6,
        1u32..=40,
        1u32..=12,
        1u32..=8,
        1u32..=4,
        any::<bool>(),
    )
        .prop_map(|(sockets, switches, g, n, nvs, l, nodes, rails, radix, spines, ro)| Params {
            sockets,
            switches,
            gpus_per_switch: g,
            nics_per_switch: n,
            nvswitches: nvs,
            links_per_nvswitch: l,
            nodes,
            rails,
            leaf_radix: radix * 2,
            spines,
            rail_optimized: ro,
        })
}

/// A config from the parameters: `switches` host bridges (round-robin over sockets), each
/// with one PCIe switch carrying GPUs and NICs.
fn config(p: &Params) -> String {
    let mut t = String::from("[fabric]\nname = \"prop\"\n\n");
    for s in 0..p.sockets {
        t += &format!("[[templates.t.numa]]\nid = {s}\ncpus = \"{}-{}\"\ndram = \"64GiB\"\n\n", s * 8, s * 8 + 7);
    }
    for b in 0..p.switches {
        t += &format!("[[templates.t.host_bridge]]\nbus = \"0000:{:02x}\"\nnuma = {}\n\n", b * 0x20, b % p.sockets);
    }
    t += &format!(
        "[[templates.t.pcie_switch]]\nname = \"sw{{i}}\"\ncount = {}\nparent = \"pci0000:{{i*32:02x}}\"\ngen = 5\nwidth = 16\n\n",
        p.switches
    );
    let gpus = p.switches * p.gpus_per_switch;
    let nics = p.switches * p.nics_per_switch;
    t += &format!(
        "[[templates.t.gpu]]\nname = \"gpu{{i}}\"\ncount = {gpus}\nparent = \"sw{{i/{}}}\"\nhbm = \"16GiB\"\ngen = 5\nwidth = 16\n\n",
        p.gpus_per_switch
    );
    t += &format!(
        "[[templates.t.nic]]\nname = \"nic{{i}}\"\ncount = {nics}\nparent = \"sw{{i/{}}}\"\ngbps = 400\nrail = \"{{i}}\"\n\n",
        p.nics_per_switch
    );
    if p.nvswitches > 0 {
        t += &format!("[[templates.t.nvswitch]]\nname = \"nvs{{i}}\"\ncount = {}\n\n", p.nvswitches);
        t += &format!(
            "[[templates.t.link]]\nkind = \"nvlink\"\nfrom = \"gpu{{i}}\"\nto = \"nvs{{j}}\"\ni = {gpus}\nj = {}\ncount = {}\ngeneration = 4\n\n",
            p.nvswitches, p.links_per_nvswitch
        );
    }
    let kind = if p.rail_optimized { "rail-optimized" } else { "leaf-spine" };
    t += &format!(
        "[cluster]\ntemplate = \"t\"\nnodes = {}\nnetwork = {{ kind = \"{kind}\", rails = {}, leaf_radix = {}, spines = {}, gbps = 400 }}\n",
        p.nodes,
        p.rails.min(nics),
        p.leaf_radix,
        p.spines
    );
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn generated_fabrics_have_the_implied_counts(p in params()) {
        let text = config(&p);
        let inv = sim::parse(&text, "prop.toml").map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let (nodes, gpus, nics) = (p.nodes as usize, (p.switches * p.gpus_per_switch) as usize, (p.switches * p.nics_per_switch) as usize);
        prop_assert_eq!(inv.count(DeviceKind::Gpu), nodes * gpus);
        prop_assert_eq!(inv.count(DeviceKind::Nic), nodes * nics);
        prop_assert_eq!(inv.count(DeviceKind::Cpu), nodes * p.sockets as usize);
        prop_assert_eq!(inv.count(DeviceKind::NvSwitch), nodes * p.nvswitches as usize);
        // Per switch: root port, upstream port, one downstream port per endpoint.
        let bridges = p.switches as usize * (2 + p.gpus_per_switch as usize + p.nics_per_switch as usize);
        prop_assert_eq!(inv.count(DeviceKind::PciBridge), nodes * bridges);
        let rails = p.rails.min(p.switches * p.nics_per_switch) as usize;
        let down = (p.leaf_radix / 2) as usize;
        let leaves = if p.rail_optimized { nodes.div_ceil(down) * rails } else { (nodes * rails).div_ceil(down) };
        prop_assert_eq!(inv.count(DeviceKind::NetworkSwitch), leaves + p.spines as usize);
        let net = inv.links.iter().filter(|l| l.kind.name() == "network").count();
        prop_assert_eq!(net, nodes * rails + leaves * p.spines as usize);
        let nv = inv.links.iter().filter(|l| l.kind.name() == "nvlink").count();
        prop_assert_eq!(nv, nodes * gpus * p.nvswitches as usize);
        // Identities are unique: the index finds every device at its own position.
        for (i, d) in inv.devices.iter().enumerate() {
            prop_assert_eq!(inv.find(&d.id).map(|x| x.get()), Some(i));
        }
        let f = Fabric::build(inv).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let g: Vec<_> = f.devices_of(DeviceKind::Gpu).collect();
        if gpus >= 2 {
            let want = if p.nvswitches > 0 {
                HopClass::Nv(p.links_per_nvswitch * p.nvswitches as u16)
            } else {
                HopClass::Pix
            };
            let class = f.classify(g[0], g[1]);
            prop_assert!(class == want || (p.nvswitches == 0 && p.gpus_per_switch == 1), "{class} vs {want}");
        }
        if nodes >= 2 {
            prop_assert_eq!(f.classify(g[0], g[g.len() - 1]), HopClass::Net);
            prop_assert!(f.route(g[0], g[g.len() - 1]).is_ok());
        }
    }

    #[test]
    fn same_parameters_same_inventory(p in params()) {
        let text = config(&p);
        let a = serde_json::to_string(&sim::parse(&text, "a").map_err(|e| TestCaseError::fail(e.to_string()))?).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let b = serde_json::to_string(&sim::parse(&text, "b").map_err(|e| TestCaseError::fail(e.to_string()))?).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(a, b);
    }

    #[test]
    fn random_edits_never_panic(p in params(), pos in any::<prop::sample::Index>(), junk in "[ -~\n]{0,12}", cut in any::<bool>()) {
        let mut text = config(&p);
        let mut at = pos.index(text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        if cut {
            text.truncate(at);
        } else {
            text.insert_str(at, &junk);
        }
        if let Err(e) = sim::parse(&text, "edit.toml") {
            prop_assert!(e.to_string().starts_with("edit.toml:"), "{}", e);
        }
    }

    #[test]
    fn bad_counts_are_errors_not_panics(count in prop_oneof![-5i64..=0, 1_000_001i64..=i64::MAX], field in 0usize..4) {
        let p = Params {
            sockets: 1, switches: 1, gpus_per_switch: 2, nics_per_switch: 1, nvswitches: 1,
            links_per_nvswitch: 2, nodes: 2, rails: 1, leaf_radix: 4, spines: 1, rail_optimized: true,
        };
        let text = config(&p);
        let text = match field {
            0 => text.replacen("count = 2\n", &format!("count = {count}\n"), 1),
            1 => text.replace("nodes = 2", &format!("nodes = {count}")),
            2 => text.replace("rails = 1", &format!("rails = {count}")),
            _ => text.replace("leaf_radix = 4", &format!("leaf_radix = {count}")),
        };
        let e = sim::parse(&text, "count.toml").expect_err("bad count accepted");
        prop_assert!(e.to_string().starts_with("count.toml:"));
        prop_assert!(e.key().is_some_and(|k| k != "<document>"), "{}", e);
    }
}
