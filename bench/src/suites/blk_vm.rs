//! `fido-bench blk`'s guest cases: a virtio-blk disk measured from INSIDE a
//! QEMU guest (TCG where the host has no usable KVM), on the same backing —
//! a file on /dev/shm — served three ways:
//!
//! * `fido-vhost`: `fido blk serve NAME --file F` (a storage domain) and
//!   `fido blk vhost NAME --socket S` → `-device vhost-user-blk-pci`;
//!   `fido-vhost-ram`: the same with `fido blk serve NAME --ram SIZE` (the
//!   blocks of the file's pattern the checks read written into it first
//!   with `fido blk write`);
//! * `qemu-virtio`: QEMU's own block layer, `-drive file=F,format=raw,
//!   cache=writeback,aio=io_uring` on an iothread → `-device virtio-blk-pci`
//!   (the settings a competent user picks for a file on tmpfs: the page
//!   cache *is* tmpfs, so O_DIRECT (`cache=none`) buys nothing and Debian
//!   12's kernel refuses it there; io_uring is QEMU's fastest file AIO; an
//!   iothread takes the I/O off the main loop);
//! * `qsd-vhost`: `qemu-storage-daemon --blockdev file,…,aio=io_uring
//!   --export vhost-user-blk,…,writable=on` → `-device vhost-user-blk-pci`.
//!
//! One guest boot per system (the test image of `scripts/vm-image.sh` with
//! a small script of ours, [`GUEST_SCRIPT`], run by `fido.run=`), guest RAM
//! a shared memfd for every system (vhost-user needs it; the built-in device
//! gets the same). The guest runs busybox `dd` with O_DIRECT: 1 MiB writes,
//! 1 MiB reads, 4 KiB reads one at a time (QD 1), and times each with its
//! own clock (`/proc/timer_list`'s nanoseconds, else `/proc/uptime`): under
//! TCG that is the time the guest sees, which is what its users see.
//!
//! The figures are checked to come from the disk: the guest reports the
//! disk's size, the md5 of a marker block the host wrote at its end and of
//! the first MiB after its writes (zeros); the host checks after the guest
//! is gone that the region the guest wrote holds its zeros.
//!
//! What this module must never do: report a figure a guest did not print in
//! this run, or leave a VM, a server or a disk file behind.

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use super::blk::{have, start, wait_service, Server};
use crate::Record;

const SUITE: &str = "blk";
pub(super) const SYSTEMS: &[&str] = &["fido-vhost", "fido-vhost-ram", "qemu-virtio", "qsd-vhost"];
pub(super) const CASES: &[&str] = &["guest-write-1m", "guest-read-1m", "guest-4k-qd1-read"];
const GUEST_MEM_MIB: u32 = 256;
const LINE_PREFIX: &str = "fido-blk-guest:";
/// Every line the guest prints for us starts with [`LINE_PREFIX`]. Arguments:
/// 1 MiB blocks to write then read, 4 KiB blocks to read, the marker block's
/// index (4 KiB units), how many times the three cases run (one result line
/// each time; the host keeps the median).
const GUEST_SCRIPT: &str = r#"#!/bin/sh
# fido-bench blk's guest side (bench/src/suites/blk_vm.rs): dd on /dev/vda,
# timed with the guest's own clock. Prints `fido-blk-guest: ...` lines.
n1m=$1 n4k=$2 marker=$3 reps=$4
dev=/dev/vda
say() { echo "fido-blk-guest: $*"; }
if [ -r /proc/timer_list ] && grep -q '^now at' /proc/timer_list; then
    clock=timer_list
    now() { awk '/^now at/ { print $3; exit }' /proc/timer_list; }
else
    clock=uptime
    now() { awk '{ printf "%.0f\n", $1 * 1000000000 }' /proc/uptime; }
fi
[ -b $dev ] || { say "error no $dev"; exit 1; }
say "clock=$clock size=$(cat /sys/block/vda/size)"
say "marker=$(dd if=$dev bs=4096 skip=$marker count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
timed() { # CASE BYTES IOS dd-args...
    c=$1 b=$2 n=$3
    shift 3
    t0=$(now)
    dd "$@" 2>/tmp/dd.err || { say "error $c: dd $*: $(cat /tmp/dd.err)"; exit 1; }
    t1=$(now)
    say "case=$c bytes=$b ios=$n ns=$((t1 - t0))"
}
rep=0
while [ $rep -lt $reps ]; do
    timed guest-write-1m $((n1m * 1048576)) $n1m if=/dev/zero of=$dev bs=1M count=$n1m oflag=direct
    timed guest-read-1m $((n1m * 1048576)) $n1m if=$dev of=/dev/null bs=1M count=$n1m iflag=direct
    timed guest-4k-qd1-read $((n4k * 4096)) $n4k if=$dev of=/dev/null bs=4k count=$n4k iflag=direct
    rep=$((rep + 1))
