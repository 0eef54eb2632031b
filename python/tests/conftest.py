"""Fixtures: a real fabricd (the workspace's build, $FABRICD) on a temporary socket and
state directory, serving the bundled HGX sim fabric (8 GPUs with HBM), as the Rust tests
start it (libfabric-mm/tests/common)."""

from __future__ import annotations

import os
import socket as socketlib
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

import fabric_mm

ROOT = Path(__file__).resolve().parents[2]


def fabricd_binary() -> Path:
    path = Path(os.environ.get("FABRICD", ROOT / "target" / "debug" / "fabricd"))
    if not path.exists():
        pytest.fail(f"{path} is not built: run `cargo build -p fabricd` (or set FABRICD)")
    return path


class Daemon:
    def __init__(self, directory: Path, extra: str = "") -> None:
        self.dir = directory
        self.socket = str(directory / "fabricd.sock")
        sim = ROOT / "configs" / "sim" / "hgx-h100-8gpu.toml"
        config = directory / "fabricd.toml"
        config.write_text(
            f'[socket]\npath = "{self.socket}"\n[state]\ndir = "{directory / "state"}"\n'
            f'[discovery]\nsim = ["{sim}"]\n[metrics]\nlisten = ""\n{extra}'
        )
        self.log = directory / "fabricd.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [str(fabricd_binary()), "--config", str(config)],
                stdout=subprocess.DEVNULL, stderr=log,
            )
        deadline = time.monotonic() + 30
        while True:
            probe = socketlib.socket(socketlib.AF_UNIX)
            try:
                probe.connect(self.socket)
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"fabricd did not come up: {self.log.read_text()}")
                time.sleep(0.02)
            finally:
                probe.close()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("fabricd"))
    yield d
    d.stop()


@pytest.fixture()
def session(daemon: Daemon) -> Iterator[fabric_mm.Session]:
    with fabric_mm.Session(daemon.socket, client_name="pytest") as s:
        yield s


@pytest.fixture()
def gpu(session: fabric_mm.Session) -> str:
    return next(d.id for d in session.devices() if any(c == "hbm" for c, _ in d.memory))


MIB = 1 << 20
# fabricd rounds HBM allocations up to its 2 MiB granule: tests allocate whole granules.
GRANULE = 2 * MIB
