//! The guest scripts (`qemu-tests/guest/*.sh`), compiled in so a run needs no source tree.

/// Helpers every test script sources (`/fabric/common.sh`).
pub const COMMON: &str = include_str!("../guest/common.sh");
/// The CXL region test.
pub const CXL: &str = include_str!("../guest/cxl.sh");
/// The hot-unplug test.
pub const UNPLUG: &str = include_str!("../guest/unplug.sh");
/// The dynamic-capacity test.
pub const DCD: &str = include_str!("../guest/dcd.sh");
/// The ivshmem (shared BAR) test.
pub const IVSHMEM: &str = include_str!("../guest/ivshmem.sh");
/// The VFIO/edu test.
pub const VFIO: &str = include_str!("../guest/vfio.sh");
/// The power-loss test.
pub const POWER: &str = include_str!("../guest/power.sh");
/// The NUMA-node (CXL memory onlined by kmem) test.
pub const NUMA: &str = include_str!("../guest/numa.sh");
/// The per-region DAX test.
pub const DAXSPLIT: &str = include_str!("../guest/daxsplit.sh");
/// The two-host domain test (one shared CXL device, etcd and fabricd on a private link).
pub const DOMAIN: &str = include_str!("../guest/domain.sh");
