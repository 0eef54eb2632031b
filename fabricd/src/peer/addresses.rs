//! The members' advertised peer addresses as the node link's listener wants them — the IPs
//! their connections come from — so that it admits them first (`admitting.rs` in
//! fabric-nodelink). An `ip:port` counts at once; a `host:port` is looked up on the
//! runtime's blocking pool, at most [`LOOKUPS`] at a time (a lookup keeps its place until
//! the resolver answers, however long that takes), and remembered for [`REMEMBERED`], a
//! failed lookup too, so that a name that does not resolve is not asked at every view.
//! One task follows the advertised addresses and hands the listener what it knows as soon
//! as it knows it: a slow resolver delays only the names it is asked, never a new set's
//! literal addresses nor the view's other work.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::daemon::Daemon;

/// How long a lookup's answer (addresses or a failure) stands before it is asked again.
pub const REMEMBERED: Duration = Duration::from_secs(60);
/// Lookups in flight at once.
pub const LOOKUPS: usize = 8;

/// Looks up a `host:port`: the system's resolver, or a test's.
pub type Lookup = Arc<dyn Fn(&str) -> std::io::Result<Vec<IpAddr>> + Send + Sync>;

/// The system's resolver (`getaddrinfo`): every address a name has.
pub fn system_lookup() -> Lookup {
    Arc::new(|address: &str| Ok(address.to_socket_addrs()?.map(|a| a.ip()).collect()))
}

/// What a lookup of one name gave, and when.
#[derive(Debug)]
struct Looked {
    ips: Vec<IpAddr>,
    at: Instant,
}

/// The names looked up so far, by `host:port` as advertised, and the lookups in flight.
pub struct Resolver {
    lookup: Lookup,
    looked: HashMap<String, Looked>,
    in_flight: HashSet<String>,
    permits: Arc<Semaphore>,
    lookups: JoinSet<(String, std::io::Result<Vec<IpAddr>>)>,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolver")
            .field("looked", &self.looked)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl Resolver {
    /// A resolver that asks `lookup`, nothing remembered yet.
    pub fn new(lookup: Lookup) -> Self {
        Self {
            lookup,
            looked: HashMap::new(),
            in_flight: HashSet::new(),
            permits: Arc::new(Semaphore::new(LOOKUPS)),
            lookups: JoinSet::new(),
        }
    }

    /// The IPs of `advertised` known now, without a lookup: the literal ones, and those of
    /// the names looked up before (however long ago), each once.
    pub fn known(&self, advertised: &[String]) -> Vec<IpAddr> {
        let mut seen = HashSet::new();
        let mut ips = Vec::new();
        for a in advertised {
            let found: &[IpAddr] = match a.parse::<SocketAddr>() {
                Ok(addr) => &[addr.ip()],
                Err(_) => self.looked.get(a).map_or(&[], |l| &l.ips),
            };
            ips.extend(found.iter().copied().filter(|ip| seen.insert(*ip)));
        }
        ips
    }

    /// The names of `advertised` to look up at `now`: never looked up, or looked up longer
    /// than [`REMEMBERED`] ago, and not being looked up. Forgets the names no longer
    /// advertised (a lookup of one in flight is recorded when it ends, then forgotten).
    pub fn due(&mut self, advertised: &[String], now: Instant) -> Vec<String> {
        let names: HashSet<&str> =
            advertised.iter().map(String::as_str).filter(|a| a.parse::<SocketAddr>().is_err()).collect();
        self.looked.retain(|name, _| names.contains(name.as_str()));
        let mut due: Vec<String> = names
            .into_iter()
            .filter(|n| !self.in_flight.contains(*n))
            .filter(|n| self.looked.get(*n).is_none_or(|l| now.saturating_duration_since(l.at) >= REMEMBERED))
            .map(str::to_owned)
            .collect();
        due.sort();
        due
    }

    /// Starts looking `names` up, without waiting: each lookup waits for one of
    /// [`LOOKUPS`] places, then runs on the blocking pool, and keeps its place until the
    /// resolver answers.
    pub fn start(&mut self, names: Vec<String>) {
        for name in names {
            if !self.in_flight.insert(name.clone()) {
                continue;
            }
            let (permits, lookup) = (self.permits.clone(), self.lookup.clone());
            self.lookups.spawn(async move {
                let Ok(permit) = permits.acquire_owned().await else {
                    return (name, Err(std::io::Error::other("the resolver's places are closed")));
                };
                let asked = name.clone();
                let looked = tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    lookup(&asked)
                })
                .await;
                (name, looked.unwrap_or_else(|e| Err(std::io::Error::other(e))))
            });
        }
    }

    /// Whether a lookup is in flight.
    pub fn busy(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// The next lookup to end, recorded (no address when it failed): its name and whether
    /// it resolved. `None` when none is in flight. Cancel-safe.
    pub async fn next(&mut self) -> Option<(String, bool)> {
        loop {
            let Some(done) = self.lookups.join_next().await else {
                // Nothing left to join: nothing is in flight (a lookup task cannot panic,
                // but a name must not stay "in flight" forever if one did).
                self.in_flight.clear();
                return None;
            };
            let Ok((name, ips)) = done else { continue };
            self.in_flight.remove(&name);
            let ips = match ips {
                Ok(ips) => ips,
                Err(e) => {
                    tracing::debug!(address = %name, error = %e, "a member's peer address does not resolve");
                    Vec::new()
                }
            };
            let resolved = !ips.is_empty();
            self.looked.insert(name.clone(), Looked { ips, at: Instant::now() });
            return Some((name, resolved));
        }
    }

    /// Looks `names` up and waits for every lookup in flight: the names that did not
    /// resolve.
    #[cfg(test)]
    async fn look_up(&mut self, names: Vec<String>) -> Vec<String> {
        self.start(names);
        let mut failed = Vec::new();
        while let Some((name, resolved)) = self.next().await {
            if !resolved {
                failed.push(name);
            }
        }
        failed.sort();
        failed
    }
}

