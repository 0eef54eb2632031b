//! fabricctl: parses arguments, installs logging, runs the command and maps errors to exit
//! codes (0 ok, 1 runtime error, 2 usage error).

use std::io::{self, BufWriter, Write};
use std::process::ExitCode;

use clap::Parser;
use fabric_cli::args::Cli;
use tracing_subscriber::EnvFilter;

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // A second subscriber can only fail to install in tests; logging is best effort.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(io::stderr).with_target(false).try_init();
}

fn main() -> ExitCode {
    // clap exits with 2 for usage errors and 0 for --help/--version.
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let stdout = io::stdout();
    let mut out = fabric_cli::Output::new(BufWriter::new(stdout.lock()));
    match fabric_cli::run(&cli, &mut out) {
        Ok(()) => {
            let _ = out.flush();
            ExitCode::SUCCESS
        }
        // Our own output closed (`fabricctl ... | head`): not an error when that is what
        // failed. Any other error (a comparison that found differences after its report's
        // reader went, or a broken pipe to the daemon's socket) still is one.
        Err(e) if out.closed() && fabric_cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            let mut err = io::stderr().lock();
            let _ = writeln!(err, "error: {}", fabric_cli::inert(&e.to_string()));
            for cause in e.chain().skip(1) {
                let _ = writeln!(err, "  caused by: {}", fabric_cli::inert(&cause.to_string()));
            }
            if let Some(h) = fabric_cli::hint(&e) {
                let _ = writeln!(err, "hint: {h}");
            }
            ExitCode::from(1)
        }
    }
}
