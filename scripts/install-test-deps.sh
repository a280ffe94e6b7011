#!/usr/bin/env bash
# Installs what Fido's tests, benches and fuzz replay need on Debian 12, as root.
# Idempotent: every step checks first and skips quickly when already satisfied
# (a second run does no network I/O at all).
#
# What is needed, and why (nothing else is):
#   build-essential  cc/c++/ld: rusqlite's bundled SQLite, libFuzzer (C++), linking
#   ucx-utils        ucx_perftest, the UCX baseline of `fido-bench channel`
#   curl             the HTTP client of the `fido pipe serve` tests
#   wrk, nginx-light, libnginx-mod-stream, fonts-dejavu-core
#                    `fido-bench pipe`: load generator, the nginx baselines (static
#                    files with sendfile; TCP proxy via the stream module), the
#                    plot's font
#   (no protoc, no capnp: the baselines' generated code is checked in; only
#   bench/proto/regenerate.sh needs them, after a schema changes)
#   python3          xmlrpc.server/xmlrpc.client, the XML-RPC baseline of `fido-bench rpc`
#   ca-certificates, curl   only when Rust itself must be installed (rustup)
#   clippy           the lint step (workspace lints: SAFETY comments, unsafe_op_in_unsafe_fn)
#   cargo-fuzz       only for scripts/fuzz-replay.sh / fuzz-run.sh
#   redis-server redis-tools nginx-light curl wrk iperf3 sockperf util-linux
#                    the real programs of the fido-net (MMNet) tests and `fido-bench net`
#                    (setpriv from util-linux runs the setuid fallback test)
#   memcached libmemcached-tools mariadb-server sysbench openssh-server
#   openssh-client nodejs socat ncat
#                    the programs of issue #19 (fido-net tests/apps.rs, `fido-bench
#                    net-apps`): memcached + memcslap/memccp/memccat, MariaDB +
#                    sysbench, sshd + ssh, node (http, cluster), socat, ncat
#   iproute2         `ip netns` / veth pairs of the fido-net cross-namespace test
#   nodejs           Node's `cluster` (sockets passed to workers over SCM_RIGHTS) in the
#                    fido-net fallback test
#   qemu-system-x86, busybox-static, cpio, xz-utils
#                    the VM domain tests, `fido demo --vm`, `fido-bench vm`: QEMU, and
#                    what scripts/vm-image.sh builds the test guest's initramfs from
#                    (the guest kernel itself is fetched there with `apt-get download`)
#   nbdkit, libnbd-bin
#                    fido-blk's EIO test: an nbdkit memory disk behind its error filter,
#                    exposed as a file by nbdfuse (libnbd-bin)
#   qemu-utils, libnbd-bin, nbdkit, fio
#                    the real NBD clients of the `fido blk nbd` tests (qemu-img, qemu-io,
#                    qemu-nbd; nbdinfo, nbdcopy; fio's nbd engine) and the NBD baselines
#                    (nbdkit memory/file, qemu-nbd) of the blk bench suite
#   e2fsprogs        mke2fs/e2fsck that scripts/vm-image.sh puts into the test guest:
#                    the ext4 of `fido demo --blk` (usually installed already)
# Not needed: pkg-config (SQLite is bundled), libclang (iceoryx2 runs bindgen
# only on QNX), procps (no test shells out to ps).
#
# FIDO_SKIP_CARGO_FUZZ=1 skips cargo-fuzz (the corpus replay then relies on the
# stable `cargo test` corpus tests only).
set -euo pipefail

say() { echo "install-test-deps: $*"; }

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then SUDO=(sudo); fi
fi

apt_updated=0
apt_install() {
    local missing=()
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$pkg")
        fi
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        say "apt: $* already installed"
        return
    fi
    if [[ $(id -u) -ne 0 && ${#SUDO[@]} -eq 0 ]]; then
        say "apt: missing ${missing[*]} and not root (no sudo); install them by hand" >&2
        return 1
    fi
    if [[ $apt_updated -eq 0 ]]; then
        say "apt-get update"
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        apt_updated=1
    fi
    say "apt-get install ${missing[*]}"
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

apt_install build-essential ucx-utils
apt_install curl wrk nginx-light libnginx-mod-stream fonts-dejavu-core
apt_install redis-server redis-tools iperf3 sockperf util-linux
apt_install memcached libmemcached-tools mariadb-server sysbench
apt_install openssh-server openssh-client nodejs socat ncat
apt_install iproute2
apt_install python3
apt_install qemu-system-x86 busybox-static cpio xz-utils
apt_install nbdkit libnbd-bin qemu-utils fio
apt_install e2fsprogs

# Rust (stable, via rustup) if there is no cargo at all.
if [[ -x "$HOME/.cargo/bin/cargo" ]]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
if command -v cargo >/dev/null; then
    say "rust: $(cargo --version) already installed"
else
    apt_install ca-certificates curl
    say "rust: installing stable toolchain with rustup"
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
        sh -s -- -y --profile minimal --default-toolchain stable
    export PATH="$HOME/.cargo/bin:$PATH"
fi

# clippy: the lint step of scripts/test.sh (a minimal rustup profile lacks it).
if cargo clippy --version >/dev/null 2>&1; then
    say "clippy: $(cargo clippy --version) already installed"
elif command -v rustup >/dev/null; then
    say "rustup component add clippy"
    rustup component add clippy
else
    say "clippy: missing and no rustup to add it; install clippy by hand" >&2
    exit 1
fi

if [[ "${FIDO_SKIP_CARGO_FUZZ:-0}" == 1 ]]; then
    say "cargo-fuzz: skipped (FIDO_SKIP_CARGO_FUZZ=1)"
elif cargo fuzz --version >/dev/null 2>&1; then
    say "cargo-fuzz: $(cargo fuzz --version) already installed"
else
    say "cargo install --locked cargo-fuzz"
    cargo install --locked cargo-fuzz
fi
say "done"
