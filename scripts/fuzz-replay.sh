#!/usr/bin/env bash
# Builds every fuzz target (libFuzzer + ASan) and runs each committed corpus
# fuzz/corpus/<target>/ through it once (`-runs=0`: no mutation, just the
# inputs). Exits non-zero if any input crashes, leaks or times out.
#
# The same corpora are also replayed on stable without libFuzzer by
# `cargo test` (crates/fido-proto/tests/corpus.rs,
# crates/fido-registry/tests/corpus.rs); this script adds ASan and the exact
# fuzz build. Usage: scripts/fuzz-replay.sh [TARGET...]
set -euo pipefail
. "$(dirname "$0")/fuzz-common.sh"
cd "$FUZZ_DIR"

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${FUZZ_TARGETS[@]}")

echo "fuzz-replay: building ${targets[*]} (${FUZZ_CARGO[*]}, target dir $CARGO_TARGET_DIR)"
if [[ $# -eq 0 ]]; then
    # Every target in one cargo invocation: the shared crates are built once
    # and the nine ASan binaries link in parallel (one `build` per target
    # linked them one after another).
    "${FUZZ_CARGO[@]}" build
else
    for t in "${targets[@]}"; do
        "${FUZZ_CARGO[@]}" build "$t"
    done
fi
for t in "${targets[@]}"; do
    n=$(find "corpus/$t" -type f | wc -l)
    echo "fuzz-replay: $t: $n inputs"
    "${FUZZ_CARGO[@]}" run "$t" "corpus/$t" -- -runs=0 -timeout=10
done
echo "fuzz-replay: ok"
