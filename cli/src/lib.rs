//! fabricctl: the operator CLI over the fabric model.
//!
//! `main.rs` only parses arguments, installs logging and prints errors; [`run`] loads the
//! inventory from its [`source`], prepares a [`view::View`] and hands it to a renderer in
//! [`render`]. Every renderer writes to an `io::Write`, so tests render into a buffer.

pub mod args;
pub mod bench;
pub mod bench_control;
pub mod bench_copy;
pub mod bench_crossnode;
pub mod bench_dma;
pub mod bench_isolation;
pub mod bench_libcontrol;
pub mod bench_netcopy;
pub mod daemon;
pub mod domain;
pub mod gpu_compare;
pub mod map;
pub mod nvsmi;
pub mod pages;
pub mod remote;
pub mod render;
pub mod source;
pub mod view;

use std::io::{self, Write};
use std::time::Duration;

use anyhow::Context;
use fabric_proto::PathDoc;
use fabric_topology::PathError;

use crate::args::{BenchCommand, Cli, Command, ListFormat, SourceArgs, TopologyFormat};
use crate::bench::BenchError;
use crate::daemon::DaemonError;
use crate::map::MapCmdError;
use crate::source::{Source, SourceError};
use crate::view::{View, ViewError};

/// Errors of the commands themselves (loading and resolving have their own).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No route between two devices.
    #[error("finding a route from {a} to {b}")]
    Route {
        /// Source argument.
        a: String,
        /// Destination argument.
        b: String,
        /// Why.
        #[source]
        source: PathError,
    },
    /// Writing the output failed.
    #[error("writing the output")]
    Output(#[source] io::Error),
}

impl RunError {
    /// How to fix it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            RunError::Route { .. } => {
                Some("check link states with `fabricctl topology -o tree`; down links are never routed over")
            }
            RunError::Output(_) => None,
        }
    }
}

/// Loads the fabric the flags select — from fabricd ([`daemon::select`]) or discovered
/// locally — and prepares it for rendering. Both paths give the same [`View`] for the
/// same fabric, so every renderer prints the same bytes.
pub fn load_view(args: &SourceArgs) -> anyhow::Result<View> {
    let fabric = match daemon::select(args)? {
        Some(mut client) => client.fabric()?,
        None => Source::from_args(args).load()?,
    };
    Ok(View::new(fabric, args.node.clone())?)
}

/// Writes `fabricctl topology -o FORMAT` of a view.
pub fn write_topology(view: &View, format: TopologyFormat, out: &mut dyn Write) -> anyhow::Result<()> {
    let r = match format {
        TopologyFormat::Table => render::matrix::render(view, out),
        TopologyFormat::Tree => render::tree::render(view, out),
        TopologyFormat::Json => render::json::render_topology(view, out),
        TopologyFormat::Dot => render::dot::render(view, out),
        TopologyFormat::NcclXml => render::nccl::render(view, view.single_node()?, out),
    };
    Ok(r.map_err(RunError::Output)?)
}

/// Writes `fabricctl devices -o FORMAT` of a view.
pub fn write_devices(view: &View, format: ListFormat, out: &mut dyn Write) -> Result<(), RunError> {
    let r = match format {
        ListFormat::Table => render::devices::render(view, out),
        ListFormat::Json => render::json::render_devices(view, out),
    };
    r.map_err(RunError::Output)
}

/// Writes `fabricctl path A B -o FORMAT` of a view: `a` and `b` are device ids or labels.
pub fn write_path(view: &View, a: &str, b: &str, format: ListFormat, out: &mut dyn Write) -> anyhow::Result<()> {
    let from = view.resolve(a).with_context(|| format!("resolving the source device {a:?}"))?;
    let to = view.resolve(b).with_context(|| format!("resolving the destination device {b:?}"))?;
    let route =
        view.fabric.route(from, to).map_err(|source| RunError::Route { a: a.to_owned(), b: b.to_owned(), source })?;
    let doc = PathDoc::from_route(&view.fabric, &view.labels, from, to, &route);
    let r = match format {
        ListFormat::Table => render::path::render_table(&doc, out),
        ListFormat::Json => render::path::render_json(&doc, out),
    };
    Ok(r.map_err(RunError::Output)?)
}

