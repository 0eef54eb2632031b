//! Path queries: the widest (highest bottleneck bandwidth, then fewest hops) route between
//! two devices, with its hop class, latency and degradation.
//!
//! The search is bounded so that a query on a 100,000-GPU fabric stays in microseconds:
//! within a node (plus its scale-up domain) it is a widest-path Dijkstra over a few dozen
//! devices; between nodes that share no scale-up domain the route is composed as
//! device → best NIC, NIC → NIC over the network switches (bidirectional BFS), NIC → device.
//! Live members of a domain whose network no record describes are still `NET` to each
//! other: their route is the two ends, with no link, bandwidth or latency known.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use serde::Serialize;

use crate::class::HopClass;
use crate::device::DeviceKind;
use crate::graph::Fabric;
use crate::inventory::DeviceIdx;
use crate::link::{Link, LinkKind, LinkState};

/// Errors from path queries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// A device index out of range.
    #[error("no device with index {0}")]
    NoDevice(u32),
    /// No usable route (links down, or nothing connects the two).
    #[error("no usable path between {0} and {1}")]
    Unreachable(String, String),
}

/// A route between two devices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Route {
    /// Devices from source to destination, inclusive.
    pub hops: Vec<DeviceIdx>,
    /// Links traversed, as indexes into the inventory's links.
    pub links: Vec<usize>,
    /// Bottleneck bandwidth now (per direction, MB/s), over links whose bandwidth is known.
    pub bandwidth_mbps: Option<u64>,
    /// Bottleneck bandwidth the route is built for.
    pub max_bandwidth_mbps: Option<u64>,
    /// Sum of known link latencies.
    pub latency_ns: Option<u64>,
    /// Hop class of the two ends.
    pub class: HopClass,
    /// Links on the route running below their capability.
    pub degraded_links: Vec<usize>,
}

impl Route {
    /// Fraction of the route's built bandwidth that is left (1.0 when healthy).
    pub fn fraction(&self) -> Option<f64> {
        match (self.bandwidth_mbps, self.max_bandwidth_mbps) {
            (Some(c), Some(m)) if m > 0 => Some(c as f64 / m as f64),
            _ => None,
        }
    }
}

/// Ranking of routes: fewer links of unknown bandwidth first, then the higher bottleneck
/// of the known ones.
type Rank = (Reverse<u32>, u64);

impl Fabric {
    /// The best route from `a` to `b`.
    pub fn route(&self, a: DeviceIdx, b: DeviceIdx) -> Result<Route, PathError> {
        for x in [a, b] {
            if x.get() >= self.len() {
                return Err(PathError::NoDevice(x.0));
            }
        }
        let hops = if a == b { Some(vec![a]) } else { self.find_hops(a, b) };
        let hops = match hops {
            Some(hops) => hops,
            // Live members of one domain reach each other over the network even where no
            // record describes it (the matrix says NET): a route of the two ends, nothing
            // known of its links.
            None if self.classify(a, b) == HopClass::Net => vec![a, b],
            None => {
                return Err(PathError::Unreachable(self.device(a).id.to_string(), self.device(b).id.to_string()));
            }
        };
        Ok(self.describe(hops, a, b))
    }

    pub(crate) fn find_hops(&self, a: DeviceIdx, b: DeviceIdx) -> Option<Vec<DeviceIdx>> {
        let (na, nb) = (self.node_index(a), self.node_index(b));
        let (sa, sb) = (self.scale_up_domain(a), self.scale_up_domain(b));
        let shared_su = sa.is_some() && sa == sb;
        match (na, nb) {
            (Some(x), Some(y)) if x == y || shared_su => {
                let allow = |d: DeviceIdx| {
                    let n = self.node_index(d);
                    n == na || n == nb || (shared_su && self.scale_up_domain(d) == sa)
                };
                self.widest(a, &allow, |d| d == b).map(|(_, p)| p)
            }
            (Some(_), Some(_)) => self.across_network(a, b),
            // A fabric-level device (a shared switch) at one end: search without bounds.
            _ => self.widest(a, &|_| true, |d| d == b).map(|(_, p)| p),
        }
    }

