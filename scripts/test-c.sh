#!/usr/bin/env bash
# Builds the C API, installs it in a temporary prefix, compiles the examples and C tests with
# pkg-config, and runs them against a temporary fabric under AddressSanitizer and UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
name="ctest-$$"
bp=target/debug/backplane
cleanup() {
  "$bp" down --name "$name" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
PROFILE=debug scripts/install-capi.sh "$work/prefix" >/dev/null
export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
cflags=(-std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -g -fsanitize=address,undefined -fno-omit-frame-pointer)
cc "${cflags[@]}" tests/c/dgram_errors.c $(pkg-config --cflags --libs backplane) -o "$work/dgram_errors"
cc "${cflags[@]}" examples/c/dgram_example.c $(pkg-config --cflags --libs backplane) -o "$work/dgram_example"
cc "${cflags[@]}" tests/c/verbs_errors.c $(pkg-config --cflags --libs backplane) -pthread -o "$work/verbs_errors"
cc "${cflags[@]}" examples/c/verbs_pingpong.c $(pkg-config --cflags --libs backplane) -lm -o "$work/verbs_pingpong"
cc "${cflags[@]}" examples/c/verbs_stream.c $(pkg-config --cflags --libs backplane) -o "$work/verbs_stream"
# The error-path tests once more without ASan, whose quarantine keeps freed memory from being
# reused at once: the stale-handle checks must meet the address reuse they guard against.
plain=(-std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -g -O1)
cc "${plain[@]}" tests/c/dgram_errors.c $(pkg-config --cflags --libs backplane) -o "$work/dgram_errors_plain"
cc "${plain[@]}" tests/c/verbs_errors.c $(pkg-config --cflags --libs backplane) -pthread -o "$work/verbs_errors_plain"
cc "${cflags[@]}" tests/c/dma_errors.c $(pkg-config --cflags --libs backplane) -pthread -o "$work/dma_errors"
cc "${cflags[@]}" -O2 examples/c/dma_copy.c $(pkg-config --cflags --libs backplane) -o "$work/dma_copy"
cargo build -p backplane-cli
"$bp" up --name "$name" --nodes 2 --no-net >/dev/null
export BACKPLANE_FABRIC="$name" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1
"$work/dgram_errors"
"$work/dgram_example" recv 2 9000 5000 > "$work/recv.out" &
recv=$!
"$work/dgram_example" send 1 2 9000 5000 1000 > "$work/send.out"
wait "$recv"
cat "$work/send.out" "$work/recv.out"
sent=$(sed -n 's/.*checksum \([0-9]*\).*/\1/p' "$work/send.out")
got=$(sed -n 's/.*checksum \([0-9]*\).*/\1/p' "$work/recv.out")
if [ "$sent" != "$got" ]; then
  echo "C example: checksum sent $sent, received $got"
  exit 1
fi

# Verbs: the error paths in one process, then two processes (one per node) per example.
timeout 120 "$work/verbs_errors"
timeout 120 "$work/dgram_errors_plain" | tail -1
timeout 120 "$work/verbs_errors_plain"
timeout 120 "$work/verbs_pingpong" server 1 7000 10000 8 > "$work/pp-server.out" &
srv=$!
timeout 120 "$work/verbs_pingpong" client 2 1 7000 10000 8 > "$work/pp-client.out"
wait "$srv"
cat "$work/pp-client.out" "$work/pp-server.out"
grep -q "t_typical" "$work/pp-client.out"
timeout 120 "$work/verbs_stream" server 1 7001 5000 65536 > "$work/st-server.out" &
srv=$!
timeout 120 "$work/verbs_stream" client 2 1 7001 5000 65536 > "$work/st-client.out"
wait "$srv"
cat "$work/st-client.out" "$work/st-server.out"
grep -q "received 5000 x 65536 B in order" "$work/st-server.out"

# Raw DMA: the error paths, then a 64 MiB scattered copy beside a memcpy of the same size.
timeout 120 "$work/dma_errors"
timeout 120 "$work/dma_copy" 1 64 > "$work/dma-copy.out"
cat "$work/dma-copy.out"
grep -q "bytes checked" "$work/dma-copy.out"
echo "C API: examples and error-path tests passed under ASan/UBSan"
