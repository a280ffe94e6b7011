//! Real users for tests that cross uids (they need root): created once if
//! missing, shared by every test that asks for the same name.

use std::process::Command;
use std::sync::Mutex;

/// Serialises `useradd` between the tests of one binary.
static USERS: Mutex<()> = Mutex::new(());

#[derive(Clone, Copy, Debug)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

fn id_of(name: &str, flag: &str) -> Option<u32> {
    let out = Command::new("id").args([flag, name]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// A system user `name` (no home, no shell), created if missing (root
/// only). `None`, with a message saying the test is skipped, without root.
pub fn test_user(name: &str) -> Option<User> {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: this test needs root (to create user {name} and run children under other uids)");
        return None;
    }
    let _g = USERS.lock().unwrap_or_else(|e| e.into_inner());
    if id_of(name, "-u").is_none() {
        let st = Command::new("useradd")
            .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name])
            .status()
            .expect("running useradd");
        // 9: created meanwhile by someone else.
        assert!(st.success() || st.code() == Some(9), "useradd {name}: {st}");
    }
    Some(User {
        uid: id_of(name, "-u").expect("uid of the test user"),
        gid: id_of(name, "-g").expect("gid of the test user"),
    })
}
