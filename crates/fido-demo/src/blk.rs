//! `fido demo --blk`: the Fido paper's storage appliance (§3.5, §5) in one
//! command. A VM's virtio-blk disk is served by a chain of domains, each a
//! process of this binary:
//!
//! ```text
//! guest ext4 → virtio-blk (vhost-user-blk-pci, guest RAM a shared memfd)
//!   → `fido blk vhost disk` → `fido blk raid1 disk` → `fido blk serve m1|m2`
//!                                                      (a file each, in a temp dir)
//! ```
//!
//! The guest (the test image of `scripts/vm-image.sh`, with e2fsprogs
//! inside, under plain QEMU: it needs no Fido device of its own) makes an ext4 file system on `/dev/vda`, mounts
//! it, and writes a tree of files of random content, syncing as it goes.
//! Half-way, the demo kills storage domain m2 with SIGKILL; the RAID-1 goes
//! on degraded and the guest keeps writing. It records every file's SHA-256.
//! Then m2 is started again on its file, the RAID-1 resyncs the regions
//! written while it was away, and once the RAID reports itself clean the
//! guest unmounts, runs `e2fsck -fn` (must be clean), remounts and checks
//! every checksum. After the guest powered off, the demo compares the two
//! mirrors' files byte for byte. Each step is printed with its time; the
//! last line is `result: PASS` or `result: FAIL (reason)`.
//!
//! The guest's script goes over its serial console (the kernel command line
//! is too short for it and takes no double quotes): the command line's
//! `fido.run=` turns echo off, says so with an event, reads the script's
//! lines and runs it. The script reports with JSON event lines and waits on
//! the console for the demo's `go` before it checks the file system.
//!
//! What it must never do: leave anything behind (every helper is killed and
//! reaped on every path — dropped in reverse order of start — and dies with
//! this process, QEMU too, through `setpriv --pdeathsig KILL`; the
//! broker's and the demo's temporary directories, which hold every socket
//! and both mirror files, are removed), or say PASS when a step or check
//! failed.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::demo::size_str;
use crate::proc::{self, EmbeddedBroker, Kid};
use crate::vm::{self, GuestVm};

/// Each mirror's size (the guest's disk): room for ext4's journal and
/// inode tables beside the files, small enough to mkfs quickly under TCG.
const DISK_BYTES: u64 = 64 << 20;
/// Guest RAM, also the size of its shared memfd the back end maps.
const GUEST_MIB: u32 = 256;
/// Files the guest writes; the storage domain dies after the first half.
const FILES: u32 = 300;
/// The guest syncs after every this many files, so that block I/O keeps
/// flowing while it writes (and is in flight when a mirror dies).
const SYNC_EVERY: u32 = 10;
/// A TCG boot on a loaded 2-core machine (an idle one takes ~8 s).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
/// A helper's start, a guest step, the RAID's resync.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a helper may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

const MEMBERS: [&str; 2] = ["m1", "m2"];
const DISK: &str = "disk";

/// Bytes in MiB, one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

/// Times every line from the demo's start.
struct Clock(Instant);

impl Clock {
    fn say(&self, what: impl AsRef<str>) {
        say!("[{:6.1} s] {}", self.0.elapsed().as_secs_f64(), what.as_ref());
    }
}

