# Sourced by scripts/fuzz-*.sh: pick a toolchain cargo-fuzz can use.
#
# cargo-fuzz needs `-Z` flags (sanitizers, sancov), i.e. a nightly rustc. We use
# the `nightly` rustup toolchain when it is installed; otherwise the stable one
# with RUSTC_BOOTSTRAP=1, which unlocks the same flags on a stable compiler
# (no download needed). FIDO_FUZZ_TOOLCHAIN overrides (e.g. `nightly-2026-05-01`,
# or `stable`, which forces the RUSTC_BOOTSTRAP route).
# Builds go to $CARGO_TARGET_DIR (default: /tmp/target-fuzz) so they never
# invalidate the workspace's own target directory.

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../fuzz" && pwd)"
FUZZ_TARGETS=(proto_client_msg proto_broker_msg registry_path descriptor rpc_dispatch resume net_request broker_session guest_link)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/target-fuzz}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz missing (cargo install --locked cargo-fuzz, or scripts/install-test-deps.sh)" >&2
    exit 1
fi

if [[ -n "${FIDO_FUZZ_TOOLCHAIN:-}" ]]; then
    FUZZ_CARGO=(cargo "+$FIDO_FUZZ_TOOLCHAIN" fuzz)
    [[ "$FIDO_FUZZ_TOOLCHAIN" == nightly* ]] || export RUSTC_BOOTSTRAP=1
elif command -v rustup >/dev/null && rustup toolchain list | grep -q '^nightly'; then
    FUZZ_CARGO=(cargo +nightly fuzz)
else
    export RUSTC_BOOTSTRAP=1
    FUZZ_CARGO=(cargo fuzz)
    echo "fuzz: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1" >&2
fi
