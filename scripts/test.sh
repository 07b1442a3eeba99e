#!/usr/bin/env bash
# The whole test suite: style, lints, the API docs, unit + property + multi-process tests, loom models.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The API docs build without a broken or ambiguous link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace
# The ring protocol under loom's model checker (its own target dir: --cfg loom rebuilds all).
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p backplane --release --lib loom
# The C API through its header and pkg-config, under AddressSanitizer and UBSan.
scripts/test-c.sh
