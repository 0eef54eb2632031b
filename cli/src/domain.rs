//! `fabricctl domain status|nodes|gc NODE`: the domain the daemon's node belongs to, from
//! its `fabric.domain/v1` document (protocol 1.6; the nodes in pages from 1.7,
//! [`crate::pages`]), as a table or JSON; and the GFA
//! translation `fabricctl map translate --daemon` asks of a daemon.

use std::io::{self, Write};
use std::path::PathBuf;

use clap::{Args, Subcommand};
use fabric_proto::domain::{DOMAIN_SCHEMA, DomainDoc};
use fabric_proto::wire::{
    BoundedVec, DOMAIN, DomainAction, DomainRequest, Name, PAGED, Request, Response, TranslateQuery, TranslateRequest,
    Translation,
};
use serde::Serialize;

use crate::args::ListFormat;
use crate::daemon::{Client, DaemonError};

/// `fabricctl domain`.
#[derive(Debug, Args)]
pub struct DomainArgs {
    /// What to show or do (default: status).
    #[command(subcommand)]
    pub command: Option<DomainCommand>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Table, global = true)]
    pub output: ListFormat,
    /// The daemon's socket (default: $FABRIC_SOCKET, /run/fabric/fabricd.sock for root,
    /// else $XDG_RUNTIME_DIR/fabric/fabricd.sock).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1, global = true)]
    pub daemon: Option<Option<PathBuf>>,
}

/// `fabricctl domain` subcommands.
#[derive(Debug, Subcommand)]
pub enum DomainCommand {
    /// This node's standing (joined, fenced, etcd unreachable), the leader, etcd, the
    /// members and what is missing and why.
    Status,
    /// The domain's nodes: incarnation, slot, live or gone, peer address; the leader marked.
    Nodes,
    /// Free the slot of a node that is gone, for good (root or the admin group).
    Gc {
        /// The node.
        node: String,
    },
}

fn need_domain(client: &Client, what: &str) -> anyhow::Result<()> {
    let version = client.version();
    if version < DOMAIN {
        anyhow::bail!("fabricd at {} speaks protocol {version}; {what} needs {DOMAIN}", client.path().display());
    }
    Ok(())
}

/// Runs `fabricctl domain`.
pub fn run(args: &DomainArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut client = Client::connect(args.daemon.clone().flatten().as_deref())?;
    need_domain(&client, "fabricctl domain")?;
    let action = match &args.command {
        None | Some(DomainCommand::Status) => DomainAction::Status,
        Some(DomainCommand::Nodes) => DomainAction::Nodes,
        Some(DomainCommand::Gc { node }) => DomainAction::Gc {
            node: Name::new(node.as_str()).map_err(|_| anyhow::anyhow!("node name {node:?} is too long"))?,
        },
    };
    let paged = client.version() >= PAGED;
    let parsed = match action {
        // 1.7: the nodes a page at a time; a status of many nodes only counts them.
        DomainAction::Nodes if paged => crate::pages::nodes(&mut client)?,
        DomainAction::Status if paged => {
            let mut doc = ask(&mut client, DomainAction::Status)?;
            doc.nodes = crate::pages::nodes(&mut client)?.nodes;
            doc
        }
        action => ask(&mut client, action)?,
    };
    if args.output == ListFormat::Json {
        serde_json::to_writer_pretty(&mut *out, &parsed)?;
        writeln!(out)?;
    } else {
        render(&parsed, out)?;
    }
    Ok(())
}

/// One `Domain` answer.
fn ask(client: &mut Client, action: DomainAction) -> anyhow::Result<DomainDoc> {
    let doc = match client.call(Request::Domain(DomainRequest { action }))? {
        Response::Domain(d) => d,
        _ => return Err(DaemonError::Unexpected(client.path().to_owned()).into()),
    };
    Ok(serde_json::from_str(&doc.json).map_err(|e| DaemonError::Document {
        path: client.path().to_owned(),
        schema: DOMAIN_SCHEMA,
        message: e.to_string(),
    })?)
}

