#!/usr/bin/env bash
# Fido's whole test suite, as CI runs it (.ci/run) and as the README tells
# people to run it:   bash scripts/test.sh
#
# Steps (each timed; a failed step does not stop the later independent ones,
# but the script exits non-zero if any step failed):
#   deps         scripts/install-test-deps.sh (idempotent, needs root on a fresh box)
#   build        cargo build --release --workspace
#   test         cargo test --release --workspace  (release: the multi-process
#                tests should see realistic timing; includes the stable replay
#                of the fuzz corpora, crates/fido-{proto,registry}/tests/corpus.rs)
#   lint         cargo clippy --release --workspace --all-targets: the workspace
#                lints at deny level (every unsafe block has a SAFETY comment,
#                unsafe_op_in_unsafe_fn) fail it; other clippy lints only warn
#   loom         RUSTFLAGS="--cfg loom" cargo test -p fido-ring --release --test loom
#                (own target dir, so it does not invalidate the main build)
#   fuzz-replay  scripts/fuzz-replay.sh: every corpus through the libFuzzer+ASan
#                build of its target (nightly, or stable + RUSTC_BOOTSTRAP=1)
#
# Knobs: FIDO_CI_CARGO_ARGS (default "--workspace --features fido/tokio,fido-broker/fuzz-hooks"; e.g. "-p fido-shm -p fido-ring"
# while a crate does not build), FIDO_CI_FUZZ=0 skips fuzz-replay,
# FIDO_CI_SKIP_DEPS=1 skips deps; FIDO_CI_{BUILD,TEST,LOOM,FUZZ}_LIMIT set the
# per-step time limits in seconds (defaults 2400/1500/600/1500: generous, the
# whole suite is meant to stay under 30 min on 2 cores; see the step timings).
# CARGO_TARGET_DIR is honoured; loom and fuzz
# builds go to $CARGO_TARGET_DIR/loom and $CARGO_TARGET_DIR/fuzz.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -x "$HOME/.cargo/bin/cargo" ]]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
# The tokio flavour is behind a feature: build and test with it on, in both
# steps, so the test step reuses the build. fido-broker's fuzz hooks likewise:
# its tests turn them on (tests/fuzz_corpus.rs replays the broker_session corpus).
read -r -a cargo_args <<<"${FIDO_CI_CARGO_ARGS:---workspace --features fido/tokio,fido-broker/fuzz-hooks}"

passed=0 failed=0
failed_steps=()
summary=()

# step NAME LIMIT_SECONDS CMD...: runs CMD under `timeout` (which signals CMD's
# whole process group, so hung test children die too).
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc=0
    echo
    echo "=== fido-ci: $name (limit ${limit}s): $*"
    timeout -k 30 "$limit" "$@" || rc=$?
    [[ $rc -ne 124 ]] || echo "=== fido-ci: $name: timed out after ${limit}s"
    local dt=$((SECONDS - t0))
    if [[ $rc -eq 0 ]]; then
        passed=$((passed + 1))
        summary+=("  ok    $name (${dt}s)")
    else
        failed=$((failed + 1))
        failed_steps+=("$name")
        summary+=("  FAIL  $name (${dt}s, exit $rc)")
    fi
    echo "=== fido-ci: $name: $([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)") in ${dt}s"
    return 0
}

skip_because() {
    failed=$((failed + 1))
    failed_steps+=("$1")
    summary+=("  SKIP  $1 (counted as failed: $2)")
    echo "=== fido-ci: $1: skipped, $2"
}

if [[ "${FIDO_CI_SKIP_DEPS:-0}" != 1 ]]; then
    step deps 900 bash scripts/install-test-deps.sh
fi

step build "${FIDO_CI_BUILD_LIMIT:-2400}" cargo build --release "${cargo_args[@]}"
if [[ " ${failed_steps[*]} " == *" build "* ]]; then
    skip_because test "build failed"
else
    # Tests that need a cdylib or a binary cargo test does not build (the
    # preload library, libfido.so) run `cargo build` themselves: with the
    # same arguments, so it finds everything fresh instead of rebuilding.
    step test "${FIDO_CI_TEST_LIMIT:-1500}" env FIDO_TEST_CARGO_ARGS="${cargo_args[*]}" \
        cargo test --release "${cargo_args[@]}"
fi

# clippy shares the build's dependencies (same profile), so it only checks our crates.
step lint "${FIDO_CI_LINT_LIMIT:-900}" cargo clippy --release "${cargo_args[@]}" --all-targets

step loom "${FIDO_CI_LOOM_LIMIT:-600}" env RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$target_dir/loom" \
    cargo test -p fido-ring --release --test loom

if [[ "${FIDO_CI_FUZZ:-1}" != 0 ]]; then
    step fuzz-replay "${FIDO_CI_FUZZ_LIMIT:-1500}" env CARGO_TARGET_DIR="$target_dir/fuzz" bash scripts/fuzz-replay.sh
fi

# Not a test (prints a benchmark table; takes minutes). Run by hand:
# cargo run --release -p fido-cli -- bench channel --quick

echo
echo "fido-ci: steps:"
printf '%s\n' "${summary[@]}"
echo "fido-ci: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
