//! Strict parsers for the attribute formats of `/sys/class/infiniband/*`, as
//! `drivers/infiniband/core/sysfs.c` writes them and
//! `Documentation/ABI/stable/sysfs-class-infiniband` describes them. Each returns `None` for
//! anything else; the caller reports it.

use fabric_topology::{GidType, LinkLayer, PhysState, PortState};

/// Splits the kernel's `"<number>: <name>"` (`state`, `phys_state`, `node_type`). The
/// number decides; the name must be present and printable (it is only checked, since the
/// kernel's names changed over time: `Phy Test`, `<unknown>`).
fn numbered(s: &str) -> Option<(u8, &str)> {
    let (n, name) = s.trim().split_once(": ")?;
    if n.is_empty() || n.len() > 3 || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let name = name.trim();
    if name.is_empty() || name.len() > 32 || !name.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return None;
    }
    Some((n.parse().ok()?, name))
}

/// `state`: `4: ACTIVE` (IB spec port states 1-5; 0 is "no state change", never a state).
pub fn port_state(s: &str) -> Option<PortState> {
    Some(match numbered(s)?.0 {
        1 => PortState::Down,
        2 => PortState::Init,
        3 => PortState::Armed,
        4 => PortState::Active,
        5 => PortState::ActiveDefer,
        _ => return None,
    })
}

/// `phys_state`: `5: LinkUp` (IB spec physical states 1-7).
pub fn phys_state(s: &str) -> Option<PhysState> {
    Some(match numbered(s)?.0 {
        1 => PhysState::Sleep,
        2 => PhysState::Polling,
        3 => PhysState::Disabled,
        4 => PhysState::PortConfigurationTraining,
        5 => PhysState::LinkUp,
        6 => PhysState::LinkErrorRecovery,
        7 => PhysState::PhyTest,
        _ => return None,
    })
}

/// `node_type`: `1: CA` → `CA`.
pub fn node_type(s: &str) -> Option<String> {
    numbered(s).map(|(_, name)| name.to_owned())
}

/// `rate`: `"%d%s Gb/sec (%dX%s)"` (`56 Gb/sec (4X FDR)`, `2.5 Gb/sec (1X SDR)`,
/// `100 Gb/sec (2X HDR)`) → Mb/s. Only the leading figure is used: it is active width ×
/// active speed already; a decimal part of up to three digits is accepted.
pub fn rate_mbps(s: &str) -> Option<u64> {
    let (num, rest) = s.trim().split_once(' ')?;
    if !rest.starts_with("Gb/sec") {
        return None;
    }
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() || int.len() > 7 || frac.len() > 3 {
        return None;
    }
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: u64 = int.parse().ok()?;
    let mut milli: u64 = 0;
    for (i, b) in frac.bytes().enumerate() {
        milli += u64::from(b - b'0') * [100, 10, 1][i];
    }
    whole.checked_mul(1000)?.checked_add(milli)
}

/// `link_layer`: `InfiniBand` or `Ethernet` (the kernel writes `Unknown` for others).
pub fn link_layer(s: &str) -> Option<LinkLayer> {
    match s.trim() {
        "InfiniBand" => Some(LinkLayer::Infiniband),
        "Ethernet" => Some(LinkLayer::Ethernet),
        _ => None,
    }
}

/// `lid`, `sm_lid`: `0x3a4` (16 bits).
pub fn lid(s: &str) -> Option<u32> {
    let t = s.trim().strip_prefix("0x")?;
    if t.is_empty() || t.len() > 4 {
        return None;
    }
    u32::from_str_radix(t, 16).ok()
}

/// Parses `n` colon-separated groups of four hex digits (GUIDs: 4, GIDs: 8) into the
/// big-endian value, and the canonical lower-case text.
fn hex_groups(s: &str, n: usize) -> Option<(u128, String)> {
    let t = s.trim();
    let mut v: u128 = 0;
    let mut groups = 0;
    for g in t.split(':') {
        if g.len() != 4 || !g.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        v = (v << 16) | u128::from(u16::from_str_radix(g, 16).ok()?);
        groups += 1;
        if groups > n {
            return None;
        }
    }
    (groups == n).then(|| (v, t.to_ascii_lowercase()))
}

/// `node_guid`, `sys_image_guid`: `0002:c903:00f9:bfa0` → the value and canonical text.
pub fn guid(s: &str) -> Option<(u64, String)> {
    hex_groups(s, 4).and_then(|(v, t)| Some((u64::try_from(v).ok()?, t)))
}

/// `gids/N`: eight groups (`fe80:0000:…:bfa1`) → the value and canonical text.
pub fn gid(s: &str) -> Option<(u128, String)> {
    hex_groups(s, 8)
}