/// The table form.
pub fn render(doc: &DomainDoc, out: &mut dyn Write) -> io::Result<()> {
    if let Some(gc) = &doc.gc {
        match gc.slot {
            Some(s) => write!(out, "domain {}: freed slot {s} of {}", doc.domain, gc.node)?,
            None => write!(out, "domain {}: {} held no slot", doc.domain, gc.node)?,
        }
        return match gc.lifted_bytes.filter(|b| *b > 0) {
            Some(b) => writeln!(out, "; {b} bytes it held in quarantine are free again"),
            None => writeln!(out),
        };
    }
    if let Some(me) = &doc.this {
        write!(
            out,
            "domain {}  node {} (slot {}, incarnation {})  {}",
            doc.domain, me.node, me.slot, me.incarnation, me.standing
        )?;
        match &me.reason {
            Some(r) => writeln!(out, ": {r}")?,
            None => writeln!(out)?,
        }
        for share in &me.shares {
            writeln!(out, "share of {}: {:#x}+{:#x}", share.resource, share.offset, share.len)?;
        }
    } else {
        writeln!(out, "domain {}", doc.domain)?;
    }
    match (&doc.leader, &doc.this) {
        (Some(l), _) => {
            let who = if l.this_node { " (this node)" } else { "" };
            writeln!(out, "leader {}{who}  term {}", l.node, l.term)?
        }
        // Only a status answer says it does not know.
        (None, Some(_)) => writeln!(out, "leader unknown")?,
        (None, None) => {}
    }
    if let Some(e) = &doc.etcd {
        let rtt = e.round_trip_us.map_or_else(|| "-".to_owned(), |us| format!("{:.1} ms", us as f64 / 1000.0));
        let reach = if e.reachable { "reachable" } else { "unreachable" };
        writeln!(out, "etcd {reach}  round trip {rtt}  errors {}", e.errors)?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:<20} {:<6} {:>5} {:>20} {:<24} {:>6}  {:<6}  GROUPS",
        "NODE", "STATE", "SLOT", "INCARNATION", "PEER", "RANGES", "ROLE"
    )?;
    for n in &doc.nodes {
        let slot = n.slot.map_or_else(|| "-".to_owned(), |s| s.to_string());
        let inc = n.incarnation.map_or_else(|| "-".to_owned(), |i| i.to_string());
        let peer = n.peer_address.as_deref().unwrap_or("-");
        let role = if n.leader { "leader" } else { "-" };
        // Unconfirmed (the answering node is not joined): what its last view said, marked.
        let state = n.last_seen.as_ref().map_or_else(|| n.state.clone(), |seen| format!("{seen}?"));
        let groups = if n.groups.is_empty() { "-".to_owned() } else { n.groups.join(",") };
        writeln!(
            out,
            "{:<20} {:<6} {:>5} {:>20} {:<24} {:>6}  {role:<6}  {groups}",
            n.name, state, slot, inc, peer, n.ranges
        )?;
    }
    if let Some(missing) = doc.missing.as_ref().filter(|m| !m.is_empty()) {
        writeln!(out, "\nmissing:")?;
        for m in missing {
            writeln!(out, "  {m}")?;
        }
    }
    if let Some(q) = doc.quarantine.as_ref().filter(|q| !q.is_empty()) {
        writeln!(out, "\nquarantined (freed here, not reused while the node may still map it):")?;
        for n in q {
            writeln!(out, "  {}: {} regions, {} bytes", n.node, n.regions, n.bytes)?;
        }
    }
    Ok(())
}

/// `fabric.map.translate.daemon/v1`: a daemon's answer (in a domain, the node whose slot
/// holds the GFA), which is not the local `fabric.map.translate/v1`.
#[derive(Debug, Serialize)]
struct RemoteTranslateDoc {
    schema: &'static str,
    gfa: String,
    /// The node whose slot holds the GFA, when it is another node of the domain.
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    live: Option<bool>,
    answer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    offset: Option<String>,
}

