#!/usr/bin/env bash
# Installs libfabric-mm for C callers: the shared and static libraries, the committed
# header and a filled-in pkg-config file, so that `cc app.c $(pkg-config --cflags --libs
# fabric-mm)` works against the installed copy.
#
#   scripts/install-mm.sh [--prefix DIR] [--libdir DIR] [--includedir DIR]
#                         [--destdir DIR] [--from DIR]
#
#   --prefix DIR      where it goes (default /usr/local)
#   --libdir DIR      libraries and pkgconfig/ (default PREFIX/lib)
#   --includedir DIR  fabric_mm.h (default PREFIX/include)
#   --destdir DIR     stage under DIR (packaging): files land in DIR/PREFIX/..., while the
#                     pkg-config file names PREFIX, where they will be at run time
#   --from DIR        take the libraries already built in DIR (e.g. target/debug) instead
#                     of building a release with cargo
#
# Exit status: 0 installed; 1 a build or copy failed; 2 bad arguments.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

usage() { sed -n '6,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

prefix=/usr/local libdir="" includedir="" destdir="" from=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix|--libdir|--includedir|--destdir|--from)
      [ $# -ge 2 ] && [ -n "$2" ] || { echo "install-mm: $1 needs a directory" >&2; usage; }
      case "$1" in
        --prefix) prefix="$2" ;;
        --libdir) libdir="$2" ;;
        --includedir) includedir="$2" ;;
        --destdir) destdir="$2" ;;
        --from) from="$2" ;;
      esac
      shift 2 ;;
    -h|--help) usage ;;
    *) echo "install-mm: unknown argument '$1'" >&2; usage ;;
  esac
done
# pkg-config resolves nothing relative: every directory it names must be absolute.
for d in "$prefix" ${libdir:+"$libdir"} ${includedir:+"$includedir"}; do
  case "$d" in /*) ;; *) echo "install-mm: '$d' is not an absolute path" >&2; exit 2 ;; esac
done
libdir="${libdir:-$prefix/lib}"
includedir="${includedir:-$prefix/include}"

if [ -z "$from" ]; then
  (cd "$root" && cargo build -p libfabric-mm --lib --release --locked)
  from="${CARGO_TARGET_DIR:-$root/target}/release"
fi
for f in libfabric_mm.so libfabric_mm.a; do
  [ -f "$from/$f" ] || { echo "install-mm: $from has no $f (build it: cargo build -p libfabric-mm --lib)" >&2; exit 1; }
done

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)"
[ -n "$version" ] || { echo "install-mm: no workspace version in $root/Cargo.toml" >&2; exit 1; }

install -d "$destdir$libdir/pkgconfig" "$destdir$includedir"
install -m 0755 "$from/libfabric_mm.so" "$destdir$libdir/libfabric_mm.so"
install -m 0644 "$from/libfabric_mm.a" "$destdir$libdir/libfabric_mm.a"
install -m 0644 "$root/libfabric-mm/include/fabric_mm.h" "$destdir$includedir/fabric_mm.h"
# '|' delimits: the directories may hold '/' but never a newline or '|' we would accept.
for d in "$prefix" "$libdir" "$includedir"; do
  case "$d" in *'|'*|*'&'*|*\\*) echo "install-mm: '$d' holds a character pkg-config files cannot carry here" >&2; exit 2 ;; esac
done
sed -e "s|@PREFIX@|$prefix|g" -e "s|@LIBDIR@|$libdir|g" -e "s|@INCLUDEDIR@|$includedir|g" \
    -e "s|@VERSION@|$version|g" -e '/^# pkg-config file for/d' \
    "$root/libfabric-mm/fabric-mm.pc.in" >"$destdir$libdir/pkgconfig/fabric-mm.pc"
chmod 0644 "$destdir$libdir/pkgconfig/fabric-mm.pc"
echo "install-mm: libfabric-mm $version in $destdir$libdir, header in $destdir$includedir"
echo "install-mm: PKG_CONFIG_PATH=$libdir/pkgconfig pkg-config --cflags --libs fabric-mm"
