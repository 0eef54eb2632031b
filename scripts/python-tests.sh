#!/usr/bin/env bash
# The Python package's tests (docs/python.md): a fresh virtual environment under target/,
# maturin, numpy, pytest and mypy from PyPI, the package built from source exactly as a
# user builds it (`pip install ./python`), then mypy over the package, its stubs, the tests
# and the examples, stubtest (the stubs against the built module), and pytest against a real fabricd on a temporary socket.
#
#   scripts/python-tests.sh            # everything
#   scripts/python-tests.sh -k dlpack  # pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/python-venv
# Nothing written into the source tree (no __pycache__ next to the tests and examples).
export PYTHONDONTWRITEBYTECODE=1
python=${PYTHON:-python3}

# Always a new environment: nothing an earlier run (or anyone else) installed is reused.
rm -rf "$venv"
if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
  # Debian's python3 makes no venv (no ensurepip) without python3-venv.
  rm -rf "$venv"
  if [[ ${FABRIC_INSTALL_DEPS:-0} == 1 && $(id -u) == 0 ]]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    "$python" -m venv "$venv"
  else
    echo "python-tests: $python cannot make a virtual environment: install python3-venv" >&2
    exit 1
  fi
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check maturin numpy pytest mypy

# The daemon the tests start (the workspace's debug build; cheap when test.sh built it).
cargo build -p fabricd --bin fabricd --locked --quiet

# From source, as `pip install ./python` on a fresh machine does (maturin from PyPI,
# the workspace's Cargo.lock, a release build into target/).
"$venv/bin/pip" install --quiet --disable-pip-version-check ./python

# The code and the stubs as mypy reads them, then the stubs against the built module.
"$venv/bin/mypy" --strict --cache-dir target/mypy-cache python/fabric_mm python/tests examples/python python/bench.py
(cd target && "$OLDPWD/$venv/bin/python" -m mypy.stubtest fabric_mm._native)

export FABRICD=${FABRICD:-$PWD/target/debug/fabricd}
# Run from a directory without python/fabric_mm in it, so the installed package is tested.
(cd python/tests && "$OLDPWD/$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" .)