    /// device → NIC on its node, NIC → NIC through network switches, NIC → device.
    fn across_network(&self, a: DeviceIdx, b: DeviceIdx) -> Option<Vec<DeviceIdx>> {
        let has_net = |d: DeviceIdx| {
            self.device(d).kind == DeviceKind::Nic
                && self.neighbors(d).any(|(_, l)| {
                    matches!(self.link(l).kind, LinkKind::Network { .. }) && self.link(l).state != LinkState::Down
                })
        };
        let nic_side = |x: DeviceIdx| -> Option<Vec<DeviceIdx>> {
            // A NIC on the network is its own way out.
            if has_net(x) {
                return Some(vec![x]);
            }
            let n = self.node_index(x);
            let allow = move |d: DeviceIdx| self.node_index(d) == n;
            self.widest(x, &allow, has_net).map(|(_, p)| p)
        };
        let mut left = nic_side(a)?;
        let mut right = nic_side(b)?;
        let (na, nb) = (*left.last()?, *right.last()?);
        let mid = self.network_bfs(na, nb)?;
        right.reverse();
        left.pop();
        left.extend(mid);
        left.extend(right.into_iter().skip(1));
        Some(left)
    }

    /// Fewest-hop path between two NICs over network links and network switches,
    /// searching from both ends.
    fn network_bfs(&self, s: DeviceIdx, t: DeviceIdx) -> Option<Vec<DeviceIdx>> {
        if s == t {
            return Some(vec![s]);
        }
        let mut prev: [HashMap<DeviceIdx, DeviceIdx>; 2] = [HashMap::new(), HashMap::new()];
        prev[0].insert(s, s);
        prev[1].insert(t, t);
        let mut front: [VecDeque<DeviceIdx>; 2] = [VecDeque::from([s]), VecDeque::from([t])];
        while !front[0].is_empty() && !front[1].is_empty() {
            let side = usize::from(front[1].len() < front[0].len());
            let level: Vec<DeviceIdx> = front[side].drain(..).collect();
            for x in level {
                for (n, li) in self.neighbors(x) {
                    let l = self.link(li);
                    if l.state == LinkState::Down || !matches!(l.kind, LinkKind::Network { .. }) {
                        continue;
                    }
                    let endpoint = n == s || n == t;
                    if !endpoint && self.device(n).kind != DeviceKind::NetworkSwitch {
                        continue;
                    }
                    if prev[side].contains_key(&n) {
                        continue;
                    }
                    prev[side].insert(n, x);
                    if prev[1 - side].contains_key(&n) {
                        let walk = |m: &HashMap<DeviceIdx, DeviceIdx>, mut c: DeviceIdx| {
                            let mut v = vec![c];
                            while let Some(&p) = m.get(&c) {
                                if p == c {
                                    break;
                                }
                                v.push(p);
                                c = p;
                            }
                            v
                        };
                        let mut path = walk(&prev[0], n);
                        path.reverse();
                        path.extend(walk(&prev[1], n).into_iter().skip(1));
                        return Some(path);
                    }
                    front[side].push_back(n);
                }
            }
        }
        None
    }

