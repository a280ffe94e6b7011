#!/usr/bin/env bash
# A long fuzzing run of one target, summarised:
#   scripts/fuzz-long.sh TARGET SECONDS [libFuzzer args...]
# e.g. the hour of the broker's stateful session target:
#   scripts/fuzz-long.sh broker_session 3600
#
# Runs libFuzzer in fork mode (FUZZ_JOBS workers, default 1) so that the run
# lasts SECONDS even when inputs crash: every crash, timeout or OOM is saved
# under fuzz/artifacts/TARGET/ and fuzzing goes on. New coverage goes to
# fuzz/corpus-local/TARGET (git-ignored); the committed corpus is only read.
# The log is kept in fuzz/artifacts/TARGET/long-<date>.log. At the end it prints
# the executions, the coverage (edges, features, corpus) and the crashes.
# Set FIDO_FUZZ_SKIP=resume,raw (broker_session) to leave out steps whose known
# bug would otherwise be all the run finds.
# Reproduce and minimise a crash:
#   FIDO_FUZZ_TRACE=1 cargo +nightly fuzz run TARGET fuzz/artifacts/TARGET/crash-…
#   cargo +nightly fuzz tmin TARGET fuzz/artifacts/TARGET/crash-…
set -euo pipefail
. "$(dirname "$0")/fuzz-common.sh"

if [[ $# -lt 2 ]]; then
    echo "usage: $0 TARGET SECONDS [libFuzzer args...]   (targets: ${FUZZ_TARGETS[*]})" >&2
    exit 2
fi
target=$1 secs=$2
shift 2
cd "$FUZZ_DIR"
mkdir -p "corpus-local/$target" "corpus/$target" "artifacts/$target"
log="artifacts/$target/long-$(date -u +%Y%m%dT%H%M%SZ).log"
marker=$(mktemp)
trap 'rm -f "$marker"' EXIT

echo "fuzz-long: building $target (${FUZZ_CARGO[*]}, target dir $CARGO_TARGET_DIR)"
"${FUZZ_CARGO[@]}" build "$target"
echo "fuzz-long: $target for ${secs}s, ${FUZZ_JOBS:-1} worker(s); log $FUZZ_DIR/$log"
t0=$SECONDS
rc=0
"${FUZZ_CARGO[@]}" run "$target" "corpus-local/$target" "corpus/$target" -- \
    -max_total_time="$secs" -fork="${FUZZ_JOBS:-1}" -ignore_crashes=1 \
    -ignore_timeouts=1 -ignore_ooms=1 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="artifacts/$target/" "$@" >"$log" 2>&1 || rc=$?

last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
crashes=$(find "artifacts/$target" -newer "$marker" -type f \
    \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | sort)
echo "fuzz-long: $target ran $((SECONDS - t0))s (libFuzzer exit $rc)"
echo "fuzz-long: last status: ${last:-none (see the log)}"
if [[ $last =~ ^#([0-9]+) ]]; then echo "fuzz-long: executions: ${BASH_REMATCH[1]}"; fi
if [[ $last =~ cov:\ ([0-9]+) ]]; then echo "fuzz-long: coverage: ${BASH_REMATCH[1]} edges"; fi
if [[ $last =~ ft:\ ([0-9]+) ]]; then echo "fuzz-long: features: ${BASH_REMATCH[1]}"; fi
if [[ $last =~ corp:\ ([0-9]+) ]]; then echo "fuzz-long: corpus: ${BASH_REMATCH[1]} inputs"; fi
echo "fuzz-long: crashes/timeouts/ooms saved: $(printf '%s' "$crashes" | grep -c . || true)"
[[ -z $crashes ]] || printf '  %s\n' $crashes
grep -E '^(==[0-9]+==ERROR|thread .* panicked)' "$log" | sort | uniq -c | sort -rn | head -n 20 || true
[[ -z $crashes ]]
