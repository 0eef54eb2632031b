//! The VFIO DMA backend on the host, where it cannot run (no IOMMU for the test, usually no
//! root): a function named in `dma.vfio` that cannot be taken is refused with its typed
//! reason, shown in `Status` as a problem, and the daemon serves on with registrations in
//! software. The real path (bind, container, map, device copies, faults) is proved in the
//! QEMU tier (`vfio_edu_dma_through_the_iommu`).
#![allow(clippy::unwrap_used)]

mod common;

use fabric_proto::wire::{ProblemKind, Request, Response, StatusRequest};

/// A PCI address no host has (the top domain, bus, device and function).
const ABSENT: &str = "ffff:ff:1f.7";

#[test]
fn a_function_that_cannot_be_taken_is_a_status_problem_and_the_daemon_serves_on() {
    let setup = common::Setup::with_sim(&common::sim_file(), &format!("[dma]\nvfio = [{ABSENT:?}]\n"));
    let daemon = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    let p = s.problems.iter().find(|p| p.subject.as_str() == format!("vfio:{ABSENT}"));
    let Some(p) = p else { panic!("no VFIO problem in {s:?}") };
    assert_eq!(p.kind, ProblemKind::BackendFailed);
    // As root the function is looked for (and absent); otherwise root is what is missing.
    let detail = p.detail.as_str();
    assert!(detail.contains(&format!("no PCI function {ABSENT}")) || detail.contains("needs root"), "{detail}");
    assert!(daemon.log().contains("not taken for VFIO DMA"), "{}", daemon.log());
}
