//! The `syscall(2)` interposer: a program's system calls made through libc's
//! variadic `syscall` reach the kernel with their arguments intact, whether
//! it passes fewer words than six or all six (tests/c/syscall.c checks the
//! kernel's answers, the sixth word included); an io_uring created that way
//! turns acceleration off for the process's later connections. And the
//! library's own system calls never go through its interposer.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;
use common::*;
use std::time::Duration;

#[test]
fn system_calls_through_the_interposer_keep_their_arguments() {
    let b = Broker::start();
    let exe = b.dir.path().join("fido-net-syscall");
    compile_c("syscall.c", &exe, &["-pthread"]);
    // Plain first: the probe itself is right.
    let plain = run_ok(std::process::Command::new(&exe), Duration::from_secs(60));
    assert!(plain.ends_with("done\n"), "{plain}");
    let accel = run_ok(b.accel(&exe), Duration::from_secs(60));
    assert_eq!(plain, accel, "under the preload");
    // Both ends of the connection made before io_uring_setup, none of the
    // one made after it (the process name is cut to 15 bytes).
    let (n, _, _) = b.wait_accelerated("fido-net-syscal", 2);
    assert_eq!(n, 2, "stats: {:?}", b.stats());
    assert_eq!(b.plain_local("fido-net-syscal"), 0, "{:?}", b.stats());
}

/// The library's own system calls are raw (`sys`): a call through libc's
/// `syscall` from its code would enter its own interposer.
#[test]
fn the_library_never_calls_libc_syscall_itself() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            assert!(
                !line.contains("libc::syscall("),
                "{}:{}: {line}",
                path.display(),
                i + 1
            );
        }
    }
}