/// How often the listener is handed what lookups found while more are in flight.
pub const HAND_OVER_EVERY: Duration = Duration::from_secs(1);

/// Follows the members' advertised addresses (`advertised`, sorted, each once) until the
/// daemon or the sender goes, and hands the listener their IPs: what is known, at once for
/// each new set; what lookups find, as they end (at most every [`HAND_OVER_EVERY`] while
/// more are in flight). Names are looked up again every [`REMEMBERED`]. A lookup never
/// holds up a new set's hand-over.
pub async fn follow(daemon: Weak<Daemon>, mut advertised: watch::Receiver<Vec<String>>, mut resolver: Resolver) {
    let hand_over = |ips: Vec<IpAddr>| {
        let Some(d) = daemon.upgrade() else { return false };
        if let Some(link) = d.domain.as_ref().and_then(|x| x.link()) {
            link.set_member_addresses(ips);
        }
        true
    };
    let mut failed: Vec<String> = Vec::new();
    loop {
        let now: Vec<String> = advertised.borrow_and_update().clone();
        let due = resolver.due(&now, Instant::now());
        resolver.start(due);
        if !hand_over(resolver.known(&now)) {
            return;
        }
        let (refresh, mut handed) = (tokio::time::Instant::now() + REMEMBERED, tokio::time::Instant::now());
        loop {
            tokio::select! {
                changed = advertised.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                done = resolver.next(), if resolver.busy() => {
                    if let Some((name, false)) = done {
                        failed.push(name);
                    }
                    if resolver.busy() && handed.elapsed() < HAND_OVER_EVERY {
                        continue;
                    }
                    if !hand_over(resolver.known(&now)) {
                        return;
                    }
                    handed = tokio::time::Instant::now();
                    if !resolver.busy() && !failed.is_empty() {
                        failed.sort();
                        tracing::warn!(
                            unresolved = failed.len(),
                            first = %failed[0],
                            "members' peer addresses that do not resolve: their connections are admitted as any other address's"
                        );
                        failed.clear();
                    }
                }
                () = tokio::time::sleep_until(refresh) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    /// A resolver over a table, counting the lookups of each name.
    fn table(entries: &[(&str, &[&str])]) -> (Resolver, Arc<Mutex<HashMap<String, usize>>>) {
        let table: HashMap<String, Vec<IpAddr>> =
            entries.iter().map(|(n, ips)| ((*n).to_owned(), ips.iter().map(|s| ip(s)).collect())).collect();
        let asked = Arc::new(Mutex::new(HashMap::new()));
        let counted = asked.clone();
        let lookup: Lookup = Arc::new(move |name: &str| {
            *counted.lock().unwrap().entry(name.to_owned()).or_insert(0) += 1;
            table.get(name).cloned().ok_or_else(|| std::io::Error::other("no such name"))
        });
        (Resolver::new(lookup), asked)
    }

    #[tokio::test]
    async fn literal_addresses_count_at_once_and_names_once_looked_up() {
        let (mut r, asked) = table(&[("tray1:7471", &["10.0.0.1", "fd00::1"]), ("tray2:7471", &["10.0.0.1"])]);
        let advertised = strings(&["10.0.0.9:7471", "[fd00::9]:7471", "tray1:7471", "tray2:7471", "nowhere:1"]);
        assert_eq!(r.known(&advertised), [ip("10.0.0.9"), ip("fd00::9")], "names wait for their lookup");
        let due = r.due(&advertised, Instant::now());
        assert_eq!(due, strings(&["nowhere:1", "tray1:7471", "tray2:7471"]));
        assert_eq!(r.look_up(due).await, strings(&["nowhere:1"]), "the name that did not resolve");
        assert_eq!(
            r.known(&advertised),
            [ip("10.0.0.9"), ip("fd00::9"), ip("10.0.0.1"), ip("fd00::1")],
            "every address of a name, each IP once"
        );
        // Within REMEMBERED nothing is due, a failed name included; past it, every name is.
        assert!(r.due(&advertised, Instant::now()).is_empty());
        let later = Instant::now() + REMEMBERED;
        assert_eq!(r.due(&advertised, later).len(), 3);
        assert_eq!(asked.lock().unwrap().values().sum::<usize>(), 3, "one lookup per name");
    }

    #[tokio::test]
    async fn a_name_no_longer_advertised_is_forgotten() {
        let (mut r, asked) = table(&[("tray1:7471", &["10.0.0.1"])]);
        let with = strings(&["tray1:7471"]);
        let due = r.due(&with, Instant::now());
        r.look_up(due).await;
        assert_eq!(r.known(&with), [ip("10.0.0.1")]);
        assert!(r.due(&[], Instant::now()).is_empty());
        assert!(r.known(&with).is_empty(), "forgotten once it left the members");
        assert_eq!(r.due(&with, Instant::now()), with, "and looked up again when it comes back");
        assert_eq!(asked.lock().unwrap()["tray1:7471"], 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_lookups_wait_on_the_resolver_at_once() {
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (n, m) = (now.clone(), most.clone());
        let lookup: Lookup = Arc::new(move |_: &str| {
            let at = n.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(at, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            n.fetch_sub(1, Ordering::SeqCst);
            Ok(vec![ip("10.0.0.1")])
        });
        let mut r = Resolver::new(lookup);
        let names: Vec<String> = (0..LOOKUPS * 3).map(|i| format!("tray{i}:7471")).collect();
        let due = r.due(&names, Instant::now());
        assert!(r.look_up(due).await.is_empty());
        let most = most.load(Ordering::SeqCst);
        assert!(most > 1 && most <= LOOKUPS, "{most} lookups at once");
        assert!(r.due(&names, Instant::now()).is_empty(), "every name remembered");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lookup_the_resolver_holds_up_holds_up_nothing_else() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let lookup: Lookup = Arc::new(move |name: &str| {
            if name == "slow:1" {
                let _ = held.lock().unwrap().recv();
            }
            Ok(vec![ip("10.0.0.7")])
        });
        let mut r = Resolver::new(lookup);
        let first = strings(&["slow:1"]);
        let due = r.due(&first, Instant::now());
        r.start(due);
        assert!(r.busy());
        // A new set while the lookup hangs: its literal address is known at once, and the
        // name in flight is not asked twice.
        let second = strings(&["10.0.0.9:7471", "slow:1"]);
        assert_eq!(r.known(&second), [ip("10.0.0.9")]);
        assert!(r.due(&second, Instant::now()).is_empty());
        release.send(()).unwrap();
        assert_eq!(r.next().await, Some(("slow:1".to_owned(), true)));
        assert!(!r.busy());
        assert_eq!(r.known(&second), [ip("10.0.0.9"), ip("10.0.0.7")]);
        assert_eq!(r.next().await, None);
    }

    #[tokio::test]
    async fn the_system_resolver_gives_every_address_of_a_literal() {
        // A literal needs no resolver; no name is asked here (a test sends nothing to the
        // host's DNS).
        let ips = tokio::task::spawn_blocking(|| system_lookup()("[::1]:7471")).await.unwrap().unwrap();
        assert_eq!(ips, [ip("::1")]);
    }
}
