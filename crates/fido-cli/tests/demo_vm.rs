//! `fido demo --vm`: the demo pipeline with both forwarders in VMs passes
//! its checks beside virtio-net TCP, and leaves nothing behind (no QEMU, no
//! helper, no VM record, no temporary file). Boots two TCG guests once.
//! Skipped, saying why, only where QEMU is missing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use fido_test_support::wait::run_limited;

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Live processes whose command line contains `needle` (QEMU's `-name
/// guest=NAME`, the supervisors' `vm run NAME`).
fn processes_naming(needle: &str) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = text(&cmd).replace('\0', " ");
        if cmd.contains(needle) {
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
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

#[test]
fn demo_vm_passes_beside_tcp_and_leaves_nothing_behind() {
    if !fido_test_support::vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not on PATH (fido demo --vm runs its forwarders in QEMU guests)");
        return;
    }
    let image = fido_test_support::vm::image();
    let dir = tempfile::tempdir().unwrap();
    let (tmp, runtime) = (dir.path().join("tmp"), dir.path().join("run"));
    std::fs::create_dir(&tmp).unwrap();
    std::fs::create_dir(&runtime).unwrap();
    let mut cmd = Command::new(FIDO);
    cmd.args(["demo", "--vm", "--seconds", "1"])
        .env("FIDO_VM_IMAGE_DIR", &image.dir)
        // No broker there: the demo starts (and removes) its own.
        .env("FIDO_BROKER", dir.path().join("no-broker/broker.sock"))
        .env("TMPDIR", &tmp)
        // The VM records go here, so that what is left is ours to see.
        .env("XDG_RUNTIME_DIR", &runtime)
        .env_remove("RUST_LOG");
    let started = Instant::now();
    // Two TCG boots on a loaded 2-core machine, both pipelines, power-off.
    let (out, demo_pid) = run_limited(&mut cmd, Duration::from_secs(300));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "demo --vm failed ({}):\n{stdout}\n{stderr}", out.status);
    eprintln!("demo --vm took {:.1} s\n{stdout}\n{stderr}", started.elapsed().as_secs_f64());

    for want in [
        "[ ok ] sequence",
        "[ ok ] delivered = sent",
        "[ ok ] checksum",
        "[ ok ] pointer unchanged",
        "[ ok ] bytes copied: 0 B over 4 domains",
        &format!("[ ok ] fwd1 (VM demo-vm1-{demo_pid}) forwarded all"),
        &format!("[ ok ] fwd2 (VM demo-vm2-{demo_pid}) forwarded all"),
        "[ ok ] TCP checksum",
        "[ ok ] TCP delivered = sent",
        "[ ok ] VMs powered off",
        "virtio-net TCP",
        "fido / TCP",
        "latency p50",
        "result: PASS",
    ] {
        assert!(stdout.contains(want), "missing `{want}` in:\n{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // Every domain's row of the per-domain table, the guests' included,
    // says 0 bytes copied, and the guests' forwarders moved messages.
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("role "))
        .skip(1)
        .take(4)
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in &rows {
        let cols: Vec<&str> = row.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        // role, domain, pid, messages, GB/s, msgs/s, bytes copied, rung, suppressed
        assert_eq!(cols.len(), 9, "{row}");
        assert!(cols[3].parse::<u64>().unwrap() > 0, "no messages in {row}");
        assert_eq!(cols[6], "0", "bytes copied in {row}");
    }
    assert!(rows[1].starts_with(&format!("fwd1 (VM demo-vm1-{demo_pid})")), "{}", rows[1]);

    // Nothing left: no QEMU or supervisor of this run, no VM record, no
    // temporary file (broker socket, consoles, sockets).
    for vm in [format!("demo-vm1-{demo_pid}"), format!("demo-vm2-{demo_pid}")] {
        let left = processes_naming(&vm);
        assert!(left.is_empty(), "left running: {left:?}");
    }
    let records: Vec<String> = files_under(&runtime).into_iter().filter(|f| f.ends_with(".json")).collect();
    assert!(records.is_empty(), "VM records left: {records:?}");
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        let namespaces = text(&out.stdout);
        assert!(!namespaces.contains(&format!("fido-demo-{demo_pid}")), "network namespace left: {namespaces}");
    }
    let tmp_left = files_under(&tmp);
    assert!(tmp_left.is_empty(), "left in TMPDIR: {tmp_left:?}");
}
