#!/usr/bin/env bash
# The quickstart: defines a variant with attention!, JIT-compiles it with
# NVRTC and, where a GPU exists, runs and checks it.
set -euo pipefail
source "$(dirname "$0")/nvrtc-env.sh"
cd "$flashgen_root"
cargo run --release -p flashgen --example quickstart
