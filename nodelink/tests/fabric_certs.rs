//! `fabric-certs` as an operator runs it: files made with private keys, bad arguments and
//! another domain's CA answered with an error message and a failing status, never a panic.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

use fabric_nodelink::{Credentials, NodeIdentity, Pem, PemFiles};

fn certs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabric-certs")).args(args).output().expect("run fabric-certs")
}

fn refused(out: &Output, says: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(out.status.code().is_some(), "killed by a signal: {out:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains(says), "expected {says:?} in {stderr}");
}

#[test]
fn makes_a_ca_and_node_certificates_and_refuses_bad_arguments() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("certs");
    let d = dir.to_str().expect("utf-8");
    assert!(certs(&["ca", d, "--domain", "lab"]).status.success());
    let out = certs(&["node", d, "--domain", "lab", "--node", "n1", "--san", "127.0.0.1", "--san", "n1.example"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let n1 = PemFiles::node(&dir, "n1");
    assert_eq!(std::fs::metadata(&n1.key).expect("key").permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777, 0o700);
    let ca: Pem = PemFiles::ca(&dir).read().expect("ca");
    let creds = Credentials::from_pem(&ca.cert, &n1.read().expect("n1")).expect("usable for a link");
    assert_eq!(creds.identity(), &NodeIdentity::new("lab", "n1").expect("id"));

    refused(&certs(&["ca", d, "--domain", "lab"]), "exists");
    refused(&certs(&["node", d, "--domain", "other", "--node", "n2"]), "another domain's CA");
    refused(&certs(&["node", d, "--domain", "lab", "--node", "Bad_Name"]), "node name");
    refused(&certs(&["node", d, "--domain", "lab", "--node", "n3", "--san", "not a host!"]), "neither an IP");
    refused(&certs(&["ca", d, "--domain=-lab"]), "domain name");
    let missing = tmp.path().join("nothing");
    refused(&certs(&["node", missing.to_str().expect("utf-8"), "--domain", "lab", "--node", "n4"]), "ca.pem");
    refused(&certs(&["frobnicate"]), "unrecognized subcommand");
}
