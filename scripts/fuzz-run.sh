#!/usr/bin/env bash
# Long fuzzing run of one target:  scripts/fuzz-run.sh TARGET SECONDS [libFuzzer args...]
#
# New inputs go to fuzz/corpus-local/TARGET (git-ignored); the committed seeds in
# fuzz/corpus/TARGET are read but never written. Crashes land in
# fuzz/artifacts/TARGET/ (reproduce: cargo +nightly fuzz run TARGET FILE).
# To keep what a run found, minimise it into the committed corpus:
#   cargo +nightly fuzz cmin TARGET   (or libFuzzer -merge=1 corpus/T corpus-local/T)
# Set FUZZ_JOBS=N for N parallel workers.
set -euo pipefail
. "$(dirname "$0")/fuzz-common.sh"

if [[ $# -lt 2 ]]; then
    echo "usage: $0 TARGET SECONDS [libFuzzer args...]   (targets: ${FUZZ_TARGETS[*]})" >&2
    exit 2
fi
target=$1 secs=$2
shift 2
cd "$FUZZ_DIR"
mkdir -p "corpus-local/$target" "corpus/$target"
jobs=()
if [[ -n "${FUZZ_JOBS:-}" ]]; then jobs=(-fork="$FUZZ_JOBS"); fi
echo "fuzz-run: $target for ${secs}s (${FUZZ_CARGO[*]})"
exec "${FUZZ_CARGO[@]}" run "$target" "corpus-local/$target" "corpus/$target" -- \
    -max_total_time="$secs" -print_final_stats=1 "${jobs[@]}" "$@"
