//! Two guests as two hosts of one domain: each has one CXL type-3 device whose memory is
//! the same host file (a multi-headed memory device, as a CXL pool shared by hosts), and
//! the two are linked by a private virtio-net link carried over host loopback
//! (`-netdev socket`), on which guest A runs etcd and both run fabricd as domain nodes.
//! `guest/domain.sh` is the guests' side; `tests/domain.rs` the test.

use std::fs;
use std::path::Path;

use crate::vm::VmSpec;

/// Serial number of the shared device, the same in both guests (one physical device).
pub const SERIAL: u64 = 0x3000;
/// Bytes of the shared device's memory.
pub const BYTES: u64 = 256 << 20;
/// The link's addresses: guest A (which runs etcd), guest B.
pub const ADDRESSES: [&str; 2] = ["192.168.77.1", "192.168.77.2"];

/// Which end of the pair a guest is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host {
    /// Runs etcd, listens on the link, owns the exported region.
    A,
    /// Connects to A's link, imports A's bytes.
    B,
}

impl Host {
    /// The node name the guest's fabricd joins with.
    pub fn node(self) -> &'static str {
        match self {
            Self::A => "a",
            Self::B => "b",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::A => 0,
            Self::B => 1,
        }
    }
}

/// Adds the shared device and the link to `spec`: one host bridge, one root port, one
/// volatile type-3 device on `file` (created here, `BYTES` long, shared), a 4 GiB window;
/// a virtio-net device on a socket netdev, listening on `127.0.0.1:port` for A and
/// connecting to it for B (so A's QEMU must start first). `/fabric/node.env` tells the
/// guest script its role and addresses.
pub fn add(spec: &mut VmSpec, host: Host, file: &Path, port: u16) -> std::io::Result<()> {
    fs::OpenOptions::new().create(true).truncate(false).write(true).open(file)?.set_len(BYTES)?;
    spec.machine = "q35,cxl=on".to_owned();
    spec.device("pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1")
        .device("cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=0")
        .object(format!("memory-backend-file,id=shared-be,share=on,mem-path={},size={BYTES}", file.display()))
        .device(format!("cxl-type3,bus=rp0,volatile-memdev=shared-be,id=shared,sn={SERIAL:#x}"));
    spec.arg("-M").arg("cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G");
    let end = match host {
        Host::A => format!("listen=127.0.0.1:{port}"),
        Host::B => format!("connect=127.0.0.1:{port}"),
    };
    spec.arg("-netdev").arg(format!("socket,id=link,{end}"));
    spec.device(format!("virtio-net-pci,bus=pcie.0,netdev=link,mac=52:54:00:77:00:0{}", host.index() + 1));
    let peer = match host {
        Host::A => Host::B,
        Host::B => Host::A,
    };
    let env = format!(
        "NODE={}\nME={}\nPEER={}\nETCD={}\nSERIAL={SERIAL:#x}\n",
        host.node(),
        ADDRESSES[host.index()],
        ADDRESSES[peer.index()],
        ADDRESSES[0]
    );
    spec.files.push(("fabric/node.env".into(), env.into_bytes()));
    Ok(())
}

/// Checks that `len` bytes of `file` from `offset` hold the pattern for `seed` (offsets
/// counted from `offset`): where the host sees a guest's stores.
pub fn check_file(file: &Path, offset: u64, len: u64, seed: u64) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, offset).map_err(|e| format!("{} at {offset:#x}: {e}", file.display()))?;
    for (i, w) in buf.chunks_exact(8).enumerate() {
        let at = i as u64 * 8;
        let got = u64::from_le_bytes(w.try_into().unwrap_or_default());
        let want = crate::pattern::word(seed, at);
        if got != want {
            return Err(format!("host file offset {:#x}: {got:#018x}, expected {want:#018x}", offset + at));
        }
    }
    Ok(())
}