/// Runs a parsed command line, writing its output to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> anyhow::Result<()> {
    daemon::set_timeout(cli.timeout);
    match &cli.command {
        Command::Partitions(p) => remote::partitions(p, out)?,
        Command::Regions(r) => remote::regions(r, out)?,
        Command::Domain(d) => domain::run(d, out)?,
        Command::Status(s) => {
            let mut client = daemon::Client::connect(s.daemon.clone().flatten().as_deref())?;
            let status = client.status()?;
            let doc = daemon::status_doc(client.path(), &status);
            daemon::render_status(&doc, s.output, out).map_err(RunError::Output)?;
        }
        Command::Topology(a) => write_topology(&load_view(&a.source)?, a.output, out)?,
        Command::Devices(a) => write_devices(&load_view(&a.source)?, a.output, out)?,
        Command::Path(a) => write_path(&load_view(&a.source)?, &a.a, &a.b, a.output, out)?,
        Command::Map(m) => map::run(m, out)?,
        Command::GpuCompare(g) => {
            let view = load_view(&g.source)?;
            let c = gpu_compare::compare_files(&view, &g.smi_xml, &g.smi_topo)?;
            let r = match g.output {
                ListFormat::Table => gpu_compare::render_table(&c, out),
                ListFormat::Json => gpu_compare::render_json(&c, out),
            };
            let written = r.and_then(|()| out.flush());
            // The verdict is the exit status: a report whose reader went (`| grep -q`)
            // does not turn differences into success.
            let reader_gone = written.as_ref().is_err_and(io_broken_pipe);
            if c.differences > 0 && (written.is_ok() || reader_gone) {
                return Err(gpu_compare::GpuCompareError::Differences(c.differences).into());
            }
            written.map_err(RunError::Output)?;
        }
        Command::Bench(b) => match &b.which {
            BenchCommand::Translate { ranges, lookups } => {
                let r = fabric_addrmap::bench::translate(*ranges, *lookups)?;
                bench::print(&r, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Host { runs, sysfs_root } => {
                let r = bench::host(*runs, sysfs_root)?;
                bench::print(&r, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Scale { sim, queries } => {
                let r = bench::scale(sim, *queries)?;
                bench::print(&r, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Control { socket, sim, iterations, clients, seconds, mode, set, zeroed_bytes } => {
                let opts = bench_control::ControlOptions {
                    daemon: socket.clone(),
                    sim: sim.clone(),
                    iterations: *iterations,
                    clients: (*clients).max(1),
                    duration: Duration::from_secs_f64(*seconds),
                    set: set.clone(),
                    zeroed_bytes: (*zeroed_bytes).max(2 << 20),
                };
                match mode {
                    args::ControlMode::Latency => {
                        let r = bench_control::control(&opts)?;
                        bench::print(&r, b.json, out).map_err(RunError::Output)?;
                    }
                    args::ControlMode::Isolation => {
                        let r = bench_isolation::isolation(&opts)?;
                        bench::print(&r, b.json, out).map_err(RunError::Output)?;
                    }
                }
            }
            BenchCommand::Copy { sim, sizes, engines, iterations, depth, batch, dir } => {
                let opts = bench_copy::CopyOptions {
                    sim: sim.clone(),
                    sizes: sizes.clone(),
                    engines: engines.clone(),
                    iterations: *iterations,
                    depth: *depth,
                    batch: *batch,
                    dir: dir.clone(),
                };
                let r = bench_copy::copy(&opts)?;
                bench::print(&r, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Libcontrol { socket, sim, iterations } => {
                let opts = bench_libcontrol::LibControlOptions {
                    daemon: socket.clone(),
                    sim: sim.clone(),
                    iterations: *iterations,
                };
                let r = bench_libcontrol::libcontrol(&opts)?;
                bench::print(&r, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Crossnode { owner, importer, iterations, net_importer, net_bytes } => {
                let opts = bench_crossnode::CrossNodeOptions {
                    owner: owner.clone(),
                    importer: importer.clone(),
                    iterations: *iterations,
                    net_importer: net_importer.clone(),
                    net_bytes: *net_bytes,
                };
                bench::print(&bench_crossnode::crossnode(&opts)?, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Netcopy { owner, importer, bytes, rounds, owner_netns, importer_netns } => {
                let opts = bench_netcopy::NetCopyOptions {
                    owner: owner.clone(),
                    importer: importer.clone(),
                    bytes: *bytes,
                    rounds: *rounds,
                    netns: owner_netns.clone().zip(importer_netns.clone()),
                };
                bench::print(&bench_netcopy::netcopy(&opts)?, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::EchoServer { socket } => bench_control::echo_server(socket)?,
            BenchCommand::Register { socket, sim, bytes, iterations, hits } => {
                let opts = bench_dma::DmaOptions {
                    daemon: socket.clone(),
                    sim: sim.clone(),
                    bytes: *bytes,
                    iterations: *iterations,
                    hits: *hits,
                };
                bench::print(&bench_dma::register(&opts)?, b.json, out).map_err(RunError::Output)?;
            }
            BenchCommand::Loadstore { socket, sim, bytes, iterations } => {
                let opts = bench_dma::DmaOptions {
                    daemon: socket.clone(),
                    sim: sim.clone(),
                    bytes: *bytes,
                    iterations: *iterations,
                    hits: 0,
                };
                bench::print(&bench_dma::loadstore(&opts)?, b.json, out).map_err(RunError::Output)?;
            }
        },
    }
    out.flush().map_err(RunError::Output)?;
    Ok(())
}

/// Whether `err` is a write that failed because the reader closed the pipe: an
/// `io::Error` of that kind anywhere in its chain, also inside a JSON writer's error
/// (serde_json keeps the `io::Error` it got, and wrapping one in `io::Error::other`
/// hides the inner one from the chain).
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(error_broken_pipe)
}

/// [`is_broken_pipe`] of one `io::Error`, the error it wraps included.
fn io_broken_pipe(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::BrokenPipe || e.get_ref().is_some_and(|inner| error_broken_pipe(inner))
}

/// [`is_broken_pipe`] of one error: an `io::Error`, or a JSON writer's.
fn error_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    e.downcast_ref::<io::Error>().is_some_and(io_broken_pipe)
        || e.downcast_ref::<serde_json::Error>().and_then(serde_json::Error::io_error_kind)
            == Some(io::ErrorKind::BrokenPipe)
}

/// The fix to suggest for an error, from the first error in its chain that knows one.
pub fn hint(err: &anyhow::Error) -> Option<&'static str> {
    err.chain().find_map(|e| {
        if let Some(e) = e.downcast_ref::<SourceError>() {
            Some(e.hint())
        } else if let Some(e) = e.downcast_ref::<ViewError>() {
            Some(e.hint())
        } else if let Some(e) = e.downcast_ref::<RunError>() {
            e.hint()
        } else if let Some(e) = e.downcast_ref::<BenchError>() {
            e.hint()
        } else if let Some(e) = e.downcast_ref::<MapCmdError>() {
            e.hint()
        } else if let Some(e) = e.downcast_ref::<DaemonError>() {
            e.hint()
        } else if let Some(e) = e.downcast_ref::<gpu_compare::GpuCompareError>() {
            e.hint()
        } else {
            None
        }
    })
}

/// `text` with every control character but newline and tab as `?` (see [`Output`]), for
/// what fabricctl writes to standard error (errors quote the daemon's words).
pub fn inert(text: &str) -> String {
    text.chars().map(|c| if c.is_control() && c != '\n' && c != '\t' { '?' } else { c }).collect()
}

/// fabricctl's standard output: remembers whether the reader closed it (`fabricctl ... |
/// head`), which ends the command without an error — a broken pipe of fabricd's socket
/// in the error chain must not read as one. And it never passes a terminal control
/// character on: names and notes come from sim files, sysfs dumps and the daemon, and an
/// escape sequence in one (`ESC ] 52 ;` writes the clipboard) would reach the operator's
/// terminal. No output has control characters of its own but newlines and tabs (JSON
/// escapes them inside strings), so each other C0 or C1 control (and DEL) becomes `?`.
#[derive(Debug)]
pub struct Output<W: Write> {
    inner: W,
    closed: bool,
    /// A `0xC2` held back: the first byte of a C1 control's two in UTF-8, or of another
    /// character's.
    c2: bool,
}

impl<W: Write> Output<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        Self { inner, closed: false, c2: false }
    }

    /// `buf` with every control character but newline and tab replaced by `?`.
    fn inert(&mut self, buf: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(buf.len() + 1);
        for &b in buf {
            if std::mem::take(&mut self.c2) {
                if (0x80..=0x9f).contains(&b) {
                    // U+0080..U+009F, a C1 control.
                    out.push(b'?');
                    continue;
                }
                out.push(0xc2);
            }
            match b {
                b'\n' | b'\t' => out.push(b),
                0..=0x1f | 0x7f => out.push(b'?'),
                0xc2 => self.c2 = true,
                _ => out.push(b),
            }
        }
        out
    }

    /// The writer, what was held back flushed to it first (flushed when it accepts it).
    pub fn into_inner(mut self) -> W {
        if std::mem::take(&mut self.c2) {
            let _ = self.inner.write_all(&[0xc2]);
        }
        self.inner
    }

    /// Whether a write or flush failed because the reader closed the output.
    pub fn closed(&self) -> bool {
        self.closed
    }

    fn note<T>(&mut self, r: io::Result<T>) -> io::Result<T> {
        if r.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::BrokenPipe) {
            self.closed = true;
        }
        r
    }
}

impl<W: Write> Write for Output<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let inert = self.inert(buf);
        let r = self.inner.write_all(&inert).map(|()| buf.len());
        self.note(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        let held = if std::mem::take(&mut self.c2) { self.inner.write_all(&[0xc2]) } else { Ok(()) };
        let r = held.and_then(|()| self.inner.flush());
        self.note(r)
    }
}

#[cfg(test)]
#[path = "../tests/common/mod.rs"]
pub(crate) mod testkit;

#[cfg(test)]
mod tests;
