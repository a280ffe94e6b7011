#!/usr/bin/env bash
# Builds the test guest of Fido's VM domains: a Debian 12 kernel and a busybox
# initramfs holding the workspace's `fido` binary, bootable under QEMU (TCG or
# KVM) in a few seconds. Used by the VM tests (fido-test-support's `vm::image`),
# `fido demo --vm` and `fido-bench vm`.
#
#   scripts/vm-image.sh [--out DIR] [--cache DIR] [--add SRC:DST]... [--fido PATH] [--quiet]
#
# Outputs in DIR (default ${FIDO_VM_IMAGE_DIR:-${CARGO_TARGET_DIR:-target}/vm-image}):
#   kernel      the uncompressed vmlinux ELF extracted from Debian's bzImage
#               (QEMU boots it through PVH, about twice as fast as the bzImage);
#               Debian's bzImage itself if extraction fails
#   initrd.img  the initramfs (newc cpio, uncompressed: under TCG the guest's
#               gunzip of it cost ~1 s of a ~5 s boot, QEMU's copy costs nothing)
#   cmdline     the kernel command line to boot it with
#   manifest    what is inside, with versions and sizes
# Cached: nothing is rebuilt when the key (this script, the kernel package's
# version, the fido binary and every --add file's content) is unchanged; the
# kernel part (download, extraction, module selection) is cached separately,
# keyed by the script and the kernel version, so a new fido binary only
# repacks the initramfs. That cache (--cache, default FIDO_VM_CACHE or
# vm-image-cache beside DIR) is shared by every image built beside it, under
# a lock (flock), so concurrent builds wait for each other.
#
# Inputs:
#   kernel   linux-image-6.1.0-*-amd64, the version Debian's linux-image-amd64
#            depends on, fetched with `apt-get download` (.deb kept in
#            the cache); FIDO_VM_KERNEL_DEB=path.deb uses that package instead
#            (offline builds)
#   busybox  /bin/busybox of Debian's busybox-static (scripts/install-test-deps.sh)
#   fido     target/release/fido (or --fido PATH); built with
#            `cargo build --release -p fido-cli` when missing. Copied stripped of
#            debug info, with the shared libraries ldd lists.
#   --add SRC:DST   more files (test programs) at DST in the guest; ELF
#            files get their shared libraries too, and lose their debug info.
#   e2fsprogs  mke2fs and e2fsck of the host's e2fsprogs (Debian package
#            e2fsprogs), with their libraries, at /sbin/mke2fs and /sbin/e2fsck
#            (also mkfs.ext4 and fsck.ext4), replacing busybox's mke2fs: the
#            ext4 of `fido demo --blk`. Left out, saying so in the manifest
#            ("e2fsprogs: missing"), where the host has none.
#
# The guest's /init: mounts proc, sys, devtmpfs, devpts, tmpfs (/tmp, /dev/shm,
# /run); loads virtio (pci, console, net, blk, rng), VFIO (vfio,
# vfio_iommu_type1, vfio-pci) and ext4 (with crc32c) with their dependencies; brings lo up and eth0 if
# the command line has fido.ip=ADDR/LEN (fido.gw=GW optional); sets the
# hostname from fido.hostname=; then runs fido.run="CMD" and powers off, or
# without it a root shell on the serial console, forever (no login).
# fido.verbose keeps kernel messages on the console after boot.
set -euo pipefail

