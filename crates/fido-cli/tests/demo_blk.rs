//! `fido demo --blk`: a TCG guest's ext4 on a vhost-user-blk disk served by
//! a RAID-1 of two storage domains survives `kill -9` of one mid-write (the
//! RAID goes degraded, the restarted domain is resynced, fsck is clean,
//! every checksum matches, the mirrors are identical), and the demo leaves
//! nothing behind (no QEMU, no `fido blk` helper, no socket, no file).
//! Boots one TCG guest. Skipped, saying why, only where QEMU is missing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use fido_test_support::wait::run_limited;

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Live processes whose command line or environment mentions `needle`
/// (the demo's helpers name files in its TMPDIR, and all of them have
/// FIDO_BROKER there).
fn processes_naming(needle: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let cmd = text(&std::fs::read(e.path().join("cmdline")).unwrap_or_default()).replace('\0', " ");
        let env = text(&std::fs::read(e.path().join("environ")).unwrap_or_default());
        if cmd.contains(needle) || env.contains(needle) {
            out.push((pid, cmd));
        }
    }
    out
}

fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        }
        out.push(p.display().to_string());
    }
    out
}

/// The line of `stdout` containing `what`, and its time (`[  12.3 s] ...`).
fn timed_line<'a>(stdout: &'a str, what: &str) -> (f64, &'a str) {
    let line = stdout.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no line with `{what}` in:\n{stdout}"));
    let t = line
        .strip_prefix('[')
        .and_then(|l| l.split_once(" s]"))
        .and_then(|(t, _)| t.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no time on {line:?}"));
    (t, line)
}

#[test]
fn demo_blk_survives_a_killed_mirror_and_leaves_nothing_behind() {
    if !fido_test_support::vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not on PATH (fido demo --blk boots a QEMU guest)");
        return;
    }
    // The tests' image: scripts/vm-image.sh puts the host's e2fsprogs in it.
    let image = fido_test_support::vm::image();
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let mut cmd = Command::new(FIDO);
    cmd.args(["demo", "--blk"])
        .env("FIDO_VM_IMAGE_DIR", &image.dir)
        // No broker there: the demo starts (and removes) its own.
        .env("FIDO_BROKER", dir.path().join("no-broker/broker.sock"))
        .env("TMPDIR", &tmp)
        .env_remove("RUST_LOG");
    let started = Instant::now();
    // One TCG boot (~5 s idle), mkfs, 300 files, resync, fsck: ~20 s here.
    let (out, _demo_pid) = run_limited(&mut cmd, Duration::from_secs(300));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!("demo --blk took {:.1} s\n{stdout}\n{stderr}", started.elapsed().as_secs_f64());
    assert!(out.status.success(), "demo --blk failed ({}):\n{stdout}\n{stderr}", out.status);

    for want in [
        "[ ok ] guest wrote its tree: 300 files",
        "[ ok ] degraded, guest kept writing",
        "[ ok ] resync:",
        "[ ok ] fsck: e2fsck -fn exit 0",
        "[ ok ] checksums: 300 of 300 files match",
        "[ ok ] no I/O error in the guest",
        "[ ok ] mirrors identical: m1.img = m2.img",
        "[ ok ] clean stop",
        "result: PASS",
    ] {
        assert!(stdout.contains(want), "missing `{want}` in:\n{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // The story in order: the kill, the RAID degraded, the guest done
    // writing, the restart, the RAID clean again, then fsck and checksums.
    let (t_kill, _) = timed_line(&stdout, "kill -9 storage domain m2");
    let (t_degraded, _) = timed_line(&stdout, "RAID-1: state=degraded members=m1:up,m2:down");
    let (t_written, _) = timed_line(&stdout, "guest: all 300 files written");
    let (t_restart, _) = timed_line(&stdout, "storage domain m2 restarted");
    let clean_after_restart = stdout
        .lines()
        .filter(|l| l.contains("RAID-1: state=clean members=m1:up,m2:up"))
        .filter_map(|l| l.strip_prefix('[').and_then(|l| l.split_once(" s]")).and_then(|(t, _)| t.trim().parse::<f64>().ok()))
        .any(|t| t >= t_restart);
    let (t_fsck, _) = timed_line(&stdout, "e2fsck -fn /dev/vda: exit 0 (clean)");
    assert!(t_kill <= t_degraded && t_degraded <= t_written && t_written <= t_restart && t_restart <= t_fsck, "out of order:\n{stdout}");
    assert!(clean_after_restart, "no clean RAID after the restart:\n{stdout}");
    let (_, resync) = timed_line(&stdout, "regions of 65536 bytes copied from m1 to m2");
    let regions: u64 = resync.split("after the restart: ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(regions > 0, "{resync}");

    // Nothing left: no helper or QEMU of this run (their command lines or
    // environments name our TMPDIR), no file in TMPDIR.
    let left = processes_naming(&tmp.display().to_string());
    assert!(left.is_empty(), "left running: {left:?}");
    let tmp_left = files_under(&tmp);
    assert!(tmp_left.is_empty(), "left in TMPDIR: {tmp_left:?}");
}
