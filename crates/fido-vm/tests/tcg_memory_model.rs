//! Why every TCG guest gets two possible CPUs (`fido_vm::qemu::tcg_smp`), and
//! that the guest side refuses one that has a single one.
//!
//! `scripts/tcg-litmus.c` runs the store-buffering litmus test between this
//! process and a guest over an ivshmem-plain BAR: each side stores to its own
//! word, fences, and loads the other's; x86 forbids both loads missing both
//! stores, and Fido's ring protocol (a sleep word against a slot mark) relies
//! on exactly that. Two boots of the test guest:
//!
//! - with the `-smp` of Fido's guests: without fences the outcome shows (the
//!   harness can see it), with them it never does;
//! - with `-smp 1`: with fences it shows too under QEMU before 8.1, which
//!   drops a one-CPU guest's barriers (asserted there, printed elsewhere);
//!   and the guest's `fido` refuses to join, naming the fix.

use fido_test_support::vm::{self, BootOptions, PlainVm};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const CMD: Duration = Duration::from_secs(120);

/// Compiles scripts/tcg-litmus.c statically (it runs in the guest and here).
fn litmus_binary(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tcg-litmus.c");
    let out = dir.join("tcg-litmus");
    let status = Command::new("cc")
        .args(["-O2", "-static", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("running cc (a C compiler and static glibc, libc6-dev, are needed)");
    assert!(status.success(), "cc {} failed: {status}", src.display());
    out
}

/// QEMU's version as (major, minor).
fn qemu_version() -> (u32, u32) {
    let out = Command::new("qemu-system-x86_64").arg("--version").output().expect("qemu --version");
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap_or_else(|| panic!("no version in {text:?}"));
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// A guest with an ivshmem-plain device over `shm` (and an unserved control
/// port, so its `fido` takes itself for a Fido guest), under `-smp smp`.
fn boot(image: &vm::Image, shm: &Path, smp: Option<&str>) -> PlainVm {
    let args: Vec<String> = [
        "-object",
        &format!("memory-backend-file,id=litmus,share=on,mem-path={},size=1M", shm.display()),
        "-device",
        "ivshmem-plain,memdev=litmus",
        "-device",
        "virtio-serial-pci",
        "-chardev",
        "null,id=unserved",
        "-device",
        &format!("virtserialport,chardev=unserved,name={}", fido_proto::guest::PORT_NAME),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    vm::boot_with(
        image,
        &BootOptions {
            extra_qemu_args: args,
            smp: smp.map(str::to_string),
            ..Default::default()
        },
    )
}

/// Runs `rounds` rounds of the litmus test (fenced unless `nofence`) and
/// returns how many showed the forbidden outcome.
fn litmus(guest: &mut PlainVm, litmus: &Path, shm: &Path, rounds: u64, nofence: bool) -> u64 {
    std::fs::write(shm, vec![0u8; 1 << 20]).unwrap();
    let mode = if nofence { "nofence" } else { "" };
    let host = {
        let (litmus, shm) = (litmus.to_owned(), shm.to_owned());
        let rounds = rounds.to_string();
        std::thread::spawn(move || {
            Command::new(&litmus)
                .arg("host")
                .arg(&shm)
                .arg(&rounds)
                .arg(mode)
                .output()
                .expect("running the host side")
        })
    };
    let (code, out) = guest
        .console
        .run(&format!("/bin/tcg-litmus guest {rounds} {mode}"), CMD)
        .expect("the guest side");
    let host = host.join().unwrap();
    let text = String::from_utf8_lossy(&host.stdout);
    assert!(
        code == 0 && host.status.success(),
        "guest: exit {code} {out:?}; host: {} {text:?} {:?}",
        host.status,
        String::from_utf8_lossy(&host.stderr)
    );
    let forbidden: u64 = text
        .strip_prefix("forbidden ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("host side said {text:?}"));
    eprintln!("{} fences: forbidden {forbidden} of {rounds}", if nofence { "without" } else { "with" });
    forbidden
}

/// Runs `batch` up to three times until it counts a forbidden outcome: one
/// that is possible shows in a batch unless the two sides hardly ever ran
/// at once (a loaded machine); three empty batches are a finding.
fn until_seen(mut batch: impl FnMut() -> u64) -> u64 {
    (0..3).map(|_| batch()).find(|&n| n > 0).unwrap_or(0)
}

#[test]
fn a_tcg_guest_keeps_its_fences_only_with_two_possible_cpus() {
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let litmus_bin = litmus_binary(dir.path());
    let image = vm::image_with(&[(litmus_bin.clone(), "/bin/tcg-litmus")]);
    let shm_dir = tempfile::Builder::new().prefix("fido-litmus-").tempdir_in("/dev/shm").unwrap();
    let shm = shm_dir.path().join("bar");
    std::fs::write(&shm, vec![0u8; 1 << 20]).unwrap();

    // Fido's guests: the fences hold, and the harness sees reordering when
    // they are left out.
    eprintln!("-smp {}", vm::tcg_smp(1));
    let mut guest = boot(&image, &shm, None);
    let possible = guest.console.run_ok("cat /sys/devices/system/cpu/possible", CMD);
    assert_eq!(possible.trim(), "0-1", "Fido's TCG guest has two possible CPUs");
    let unfenced = until_seen(|| litmus(&mut guest, &litmus_bin, &shm, 200_000, true));
    assert!(unfenced > 0, "the harness never saw a store-buffering outcome without fences");
    let forbidden = litmus(&mut guest, &litmus_bin, &shm, 1_000_000, false);
    assert_eq!(forbidden, 0, "a fenced store was reordered after a load in a guest with two possible CPUs");
    drop(guest);

    // One possible CPU.
    eprintln!("-smp 1");
    let mut guest = boot(&image, &shm, Some("1"));
    let fenced = until_seen(|| litmus(&mut guest, &litmus_bin, &shm, 1_000_000, false));
    let qemu = qemu_version();
    if qemu < (8, 1) {
        assert!(fenced > 0, "QEMU {qemu:?} kept a one-CPU guest's fences: the reason for maxcpus=2 is gone");
    } else {
        eprintln!("QEMU {qemu:?}: fences of a one-CPU guest kept ({fenced} forbidden); its locked instructions are still not atomic");
    }
    let (code, out) = guest.console.run("fido guest check --name litmus", CMD).unwrap();
    assert_ne!(code, 0, "fido joined from a one-CPU TCG guest: {out}");
    assert!(
        out.contains("unsound VM") && out.contains("maxcpus=2"),
        "fido's refusal does not say why: {out}"
    );
}
