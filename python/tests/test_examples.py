"""The README's example runs: producer | consumer over an exported region."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT, Daemon


def test_producer_consumer_handoff(daemon: Daemon) -> None:
    examples = ROOT / "examples" / "python"
    env = dict(os.environ, FABRIC_SOCKET=daemon.socket)
    producer = subprocess.Popen([sys.executable, str(examples / "producer.py")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    consumer = subprocess.run([sys.executable, str(examples / "consumer.py")], env=env,
                              stdin=producer.stdout, capture_output=True, text=True, timeout=60)
    assert producer.stdout is not None
    producer.stdout.close()
    assert producer.wait(timeout=60) == 0, producer.stderr.read() if producer.stderr else ""
    assert consumer.returncode == 0, consumer.stderr
    assert "checksum ok" in consumer.stdout