done
say "first_mib=$(dd if=$dev bs=1M count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
say "end"
"#;

/// The md5 of one MiB of zeros.
const ZERO_MIB_MD5: &str = "b6d81b360a5672d80c27430f39153e2c";

/// How much each guest does.
struct Sizes {
    disk: u64,
    n1m: u64,
    n4k: u64,
    /// Runs of each case per guest: the record is the median run (a
    /// loaded host makes single runs of a TCG guest swing by 2x).
    reps: u32,
}

/// The test image with [`GUEST_SCRIPT`] at /bin/fido-blk-guest.sh (built or
/// cached by `scripts/vm-image.sh`).
fn build_image(fido: &Path) -> anyhow::Result<super::vm::rig::Image> {
    let root = super::vm::rig::repo_root()?;
    let out = root.join("target/vm-image-bench-blk");
    std::fs::create_dir_all(&out)?;
    let script = out.join("fido-blk-guest.sh");
    std::fs::write(&script, GUEST_SCRIPT)?;
    let mut c = Command::new(root.join("scripts/vm-image.sh"));
    c.arg("--out")
        .arg(&out)
        .arg("--fido")
        .arg(fido)
        .arg("--add")
        .arg(format!("{}:/bin/fido-blk-guest.sh", script.display()))
        .arg("--quiet")
        .current_dir(&root)
        .stdin(Stdio::null());
    let mut status = c.status().context("running scripts/vm-image.sh")?;
    if !status.success() && out.join("kernel").exists() {
        // As in the vm suite: a rebuild that keeps the cached kernel's hard
        // link fails to `mv` it onto itself; without the old link it works.
        std::fs::remove_file(out.join("kernel"))?;
        status = c.status().context("running scripts/vm-image.sh")?;
    }
    if !status.success() {
        bail!("scripts/vm-image.sh failed ({status})");
    }
    Ok(super::vm::rig::Image {
        kernel: out.join("kernel"),
        initrd: out.join("initrd.img"),
        cmdline: std::fs::read_to_string(out.join("cmdline"))?.trim().to_string(),
    })
}

/// A fresh disk file: every byte non-zero (reads hit written data, and the
/// guest's zeros are told apart), a random-looking marker in the last 4 KiB.
/// Returns the marker's md5.
fn prepare_disk(path: &Path, size: u64, dir: &Path) -> anyhow::Result<String> {
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let chunk = vec![0xa5u8; 1 << 20];
    let mut at = 0;
    while at < size {
        let n = chunk.len().min((size - at) as usize);
        f.write_all_at(&chunk[..n], at)?;
        at += n as u64;
    }
    let mut marker = vec![0u8; 4096];
    crate::fill(&mut marker, 0x6d61_726b);
    f.write_all_at(&marker, size - 4096)?;
    let marker_file = dir.join("marker.bin");
    std::fs::write(&marker_file, &marker)?;
    let out = Command::new("md5sum").arg(&marker_file).output().context("running md5sum")?;
    let md5 = String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or_default().to_string();
    if md5.len() != 32 {
        bail!("md5sum printed {:?}", String::from_utf8_lossy(&out.stdout));
    }
    Ok(md5)
}

/// After the guest: the first `n1m` MiB hold the guest's zeros and the MiB
/// after them still holds the host's pattern.
fn check_disk(path: &Path, n1m: u64) -> anyhow::Result<()> {
    let f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..n1m {
        f.read_exact_at(&mut buf, i << 20)?;
        if let Some(p) = buf.iter().position(|&b| b != 0) {
            bail!("the guest wrote zeros over MiB 0..{n1m}, yet byte {} holds {:#x}", (i << 20) + p as u64, buf[p]);
        }
    }
    f.read_exact_at(&mut buf, n1m << 20)?;
    if buf.iter().any(|&b| b != 0xa5) {
        bail!("MiB {n1m}, which the guest did not write, changed");
    }
    Ok(())
}

/// `fido blk ARGS` on `broker`, which must succeed.
fn fido_blk_cli(fido: &Path, broker: &Path, args: &[&str]) -> anyhow::Result<()> {
    let o = Command::new(fido)
        .arg("blk")
        .args(args)
        .env("FIDO_BROKER", broker)
        .stdin(Stdio::null())
        .output()
        .context("running fido blk")?;
    if !o.status.success() {
        bail!("fido blk {args:?} failed ({}): {}", o.status, String::from_utf8_lossy(&o.stderr).trim());
    }
    Ok(())
}

