//! `fabric-certs`: makes a domain CA and node certificates for the node link (tests and
//! small domains; a site with its own PKI issues certificates of the same form).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fabric_nodelink::{San, create_ca, create_node};

/// Makes the certificates of a fabric domain's node link.
#[derive(Debug, Parser)]
#[command(name = "fabric-certs", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Make the domain CA: DIR/ca.pem and DIR/ca.key (0600). Refuses to overwrite.
    Ca {
        /// Where the files go (created 0700 if missing).
        dir: PathBuf,
        /// The domain's name.
        #[arg(long)]
        domain: String,
    },
    /// Make a node certificate signed by DIR's CA: DIR/NODE.pem and DIR/NODE.key (0600).
    Node {
        /// The directory holding the CA.
        dir: PathBuf,
        /// The domain's name (must be the CA's).
        #[arg(long)]
        domain: String,
        /// The node's name.
        #[arg(long)]
        node: String,
        /// An address or host name others reach the node at (repeatable).
        #[arg(long = "san")]
        sans: Vec<String>,
    },
}

fn run(cli: Cli) -> Result<String, fabric_nodelink::CertError> {
    let files = match cli.command {
        Command::Ca { dir, domain } => create_ca(&dir, &domain)?,
        Command::Node { dir, domain, node, sans } => {
            let sans = sans.iter().map(|s| s.parse::<San>()).collect::<Result<Vec<_>, _>>()?;
            create_node(&dir, &domain, &node, &sans)?
        }
    };
    Ok(format!("{}\n{}\n", files.cert.display(), files.key.display()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(out) => {
            #[allow(clippy::print_stdout, reason = "the tool's output: the files it wrote")]
            {
                print!("{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            #[allow(clippy::print_stderr, reason = "the tool's error report")]
            {
                eprintln!("fabric-certs: {e}");
            }
            ExitCode::FAILURE
        }
    }
}