say() { [[ $quiet == 1 ]] || echo "vm-image: $*" >&2; }
die() {
    echo "vm-image: error: $*" >&2
    exit 1
}

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
script_path="$repo_root/scripts/vm-image.sh"
out_dir="${FIDO_VM_IMAGE_DIR:-${CARGO_TARGET_DIR:-$repo_root/target}/vm-image}"
cache=""
fido_bin=""
quiet=0
adds=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --out)
        out_dir=${2:?--out needs a directory}
        shift 2
        ;;
    --cache)
        cache=${2:?--cache needs a directory}
        shift 2
        ;;
    --add)
        [[ ${2:-} == *:/* ]] || die "--add needs SRC:/ABSOLUTE/DST, got '${2:-}'"
        adds+=("$2")
        shift 2
        ;;
    --fido)
        fido_bin=${2:?--fido needs a path}
        shift 2
        ;;
    --quiet)
        quiet=1
        shift
        ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done

for tool in busybox cpio xz dpkg-deb sha256sum; do
    command -v "$tool" >/dev/null || die "'$tool' is missing (run scripts/install-test-deps.sh)"
done
busybox_bin=$(command -v busybox)
# Debian's dynamic busybox would need its libraries; the guest wants busybox-static.
if ldd "$busybox_bin" >/dev/null 2>&1; then
    die "$busybox_bin is dynamically linked; install busybox-static"
fi

mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
cache=${cache:-${FIDO_VM_CACHE:-$(dirname "$out_dir")/vm-image-cache}}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
exec {cache_lock}>"$cache/lock"
flock "$cache_lock"

# Modules the guest loads (their dependencies are added from modules.dep).
# Built in (CONFIG_*=y in Debian's config, checked below): PCIe ports and
# hotplug (ACPI, pciehp), MSI, intel-iommu with interrupt remapping, the 8250
# serial port, devtmpfs, tmpfs, unix/inet sockets, initramfs.
# ext4 finds its checksum through the crypto API (not a symbol dependency):
# crc32c_generic must be loaded by name.
wanted_modules=(virtio_pci virtio_console virtio_net virtio_blk virtio-rng
    vfio vfio_iommu_type1 vfio-pci crc32c_generic ext4)
builtin_configs=(CONFIG_PVH CONFIG_PCI_MSI CONFIG_PCIEPORTBUS CONFIG_HOTPLUG_PCI_PCIE
    CONFIG_HOTPLUG_PCI_ACPI CONFIG_INTEL_IOMMU CONFIG_IRQ_REMAP CONFIG_SERIAL_8250
    CONFIG_DEVTMPFS CONFIG_TMPFS CONFIG_UNIX CONFIG_INET CONFIG_BLK_DEV_INITRD)

# ---- the kernel package: which version, and the .deb -----------------------
kernel_deb=""
if [[ -n ${FIDO_VM_KERNEL_DEB:-} ]]; then
    kernel_deb=$(realpath "$FIDO_VM_KERNEL_DEB")
    [[ -f $kernel_deb ]] || die "FIDO_VM_KERNEL_DEB=$FIDO_VM_KERNEL_DEB does not exist"
else
    # Which package and version: asking apt-cache takes ~2 s, so the answer
    # is kept until apt's package lists change.
    lists_stamp=$(ls -l --time-style=+%s /var/lib/apt/lists/ 2>/dev/null | sha256sum | cut -d' ' -f1)
    kernel_pkg="" kernel_ver=""
    if [[ -f $cache/apt-answer && $(head -n1 "$cache/apt-answer") == "$lists_stamp" ]]; then
        { read -r _ && read -r kernel_pkg && read -r kernel_ver; } <"$cache/apt-answer" || true
    else
        kernel_pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
            sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | head -n1) || true
        if [[ -n $kernel_pkg ]]; then
            kernel_ver=$(apt-cache policy "$kernel_pkg" 2>/dev/null | sed -n 's/^ *Candidate: //p' | head -n1)
        fi
        if [[ -n $kernel_pkg && -n $kernel_ver && $kernel_ver != "(none)" ]]; then
            printf '%s\n' "$lists_stamp" "$kernel_pkg" "$kernel_ver" >"$cache/apt-answer"
        fi
    fi
    if [[ -n $kernel_pkg && -n $kernel_ver && $kernel_ver != "(none)" ]]; then
        kernel_deb="$cache/${kernel_pkg}_${kernel_ver//:/%3a}_amd64.deb"
        if [[ ! -f $kernel_deb ]]; then
            say "downloading $kernel_pkg $kernel_ver"
            # (apt warns when root downloads outside its sandbox: noise here)
            (cd "$cache" && apt-get download -qq "$kernel_pkg=$kernel_ver" 2>&1 |
                grep -v '^W: Download is performed unsandboxed' >&2) || true
            if [[ ! -f $kernel_deb && $(id -u) -eq 0 ]]; then
                say "download failed; apt-get update and retry"
                apt-get update -qq >&2
                rm -f "$cache/apt-answer"
                kernel_ver=$(apt-cache policy "$kernel_pkg" | sed -n 's/^ *Candidate: //p' | head -n1)
                kernel_deb="$cache/${kernel_pkg}_${kernel_ver//:/%3a}_amd64.deb"
                (cd "$cache" && apt-get download -qq "$kernel_pkg=$kernel_ver" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2) || true
            fi
            [[ -f $kernel_deb ]] || die "could not download $kernel_pkg=$kernel_ver (apt-get download); set FIDO_VM_KERNEL_DEB to a linux-image-6.1.0-*-amd64 .deb"
            for old in "$cache"/linux-image-*.deb; do
                [[ $old == "$kernel_deb" ]] || rm -f "$old"
            done
        fi
    else
        # No apt metadata (offline, or not Debian): the newest cached package.
        kernel_deb=$(ls -1 "$cache"/linux-image-*-amd64_*.deb 2>/dev/null | sort -V | tail -n1) || true
        [[ -n $kernel_deb ]] || die "apt-cache does not know linux-image-amd64 and no kernel package is cached in $cache; set FIDO_VM_KERNEL_DEB"
        say "apt metadata unavailable; using cached $(basename "$kernel_deb")"
    fi
fi
kernel_pkg_id=$(dpkg-deb -f "$kernel_deb" Package Version | tr '\n' ' ')

# ---- the fido binary ---------------------------------------------------------
if [[ -z $fido_bin ]]; then
    fido_bin="${CARGO_TARGET_DIR:-$repo_root/target}/release/fido"
    if [[ ! -x $fido_bin ]]; then
        say "building $fido_bin (cargo build --release -p fido-cli)"
        (cd "$repo_root" && cargo build --release -p fido-cli >&2)
    fi
fi
[[ -x $fido_bin ]] || die "fido binary $fido_bin is not executable"
fido_bin=$(realpath "$fido_bin")

# ---- e2fsprogs (optional) ------------------------------------------------------
# Looked for in the sbin directories too: they are not on a user's PATH.
e2fs_tools=()
for tool in mke2fs e2fsck; do
    found=$(PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" || true)
    # busybox's applets of the same name are not e2fsprogs.
    if [[ -n $found && $(realpath "$found") != "$(realpath "$busybox_bin")" ]]; then
        e2fs_tools+=("$(realpath "$found"):/sbin/$tool")
    fi
done
[[ ${#e2fs_tools[@]} == 2 ]] || e2fs_tools=()

# ---- cache keys --------------------------------------------------------------
script_hash=$(sha256sum "$script_path" | cut -d' ' -f1)
kernel_key=$(printf '%s\n' "$script_hash" "$kernel_pkg_id" | sha256sum | cut -d' ' -f1)
{
    echo "$kernel_key"
    sha256sum "$fido_bin" | cut -d' ' -f1
    sha256sum "$busybox_bin" | cut -d' ' -f1
    for tool in "${e2fs_tools[@]}"; do echo "$tool $(sha256sum "${tool%%:/*}" | cut -d' ' -f1)"; done
    for add in "${adds[@]}"; do
        src=${add%%:/*}
        [[ -f $src ]] || die "--add: '$src' is not a file"
        echo "$add $(sha256sum "$src" | cut -d' ' -f1)"
    done
} >"$out_dir/.key.new"
image_key=$(sha256sum "$out_dir/.key.new" | cut -d' ' -f1)
rm -f "$out_dir/.key.new"

outputs=(kernel initrd.img cmdline manifest)
have_all=1
for f in "${outputs[@]}"; do [[ -s $out_dir/$f ]] || have_all=0; done
if [[ $have_all == 1 && -f $out_dir/key && $(cat "$out_dir/key") == "$image_key" ]]; then
    say "up to date: $out_dir"
    exit 0
fi

work=$(mktemp -d "$out_dir/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# ---- stage 1: kernel + selected modules (cached by kernel_key) ----------------
kstage="$cache/kernel-$kernel_key"
if [[ ! -f $kstage/done ]]; then
    rm -rf "$cache"/kernel-*
    say "extracting $(basename "$kernel_deb")"
    x="$work/deb"
    mkdir -p "$x"
    dpkg-deb -x "$kernel_deb" "$x"
    kver=$(ls -1 "$x/lib/modules" | head -n1)
    [[ -n $kver && -f $x/boot/vmlinuz-$kver ]] || die "$(basename "$kernel_deb") has no boot/vmlinuz-<version>"
    config="$x/boot/config-$kver"
    for c in "${builtin_configs[@]}"; do
        grep -qx "$c=y" "$config" || die "kernel $kver: $c is not built in; the initramfs would need more modules"
    done
    mkdir -p "$kstage.tmp/modules"
    cp "$x/boot/vmlinuz-$kver" "$kstage.tmp/vmlinuz"
    cp "$config" "$kstage.tmp/config"

    # The uncompressed vmlinux: find the compressed payload's magic in the
    # bzImage and decompress from there (what the kernel's extract-vmlinux
    # does); trailing bytes after the stream make the decompressor complain,
    # so success = an ELF came out. (The magics lack their NUL bytes: a bash
    # string cannot hold one.)
    extract_vmlinux() {
        local img=$1 out=$2 magic cmd off
        for pair in $'\xfd7zXZ:xz -dcq' $'\x28\xb5\x2f\xfd:zstd -dcq' $'\x1f\x8b\x08:gzip -dcq'; do
            magic=${pair%%:*}
            cmd=${pair#*:}
            command -v "${cmd%% *}" >/dev/null || continue
            for off in $(LC_ALL=C grep -aobF -- "$magic" "$img" | cut -d: -f1 | head -n5); do
                tail -c "+$((off + 1))" "$img" | $cmd >"$out" 2>/dev/null || true
                if [[ $(head -c4 "$out" | od -An -tx1 | tr -d ' ') == 7f454c46 ]]; then
                    return 0
                fi
            done
        done
        rm -f "$out"
        return 1
    }
    if extract_vmlinux "$x/boot/vmlinuz-$kver" "$kstage.tmp/vmlinux"; then
        say "extracted vmlinux ($(du -h "$kstage.tmp/vmlinux" | cut -f1))"
    else
        say "could not extract vmlinux from the bzImage; the bzImage will be booted"
    fi

    # Dependencies: busybox depmod writes modules.dep (the .deb ships none;
    # kmod's depmod may be absent), then a depth-first walk puts every
    # dependency before its users.
    busybox depmod -b "$x" "$kver"
    moddep="$x/lib/modules/$kver/modules.dep"
    declare -A dep_of=() path_of=() done_mod=()
    while IFS= read -r line; do
        path=${line%%:*}
        name=$(basename "$path" .ko)
        name=${name//-/_}
        path_of[$name]=$path
        dep_of[$name]=${line#*:}
    done <"$moddep"
    order=()
    visit() {
        local name=${1//-/_} d dn
        [[ -n ${path_of[$name]:-} ]] || die "kernel $kver has no module '$1'"
        [[ -z ${done_mod[$name]:-} ]] || return 0
        done_mod[$name]=1
        for d in ${dep_of[$name]}; do
            dn=$(basename "$d" .ko)
            visit "$dn"
        done
        order+=("${path_of[$name]}")
    }
    for m in "${wanted_modules[@]}"; do visit "$m"; done
    for p in "${order[@]}"; do
        mkdir -p "$kstage.tmp/modules/$kver/$(dirname "$p")"
        cp "$x/lib/modules/$kver/$p" "$kstage.tmp/modules/$kver/$p"
        echo "$p"
    done >"$kstage.tmp/load-order"
    # A modules.dep of just these, so `modprobe` works in the guest too.
    for p in "${order[@]}"; do grep -F "$p:" "$moddep" | grep "^$p:"; done \
        >"$kstage.tmp/modules/$kver/modules.dep"
    cp "$x/lib/modules/$kver/modules.builtin" "$kstage.tmp/modules/$kver/" 2>/dev/null || true
    echo "$kver" >"$kstage.tmp/kver"
    rm -rf "$x"
    touch "$kstage.tmp/done"
    rm -rf "$kstage"
    mv "$kstage.tmp" "$kstage"
fi
kver=$(cat "$kstage/kver")

# ---- stage 2: the initramfs --------------------------------------------------
root="$work/root"
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,run,root,mnt,usr/bin,usr/sbin,lib/modules}
chmod 1777 "$root/tmp"
cp "$busybox_bin" "$root/bin/busybox"
for applet in $("$busybox_bin" --list-full); do
    [[ -e $root/$applet ]] || ln -s /bin/busybox "$root/$applet"
done
cp -r "$kstage/modules/$kver" "$root/lib/modules/"
cp "$kstage/load-order" "$root/etc/fido-modules"

# copy_with_libs SRC DST: SRC at DST in the guest, plus its shared libraries
# at the paths ldd resolves them to (the loader where PT_INTERP says).
copy_with_libs() {
    local src=$1 dst=$2 lib
    mkdir -p "$root$(dirname "$dst")"
    # DST may be a busybox applet's link: replace the link, never write
    # through it (its target, /bin/busybox, is absolute: the host's).
    rm -f "$root$dst"
    cp -L "$src" "$root$dst"
    chmod a+rx,u+w "$root$dst"
    if [[ $(head -c4 "$src" | od -An -tx1 | tr -d ' ') == 7f454c46 ]]; then
        for lib in $(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' || true); do
            [[ -e $root$lib ]] && continue
            mkdir -p "$root$(dirname "$lib")"
            cp -L "$lib" "$root$lib"
        done
    fi
}
# Debug info is most of a Rust binary's size (fido: 53 MB -> 8 MB) and the
# guest never reads it; the symbol table stays (backtraces name functions).
strip_debug() {
    if command -v strip >/dev/null && [[ $(head -c4 "$1" | od -An -tx1 | tr -d ' ') == 7f454c46 ]]; then
        strip --strip-debug "$1" 2>/dev/null || true
    fi
}
copy_with_libs "$fido_bin" /bin/fido
strip_debug "$root/bin/fido"
for add in "${e2fs_tools[@]}" "${adds[@]}"; do
    copy_with_libs "${add%%:/*}" "/${add#*:/}"
    strip_debug "$root/${add#*:/}"
done
if [[ ${#e2fs_tools[@]} == 2 ]]; then
    for fs in ext2 ext3 ext4; do
        ln -sf mke2fs "$root/sbin/mkfs.$fs"
        ln -sf e2fsck "$root/sbin/fsck.$fs"
    done
fi

cat >"$root/init" <<'INIT'
#!/bin/sh
# Fido test guest init (scripts/vm-image.sh). Busybox only; no udev, no login.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root TERM=vt100
mount -t devtmpfs devtmpfs /dev
# The initramfs has no /dev/console node; take the console now.
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /run

# Parameters of our own: fido.ip=A/N fido.gw=G fido.hostname=H fido.run="CMD"
# fido.verbose. (Kernel parameters with a dot never reach init's environment.)
fido_ip= fido_gw= fido_run= fido_hostname= fido_verbose=
cmdline=$(cat /proc/cmdline)
# eval splits quoted values ("a b") as the kernel does; a command line it
# cannot parse (unbalanced quotes) would end this shell, so try it first.
if (eval "set -- $cmdline") 2>/dev/null; then
    eval "set -- $cmdline"
else
    echo "init: cannot split the command line on quotes; splitting on spaces"
    set -- $cmdline
fi
for arg in "$@"; do
    case "$arg" in
    fido.ip=*) fido_ip=${arg#fido.ip=} ;;
    fido.gw=*) fido_gw=${arg#fido.gw=} ;;
    fido.hostname=*) fido_hostname=${arg#fido.hostname=} ;;
    fido.run=*) fido_run=${arg#fido.run=} ;;
    fido.verbose) fido_verbose=1 ;;
    esac
done

while read -r mod; do
    insmod "/lib/modules/$(uname -r)/$mod" || echo "init: insmod $mod failed"
done </etc/fido-modules

hostname "${fido_hostname:-fido-guest}"
ip link set lo up
if [ -n "$fido_ip" ] && [ -e /sys/class/net/eth0 ]; then
    ip addr add "$fido_ip" dev eth0 && ip link set eth0 up || echo "init: eth0 $fido_ip failed"
    if [ -n "$fido_gw" ]; then ip route add default via "$fido_gw" || echo "init: route via $fido_gw failed"; fi
fi
# Kernel messages would interleave with the console's command output.
[ -n "$fido_verbose" ] || echo 1 >/proc/sys/kernel/printk

if [ -n "$fido_run" ]; then
    /bin/sh -c "$fido_run"
    echo "fido.run: exit $?"
    sync
    poweroff -f
fi
echo "fido-guest: shell on the console"
while true; do
    setsid cttyhack /bin/sh -l
    sleep 0.2 # a shell that cannot start must not spin
done
INIT
chmod 755 "$root/init"
cat >"$root/etc/profile" <<'PROFILE'
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root
PS1='fido-guest# '
PROFILE
echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
echo "root:x:0:" >"$root/etc/group"

(cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) \
    >"$work/initrd.img"

# ---- outputs -----------------------------------------------------------------
# The kernel is the cache's file, hard-linked where possible (66 MB per image
# otherwise); a later cache rebuild replaces the cache's name, not this inode.
if [[ -f $kstage/vmlinux ]]; then
    ln -f "$kstage/vmlinux" "$work/kernel" 2>/dev/null || cp "$kstage/vmlinux" "$work/kernel"
    kernel_kind="vmlinux (uncompressed ELF, PVH boot)"
else
    ln -f "$kstage/vmlinuz" "$work/kernel" 2>/dev/null || cp "$kstage/vmlinuz" "$work/kernel"
    kernel_kind="bzImage (vmlinux extraction failed)"
fi
# cryptomgr.notests: the self-tests of the crypto algorithms were 3.5 s of
# an 8.4 s boot under TCG (measured in deterministic guest time, -icount
# shift=2). Other usual speed-ups (tsc=reliable, no_timer_check, the i8042
# probes, mitigations=off, random.trust_cpu, 8250.nr_uarts=1, pci=noaer,
# initcall_blacklist=crypto_kdf108_init) changed nothing there, so they are
# not used for speed. no_timer_check is used for robustness: on a loaded host
# a TCG guest's early check that the timer interrupt reaches the CPU through
# the interrupt-remapped IO-APIC can time out, and the kernel panics ("timer
# doesn't work through Interrupt-remapped IO-APIC"; seen with two guests and
# builds on two CPUs).
echo "console=ttyS0 intel_iommu=on panic=-1 quiet cryptomgr.notests no_timer_check" >"$work/cmdline"
{
    echo "fido test guest (scripts/vm-image.sh)"
    echo "key: $image_key"
    echo "kernel: $kernel_pkg_id($kver), $kernel_kind, $(stat -c %s "$work/kernel") bytes"
    echo "busybox: $("$busybox_bin" 2>&1 | head -n1)"
    echo "fido: $fido_bin sha256 $(sha256sum "$fido_bin" | cut -d' ' -f1)"
    echo "fido --version: $("$fido_bin" --version 2>&1 | head -n1 || true)"
    echo "initrd: $(stat -c %s "$work/initrd.img") bytes, newc cpio"
    if [[ ${#e2fs_tools[@]} == 2 ]]; then
        echo "e2fsprogs: $("${e2fs_tools[0]%%:/*}" -V 2>&1 | head -n1)"
    else
        echo "e2fsprogs: missing (the build host has no mke2fs/e2fsck; Debian package e2fsprogs)"
    fi
    echo "modules (load order):"
    sed 's/^/  /' "$kstage/load-order"
    echo "files:"
    (cd "$root" && find . -type f ! -path './lib/modules/*' | LC_ALL=C sort | sed 's/^\./  /')
    for add in "${adds[@]}"; do echo "added: $add"; done
} >"$work/manifest"

for f in "${outputs[@]}"; do
    # The kernel may already be this very file (both hard links to the
    # cache's): mv refuses to move a file onto itself, and nothing is to do.
    if [[ $work/$f -ef $out_dir/$f ]]; then rm -f "$work/$f"; else mv -f "$work/$f" "$out_dir/$f"; fi
done
echo "$image_key" >"$out_dir/key"
say "built $out_dir: $(stat -c %s "$out_dir/kernel") bytes kernel, $(stat -c %s "$out_dir/initrd.img") bytes initrd"
