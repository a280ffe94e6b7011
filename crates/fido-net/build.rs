//! Links `libfido_net.so` so that no code inside it calls its own `syscall`
//! interposer: std and parking_lot, compiled into the same object, call
//! libc's `syscall` (futex waits, among others), and in a preloaded object
//! that name resolves to this library's own definition. `--wrap=syscall`
//! sends every such reference to `__wrap_syscall` instead (`sys`), which
//! makes the system call raw. Only where the interposer is built (see the
//! `syscall` shim in lib.rs).

fn main() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if os == "linux" && (arch == "x86_64" || arch == "aarch64") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--wrap=syscall");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
