//! `fabric.path/v1`: the route between two devices, its bottleneck, latency, hop class and
//! degradation.

use fabric_topology::{Bandwidth, DeviceId, DeviceIdx, DeviceKind, Fabric, LinkKind, LinkState, Route};
use serde::{Deserialize, Serialize};

use crate::order::MatrixLabels;
use crate::{HasSchema, PATH_SCHEMA};

/// A route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathDoc {
    /// Always `fabric.path/v1`.
    pub schema: String,
    /// Source device.
    pub from: PathHopDoc,
    /// Destination device.
    pub to: PathHopDoc,
    /// Hop class of the two ends (`NV18`, `PIX`, `NET`, ...).
    pub class: String,
    /// Devices from source to destination, inclusive.
    pub hops: Vec<PathHopDoc>,
    /// Links between consecutive hops.
    pub links: Vec<PathLinkDoc>,
    /// Bottleneck bandwidth now, MB/s per direction (over links whose bandwidth is known).
    pub bandwidth_mbps: Option<u64>,
    /// Bottleneck bandwidth the route is built for.
    pub max_bandwidth_mbps: Option<u64>,
    /// `bandwidth_mbps / max_bandwidth_mbps`, rounded to 4 decimals.
    pub fraction: Option<f64>,
    /// Sum of known link latencies.
    pub latency_ns: Option<u64>,
    /// True when a link on the route runs below its capability.
    pub degraded: bool,
}

/// A device on a route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathHopDoc {
    /// Identity.
    pub id: DeviceId,
    /// Matrix label, if any.
    pub label: Option<String>,
    /// Kind.
    pub kind: DeviceKind,
    /// Display name.
    pub name: Option<String>,
}

/// A link on a route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathLinkDoc {
    /// Upstream/first end.
    pub a: DeviceId,
    /// The other end.
    pub b: DeviceId,
    /// Kind and shape.
    pub kind: LinkKind,
    /// Bandwidth.
    pub bandwidth: Bandwidth,
    /// State.
    pub state: LinkState,
    /// Fraction of bandwidth left.
    pub fraction: Option<f64>,
    /// Latency.
    pub latency_ns: Option<u32>,
}

impl HasSchema for PathDoc {
    const SCHEMA: &'static str = PATH_SCHEMA;
    fn schema(&self) -> &str {
        &self.schema
    }
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

impl PathDoc {
    /// Describes the route from `a` to `b` computed on `fabric`.
    pub fn from_route(fabric: &Fabric, labels: &MatrixLabels, a: DeviceIdx, b: DeviceIdx, route: &Route) -> Self {
        let hop = |i| {
            let d = fabric.device(i);
            PathHopDoc {
                id: d.id.clone(),
                label: labels.label(i).map(str::to_owned),
                kind: d.kind,
                name: d.name.clone(),
            }
        };
        let hops: Vec<PathHopDoc> = route.hops.iter().map(|&i| hop(i)).collect();
        let links = route
            .links
            .iter()
            .map(|&li| {
                let l = fabric.link(li);
                PathLinkDoc {
                    a: fabric.device(l.a).id.clone(),
                    b: fabric.device(l.b).id.clone(),
                    kind: l.kind,
                    bandwidth: l.bandwidth,
                    state: l.state,
                    fraction: l.bandwidth.fraction().map(round4),
                    latency_ns: l.latency_ns,
                }
            })
            .collect();
        Self {
            schema: PATH_SCHEMA.to_owned(),
            from: hop(a),
            to: hop(b),
            class: route.class.to_string(),
            hops,
            links,
            bandwidth_mbps: route.bandwidth_mbps,
            max_bandwidth_mbps: route.max_bandwidth_mbps,
            fraction: route.fraction().map(round4),
            latency_ns: route.latency_ns,
            degraded: !route.degraded_links.is_empty(),
        }
    }
}
