//! What the C-example test binaries share: building libfido.so and linking
//! an example against it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile>/deps/<test>-XXXX -> target/<profile>
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// `cargo test` builds this crate as an rlib only: build libfido.so (same
/// profile, same target dir) so the C program links today's code.
fn build_lib(root: &Path, lib: &Path) {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.arg("build").current_dir(root);
    // The features the whole workspace was built with (scripts/test.sh sets
    // this): with other features cargo would rebuild half the workspace first.
    match std::env::var("FIDO_TEST_CARGO_ARGS") {
        Ok(args) => cmd.args(args.split_whitespace()),
        Err(_) => cmd.args(["-p", "fido-capi", "--lib"]),
    };
    if lib.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    cmd.env("CARGO_TARGET_DIR", lib.parent().unwrap());
    let st = cmd.status().expect("run cargo build");
    assert!(st.success(), "building libfido failed");
}

/// Builds `crates/fido-capi/examples/<name>.c` against libfido.so into
/// `out/<name>` and returns its path.
pub fn build_example(name: &str, out: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = lib_dir();
    build_lib(&root, &lib);
    assert!(lib.join("libfido.so").exists(), "libfido.so not built in {}", lib.display());
    let bin = out.join(name);
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&bin)
        .arg(root.join(format!("crates/fido-capi/examples/{name}.c")))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lfido")
        .status()
        .expect("run cc");
    assert!(st.success(), "cc failed");
    bin
}
