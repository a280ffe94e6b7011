//! A policy naming a group whose `/etc/group` entry is larger than any fixed
//! buffer (`getgrnam_r` used to get 64 KiB and failed with `ERANGE` on more)
//! loads. Needs root: the test creates the group with `groupadd`, lists
//! 3000 members in its line (members need not be users; `gpasswd -M` would
//! insist they were) under the shadow tools' lock, and removes it with
//! `groupdel`. Skipped, saying so, when not root or without `groupadd`.

use std::process::Command;

const MEMBERS: usize = 3000;

extern "C" {
    // <shadow.h>: the lock on the user and group files the shadow tools take.
    fn lckpwdf() -> libc::c_int;
    fn ulckpwdf() -> libc::c_int;
}

/// The group, removed again when dropped.
struct TempGroup {
    name: String,
}

impl TempGroup {
    fn create(name: &str) -> Option<TempGroup> {
        let status = Command::new("groupadd").arg(name).status().ok()?;
        assert!(status.success(), "groupadd {name}: {status}");
        Some(TempGroup {
            name: name.to_string(),
        })
    }

    /// Rewrites the group's line in /etc/group with `members`.
    fn set_members(&self, members: &[String]) {
        // SAFETY: lckpwdf takes the lock the shadow tools use; no arguments.
        assert_eq!(unsafe { lckpwdf() }, 0, "lckpwdf");
        let text = std::fs::read_to_string("/etc/group").expect("read /etc/group");
        let prefix = format!("{}:", self.name);
        let lines: Vec<String> = text
            .lines()
            .map(|l| match l.strip_prefix(&prefix) {
                // name:password:gid:members
                Some(rest) => {
                    let mut f: Vec<&str> = rest.splitn(3, ':').collect();
                    f.truncate(2);
                    format!("{prefix}{}:{}:{}", f[0], f[1], members.join(","))
                }
                None => l.to_string(),
            })
            .collect();
        std::fs::write("/etc/group", lines.join("\n") + "\n").expect("write /etc/group");
        // SAFETY: releases the lock taken above.
        unsafe { ulckpwdf() };
    }
}

impl Drop for TempGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.name).status();
    }
}

#[test]
fn a_policy_naming_a_group_larger_than_64_kib_loads() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: creating a group in /etc/group needs root");
        return;
    }
    let name = format!("fido-big-{}", std::process::id());
    let Some(group) = TempGroup::create(&name) else {
        eprintln!("skipped: groupadd is not available");
        return;
    };
    let members: Vec<String> = (0..MEMBERS)
        .map(|i| format!("fido-member-with-a-long-name-{i:05}"))
        .collect();
    group.set_members(&members);
    let entry_len: usize = members.iter().map(|m| m.len() + 1).sum();
    assert!(
        entry_len > 64 << 10,
        "the entry must outgrow the old 64 KiB buffer"
    );

    let gid = fido_broker::policy::lookup_group(&name).expect("a large group resolves");
    let policy = fido_broker::Policy::parse(&format!("[[rule]]\ngroups = [{name:?}]\n"), "test")
        .expect("a policy naming a large group loads");
    assert_eq!(policy.rules[0].gids, [gid]);
    assert!(policy.decide(12345, gid, None).is_ok());
    assert!(policy.decide(12345, gid + 1, None).is_err());
}
