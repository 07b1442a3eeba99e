#!/usr/bin/env bash
# The main job: a temporary default fabric, datagram latency and bandwidth, UCX in the same run;
# then the characterization lab (every path side by side, report folder under bench-report/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
target/release/backplane perf dgram-lat "$@"
target/release/backplane perf dgram-bw "$@"
target/release/backplane bench