/// `fabricctl map translate GFA --daemon`: asks the daemon, which in a domain names the
/// node of a GFA in another node's slot.
pub fn translate(client: &mut Client, gfa: u64, format: ListFormat, out: &mut dyn Write) -> anyhow::Result<()> {
    let queries = BoundedVec::new(vec![TranslateQuery::Gfa(gfa)]).unwrap_or_default();
    let answer = match client.call(Request::Translate(TranslateRequest { queries }))? {
        Response::Translate(t) => t.results.into_vec().into_iter().next(),
        _ => None,
    };
    let Some(answer) = answer else { return Err(DaemonError::Unexpected(client.path().to_owned()).into()) };
    let mut doc = RemoteTranslateDoc {
        schema: "fabric.map.translate.daemon/v1",
        gfa: format!("{gfa:#x}"),
        node: None,
        live: None,
        answer: String::new(),
        device: None,
        offset: None,
    };
    let resource = |r: &fabric_proto::wire::ResourceName| {
        let kind = serde_json::to_value(r.memory).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        format!("{} {kind}[{}]", r.device, r.ordinal)
    };
    match &answer {
        Translation::Resource { resource: r, offset, set } => {
            doc.answer = set.as_ref().map_or_else(|| "resource".to_owned(), |s| format!("through interleave set {s}"));
            doc.device = Some(resource(r));
            doc.offset = Some(format!("{offset:#x}"));
        }
        Translation::Remote { node, live, resource: r, set, offset } => {
            doc.node = Some(node.to_string());
            doc.live = Some(*live);
            doc.answer = match (r, set) {
                (Some(_), _) => "resource".to_owned(),
                (None, Some(s)) => format!("interleave set {s}"),
                (None, None) => "hole in the node's slot".to_owned(),
            };
            doc.device = r.as_ref().map(resource);
            if r.is_some() || set.is_some() {
                doc.offset = Some(format!("{offset:#x}"));
            }
        }
        // Not a translation: an error and exit 1, as the local translate's.
        Translation::Hole { owner } => {
            anyhow::bail!("GFA {gfa:#x} is in a hole reserved for a vanished owner ({owner})")
        }
        Translation::NotInPartition => anyhow::bail!("GFA {gfa:#x} is not in your partitions"),
        Translation::Unmapped | Translation::Gfa(_) | Translation::UnknownResource => {
            anyhow::bail!("GFA {gfa:#x} is not mapped")
        }
    }
    if format == ListFormat::Json {
        serde_json::to_writer_pretty(&mut *out, &doc)?;
        writeln!(out)?;
        return Ok(());
    }
    write!(out, "GFA {gfa:#x} ->")?;
    if let Some(n) = &doc.node {
        write!(out, " node {n}{}", if doc.live == Some(false) { " (gone)" } else { "" })?;
    }
    match (&doc.device, &doc.offset) {
        (Some(d), Some(o)) => writeln!(out, " {d} + {o}")?,
        _ => writeln!(out, " {}", doc.answer)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fabric_proto::domain::{EtcdDoc, GcDoc, LeaderDoc, NodeDoc, QuarantineDoc, SelfDoc, ShareDoc};

    use super::*;

    fn node(name: &str, live: bool, slot: u32) -> NodeDoc {
        NodeDoc {
            name: name.into(),
            state: if live { "live" } else { "gone" }.into(),
            last_seen: None,
            slot: Some(slot),
            incarnation: live.then_some(7),
            peer_address: live.then(|| format!("{name}:7471")),
            ranges: 4,
            mapped_bytes: 1 << 30,
            leader: false,
            groups: vec![],
        }
    }

    #[test]
    fn status_shows_standing_etcd_nodes_and_what_is_missing() {
        let doc = DomainDoc {
            domain: "supernode".into(),
            this: Some(SelfDoc {
                node: "tray0".into(),
                slot: 3,
                standing: "fenced".into(),
                reason: Some("lease lost: etcd keepalive: no answer".into()),
                incarnation: 9,
                shares: vec![ShareDoc {
                    resource: "serial:cxl/0x3000/cxl_volatile0".into(),
                    offset: 64 << 20,
                    len: 64 << 20,
                }],
            }),
            etcd: Some(EtcdDoc { reachable: false, round_trip_us: Some(1500), errors: 2 }),
            settings: None,
            leader: None,
            // Fenced, this node states itself so and the others unconfirmed.
            nodes: vec![
                NodeDoc { state: "fenced".into(), ..node("tray0", true, 3) },
                NodeDoc { state: "unknown".into(), last_seen: Some("gone".into()), ..node("tray1", false, 5) },
            ],
            missing: Some(vec!["tray1: gone (its lease ended); slot 5 kept as a hole".into()]),
            gc: None,
            summary: None,
            page: None,
            quarantine: Some(vec![QuarantineDoc { node: "tray1".into(), regions: 2, bytes: 4 << 20 }]),
        };
        let mut out = Vec::new();
        render(&doc, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for want in [
            "domain supernode  node tray0 (slot 3, incarnation 9)  fenced: lease lost: etcd keepalive: no answer\n",
            "fenced: lease lost: etcd keepalive: no answer\nshare of serial:cxl/0x3000/cxl_volatile0: 0x4000000+0x4000000\n",
            "leader unknown\n",
            "etcd unreachable  round trip 1.5 ms  errors 2\n",
            "tray0                fenced     3                    7 tray0:7471",
            "tray1                gone?      5                    - -",
            "missing:\n  tray1: gone",
            "quarantined (freed here, not reused while the node may still map it):\n  tray1: 2 regions, 4194304 bytes\n",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        let led = DomainDoc {
            leader: Some(LeaderDoc { node: "tray2".into(), term: 17, this_node: false }),
            nodes: vec![
                node("tray0", true, 3),
                NodeDoc {
                    leader: true,
                    groups: vec!["nvlink-clique:c0ffee.7".into(), "cxl-pool:rack4".into()],
                    ..node("tray2", true, 4)
                },
            ],
            ..doc.clone()
        };
        let mut out = Vec::new();
        render(&led, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("\nleader tray2  term 17\n"), "{text}");
        assert!(
            text.contains("tray2:7471                    4  leader  nvlink-clique:c0ffee.7,cxl-pool:rack4\n"),
            "{text}"
        );
        assert!(text.contains("tray0:7471                    4  -       -\n"), "{text}");
        let freed = DomainDoc { gc: Some(GcDoc { node: "tray1".into(), slot: Some(5), lifted_bytes: None }), ..doc };
        let mut out = Vec::new();
        render(&freed, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "domain supernode: freed slot 5 of tray1\n");
    }
}
