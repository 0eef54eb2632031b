//! RDMA devices of a NIC (`/sys/class/infiniband/*`): ports with their state, rate, link
//! layer (InfiniBand, or Ethernet = RoCE), GIDs and the netdev behind each port.
//!
//! Values keep the kernel's meaning (`Documentation/ABI/stable/sysfs-class-infiniband`);
//! anything the kernel did not show is `None`, never a default.

use serde::{Deserialize, Serialize};

use crate::link::LinkState;

/// One RDMA device (`mlx5_0`, `rxe0`) and its ports. A PCI function usually has one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// The kernel's name for it (`mlx5_0`): what verbs, NCCL and `rdma link` call it. The
    /// kernel (or rdma-core's udev rule) may rename it, so it is not an identity.
    pub name: String,
    /// `node_type` without its number (`CA`, `RNIC`, `switch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_type: Option<String>,
    /// `node_guid`, as the kernel writes it (`0002:c903:00f9:bfa0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_guid: Option<String>,
    /// `sys_image_guid`: shared by the devices of one adapter (NCCL's `guid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sys_image_guid: Option<String>,
    /// `fw_ver`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<String>,
    /// Ports in number order.
    pub ports: Vec<RdmaPort>,
    /// GPUDirect RDMA through a peer-memory client: the file under the sysfs root whose
    /// presence says one is loaded (`sys/module/nvidia_peermem/version`), as NCCL checks.
    /// `None` when none is; dma-buf registration is not visible in sysfs (see
    /// docs/discovery.md), so `None` does not mean GPUDirect is impossible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_memory: Option<String>,
}

/// The link layer of a port (`link_layer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkLayer {
    /// InfiniBand.
    Infiniband,
    /// Ethernet: RDMA over Converged Ethernet (RoCE), iWARP or Soft-RoCE.
    Ethernet,
}

/// Logical port state (`state`: `4: ACTIVE`), numbered as in the InfiniBand spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PortState {
    /// 1: no physical link, or the port is disabled.
    Down,
    /// 2: the physical link is up, the subnet manager has not configured the port.
    Init,
    /// 3: configured, not yet activated.
    Armed,
    /// 4: carries data.
    Active,
    /// 5: active, deferring (a transient error recovery state).
    ActiveDefer,
}

/// Physical port state (`phys_state`: `5: LinkUp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PhysState {
    /// 1.
    Sleep,
    /// 2: looking for a partner (nothing cabled, or the far end is down).
    Polling,
    /// 3.
    Disabled,
    /// 4.
    PortConfigurationTraining,
    /// 5.
    LinkUp,
    /// 6.
    LinkErrorRecovery,
    /// 7.
    PhyTest,
}

/// What a GID entry is used for (`gid_attrs/types/N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GidType {
    /// `IB/RoCE v1`: an InfiniBand GID on an InfiniBand port, RoCE v1 (Ethernet frames,
    /// not routable) on an Ethernet one.
    IbRoceV1,
    /// `RoCE v2`: RDMA over UDP/IP, routable.
    RoceV2,
}

/// One populated GID table entry (`ports/N/gids/I`); all-zero entries are unused and left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaGid {
    /// The table index (what `NCCL_IB_GID_INDEX` names).
    pub index: u32,
    /// The GID as the kernel writes it (8 groups of 4 hex digits).
    pub gid: String,
    /// Its type, when the kernel says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<GidType>,
    /// The netdev it belongs to (`gid_attrs/ndevs/I`), on Ethernet ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netdev: Option<String>,
}

/// One port of an RDMA device (`ports/N`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaPort {
    /// The port number (from 1 on a host adapter).
    pub number: u32,
    /// Logical state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<PortState>,
    /// Physical state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phys_state: Option<PhysState>,
    /// Data rate in Mb/s (active width × active speed: `100 Gb/sec (4X EDR)` is 100,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_mbps: Option<u64>,
    /// The kernel's rate text, for display (`100 Gb/sec (4X EDR)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// Link layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_layer: Option<LinkLayer>,
    /// The port's LID (InfiniBand; 0 until the subnet manager assigns one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lid: Option<u32>,
    /// The subnet manager's LID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_lid: Option<u32>,
    /// The port GUID: the interface identifier (low 64 bits) of GID 0 on an InfiniBand port,
    /// as the kernel writes GIDs (`0002:c903:00f9:bfa1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_guid: Option<String>,
    /// Populated GIDs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gids: Vec<RdmaGid>,
    /// The netdev carrying the port (`ib0`, `eth2`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netdev: Option<String>,
}

impl RdmaPort {
    /// The state of the port's link: up when it carries data (`ACTIVE` on a physical
    /// `LinkUp`); degraded when the physical link is up but the port does not carry data yet
    /// (`INIT`/`ARMED`: no subnet manager has activated it) or is recovering from errors;
    /// down otherwise. Unknown states count as down: a port that says nothing is not
    /// shown as usable.
    pub fn link_state(&self) -> LinkState {
        match (self.state, self.phys_state) {
            (Some(PortState::Active), Some(PhysState::LinkUp)) => LinkState::Up,
            (Some(PortState::Active | PortState::ActiveDefer), _) => LinkState::Degraded,
            (Some(PortState::Init | PortState::Armed), Some(PhysState::LinkUp)) => LinkState::Degraded,
            (_, Some(PhysState::LinkErrorRecovery)) => LinkState::Degraded,
            _ => LinkState::Down,
        }
    }

    /// True for an Ethernet (RoCE) port.
    pub fn is_roce(&self) -> bool {
        self.link_layer == Some(LinkLayer::Ethernet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(state: Option<PortState>, phys: Option<PhysState>) -> RdmaPort {
        RdmaPort {
            number: 1,
            state,
            phys_state: phys,
            rate_mbps: None,
            rate: None,
            link_layer: None,
            lid: None,
            sm_lid: None,
            port_guid: None,
            gids: Vec::new(),
            netdev: None,
        }
    }

    #[test]
    fn only_an_active_linked_port_is_up() {
        assert_eq!(port(Some(PortState::Active), Some(PhysState::LinkUp)).link_state(), LinkState::Up);
        assert_eq!(port(Some(PortState::Init), Some(PhysState::LinkUp)).link_state(), LinkState::Degraded);
        assert_eq!(port(Some(PortState::Active), None).link_state(), LinkState::Degraded);
        assert_eq!(port(Some(PortState::Down), Some(PhysState::Polling)).link_state(), LinkState::Down);
        assert_eq!(port(Some(PortState::Down), Some(PhysState::Disabled)).link_state(), LinkState::Down);
        assert_eq!(port(None, None).link_state(), LinkState::Down);
    }
}