/// The guest's script (busybox sh; e2fsprogs by full path: busybox sh
/// runs its own applets of the same names first): mkfs and mount, half the
/// files, a `half` event, the other half, the checksums, a `written` event;
/// then, after the demo's `go`, fsck, remount, the checksums checked, and a
/// `verified` event. A failed step is a `failed` event naming it.
fn guest_script() -> String {
    let half = FILES / 2;
    format!(
        r#"ev() {{ printf '{{"event":"%s"%s}}\n' "$1" "$2"; }}
fail() {{ ev failed ",\"step\":\"$1\""; exit 1; }}
for t in /sbin/mke2fs /sbin/e2fsck; do [ -x $t ] && [ ! -L $t ] || fail no-e2fsprogs; done
[ -b /dev/vda ] || fail no-vda
/sbin/mke2fs -q -F -t ext4 /dev/vda > /tmp/mkfs.log 2>&1 || {{ cat /tmp/mkfs.log; fail mkfs.ext4; }}
mkdir -p /mnt/d && mount -t ext4 /dev/vda /mnt/d || fail mount
ev mounted ",\"sectors\":$(cat /sys/block/vda/size)"
bytes=0
put() {{
  i=$1
  while [ $i -le $2 ]; do
    d=/mnt/d/dir$((i % 6))/sub$((i % 4))
    [ -d $d ] || mkdir -p $d || fail mkdir
    n=$(( (RANDOM % 64 + 1) * 512 - RANDOM % 512 ))
    head -c $n /dev/urandom > $d/file$i || fail write
    bytes=$((bytes + n))
    [ $((i % {SYNC_EVERY})) -ne 0 ] || sync || fail sync
    i=$((i + 1))
  done
}}
put 1 {half}
sync || fail sync
ev half ",\"files\":{half},\"bytes\":$bytes"
put {next} {FILES}
sync || fail sync
cd /mnt/d && find . -type f | sort > /tmp/list && xargs sha256sum < /tmp/list > /tmp/sums || fail sha256sum
cd /
ev written ",\"files\":$(wc -l < /tmp/sums),\"dirs\":$(find /mnt/d -mindepth 1 -type d | wc -l),\"bytes\":$bytes"
read -r go
umount /mnt/d || fail umount
/sbin/e2fsck -fn /dev/vda > /tmp/fsck.log 2>&1
rc=$?
cat /tmp/fsck.log
ev fsck ",\"rc\":$rc"
mount -t ext4 /dev/vda /mnt/d || fail remount
cd /mnt/d && sha256sum -c /tmp/sums > /tmp/check.log 2>&1
cd /
grep -v ': OK$' /tmp/check.log | head -n 5
umount /mnt/d || fail umount
ev verified ",\"ok\":$(grep -c ': OK$' /tmp/check.log),\"bad\":$(grep -vc ': OK$' /tmp/check.log),\"io_errors\":$(dmesg | grep -ciE 'i/o error|ext4-fs error|buffer i/o')"
"#,
        next = half + 1,
    )
}

/// The kernel command line's part: echo off (the script's lines must not
/// come back as output), an event to say the guest reads, then `lines`
/// lines into a file that runs. No double quotes (the command line's
/// quoting): the event's are octal escapes of printf.
fn guest_loader(lines: usize) -> String {
    format!(
        "stty -echo; printf '{{\\042event\\042:\\042script\\042}}\\n'; head -n {lines} > /tmp/demo.sh; sh /tmp/demo.sh"
    )
}

/// Checks that the image has e2fsprogs (its manifest says so).
fn check_e2fsprogs(image: &vm::Image) -> anyhow::Result<String> {
    let rebuild = format!("`bash scripts/vm-image.sh --out {}`", image.dir.display());
    match image.manifest.lines().find_map(|l| l.strip_prefix("e2fsprogs: ")) {
        Some(v) if v.starts_with("missing") => bail!(
            "the test guest image in {} has no mkfs.ext4/e2fsck: the host that built it lacks e2fsprogs. Install it (Debian: apt-get install e2fsprogs) and rebuild the image with {rebuild}",
            image.dir.display()
        ),
        Some(v) => Ok(v.trim().to_string()),
        None => bail!(
            "the test guest image in {} was built without e2fsprogs (an older scripts/vm-image.sh): rebuild it with {rebuild} (it takes mke2fs/e2fsck from the host's e2fsprogs package)",
            image.dir.display()
        ),
    }
}

/// The arguments of `fido blk ...` for a helper.
fn blk(args: &[&str]) -> Vec<String> {
    std::iter::once("blk").chain(args.iter().copied()).map(String::from).collect()
}