    /// The best route from `src` over allowed devices to the first device that satisfies
    /// `goal`: the fewest links of unknown bandwidth, then the widest bottleneck among the
    /// known ones, then the fewest hops. Only transit devices are passed through. In two
    /// searches, each exact: the best (unknown links, bottleneck) any route reaches, then
    /// the fewest (unknown links, hops) over the links at least that wide — one search
    /// ranked by all three would keep a wide, long prefix over a short, narrow one that
    /// the rest of the route makes as good.
    fn widest(
        &self,
        src: DeviceIdx,
        allow: &dyn Fn(DeviceIdx) -> bool,
        goal: impl Fn(DeviceIdx) -> bool,
    ) -> Option<(Rank, Vec<DeviceIdx>)> {
        let widest = |r: Rank, l: &Link| {
            Some(match l.bandwidth.current_mbps {
                Some(bw) => (r.0, r.1.min(bw)),
                None => (Reverse(r.0.0 + 1), r.1),
            })
        };
        let (rank, _) = self.best_first(src, allow, &goal, (Reverse(0), u64::MAX), widest)?;
        let shortest = |r: Reverse<(u32, u32)>, l: &Link| match l.bandwidth.current_mbps {
            Some(bw) if bw < rank.1 => None,
            Some(_) => Some(Reverse((r.0.0, r.0.1 + 1))),
            None => Some(Reverse((r.0.0 + 1, r.0.1 + 1))),
        };
        let (_, path) = self.best_first(src, allow, &goal, Reverse((0, 0)), shortest)?;
        Some((rank, path))
    }

    /// Best-first search from `src` (Dijkstra, highest key first): `step` extends a key
    /// over a link (never to a better one), or refuses the link. The first device popped
    /// that satisfies `goal`, with its key and path.
    fn best_first<K: Ord + Copy>(
        &self,
        src: DeviceIdx,
        allow: &dyn Fn(DeviceIdx) -> bool,
        goal: &dyn Fn(DeviceIdx) -> bool,
        start: K,
        step: impl Fn(K, &Link) -> Option<K>,
    ) -> Option<(K, Vec<DeviceIdx>)> {
        let mut best: HashMap<DeviceIdx, (K, DeviceIdx)> = HashMap::new();
        let mut heap = BinaryHeap::new();
        best.insert(src, (start, src));
        heap.push((start, src));
        while let Some((key, x)) = heap.pop() {
            if best.get(&x).is_some_and(|(k, _)| *k > key) {
                continue;
            }
            if x != src && goal(x) {
                let mut path = vec![x];
                let mut c = x;
                while c != src {
                    c = best[&c].1;
                    path.push(c);
                }
                path.reverse();
                return Some((key, path));
            }
            if x != src && !self.device(x).kind.is_transit() {
                continue;
            }
            for (n, li) in self.neighbors(x) {
                let l = self.link(li);
                if l.state == LinkState::Down || !(allow(n) || goal(n)) {
                    continue;
                }
                let Some(cand) = step(key, l) else { continue };
                if best.get(&n).is_none_or(|(k, _)| cand > *k) {
                    best.insert(n, (cand, x));
                    heap.push((cand, n));
                }
            }
        }
        None
    }

    fn describe(&self, hops: Vec<DeviceIdx>, a: DeviceIdx, b: DeviceIdx) -> Route {
        let mut links = Vec::with_capacity(hops.len().saturating_sub(1));
        for w in hops.windows(2) {
            // The widest link between consecutive hops (parallel links: take the best).
            let li = self
                .neighbors(w[0])
                .filter(|&(n, li)| n == w[1] && self.link(li).state != LinkState::Down)
                // A link of known bandwidth before one of unknown.
                .max_by_key(|&(_, li)| self.link(li).bandwidth.current_mbps.map(|bw| (1, bw)).unwrap_or((0, 0)))
                .map(|(_, li)| li);
            links.extend(li);
        }
        let min_known = |f: &dyn Fn(usize) -> Option<u64>| links.iter().filter_map(|&l| f(l)).min();
        let bandwidth_mbps = min_known(&|l| self.link(l).bandwidth.current_mbps);
        let max_bandwidth_mbps = min_known(&|l| self.link(l).bandwidth.max_mbps);
        let lat: Vec<u64> = links.iter().filter_map(|&l| self.link(l).latency_ns.map(u64::from)).collect();
        let latency_ns = (!lat.is_empty()).then(|| lat.iter().sum());
        let degraded_links = links.iter().copied().filter(|&l| self.link(l).state == LinkState::Degraded).collect();
        let class = if a == b { HopClass::X } else { self.classify(a, b) };
        Route { hops, links, bandwidth_mbps, max_bandwidth_mbps, latency_ns, class, degraded_links }
    }
}