/// Waits until `log` holds `needle` (a server's readiness line).
fn wait_log(log: &Path, needle: &str, server: &mut Server) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return Ok(());
        }
        if let Ok(Some(st)) = server.child.try_wait() {
            bail!("{} exited ({st}) before it was ready:\n{text}", server.what);
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{} not ready within 30 s:\n{text}", server.what);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `path` is a socket (qemu-storage-daemon listens from then
/// on; a probe connection would be taken for the front end).
fn wait_socket_file(path: &Path, server: &mut Server, log: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt as _;
    let t = Instant::now();
    loop {
        if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        if let Ok(Some(st)) = server.child.try_wait() {
            bail!("{} exited ({st}):\n{}", server.what, std::fs::read_to_string(log).unwrap_or_default());
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{} did not create {} within 30 s", server.what, path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What one guest printed.
#[derive(Default)]
struct GuestReport {
    size_sectors: Option<u64>,
    clock: String,
    marker: String,
    first_mib: String,
    /// (case, bytes, ios, ns)
    cases: Vec<(String, u64, u64, u64)>,
    end: bool,
}

fn parse_console(text: &str) -> anyhow::Result<GuestReport> {
    let mut r = GuestReport::default();
    for line in text.lines() {
        let Some(rest) = line.trim_end_matches('\r').split_once(LINE_PREFIX).map(|(_, r)| r.trim()) else {
            continue;
        };
        if let Some(e) = rest.strip_prefix("error") {
            bail!("the guest failed:{e}");
        }
        if rest == "end" {
            r.end = true;
            continue;
        }
        let mut case = None;
        let (mut bytes, mut ios, mut ns) = (None, None, None);
        for kv in rest.split_whitespace() {
            let Some((k, v)) = kv.split_once('=') else { continue };
            match k {
                "clock" => r.clock = v.to_string(),
                "size" => r.size_sectors = v.parse().ok(),
                "marker" => r.marker = v.to_string(),
                "first_mib" => r.first_mib = v.to_string(),
                "case" => case = Some(v.to_string()),
                "bytes" => bytes = v.parse().ok(),
                "ios" => ios = v.parse().ok(),
                "ns" => ns = v.parse().ok(),
                _ => {}
            }
        }
        if let Some(c) = case {
            match (bytes, ios, ns) {
                (Some(b), Some(n), Some(t)) if t > 0 => r.cases.push((c, b, n, t)),
                _ => bail!("the guest printed a malformed result line: {line:?}"),
            }
        }
    }
    Ok(r)
}

/// Boots the guest with `disk_args`, waits for it to power off, returns its console.
fn boot(image: &super::vm::rig::Image, sizes: &Sizes, disk_args: &[String], dir: &Path, system: &str) -> anyhow::Result<String> {
    let console = dir.join(format!("{system}-console.log"));
    let qlog = dir.join(format!("{system}-qemu.log"));
    let _ = std::fs::remove_file(&console);
    let mut c = Command::new("qemu-system-x86_64");
    c.args(["-machine", "q35", "-accel"])
        .arg(if super::vm::rig::accel().0 == "kvm" { "kvm" } else { "tcg,thread=multi" })
        .args(["-cpu", super::vm::rig::guest_cpu(), "-smp", &super::vm::rig::guest_smp(), "-m", &format!("{GUEST_MEM_MIB}M")])
        .arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={GUEST_MEM_MIB}M,share=on"))
        .args(["-numa", "node,memdev=mem"])
        .args(["-nographic", "-nodefaults", "-no-user-config", "-no-reboot"])
        .arg("-chardev")
        .arg(format!("file,id=con,path={}", console.display()))
        .args(["-serial", "chardev:con"])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initrd)
        .arg("-append")
        .arg(format!(
            "{} fido.run=\"/bin/sh /bin/fido-blk-guest.sh {} {} {} {}\"",
            image.cmdline,
            sizes.n1m,
            sizes.n4k,
            sizes.disk / 4096 - 1,
            sizes.reps
        ))
        .args(disk_args);
    let mut vm = start(c, &format!("{system} guest (QEMU)"), &qlog)?;
    let limit = Duration::from_secs(300);
    let t = Instant::now();
    loop {
        if let Some(st) = vm.child.try_wait()? {
            if !st.success() {
                bail!("{system}: QEMU exited {st}:\n{}", std::fs::read_to_string(&qlog).unwrap_or_default());
            }
            break;
        }
        fido_demo::proc::check_interrupt()?;
        if t.elapsed() > limit {
            bail!(
                "{system}: the guest did not finish within {limit:?}; console:\n{}",
                std::fs::read_to_string(&console).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("blk bench: {system}: guest booted, measured and powered off in {:.1} s", t.elapsed().as_secs_f64());
    Ok(std::fs::read_to_string(&console).unwrap_or_default())
}

/// Runs the guest cases `opts` wants; adds their records, and what was
/// skipped and why.
pub(super) fn run(
    opts: &crate::Opts,
    fido: &Path,
    broker: &Path,
    dir: &Path,
    records: &mut Vec<Record>,
    skipped: &mut Vec<&'static str>,
) -> anyhow::Result<()> {
    let wanted = |sys: &str| CASES.iter().any(|c| opts.wants(sys, c));
    if !SYSTEMS.iter().any(|s| wanted(s)) {
        return Ok(());
    }
    if !have("qemu-system-x86_64") {
        skipped.push("guest cases: qemu-system-x86_64 (apt-get install qemu-system-x86)");
        return Ok(());
    }
    let sizes = if opts.quick {
        Sizes { disk: 256 << 20, n1m: 128, n4k: 3000, reps: 3 }
    } else {
        Sizes { disk: 1 << 30, n1m: 512, n4k: 20000, reps: 5 }
    };
    let image = build_image(fido).context("the guest image (scripts/vm-image.sh)")?;
    let (accel, why) = super::vm::rig::accel();
    eprintln!("blk bench: guests run under {accel} ({why})");
    let disk = dir.join("guest-disk.img");
    let vsock = dir.join("guest-vhost.sock");
    let disk_arg = disk.display().to_string();
    let vsock_arg = vsock.display().to_string();
    for &system in SYSTEMS {
        if !wanted(system) {
            continue;
        }
        if system == "qsd-vhost" && !have("qemu-storage-daemon") {
            skipped.push("qsd-vhost: qemu-storage-daemon (apt-get install qemu-system-x86)");
            continue;
        }
        let marker = prepare_disk(&disk, sizes.disk, dir)?;
        let _ = std::fs::remove_file(&vsock);
        let mut servers: Vec<Server> = Vec::new();
        let vhost_dev = vec![
            "-chardev".to_string(),
            format!("socket,id=vb,path={vsock_arg}"),
            "-device".into(),
            "vhost-user-blk-pci,chardev=vb,num-queues=1".into(),
        ];
        let disk_args = match system {
            "fido-vhost" | "fido-vhost-ram" => {
                let log = dir.join("guest-serve.log");
                let mut c = Command::new(fido);
                c.args(["blk", "serve", "guest-disk"]).env("FIDO_BROKER", broker);
                if system == "fido-vhost-ram" {
                    c.args(["--ram", &sizes.disk.to_string()]);
                } else {
                    c.args(["--file", &disk_arg]);
                }
                let mut s = start(c, "fido blk serve (guest disk)", &log)?;
                wait_service(fido, broker, "guest-disk", &mut s, &log)?;
                servers.push(s);
                if system == "fido-vhost-ram" {
                    // What the guest and `check_disk` read of the host's
                    // pattern: the MiB after the guest's writes and the
                    // marker (the guest writes everything else it reads).
                    // Piecewise: `fido blk write` of the whole 256 MiB file
                    // runs out of its arena.
                    let pattern = dir.join("pattern.bin");
                    std::fs::write(&pattern, vec![0xa5u8; 1 << 20])?;
                    let at = (sizes.n1m << 20).to_string();
                    fido_blk_cli(fido, broker, &["write", "guest-disk", &at, "--in", &pattern.display().to_string()])?;
                    let at = (sizes.disk - 4096).to_string();
                    let marker = dir.join("marker.bin").display().to_string();
                    fido_blk_cli(fido, broker, &["write", "guest-disk", &at, "--in", &marker])?;
                }
                let log = dir.join("guest-vhost.log");
                let mut c = Command::new(fido);
                c.args(["blk", "vhost", "guest-disk", "--socket", &vsock_arg]).env("FIDO_BROKER", broker);
                let mut s = start(c, "fido blk vhost", &log)?;
                wait_log(&log, "vhost-user-blk: serving", &mut s)?;
                servers.push(s);
                vhost_dev
            }
            "qemu-virtio" => vec![
                "-object".into(),
                "iothread,id=io0".into(),
                "-drive".into(),
                format!("file={disk_arg},if=none,id=d0,format=raw,cache=writeback,aio=io_uring"),
                "-device".into(),
                "virtio-blk-pci,drive=d0,iothread=io0,num-queues=1".into(),
            ],
            _ => {
                let log = dir.join("guest-qsd.log");
                let mut c = Command::new("qemu-storage-daemon");
                c.arg("--blockdev")
                    .arg(format!("driver=file,node-name=disk,filename={disk_arg},cache.direct=off,aio=io_uring"))
                    .arg("--export")
                    .arg(format!(
                        "type=vhost-user-blk,id=exp0,node-name=disk,addr.type=unix,addr.path={vsock_arg},writable=on,num-queues=1"
                    ));
                let mut s = start(c, "qemu-storage-daemon", &log)?;
                wait_socket_file(&vsock, &mut s, &log)?;
                servers.push(s);
                vhost_dev
            }
        };
        let console = boot(&image, &sizes, &disk_args, dir, system);
        // What the guest left on the disk, for `check_disk`: the file, or
        // for a RAM disk the region read back while it still runs.
        let mut written = disk.clone();
        if system == "fido-vhost-ram" && console.is_ok() {
            written = dir.join("guest-ram-readback.img");
            let len = ((sizes.n1m + 1) << 20).to_string();
            let out = written.display().to_string();
            fido_blk_cli(fido, broker, &["read", "guest-disk", "0", &len, "--out", &out])?;
        }
        // The front end's servers stop after their guest (last started first).
        while let Some(s) = servers.pop() {
            drop(s);
        }
        let console = console?;
        let report = parse_console(&console)
            .and_then(|r| {
                if !r.end {
                    bail!("the guest did not finish its script");
                }
                if r.size_sectors != Some(sizes.disk / 512) {
                    bail!("the guest's disk has {:?} sectors, expected {}", r.size_sectors, sizes.disk / 512);
                }
                if r.marker != marker {
                    bail!("the guest read marker md5 {:?}, the host wrote {marker}", r.marker);
                }
                if r.first_mib != ZERO_MIB_MD5 {
                    bail!("the guest read back {:?} as the first MiB's md5 after writing zeros", r.first_mib);
                }
                Ok(r)
            })
            .with_context(|| format!("{system}: guest console:\n{}", tail(&console)))?;
        check_disk(&written, sizes.n1m).with_context(|| format!("{system}: the disk file after the guest"))?;
        eprintln!("blk bench: {system}: guest clock {}", report.clock);
        for case in CASES {
            if !opts.wants(system, case) {
                continue;
            }
            let mut runs: Vec<(u64, u64, u64)> =
                report.cases.iter().filter(|c| c.0 == *case).map(|c| (c.1, c.2, c.3)).collect();
            if runs.len() != sizes.reps as usize {
                bail!("{system}: the guest printed {} results for {case}, expected {}", runs.len(), sizes.reps);
            }
            runs.sort_by_key(|r| r.2);
            let (bytes, ios, ns) = runs[runs.len() / 2];
            eprintln!(
                "blk bench: {system} {case}: runs of {}: {}",
                ios,
                runs.iter().map(|r| format!("{:.3} s", r.2 as f64 / 1e9)).collect::<Vec<_>>().join(", ")
            );
            let secs = ns as f64 / 1e9;
            records.push(if case.contains("4k") {
                Record {
                    suite: SUITE.into(),
                    case: (*case).into(),
                    system: system.into(),
                    metric: "iops".into(),
                    value: ios as f64 / secs,
                    unit: "IO/s".into(),
                    p50: None,
                    p99: None,
                    n: ios,
                }
            } else {
                Record::throughput(SUITE, case, system, bytes as f64 / secs, ios)
            });
        }
    }
    let _ = std::fs::remove_file(&disk);
    Ok(())
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(25)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_guest_lines_and_refuses_malformed_ones() {
        let r = parse_console(
            "boot noise\r\nfido-blk-guest: clock=timer_list size=262144\r\n\
             fido-blk-guest: marker=abc\nfido-blk-guest: case=guest-read-1m bytes=1048576 ios=1 ns=2000\n\
             fido-blk-guest: end\n",
        )
        .unwrap();
        assert_eq!(r.size_sectors, Some(262144));
        assert_eq!(r.clock, "timer_list");
        assert_eq!(r.cases, vec![("guest-read-1m".to_string(), 1 << 20, 1, 2000)]);
        assert!(r.end);
        assert!(parse_console("fido-blk-guest: case=guest-read-1m bytes=1 ios=1 ns=0\n").is_err());
        assert!(parse_console("fido-blk-guest: case=guest-read-1m bytes=x ios=1 ns=5\n").is_err());
        assert!(parse_console("fido-blk-guest: error guest-read-1m: dd failed\n").is_err());
    }
}