/// Starts a `fido blk` helper and waits for its first line, which must
/// start with `ready` (its "serving ..." line).
fn start_helper(args: Vec<String>, broker: &Path, ready: &str) -> anyhow::Result<(Kid, String)> {
    let mut kid = Kid::spawn(&args, broker)?;
    let line = kid.next_line(Instant::now() + STEP_TIMEOUT)?;
    if !line.starts_with(ready) {
        bail!("`fido {}` printed {line:?}, expected a line starting {ready:?}", args.join(" "));
    }
    Ok((kid, line))
}

/// SIGTERM, then waits for a clean exit (kills it after [`STOP_TIMEOUT`]).
fn terminate(kid: Kid, what: &str) -> anyhow::Result<()> {
    if let Some(pid) = rustix::process::Pid::from_raw(kid.pid() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    kid.finish(STOP_TIMEOUT).map(|_| ()).with_context(|| format!("stopping {what}"))
}

/// Compares the two mirrors' files; `Ok((bytes, nonzero_bytes))` when they
/// are identical, else the first offset where they differ.
fn compare_mirrors(a: &Path, b: &Path) -> anyhow::Result<Result<(u64, u64), u64>> {
    let open = |p: &Path| std::fs::File::open(p).with_context(|| format!("opening {}", p.display()));
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    if la != lb {
        return Ok(Err(la.min(lb)));
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let (mut at, mut nonzero) = (0u64, 0u64);
    while at < la {
        let n = (la - at).min(ba.len() as u64) as usize;
        fa.read_exact(&mut ba[..n]).with_context(|| format!("reading {}", a.display()))?;
        fb.read_exact(&mut bb[..n]).with_context(|| format!("reading {}", b.display()))?;
        if ba[..n] != bb[..n] {
            let first = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y).unwrap_or(0);
            return Ok(Err(at + first as u64));
        }
        nonzero += ba[..n].chunks(512).filter(|s| s.iter().any(|&x| x != 0)).map(|s| s.len() as u64).sum::<u64>();
        at += n as u64;
    }
    Ok(Ok((la, nonzero)))
}

/// What the run found, for the checks.
struct Findings {
    files: u64,
    dirs: u64,
    bytes: u64,
    /// The RAID said `degraded` before the guest finished writing.
    degraded_while_writing: bool,
    /// RAID-1 state lines seen after the kill.
    raid_lines: Vec<String>,
    resynced_regions: u64,
    resync_secs: f64,
    fsck_rc: Option<i64>,
    sums_ok: u64,
    sums_bad: u64,
    io_errors: Option<u64>,
    /// `Ok((bytes, nonzero))` or the first differing offset.
    mirrors: Option<Result<(u64, u64), u64>>,
    stopped_cleanly: Result<(), String>,
}

impl Default for Findings {
    fn default() -> Self {
        Findings {
            files: 0,
            dirs: 0,
            bytes: 0,
            degraded_while_writing: false,
            raid_lines: Vec::new(),
            resynced_regions: 0,
            resync_secs: 0.0,
            fsck_rc: None,
            sums_ok: 0,
            sums_bad: 0,
            io_errors: None,
            mirrors: None,
            stopped_cleanly: Ok(()),
        }
    }
}

/// A number from a guest event.
fn num(v: &Value, key: &str) -> anyhow::Result<u64> {
    v[key].as_u64().with_context(|| format!("the guest's event has no number {key:?}: {v}"))
}

/// Waits for the guest's event `want`, echoing the RAID's state lines as
/// they come (and remembering them); a `failed` event or any other event is
/// an error naming the guest's step.
fn guest_event(
    guest: &mut GuestVm,
    raid: &mut Kid,
    want: &str,
    deadline: Instant,
    clock: &Clock,
    seen: &mut Vec<String>,
) -> anyhow::Result<Value> {
    loop {
        drain_raid(raid, clock, seen)?;
        if Instant::now() > deadline {
            bail!("the guest sent no `{want}` event in time{}", guest.said());
        }
        let Some(v) = guest.poll_event(Duration::from_millis(100))? else {
            continue;
        };
        match v["event"].as_str() {
            Some(e) if e == want => return Ok(v),
            Some("failed") => bail!("the guest's step `{}` failed{}", v["step"].as_str().unwrap_or("?"), guest.said()),
            _ => bail!("the guest sent {v} while the demo waited for `{want}`{}", guest.said()),
        }
    }
}

/// The RAID's next state line (`raid disk: state=...`) within `wait`,
/// printed and remembered.
fn raid_line(raid: &mut Kid, wait: Duration, clock: &Clock, seen: &mut Vec<String>) -> anyhow::Result<Option<String>> {
    let Some(line) = raid.poll_line(wait)? else {
        return Ok(None);
    };
    let state = line.strip_prefix(&format!("raid {DISK}: ")).unwrap_or(&line).to_string();
    clock.say(format!("RAID-1: {state}"));
    seen.push(state.clone());
    Ok(Some(state))
}

/// Prints the RAID's state lines that came.
fn drain_raid(raid: &mut Kid, clock: &Clock, seen: &mut Vec<String>) -> anyhow::Result<()> {
    while raid_line(raid, Duration::ZERO, clock, seen)?.is_some() {}
    Ok(())
}

/// Waits until the RAID prints a state line starting `state=WANT`.
fn raid_state(raid: &mut Kid, want: &str, deadline: Instant, clock: &Clock, seen: &mut Vec<String>) -> anyhow::Result<()> {
    let prefix = format!("state={want} ");
    loop {
        if Instant::now() > deadline {
            bail!("the RAID-1 did not become {want} in time (last state: {:?})", seen.last());
        }
        if raid_line(raid, Duration::from_millis(100), clock, seen)?.is_some_and(|l| l.starts_with(&prefix)) {
            return Ok(());
        }
    }
}

/// `fido blk raid-status disk`'s `key=value` lines.
fn raid_status(broker: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let mut kid = Kid::spawn(&blk(&["raid-status", DISK]), broker)?;
    let mut out = Vec::new();
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match kid.next_line(deadline) {
            Ok(line) => {
                if let Some((k, v)) = line.split_once('=') {
                    out.push((k.to_string(), v.to_string()));
                }
            }
            Err(_) if !out.is_empty() => break,
            Err(e) => return Err(e),
        }
    }
    kid.finish(STOP_TIMEOUT)?;
    Ok(out)
}

