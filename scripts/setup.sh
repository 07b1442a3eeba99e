#!/usr/bin/env bash
# Installs what backplane needs on a fresh Debian machine with Rust, then builds it.
#   scripts/setup.sh          everything for the main job (release build, UCX for comparison)
#   scripts/setup.sh --test   everything for the test suite
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-main}
# ucx-utils: ucx_perftest, the peer `backplane perf` measures against in the same run.
# libucx-dev: the UCP header backplane-ucx (the link between the hosts of a fabric) builds against.
# iproute2: namespaces and interfaces of IP over the fabric. procps: ps. ip also builds `bench`'s veth pair.
# (No fonts: the bench's plots embed DejaVu Sans.)
# iperf3, iputils-ping, sockperf: the network tests and the IP benchmark.
# libibverbs-dev: the header the drop-in libibverbs.so.1 (backplane-ibverbs) is checked
# against when it builds; ibverbs-utils, perftest: the unmodified RDMA programs it is tested with.
# python3, curl, netcat-openbsd, redis-server, redis-tools: unmodified programs the accelerated
# sockets (exec --accel, backplane-sockets) are tested with (with iperf3 and sockperf);
# openssh-server, openssh-client, rsync: sshd forks and execs with the connection (scp, rsync
# over ssh); qperf: tcp_bw and tcp_lat.
# openmpi-bin, libopenmpi-dev: MPI over UCX over the drop-in libibverbs (mpirun starting its
# ranks in nodes through `backplane rsh`).
packages=(ucx-utils libucx-dev iproute2 procps iperf3 iputils-ping sockperf libibverbs-dev ibverbs-utils perftest
  python3 curl netcat-openbsd redis-server redis-tools openssh-server openssh-client rsync qperf
  openmpi-bin libopenmpi-dev)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    # Installing a server (sshd, redis) must not start it as a system service: the tests run
    # their own instances, on their own ports.
    policy=/usr/sbin/policy-rc.d
    made_policy=""
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
      $sudo chmod +x "$policy"
      made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    [ -z "$made_policy" ] || $sudo rm -f "$policy"
  else
    echo "setup: please install ${missing[*]} (no apt-get here)" >&2
  fi
fi

if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

if [ "$mode" = "--test" ]; then
  cargo build --workspace --all-targets
else
  cargo build --release -p backplane-cli -p backplane-ibverbs -p backplane-sockets
fi
