# Sourced by the scripts that build fabricd (scripts/run.sh): fabricd links fabric-domain,
# whose etcd client (the etcd-client crate) compiles etcd's protos at build time and so needs
# `protoc`. `ensure_protoc` keeps a `protoc` on PATH or a $PROTOC that is set; otherwise
# (a fresh machine, no root needed) it makes a private virtual environment under target/
# with grpcio-tools from PyPI, whose bundled protoc and well-known protos a small wrapper
# runs, and exports PROTOC to it. As root, scripts/deps.sh installs Debian's protoc instead.
ensure_protoc() {
  if [[ -n ${PROTOC:-} ]] || command -v protoc >/dev/null 2>&1; then
    return 0
  fi
  local venv=target/protoc-venv wrapper
  wrapper=$PWD/$venv/protoc
  if [[ ! -x $wrapper ]]; then
    echo "protoc: none on PATH; fetching grpcio-tools from PyPI into $venv (once)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" || { echo "protoc: python3 cannot make a virtual environment (install python3-venv or protobuf-compiler)" >&2; return 1; }
    "$venv/bin/pip" install --quiet --disable-pip-version-check grpcio-tools || return 1
    local include
    include=$("$venv/bin/python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
    printf '#!/bin/sh\nexec "%s" -m grpc_tools.protoc -I"%s" "$@"\n' "$PWD/$venv/bin/python" "$include" >"$wrapper"
    chmod 755 "$wrapper"
  fi
  export PROTOC=$wrapper
}