/// Runs the appliance; the findings, or the step that failed. Everything it
/// started is gone when it returns.
fn appliance(image: &vm::Image, clock: &Clock, f: &mut Findings) -> anyhow::Result<()> {
    let broker = EmbeddedBroker::start("fido-demo-blk-")?;
    let bsock = broker.socket().to_path_buf();
    let dir = tempfile::Builder::new().prefix("fido-demo-blk-").tempdir().context("creating a temporary directory")?;
    clock.say(format!("broker: embedded, at {}; files and sockets in {}", bsock.display(), dir.path().display()));

    // Two storage domains, each a file (zeros: the mirrors start identical).
    let files: Vec<PathBuf> = MEMBERS.iter().map(|m| dir.path().join(format!("{m}.img"))).collect();
    for p in &files {
        let file = std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
        file.set_len(DISK_BYTES).with_context(|| format!("sizing {}", p.display()))?;
    }
    let serve = |i: usize| blk(&["serve", MEMBERS[i], "--file", &files[i].display().to_string(), "--arena", "256M"]);
    let mut members: [Option<Kid>; 2] = [None, None];
    for i in 0..2 {
        let (kid, _) = start_helper(serve(i), &bsock, &format!("serving blk:{} ", MEMBERS[i]))?;
        clock.say(format!("storage domain {} (pid {}): `fido blk serve {} --file {}` ({})", MEMBERS[i], kid.pid(), MEMBERS[i], files[i].display(), size_str(DISK_BYTES as usize)));
        members[i] = Some(kid);
    }
    // Both files are all zeros: the mirrors are in sync from the start.
    let (mut raid, _) = start_helper(
        blk(&["raid1", DISK, "--member", MEMBERS[0], "--member", MEMBERS[1], "--assume-clean", "--arena", "256M"]),
        &bsock,
        &format!("serving blk:{DISK} raid1 "),
    )?;
    clock.say(format!("RAID-1 domain {DISK} (pid {}): `fido blk raid1 {DISK} --member m1 --member m2 --assume-clean` (both files are zeros)", raid.pid()));
    let vhost_sock = dir.path().join("vhost.sock");
    let (vhost, _) = start_helper(
        vec!["blk".into(), "vhost".into(), DISK.into(), "--socket".into(), vhost_sock.display().to_string(), "--arena".into(), "256M".into()],
        &bsock,
        "vhost-user-blk: serving ",
    )?;
    clock.say(format!("vhost-user-blk back end (pid {}): `fido blk vhost {DISK} --socket {}`", vhost.pid(), vhost_sock.display()));

    // The VM: its RAM a shared memfd (the back end maps it), the disk.
    let script = guest_script();
    let vm_name = format!("demo-blk-{}", std::process::id());
    let qemu = [
        "-object".to_string(),
        format!("memory-backend-memfd,id=blkdemo-ram,size={GUEST_MIB}M,share=on"),
        "-numa".into(),
        "node,memdev=blkdemo-ram".into(),
        "-chardev".into(),
        format!("socket,id=blkdemo-disk,path={}", vhost_sock.display()),
        "-device".into(),
        "vhost-user-blk-pci,chardev=blkdemo-disk,num-queues=1".into(),
    ];
    let params = format!("fido.hostname={vm_name} fido.run=\"{}\"", guest_loader(script.lines().count()));
    clock.say(format!("booting VM {vm_name} (QEMU, TCG; {GUEST_MIB} MiB of RAM in a shared memfd; -device vhost-user-blk-pci: its /dev/vda)..."));
    let mut guest = GuestVm::start_qemu(&vm_name, image, &params, dir.path(), GUEST_MIB, &qemu)?;
    let mut seen = Vec::new();
    let boot_by = Instant::now() + BOOT_TIMEOUT;
    guest_event(&mut guest, &mut raid, "script", boot_by, clock, &mut seen)?;
    guest.send(script.as_bytes())?;
    clock.say("guest up; its script sent over the console");

    let v = guest_event(&mut guest, &mut raid, "mounted", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    clock.say(format!("guest: mkfs.ext4 /dev/vda ({}), mounted", size_str((num(&v, "sectors")? * 512) as usize)));
    let v = guest_event(&mut guest, &mut raid, "half", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    clock.say(format!("guest: {} files written ({}), syncing every {SYNC_EVERY}; it writes on", num(&v, "files")?, mib(num(&v, "bytes")?)));

    // kill -9 of m2 while the guest writes the second half.
    let victim = members[1].take().expect("m2 runs");
    let pid = victim.pid();
    drop(victim); // SIGKILL, reaped
    clock.say(format!("kill -9 storage domain m2 (pid {pid}) while the guest writes files {}..{FILES}", FILES / 2 + 1));
    let killed_at = seen.len();
    let v = guest_event(&mut guest, &mut raid, "written", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    f.degraded_while_writing = seen[killed_at..].iter().any(|l| l.starts_with("state=degraded "));
    (f.files, f.dirs, f.bytes) = (num(&v, "files")?, num(&v, "dirs")?, num(&v, "bytes")?);
    clock.say(format!(
        "guest: all {} files written ({} in {} directories), synced, SHA-256 of each recorded (in the guest's RAM)",
        f.files,
        mib(f.bytes),
        f.dirs
    ));
    if !f.degraded_while_writing {
        // Say what the RAID did say, then wait for it (a check fails below).
        raid_state(&mut raid, "degraded", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    }

    // m2 again, on its file: the RAID resyncs what was written without it.
    let (kid, _) = start_helper(serve(1), &bsock, "serving blk:m2 ")?;
    clock.say(format!("storage domain m2 restarted (pid {}) on {}", kid.pid(), files[1].display()));
    members[1] = Some(kid);
    let resync_from = Instant::now();
    raid_state(&mut raid, "clean", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    f.resync_secs = resync_from.elapsed().as_secs_f64();
    let status = raid_status(&bsock)?;
    let get = |k: &str| status.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    f.resynced_regions = get("resynced_regions").and_then(|v| v.parse().ok()).unwrap_or(0);
    let region = get("region").unwrap_or("?");
    clock.say(format!(
        "RAID-1 in sync {:.1} s after the restart: {} regions of {region} bytes copied from m1 to m2 (m2: {} connects, {} failed requests)",
        f.resync_secs,
        f.resynced_regions,
        get("member.1.connects").unwrap_or("?"),
        get("member.1.failures").unwrap_or("?"),
    ));
    f.raid_lines = seen[killed_at..].to_vec();

    guest.send(b"go\n")?;
    let v = guest_event(&mut guest, &mut raid, "fsck", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    let rc = v["rc"].as_i64().context("fsck event without rc")?;
    f.fsck_rc = Some(rc);
    clock.say(format!("guest: unmounted; e2fsck -fn /dev/vda: exit {rc}{}", if rc == 0 { " (clean)" } else { "" }));
    let v = guest_event(&mut guest, &mut raid, "verified", Instant::now() + STEP_TIMEOUT, clock, &mut seen)?;
    (f.sums_ok, f.sums_bad) = (num(&v, "ok")?, num(&v, "bad")?);
    f.io_errors = Some(num(&v, "io_errors")?);
    clock.say(format!(
        "guest: remounted; {} of {} checksums match ({} mismatches); {} I/O error lines in its kernel log; unmounted",
        f.sums_ok, f.files, f.sums_bad, f.io_errors.unwrap_or(0)
    ));
    guest.finish(Duration::from_secs(60)).context("the VM powering off")?;
    clock.say(format!("VM {vm_name} powered off"));

    // Stop the chain top-down, then read both mirrors from the host.
    let mut stopped = Vec::new();
    stopped.push(terminate(vhost, "fido blk vhost"));
    stopped.push(terminate(raid, "fido blk raid1"));
    for (i, m) in members.into_iter().enumerate() {
        if let Some(kid) = m {
            stopped.push(terminate(kid, &format!("fido blk serve {}", MEMBERS[i])));
        }
    }
    let errors: Vec<String> = stopped.into_iter().filter_map(|r| r.err().map(|e| format!("{e:#}"))).collect();
    f.stopped_cleanly = if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) };
    clock.say("back end, RAID-1 and storage domains stopped (SIGTERM)");
    let cmp = compare_mirrors(&files[0], &files[1])?;
    match cmp {
        Ok((bytes, nonzero)) => clock.say(format!(
            "mirrors read from the host: m1.img and m2.img identical ({} compared, {} not zero)",
            size_str(bytes as usize),
            mib(nonzero)
        )),
        Err(at) => clock.say(format!("mirrors read from the host: m1.img and m2.img DIFFER at byte {at}")),
    }
    f.mirrors = Some(cmp);
    broker.stop()?;
    dir.close().context("removing the demo's temporary directory")?;
    clock.say("broker stopped, temporary files removed");
    Ok(())
}

/// Runs `fido demo --blk`; `Ok(false)` when a step or a check failed.
pub fn run() -> anyhow::Result<bool> {
    proc::install_interrupt_flag()?;
    if !vm::have_qemu() {
        bail!("qemu-system-x86_64 is not on PATH: `fido demo --blk` boots a QEMU guest (Debian: apt-get install qemu-system-x86)");
    }
    // The guest runs busybox and e2fsprogs, not this binary's roles: any
    // build's image will do.
    let image = vm::find_image(false)?;
    let e2fsprogs = check_e2fsprogs(&image)?;
    let clock = Clock(Instant::now());
    say!("fido demo --blk: a VM's ext4 on a virtio-blk disk served by vhost-user-blk → RAID-1 → two storage domains; one is killed with SIGKILL mid-write and restarted");
    say!("  guest: the test image in {} ({e2fsprogs} inside)", image.dir.display());
    let mut f = Findings::default();
    let outcome = appliance(&image, &clock, &mut f);
    proc::check_interrupt()?;
    let elapsed = clock.0.elapsed().as_secs_f64();
    if let Err(e) = outcome {
        say!("everything stopped and removed ({elapsed:.1} s in all)");
        say!("result: FAIL ({e:#})");
        return Ok(false);
    }

    let mb = mib;
    let mut checks: Vec<(&str, bool, String)> = vec![
        (
            "guest wrote its tree",
            f.files == u64::from(FILES) && f.bytes > 0,
            format!("{} files, {} in {} directories on ext4", f.files, mb(f.bytes), f.dirs),
        ),
        (
            "degraded, guest kept writing",
            f.degraded_while_writing,
            if f.degraded_while_writing {
                "the RAID-1 went degraded after the kill -9 and before the guest's last write and sync, which succeeded".into()
            } else {
                format!("the RAID-1 did not report degraded while the guest wrote (after the kill: {:?})", f.raid_lines)
            },
        ),
        (
            "resync",
            f.resynced_regions > 0,
            format!("{} regions copied to the restarted m2, in sync {:.1} s after its restart", f.resynced_regions, f.resync_secs),
        ),
        (
            "fsck",
            f.fsck_rc == Some(0),
            format!("e2fsck -fn exit {}", f.fsck_rc.map_or("-".into(), |r| r.to_string())),
        ),
        (
            "checksums",
            f.sums_bad == 0 && f.sums_ok == f.files && f.files > 0,
            format!("{} of {} files match after the remount", f.sums_ok, f.files),
        ),
        (
            "no I/O error in the guest",
            f.io_errors == Some(0),
            format!("{} I/O error lines in the guest's kernel log", f.io_errors.map_or("-".into(), |n| n.to_string())),
        ),
    ];
    let (mirrors_ok, mirrors_detail) = match f.mirrors {
        Some(Ok((bytes, nonzero))) => (nonzero > 0, format!("m1.img = m2.img, {} compared byte for byte ({} not zero)", mb(bytes), mb(nonzero))),
        Some(Err(at)) => (false, format!("m1.img and m2.img differ at byte {at}")),
        None => (false, "not compared".into()),
    };
    checks.push(("mirrors identical", mirrors_ok, mirrors_detail));
    checks.push((
        "clean stop",
        f.stopped_cleanly.is_ok(),
        match &f.stopped_cleanly {
            Ok(()) => "the VM powered off; back end, RAID-1 and storage domains exited 0 on SIGTERM".into(),
            Err(e) => e.clone(),
        },
    ));
    say!("\nchecks:");
    for (what, ok, detail) in &checks {
        say!("  [{}] {what}: {detail}", if *ok { " ok " } else { "FAIL" });
    }
    let failed: Vec<&str> = checks.iter().filter(|c| !c.1).map(|c| c.0).collect();
    say!("({elapsed:.1} s in all)");
    if failed.is_empty() {
        say!("result: PASS");
        Ok(true)
    } else {
        say!("result: FAIL (checks failed: {})", failed.join(", "));
        Ok(false)
    }
}
