#!/usr/bin/env bash
# Builds and installs the C API: library, headers and pkg-config file.
#   scripts/install-capi.sh [PREFIX]      (default /usr/local; PROFILE=debug for a debug build)
# Then: cc prog.c $(pkg-config --cflags --libs backplane)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-/usr/local}
profile=${PROFILE:-release}
if [ "$profile" = release ]; then
  cargo build --release -p backplane-capi
else
  cargo build -p backplane-capi
fi
install -d "$prefix/lib/pkgconfig" "$prefix/include/backplane"
install -m 0644 include/backplane/*.h "$prefix/include/backplane/"
install -m 0755 "target/$profile/libbackplane_c.so" "$prefix/lib/"
install -m 0644 "target/$profile/libbackplane_c.a" "$prefix/lib/"
cat > "$prefix/lib/pkgconfig/backplane.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: backplane
Description: software switch fabric: kernel-bypass datagrams and RDMA verbs over shared memory
Version: 0.1.0
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lbackplane_c
Cflags: -I\${includedir}
PC
if [ "$prefix" = /usr/local ] && command -v ldconfig >/dev/null 2>&1; then ldconfig; fi
echo "installed backplane C API in $prefix"
