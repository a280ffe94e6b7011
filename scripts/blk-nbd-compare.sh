#!/usr/bin/env bash
# fio through NBD servers on the same backing, one after the other:
#   fido blk nbd in front of `fido blk serve --ram` and `--file` (tmpfs),
#   nbdkit memory, nbdkit file (tmpfs), qemu-nbd (tmpfs file).
# Jobs: 1M sequential write QD8 (MB/s; it also fills the device, so the reads
# find data), then 4k random read QD32 (IOPS). Prints one line per server and
# job; the caller keeps the figures with the command line.
#
#   scripts/blk-nbd-compare.sh [--fido PATH] [--size 512M] [--runtime 10] [--rounds 1]
#
# FIDO_NBD_ARGS: more arguments for `fido blk nbd` (e.g. "--spin-us 0").
#
# Needs: fio (nbd engine), nbdkit, qemu-nbd; a release build of `fido`. Runs
# its own broker in a temporary directory; everything it starts is stopped
# (by pid) on exit.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
fido="$repo/target/release/fido"
size=512M
runtime=10
rounds=1
while [[ $# -gt 0 ]]; do
    case $1 in
        --fido) fido=$2; shift 2 ;;
        --size) size=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
for t in fio nbdkit qemu-nbd; do
    command -v "$t" >/dev/null || { echo "blk-nbd-compare: $t not installed" >&2; exit 1; }
done
[[ -x $fido ]] || { echo "blk-nbd-compare: no $fido (cargo build --release -p fido-cli)" >&2; exit 1; }

dir=$(mktemp -d /tmp/blk-nbd-compare.XXXXXX)
shm=$(mktemp -d /dev/shm/blk-nbd-compare.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$dir" "$shm"
}
trap cleanup EXIT

wait_for() { # file (a socket the server creates; stale ones are removed before it starts)
    for _ in $(seq 200); do [[ -e $1 ]] && return 0; sleep 0.05; done
    echo "blk-nbd-compare: $1 never appeared" >&2; exit 1
}

"$fido" broker --socket "$dir/broker.sock" --state-dir "$dir/state" --pipe-disable >"$dir/broker.log" 2>&1 &
pids+=($!)
wait_for "$dir/broker.sock"
export FIDO_BROKER=$dir/broker.sock

job() { # name uri rw bs depth -> figure
    local out
    out=$(fio --name="$1" --ioengine=nbd --uri="$2" --rw="$3" --bs="$4" --iodepth="$5" \
        --size="$size" --time_based --runtime="$runtime" --output-format=json 2>/dev/null | sed -n '/^{/,$p')
    python3 -c '
import json, sys
j = json.loads(sys.stdin.read())["jobs"][0]
rw = sys.argv[1]
if rw == "write":
    print("%.0f MB/s" % (j["write"]["bw_bytes"] / 1e6))
else:
    print("%.0f IOPS" % j["read"]["iops"])
' "$3" <<<"$out"
}

measure() { # label uri
    local w r
    w=$(job write "$2" write 1M 8)
    r=$(job randread "$2" randread 4k 32)
    printf '%-28s write-1M-qd8 %12s   randread-4k-qd32 %12s\n' "$1" "$w" "$r"
}

stop_last() { kill "${pids[-1]}" 2>/dev/null || true; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'; }

for round in $(seq "$rounds"); do
    echo "round $round (size $size, $runtime s per job, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg))"

    # fido: a RAM storage domain, then a file on tmpfs.
    for backing in ram file; do
        if [[ $backing == ram ]]; then
            "$fido" blk serve bench --ram "$size" >"$dir/serve.log" 2>&1 &
        else
            truncate -s "$size" "$shm/fido.img"
            "$fido" blk serve bench --file "$shm/fido.img" >"$dir/serve.log" 2>&1 &
        fi
        pids+=($!)
        for _ in $(seq 200); do grep -q '^serving' "$dir/serve.log" && break; sleep 0.05; done
        rm -f "$dir/fido.sock"
        # shellcheck disable=SC2086
        "$fido" blk nbd bench --unix "$dir/fido.sock" ${FIDO_NBD_ARGS:-} >"$dir/nbd.log" 2>&1 &
        pids+=($!)
        wait_for "$dir/fido.sock"
        measure "fido blk nbd ($backing)" "nbd+unix:///bench?socket=$dir/fido.sock"
        stop_last; stop_last
        rm -f "$shm/fido.img"
    done

    rm -f "$dir/kit.sock"
    nbdkit -f -U "$dir/kit.sock" memory "$size" 2>"$dir/kit.log" &
    pids+=($!)
    wait_for "$dir/kit.sock"
    measure "nbdkit memory" "nbd+unix:///?socket=$dir/kit.sock"
    stop_last

    truncate -s "$size" "$shm/kit.img"
    rm -f "$dir/kitf.sock"
    nbdkit -f -U "$dir/kitf.sock" file "$shm/kit.img" 2>"$dir/kitf.log" &
    pids+=($!)
    wait_for "$dir/kitf.sock"
    measure "nbdkit file (tmpfs)" "nbd+unix:///?socket=$dir/kitf.sock"
    stop_last
    rm -f "$shm/kit.img"

    truncate -s "$size" "$shm/qemu.img"
    rm -f "$dir/qemu.sock"
    qemu-nbd --persistent --shared=8 -f raw -k "$dir/qemu.sock" "$shm/qemu.img" 2>"$dir/qemu.log" &
    pids+=($!)
    wait_for "$dir/qemu.sock"
    measure "qemu-nbd (tmpfs file)" "nbd+unix:///?socket=$dir/qemu.sock"
    stop_last
    rm -f "$shm/qemu.img"
done
