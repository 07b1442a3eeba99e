#!/usr/bin/env bash
# The main job: `backplane bench` on a temporary default fabric — every available path measured
# side by side (UCX and kernel baselines in the same run), summary table and a report folder.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
target/release/backplane bench "$@"