/// The interface identifier (low 64 bits) of a GID, written as the kernel writes GUIDs.
pub fn gid_interface_id(gid: u128) -> String {
    let v = gid as u64;
    format!("{:04x}:{:04x}:{:04x}:{:04x}", v >> 48, (v >> 32) & 0xffff, (v >> 16) & 0xffff, v & 0xffff)
}

/// `gid_attrs/types/N`: `IB/RoCE v1` or `RoCE v2`.
pub fn gid_type(s: &str) -> Option<GidType> {
    match s.trim() {
        "IB/RoCE v1" => Some(GidType::IbRoceV1),
        "RoCE v2" => Some(GidType::RoceV2),
        _ => None,
    }
}

/// A netdev or RDMA device name: 1-64 characters an interface name may have (the kernel's
/// `IFNAMSIZ` is 16, `IB_DEVICE_NAME_MAX` 64).
pub fn name(s: &str) -> Option<String> {
    let t = s.trim();
    let ok = !t.is_empty()
        && t.len() <= 64
        && t != "."
        && t != ".."
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:@".contains(&b));
    ok.then(|| t.to_owned())
}

/// The GUID as NCCL writes it in `<net guid=…>`: NCCL prints the verbs `sys_image_guid`,
/// a big-endian field, as a host integer with `%lx`, so on a little-endian host the bytes
/// come out reversed (sysfs `58a2:e103:00b1:7ca8` → `0xa87cb10003e1a258`).
pub fn nccl_guid(guid: u64) -> String {
    format!("{:#x}", guid.swap_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_follow_the_kernel_numbering() {
        assert_eq!(port_state("4: ACTIVE\n"), Some(PortState::Active));
        assert_eq!(port_state("1: DOWN"), Some(PortState::Down));
        assert_eq!(port_state("0: NOP"), None);
        assert_eq!(port_state("ACTIVE"), None);
        assert_eq!(port_state("4:"), None);
        assert_eq!(phys_state("5: LinkUp"), Some(PhysState::LinkUp));
        assert_eq!(phys_state("2: Polling"), Some(PhysState::Polling));
        assert_eq!(phys_state("7: Phy Test"), Some(PhysState::PhyTest));
        assert_eq!(phys_state("8: <unknown>"), None);
        assert_eq!(node_type("1: CA").as_deref(), Some("CA"));
        assert_eq!(node_type("6: usNIC UDP").as_deref(), Some("usNIC UDP"));
    }

    #[test]
    fn rates_are_mbps() {
        assert_eq!(rate_mbps("56 Gb/sec (4X FDR)"), Some(56_000));
        assert_eq!(rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(rate_mbps("400 Gb/sec (4X NDR)"), Some(400_000));
        assert_eq!(rate_mbps("40 Gb/sec (4X)"), Some(40_000));
        assert_eq!(rate_mbps("56 Mb/sec"), None);
        assert_eq!(rate_mbps("-1 Gb/sec"), None);
        assert_eq!(rate_mbps("1.2345 Gb/sec"), None);
        assert_eq!(rate_mbps("99999999 Gb/sec"), None);
        assert_eq!(rate_mbps(""), None);
    }

    #[test]
    fn guids_and_gids() {
        assert_eq!(guid("0002:c903:00f9:bfa0"), Some((0x0002_c903_00f9_bfa0, "0002:c903:00f9:bfa0".into())));
        assert_eq!(guid("0002:c903:00f9"), None);
        assert_eq!(guid("0002:c903:00f9:bfa0:0000"), None);
        assert_eq!(guid("0002:c903:00f9:bfaX"), None);
        let (g, _) = gid("fe80:0000:0000:0000:0002:c903:00f9:bfa1").unwrap();
        assert_eq!(gid_interface_id(g), "0002:c903:00f9:bfa1");
        assert_eq!(gid("fe80::1"), None);
        assert_eq!(lid("0x3a4"), Some(0x3a4));
        assert_eq!(lid("0x10000"), None);
        assert_eq!(lid("932"), None);
        assert_eq!(gid_type("RoCE v2\n"), Some(GidType::RoceV2));
        assert_eq!(gid_type("IB/RoCE v1"), Some(GidType::IbRoceV1));
        assert_eq!(gid_type("RoCE v3"), None);
    }

    #[test]
    fn nccl_guid_matches_the_public_h200_dump() {
        // nccl-tests#256: mlx5_0 guid="0xa87cb10003e1a258", a Mellanox GUID (OUI 58:a2:e1)
        // byte-reversed by NCCL's %lx of the big-endian field.
        let (g, _) = guid("58a2:e103:00b1:7ca8").unwrap();
        assert_eq!(nccl_guid(g), "0xa87cb10003e1a258");
    }

    #[test]
    fn names_are_interface_names() {
        assert_eq!(name("mlx5_0").as_deref(), Some("mlx5_0"));
        assert_eq!(name("../x"), None);
        assert_eq!(name(".."), None);
        assert_eq!(name(""), None);
    }
}
