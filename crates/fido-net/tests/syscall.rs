//! The `syscall(2)` interposer: a program's system calls made through libc's
//! variadic `syscall` reach the kernel with their arguments intact, whether
//! it passes fewer words than six or all six (tests/c/syscall.c checks the
//! kernel's answers, the sixth word included); an io_uring created that way
//! turns acceleration off for the process's later connections. And no code
//! inside the library goes through its own interposer.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

use fido_test_support::mmnet::*;
use fido_test_support::wait::*;
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

/// Nothing inside the library reaches its own `syscall` interposer: its own
/// system calls are raw (`sys`), and the calls std and parking_lot make to
/// libc's `syscall` are linked to `__wrap_syscall` (build.rs). So no
/// relocation of the object may name `syscall`, which it still exports.
#[test]
fn nothing_in_the_library_calls_its_own_syscall_interposer() {
    let lib = library();
    let readelf = |arg: &str| {
        let out = std::process::Command::new("readelf")
            .args([arg, "-W"])
            .arg(&lib)
            .output()
            .expect("readelf (binutils) runs");
        assert!(out.status.success(), "readelf {arg}");
        String::from_utf8(out.stdout).unwrap()
    };
    let names_syscall = |l: &&str| l.split_whitespace().any(|w| w == "syscall");
    let relocs = readelf("-r");
    let uses: Vec<&str> = relocs.lines().filter(names_syscall).collect();
    assert!(uses.is_empty(), "relocations against syscall: {uses:#?}");
    let syms = readelf("--dyn-syms");
    assert!(
        syms.lines()
            .filter(names_syscall)
            .any(|l| l.contains("FUNC") && !l.contains("UND")),
        "the interposer is not exported:\n{syms}"
    );
}
