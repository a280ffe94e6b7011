//! Whom a transfer is for, and the limits the engine keeps for them.
//!
//! The engine runs inside the broker, often as root. Left alone it would
//! write the caller's files with root's privileges: past the caller's
//! `RLIMIT_FSIZE`, into blocks ext4 reserves for root, past disk quotas
//! (`CAP_SYS_RESOURCE`), keeping set-id bits a write of the caller's would
//! clear (`CAP_FSETID`), and a FUSE daemon would see uid 0 asking. So every
//! read and write of a transfer is made with the caller's credentials
//! (io_uring personalities for splices, a thread that became the caller for
//! `copy_file_range`), and the file size limit, which credentials do not
//! carry, is kept by the engine itself ([`JobSpec::fsize_limit`](crate::JobSpec)).

use rustix::io::Errno;
use rustix::process::{Gid, Uid};

/// The credentials a transfer runs with: the caller's uid, gid and
/// supplementary groups as the kernel reported them for its socket
/// (`SO_PEERCRED`, `SO_PEERGROUPS`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Caller {
    /// Does the engine need to act as someone else for this caller? Only a
    /// root engine holds privileges to drop; a caller that is root itself, or
    /// an engine running as the caller's uid, has nothing to gain.
    pub(crate) fn needs_own_credentials(&self) -> bool {
        rustix::process::geteuid().is_root() && self.uid != 0
    }

    /// Turns the calling thread into this caller for good: its groups, gid
    /// and uid (real, effective and saved; per thread, the raw system calls),
    /// which also empties its capability sets. Checked: a thread that kept a
    /// capability is an error, never used.
    pub(crate) fn become_on_this_thread(&self) -> Result<(), Errno> {
        let groups: Vec<Gid> = self.groups.iter().map(|g| Gid::from_raw(*g)).collect();
        let (uid, gid) = (Uid::from_raw(self.uid), Gid::from_raw(self.gid));
        rustix::thread::set_thread_groups(&groups)?;
        rustix::thread::set_thread_res_gid(gid, gid, gid)?;
        rustix::thread::set_thread_res_uid(uid, uid, uid)?;
        let caps = rustix::thread::capabilities(None)?;
        if !caps.effective.is_empty() || !caps.permitted.is_empty() {
            return Err(Errno::PERM);
        }
        Ok(())
    }
}
