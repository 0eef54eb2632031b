//! The members' advertised peer addresses as the node link's listener wants them — the IPs
//! their connections come from — so that it admits them first (`admitting.rs` in
//! fabric-nodelink). An `ip:port` counts at once; a `host:port` is looked up on the
//! runtime's blocking pool, at most [`LOOKUPS`] at a time (a lookup keeps its place until
//! the resolver answers, however long that takes), and remembered for [`REMEMBERED`], a
//! failed lookup too, so that a name that does not resolve is not asked at every view.
//! One task follows the advertised addresses and hands the listener what it knows as soon
//! as it knows it: a slow resolver delays only the names, never the view's other work.

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

/// The names looked up so far, by `host:port` as advertised.
pub struct Resolver {
    lookup: Lookup,
    looked: HashMap<String, Looked>,
    permits: Arc<Semaphore>,
}

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolver").field("looked", &self.looked).finish_non_exhaustive()
    }
}

impl Resolver {
    /// A resolver that asks `lookup`, nothing remembered yet.
    pub fn new(lookup: Lookup) -> Self {
        Self { lookup, looked: HashMap::new(), permits: Arc::new(Semaphore::new(LOOKUPS)) }
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
    /// than [`REMEMBERED`] ago. Forgets the names no longer advertised.
    pub fn due(&mut self, advertised: &[String], now: Instant) -> Vec<String> {
        let names: HashSet<&str> =
            advertised.iter().map(String::as_str).filter(|a| a.parse::<SocketAddr>().is_err()).collect();
        self.looked.retain(|name, _| names.contains(name.as_str()));
        let mut due: Vec<String> = names
            .into_iter()
            .filter(|n| self.looked.get(*n).is_none_or(|l| now.saturating_duration_since(l.at) >= REMEMBERED))
            .map(str::to_owned)
            .collect();
        due.sort();
        due
    }

    /// Looks `names` up, at most [`LOOKUPS`] at a time, and remembers what each gave (no
    /// address when its lookup failed). The names that did not resolve.
    pub async fn look_up(&mut self, names: Vec<String>) -> Vec<String> {
        let mut lookups = JoinSet::new();
        for name in names {
            // The permit goes with the blocking call: a lookup the resolver holds keeps its
            // place, and no more than LOOKUPS threads ever wait on it.
            let Ok(permit) = self.permits.clone().acquire_owned().await else { break };
            let lookup = self.lookup.clone();
            lookups.spawn_blocking(move || {
                let _permit = permit;
                let ips = lookup(&name);
                (name, ips)
            });
        }
        let mut failed = Vec::new();
        while let Some(done) = lookups.join_next().await {
            let Ok((name, ips)) = done else { continue };
            let ips = match ips {
                Ok(ips) if !ips.is_empty() => ips,
                Ok(_) => {
                    tracing::debug!(address = %name, "a member's peer address resolves to no address");
                    failed.push(name.clone());
                    Vec::new()
                }
                Err(e) => {
                    tracing::debug!(address = %name, error = %e, "a member's peer address does not resolve");
                    failed.push(name.clone());
                    Vec::new()
                }
            };
            self.looked.insert(name, Looked { ips, at: Instant::now() });
        }
        failed.sort();
        failed
    }
}

/// Follows the members' advertised addresses (`advertised`, sorted, each once) until the
/// daemon or the sender goes, and hands the listener their IPs: what is known at once, then
/// again once the names due were looked up; the names are looked up again every
/// [`REMEMBERED`].
pub async fn follow(daemon: Weak<Daemon>, mut advertised: watch::Receiver<Vec<String>>, mut resolver: Resolver) {
    let hand_over = |ips: Vec<IpAddr>| {
        let Some(d) = daemon.upgrade() else { return false };
        if let Some(link) = d.domain.as_ref().and_then(|x| x.link()) {
            link.set_member_addresses(ips);
        }
        true
    };
    loop {
        let now: Vec<String> = advertised.borrow_and_update().clone();
        let due = resolver.due(&now, Instant::now());
        if !hand_over(resolver.known(&now)) {
            return;
        }
        if !due.is_empty() {
            let failed = resolver.look_up(due).await;
            if let Some(first) = failed.first() {
                tracing::warn!(
                    unresolved = failed.len(),
                    first = %first,
                    "members' peer addresses that do not resolve: their connections are admitted as any other address's"
                );
            }
            if !hand_over(resolver.known(&now)) {
                return;
            }
        }
        tokio::select! {
            changed = advertised.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(REMEMBERED) => {}
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

    #[tokio::test]
    async fn the_system_resolver_gives_every_address_of_a_literal() {
        // A literal needs no resolver; no name is asked here (a test sends nothing to the
        // host's DNS).
        let ips = tokio::task::spawn_blocking(|| system_lookup()("[::1]:7471")).await.unwrap().unwrap();
        assert_eq!(ips, [ip("::1")]);
    }
}
