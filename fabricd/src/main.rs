//! The `fabricd` binary: parses arguments, installs logging, starts the daemon, serves
//! until SIGTERM/SIGINT. Exit codes: 0 clean stop (or `--check` passed), 2 usage,
//! 3 configuration invalid, 4 start-up failed (state dir, lock, discovery, socket, metrics),
//! 1 anything else at run time.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use fabricd::config::{Config, Environment, LogFormat};
use fabricd::daemon::{backend_line, discover};
use fabricd::sys::notify;
use fabricd::transport::{http, socket};
use fabricd::{Daemon, ops};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// fabricd: the fabric daemon.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Configuration file (configs/fabricd.toml documents every key); default: built-in
    /// defaults.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the configuration and run discovery, print a summary and exit (0: fine).
    #[arg(long)]
    check: bool,
}

const EXIT_RUNTIME: u8 = 1;
const EXIT_CONFIG: u8 = 3;
const EXIT_START: u8 = 4;

fn main() -> ExitCode {
    let args = Args::parse();
    let config = match &args.config {
        Some(p) => Config::load(p),
        None => Ok(Config::default()),
    };
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "fabricd: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_logging(&config);
    if args.check {
        return check(&config, args.config.as_deref());
    }
    raise_open_files();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return ExitCode::from(EXIT_START);
        }
    };
    rt.block_on(serve(config))
}

/// Raises the soft limit on open descriptors to the hard one: every client connection,
/// region file and memory object the daemon holds is one, and the usual soft default
/// (1024) is far below what a busy node needs.
fn raise_open_files() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 || r.rlim_cur >= r.rlim_max {
        return;
    }
    let was = r.rlim_cur;
    r.rlim_cur = r.rlim_max;
    // SAFETY: setrlimit reads the rlimit `r` points to; raising the soft limit up to the
    // hard one needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0 {
        tracing::debug!(from = was, to = r.rlim_cur, "raised the open-file limit");
    }
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&config.log.level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // vfio-ioctls logs (through `log`) at `warn` what is normal here, such as a conventional
    // PCI function having no error IRQ; its errors still show, and a filter that names it
    // gets what it asks for.
    let names = |s: &str| s.contains("vfio_ioctls");
    let named =
        std::env::var(tracing_subscriber::EnvFilter::DEFAULT_ENV).is_ok_and(|s| names(&s)) || names(&config.log.level);
    let filter = match "vfio_ioctls=error".parse() {
        Ok(d) if !named => filter.add_directive(d),
        _ => filter,
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _ = match config.log.format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

fn check(config: &Config, path: Option<&std::path::Path>) -> ExitCode {
    let env = Environment::current();
    let mut out = std::io::stdout().lock();
    let file = path.map_or_else(|| "(built-in defaults)".to_owned(), |p| p.display().to_string());
    let paths = config.socket_path(&env).and_then(|s| Ok((s, config.state_dir(&env)?)));
    let (sock, state) = match paths {
        Ok(p) => p,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "fabricd: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let inv = match discover(config) {
        Ok(inv) => inv,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "fabricd: discovery failed: {}", fabricd::error_chain(&e));
            return ExitCode::from(EXIT_START);
        }
    };
    let _ = writeln!(out, "configuration {file}: ok");
    let _ = writeln!(out, "socket {}", sock.display());
    let _ = writeln!(out, "state dir {}", state.display());
    for r in &inv.backends {
        let _ = writeln!(out, "backend {}", backend_line(r));
    }
    let degraded = inv.links.iter().filter(|l| l.state != fabric_topology::LinkState::Up).count();
    let _ = writeln!(
        out,
        "discovered {} devices, {} links ({degraded} down or degraded)",
        inv.devices.len(),
        inv.links.len()
    );
    if let Err(e) = fabric_topology::Fabric::build(inv) {
        let _ =
            writeln!(std::io::stderr(), "fabricd: discovered inventory is inconsistent: {}", fabricd::error_chain(&e));
        return ExitCode::from(EXIT_START);
    }
    let _ = writeln!(out, "check passed");
    ExitCode::SUCCESS
}

async fn serve(config: Config) -> ExitCode {
    let root = Environment::current().root;
    let group = config.socket.group.clone();
    let daemon = match tokio::task::spawn_blocking(move || Daemon::start(config)).await {
        Ok(Ok(d)) => Arc::new(d),
        Ok(Err(e)) => {
            tracing::error!("cannot start: {}", fabricd::error_chain(&e));
            return ExitCode::from(EXIT_START);
        }
        Err(e) => {
            tracing::error!(error = %e, "start-up panicked");
            return ExitCode::from(EXIT_START);
        }
    };
    let path = daemon.socket_path.clone();
    let listener = match socket::bind(&path, group.as_deref(), root) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot serve the socket: {}", fabricd::error_chain(&e));
            return ExitCode::from(EXIT_START);
        }
    };
    let listener = match listener.set_nonblocking(true).and_then(|()| tokio::net::UnixListener::from_std(listener)) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot register the socket with the runtime");
            let _ = std::fs::remove_file(&path);
            return ExitCode::from(EXIT_START);
        }
    };
    let shutdown = CancellationToken::new();
    if let Err(e) = watch_signals(shutdown.clone()) {
        tracing::error!(error = %e, "cannot install signal handlers");
        let _ = std::fs::remove_file(&path);
        return ExitCode::from(EXIT_START);
    }
    let tasks = TaskTracker::new();
    let listen = daemon.config.metrics.listen.clone();
    if !listen.is_empty() {
        match http::bind(&listen) {
            Ok(l) => {
                tracing::info!(listen = %listen, "serving metrics at /metrics");
                tasks.spawn(http::serve(l, daemon.clone(), shutdown.clone()));
            }
            Err(e) => {
                tracing::error!("cannot serve metrics: {}", fabricd::error_chain(&e));
                let _ = std::fs::remove_file(&path);
                return ExitCode::from(EXIT_START);
            }
        }
    }
    fabricd::tasks::uevent::start(&daemon, &shutdown, &tasks);
    tasks.spawn(fabricd::tasks::monitor::run(daemon.clone(), shutdown.clone()));
    tasks.spawn(fabricd::tasks::grace::run(daemon.clone(), shutdown.clone()));
    tasks.spawn(fabricd::tasks::sizewatch::run(daemon.clone(), shutdown.clone()));
    tasks.spawn(fabricd::ops::refusals::run(daemon.clone(), shutdown.clone()));
    tasks.close();
    let status = ops::status(&daemon);
    tracing::info!(
        socket = %path.display(),
        devices = status.devices,
        links = status.links,
        problems = status.problems.len(),
        "ready"
    );
    notify::notify_logged(&format!("READY=1\nSTATUS=serving {} devices", status.devices));
    let domain = daemon.domain.clone();
    let r = fabricd::run(listener, daemon, shutdown.clone()).await;
    let _ = std::fs::remove_file(&path);
    // The metrics endpoint stops with the server (it also stops when the server failed).
    shutdown.cancel();
    tasks.wait().await;
    if let Some(domain) = domain {
        // Gone from the domain at once rather than one TTL later.
        let _ = tokio::task::spawn_blocking(move || domain.leave()).await;
    }
    match r {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("server failed: {}", fabricd::error_chain(&e));
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}

fn watch_signals(shutdown: CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down");
        notify::notify_logged("STOPPING=1");
        shutdown.cancel();
    });
    Ok(())
}
