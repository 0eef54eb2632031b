//! Network namespaces for fault tests: a "switch" namespace with a bridge, one namespace
//! for etcd and one per node, joined to the bridge by veth pairs, with addresses in
//! 10.77.0.0/24 that exist only inside them. A node is cut off from etcd with iptables in
//! its own namespace. Everything is removed on drop.
//!
//! Root only, with `ip` and `iptables` installed: [`Net::create`] answers
//! [`NetError::Unavailable`] otherwise, so a test can print `skipped: …` and pass. Names are
//! unique per process and per net (`ft<pid>-<n>-…`), so parallel tests never clash; the
//! host's own namespace is never touched (the veth pairs are created inside the switch
//! namespace). Code runs inside a namespace on a dedicated thread that `setns`es before it
//! builds its tokio runtime ([`in_netns`]); it never falls back to the root namespace.

use std::ffi::OsStr;
use std::future::Future;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Where `ip netns add` mounts a namespace.
const NETNS_DIR: &str = "/run/netns";
/// The address of etcd's namespace.
pub const ETCD_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

/// Errors of the namespace harness.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Not root, or `ip`/`iptables` missing: the test skips.
    #[error("network namespaces unavailable: {0}")]
    Unavailable(String),
    /// A command failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its standard error.
        stderr: String,
    },
    /// Starting a command or entering a namespace failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A namespace this harness created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Netns {
    name: String,
    addr: Ipv4Addr,
}

impl Netns {
    /// Its name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its address on the bridge.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// Checks that the namespace still exists (before anything is sent from it).
    pub fn check(&self) -> Result<(), NetError> {
        if Path::new(NETNS_DIR).join(&self.name).exists() {
            Ok(())
        } else {
            Err(NetError::Unavailable(format!("namespace {} does not exist", self.name)))
        }
    }

    /// Runs `ip netns exec <self> <args…>`.
    pub fn exec<I, S>(&self, args: I) -> Result<(), NetError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.check()?;
        let mut full: Vec<std::ffi::OsString> = vec!["netns".into(), "exec".into(), self.name.clone().into()];
        full.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        run("ip", &full)
    }

    /// Makes `cmd` run inside this namespace: the child `setns`es between fork and exec,
    /// so the process spawned is the program itself (its pid can be signalled), with no
    /// `ip netns exec` in between. The namespace must exist now; if entering it fails, the
    /// spawn fails (the program never runs in the root namespace).
    pub fn enter_on_spawn(&self, cmd: &mut Command) -> Result<(), NetError> {
        use std::os::unix::process::CommandExt;
        self.check()?;
        let path = Path::new(NETNS_DIR).join(&self.name);
        let file = std::fs::File::open(&path)
            .map_err(|source| NetError::Io { what: format!("open {}", path.display()), source })?;
        // SAFETY: the closure runs in the forked child before exec and makes one
        // async-signal-safe system call on a descriptor opened before the fork (kept open
        // by the closure, close-on-exec); it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Drops every packet this namespace sends to `to`.
    pub fn cut(&self, to: Ipv4Addr) -> Result<(), NetError> {
        self.exec(["iptables", "-A", "OUTPUT", "-d", &to.to_string(), "-j", "DROP"])
    }

    /// Removes the rule [`Netns::cut`] added.
    pub fn heal(&self, to: Ipv4Addr) -> Result<(), NetError> {
        self.exec(["iptables", "-D", "OUTPUT", "-d", &to.to_string(), "-j", "DROP"])
    }
}

/// A test's private network: the switch, etcd's namespace and the nodes'.
#[derive(Debug)]
pub struct Net {
    switch: String,
    etcd: Netns,
    nodes: Vec<Netns>,
    created: Vec<String>,
}

impl Net {
    /// Creates the switch, etcd's namespace and `nodes` node namespaces (at 10.77.0.10 +
    /// i), or says why it cannot.
    pub fn create(nodes: u8) -> Result<Self, NetError> {
        available()?;
        if nodes > 200 {
            return Err(NetError::Unavailable(format!("{nodes} nodes do not fit in 10.77.0.0/24")));
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let tag = format!("ft{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut net = Self {
            switch: format!("{tag}-sw"),
            etcd: Netns { name: format!("{tag}-etcd"), addr: ETCD_ADDR },
            nodes: (0..nodes)
                .map(|i| Netns { name: format!("{tag}-n{i}"), addr: Ipv4Addr::new(10, 77, 0, 10 + i) })
                .collect(),
            created: Vec::new(),
        };
        net.add_namespace(&net.switch.clone())?;
        let sw = net.switch.clone();
        run("ip", ["netns", "exec", &sw, "ip", "link", "add", "br0", "type", "bridge"])?;
        run("ip", ["netns", "exec", &sw, "ip", "link", "set", "br0", "up"])?;
        let members: Vec<Netns> = std::iter::once(net.etcd.clone()).chain(net.nodes.iter().cloned()).collect();
        for (port, ns) in members.iter().enumerate() {
            net.add_namespace(&ns.name)?;
            let port = format!("p{port}");
            // Created inside the switch namespace, its peer moved straight into the node's:
            // the host's namespace never sees either end.
            run(
                "ip",
                [
                    "netns", "exec", &sw, "ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                    &ns.name,
                ],
            )?;
            run("ip", ["netns", "exec", &sw, "ip", "link", "set", &port, "master", "br0", "up"])?;
            let cidr = format!("{}/24", ns.addr);
            ns.exec(["ip", "addr", "add", &cidr, "dev", "eth0"])?;
            ns.exec(["ip", "link", "set", "eth0", "up"])?;
            ns.exec(["ip", "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// etcd's namespace.
    pub fn etcd(&self) -> &Netns {
        &self.etcd
    }

    /// The nodes' namespaces.
    pub fn nodes(&self) -> &[Netns] {
        &self.nodes
    }

    fn add_namespace(&mut self, name: &str) -> Result<(), NetError> {
        run("ip", ["netns", "add", name])?;
        self.created.push(name.to_owned());
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Only the namespaces this net created; their veths and iptables rules go with them.
        for name in self.created.iter().rev() {
            let _ = run("ip", ["netns", "del", name.as_str()]);
        }
    }
}

/// Root, `ip` and `iptables`, or why not.
pub fn available() -> Result<(), NetError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NetError::Unavailable("not root".to_owned()));
    }
    for tool in ["ip", "iptables"] {
        if find(tool).is_none() {
            return Err(NetError::Unavailable(format!("`{tool}` is not installed (scripts/deps.sh)")));
        }
    }
    Ok(())
}

/// Runs `future` (built by `make`) inside `ns` on a thread of its own, with a
/// current-thread tokio runtime created after the thread entered the namespace; its
/// sockets, and every reconnection, live there.
pub fn in_netns<F, Fut>(ns: &Netns, make: F) -> Result<std::thread::JoinHandle<Fut::Output>, NetError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future,
    Fut::Output: Send + 'static,
{
    ns.check()?;
    let path = Path::new(NETNS_DIR).join(&ns.name);
    let file = std::fs::File::open(&path)
        .map_err(|source| NetError::Io { what: format!("open {}", path.display()), source })?;
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(format!("netns-{}", ns.name))
        .spawn(move || {
            // SAFETY: setns on a valid namespace fd; it changes only this thread's namespace.
            let entered = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            drop(file);
            if entered != 0 {
                let error = std::io::Error::last_os_error();
                let _ = entered_tx.send(Err(error));
                // Never fall back to the root namespace: the future is not run.
                panic!("setns failed; the future was not run");
            }
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let runtime = match runtime {
                Ok(runtime) => {
                    let _ = entered_tx.send(Ok(()));
                    runtime
                }
                Err(error) => {
                    let _ = entered_tx.send(Err(error));
                    panic!("no runtime; the future was not run");
                }
            };
            runtime.block_on(make())
        })
        .map_err(|source| NetError::Io { what: "spawn a namespace thread".to_owned(), source })?;
    match entered_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(source)) => Err(NetError::Io { what: format!("enter namespace {}", ns.name), source }),
        Err(_) => Err(NetError::Unavailable(format!("the thread for {} ended early", ns.name))),
    }
}

fn run<I, S>(program: &str, args: I) -> Result<(), NetError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let line = || {
        let words: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        format!("{program} {}", words.join(" "))
    };
    let binary = find(program).ok_or_else(|| NetError::Unavailable(format!("`{program}` is not installed")))?;
    let output = Command::new(binary)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| NetError::Io { what: line(), source })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(NetError::Command { command: line(), stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned() })
    }
}

/// `program` on `PATH` (plus the sbin directories, which a non-login root shell may lack).
pub(crate) fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
