//! Accelerated connections across `exec` (and `posix_spawn`).
//!
//! A socket without close-on-exec survives `exec`, but the ring that carries
//! its bytes lives in the old image's memory: a new image unaware of it would
//! read doorbell bytes as data. So every exported exec entry point of libc
//! (`execve`, `execv`, `execvp`, `execvpe`, `execl`, `execlp`, `execle`,
//! `fexecve`, `execveat`, `posix_spawn`, `posix_spawnp`; glibc's internal
//! calls between them are not interposable, so each needs its own wrapper)
//! first *prepares*:
//!
//! - A connection one of whose descriptors survives gets its segment's
//!   memfd duplicated without close-on-exec, and the new image is told in
//!   `FIDO_NET_INHERIT` = `1;S<sock>,<sock inode>,<segfd>,<side>,<ring>,<nonce>,<held>,<opts taken>,<nodelay>,<cork>;…;L<fd>,<inode>;…`
//!   (one `S` per surviving descriptor, one `L` per surviving published
//!   listener). The library's constructor in the new image validates every
//!   entry (the descriptor is still that socket — same inode, TCP; the
//!   segment descriptor is a memfd of the right size whose header has our
//!   magic, version, ring size, nonce and the attached state), re-attaches,
//!   closes what it does not keep and removes the variable. A socket whose
//!   segment fails validation was accelerated, so plain TCP would be wrong
//!   too: it is reset, with a debug line. A descriptor that is no longer that
//!   socket (a spawn's file actions closed or replaced it) is left alone.
//! - A connection whose every descriptor is close-on-exec is given up by this
//!   process: stale doorbells are drained (so the kernel's close is a FIN)
//!   and its side's holder count drops (a `fork` raised it), so the peer's
//!   last-holder logic sees the truth. A RST is prepared if data is unread,
//!   as TCP would send.
//! - A still-undecided client connection that survives is abandoned (one CAS:
//!   both ends stay plain TCP), since the new image could not finish its
//!   handshake.
//!
//! If the new image will not load this library (no `LD_PRELOAD` naming it in
//! the new environment, a static executable, set-user-ID/-group or file
//! capabilities), passing state is pointless: an `exec` then resets the
//! surviving accelerated connections (clear error, never doorbells read as
//! data); a `posix_spawn` marks them close-on-exec for the spawn so the child
//! does not inherit them (the parent keeps using them).
//!
//! If the exec fails, everything is undone (holder counts, duplicates,
//! prepared resets of unread data). A `posix_spawn` raises the holder count
//! of what the child inherits, like `fork`; the child lowers it again for
//! what it does not adopt.

use crate::addr::{fd_nonblock, is_tcp_stream, sock_name};
use crate::conn::{send_reset, Conn};
use crate::sys::{debug, errno, guard, set_errno};
use crate::{broker, config, real, seg, sockopt, stats, table};
use libc::{c_char, c_int};
use std::ffi::{CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

const VAR: &str = "FIDO_NET_INHERIT";

/// The process whose holder counts this image's table stands for; a vfork
/// child (same memory, other pid) execs like a spawn.
static OWNER: AtomicU32 = AtomicU32::new(0);

pub fn set_owner() {
    OWNER.store(std::process::id(), Ordering::SeqCst);
}

#[derive(PartialEq, Clone, Copy)]
enum Kind {
    /// This process becomes the new image.
    Exec,
    /// A new process runs the new image; this one goes on.
    Spawn,
}

#[derive(Default)]
struct Undo {
    /// Duplicated segment descriptors (without close-on-exec).
    dups: Vec<c_int>,
    /// Spawn: holder counts raised for the child.
    held: Vec<Arc<Conn>>,
    /// Exec: holds given up (conn, a descriptor, RST prepared).
    released: Vec<(Arc<Conn>, c_int, bool)>,
    /// Spawn into an image without the library: close-on-exec set for the spawn.
    cloexec: Vec<c_int>,
}

fn cloexec(fd: c_int) -> bool {
    // SAFETY: F_GETFD takes no argument.
    let f = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    f >= 0 && f & libc::FD_CLOEXEC != 0
}

fn inode(fd: c_int) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Gets every accelerated connection ready for an exec (see the module
/// comment). Returns the variable's value (if any) and what to undo.
fn prepare(mut kind: Kind, loads: bool) -> (Option<String>, Undo) {
    let mut undo = Undo::default();
    let entries = table::entries();
    let listeners = table::listener_fds();
    if entries.is_empty() && listeners.is_empty() {
        return (None, undo);
    }
    if OWNER.load(Ordering::SeqCst) != std::process::id() {
        kind = Kind::Spawn; // a vfork child
    }
    // Group the descriptors by connection.
    let mut groups: Vec<(Arc<Conn>, Vec<c_int>)> = Vec::new();
    for (fd, c) in entries {
        match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &c)) {
            Some((_, fds)) => fds.push(fd),
            None => groups.push((c, vec![fd])),
        }
    }
    let mut out = String::from("1");
    for (c, fds) in groups {
        let surv: Vec<c_int> = fds.iter().copied().filter(|&fd| !cloexec(fd)).collect();
        if c.me == seg::SERVER && c.state() == seg::PENDING && !surv.is_empty() && loads {
            // A claimed connection handed to the new image (inetd style):
            // its first use is here, so the new image adopts it attached.
            // (One that cannot load the library is abandoned below: plain
            // TCP, which it can read.)
            crate::handshake::first_use(surv[0]);
        }
        if c.state() == seg::PENDING {
            if !surv.is_empty()
                && c.seg
                    .hdr()
                    .state
                    .compare_exchange(
                        seg::PENDING,
                        seg::ABANDONED,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
            {
                debug!(
                    "exec: undecided connection on fd {} abandoned: plain TCP",
                    surv[0]
                );
                stats::count_plain();
                if let Some(o) = c.offer {
                    broker::withdraw_offer(o);
                }
                continue;
            }
            if c.state() == seg::PENDING {
                continue;
            }
        }
        if c.state() != seg::ATTACHED || c.broken.load(Ordering::Relaxed) {
            continue;
        }
        let me = c.seg.side(c.me);
        if surv.is_empty() && kind == Kind::Exec {
            {
                // Give up this process's hold: the exec closes every descriptor.
                let fd = fds[0];
                c.settle_armed(fd);
                let last = me.holders.fetch_sub(1, Ordering::SeqCst) == 1;
                let rst = last && c.readable_bytes() > 0;
                if rst {
                    sockopt::linger(fd, true);
                }
                undo.released.push((c.clone(), fd, rst));
            }
            continue;
        }
        // A spawn's file actions may dup2 even a close-on-exec descriptor
        // into the child (they cannot be read back): offer every connection;
        // the child adopts the ones whose socket it finds.
        let surv = if surv.is_empty() { fds.clone() } else { surv };
        // A connection whose socket was close-on-exec when set up, or whose
        // descriptor was given back under descriptor pressure, has none
        // kept: get one from our mapping if the kernel lets us.
        if loads && c.seg.kept_fd() < 0 {
            c.seg.keep_from_mapping();
        }
        let segfd = c.seg.kept_fd();
        if !loads || segfd < 0 {
            let why = if loads {
                "its segment descriptor was not kept (descriptor pressure) and \
                 /proc/self/map_files is not open to us"
            } else {
                "the new image will not load the library"
            };
            if kind == Kind::Exec {
                debug!(
                    "exec: accelerated connection on fd {} survives but {why}: reset",
                    surv[0]
                );
                c.reset(surv[0]);
            } else {
                debug!(
                    "spawn: accelerated connection on fd {} not inherited: {why}",
                    surv[0]
                );
                for &fd in &surv {
                    if !cloexec(fd) {
                        // SAFETY: setting close-on-exec on the program's
                        // descriptor, cleared again after the spawn.
                        unsafe {
                            real::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong)
                        };
                        undo.cloexec.push(fd);
                    }
                }
            }
            continue;
        }
        // SAFETY: duplicating our own descriptor, without close-on-exec.
        let d = unsafe { real::fcntl(segfd, libc::F_DUPFD, 0) };
        if d < 0 {
            if kind == Kind::Exec {
                debug!("exec: cannot pass the segment of fd {}: reset", surv[0]);
                c.reset(surv[0]);
            }
            continue;
        }
        undo.dups.push(d);
        let held = kind == Kind::Spawn;
        if held {
            me.holders.fetch_add(1, Ordering::SeqCst);
            undo.held.push(c.clone());
        }
        let h = c.seg.hdr();
        for fd in surv {
            let Some(ino) = inode(fd) else { continue };
            // The program's TCP_NODELAY/TCP_CORK as it set them (the real
            // socket runs with Nagle and the cork off: see `sockopt`).
            let taken = c.tcp_opts.taken.load(Ordering::Acquire);
            out.push_str(&format!(
                ";S{fd},{ino},{d},{},{},{},{},{},{},{}",
                c.me,
                c.seg.ring_len(),
                h.nonce,
                held as u8,
                taken as u8,
                c.tcp_opts.app_nodelay.load(Ordering::Relaxed),
                c.tcp_opts.app_cork.load(Ordering::Relaxed)
            ));
        }
    }
    if loads {
        for fd in listeners {
            if !cloexec(fd) {
                if let Some(ino) = inode(fd) {
                    out.push_str(&format!(";L{fd},{ino}"));
                }
            }
        }
    }
    ((out.len() > 1).then_some(out), undo)
}

/// After the exec returned (it failed) or a spawn: undo what must be.
fn finish(undo: Undo, spawned: bool) {
    for d in undo.dups {
        // SAFETY: our duplicates.
        unsafe { real::close(d) };
    }
    if !spawned {
        for c in undo.held {
            c.seg.side(c.me).holders.fetch_sub(1, Ordering::SeqCst);
        }
    }
    for (c, fd, rst) in undo.released {
        c.seg.side(c.me).holders.fetch_add(1, Ordering::SeqCst);
        if rst {
            sockopt::linger(fd, false);
        }
    }
    for fd in undo.cloexec {
        // SAFETY: clearing the close-on-exec flag we set.
        unsafe { real::fcntl(fd, libc::F_SETFD, 0) };
    }
}

// ---- will the new image load us? -----------------------------------------

/// The file name of this library (`libfido_net.so`).
fn our_library() -> Option<Vec<u8>> {
    // SAFETY: all-zero is a valid Dl_info (null pointers).
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr on a function of ours, into a zeroed Dl_info.
    if unsafe { libc::dladdr(our_library as *const libc::c_void, &mut info) } == 0
        || info.dli_fname.is_null()
    {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path.
    let p = unsafe { CStr::from_ptr(info.dli_fname) };
    let name = p.to_bytes().rsplit(|&b| b == b'/').next()?;
    Some(name.to_vec())
}

/// The environment list as strings (bounded: a corrupt list is not ours to fix).
///
/// # Safety
/// `envp` is null or a NULL-terminated array of C strings.
unsafe fn env_list<'a>(envp: *const *const c_char) -> Vec<&'a CStr> {
    let mut v = Vec::new();
    if envp.is_null() {
        return v;
    }
    let mut i = 0;
    loop {
        // SAFETY: the caller's NULL-terminated array.
        let p = unsafe { *envp.add(i) };
        if p.is_null() || i > 1 << 20 {
            break;
        }
        // SAFETY: each entry is a C string.
        v.push(unsafe { CStr::from_ptr(p) });
        i += 1;
    }
    v
}

/// Does `LD_PRELOAD` in `env` name an existing file called like this
/// library? (By name, not inode: a rebuilt or upgraded library replaces the
/// file, and the new image loads whichever file the path names then.)
fn preload_names_us(env: &[&CStr]) -> bool {
    let Some(ours) = our_library() else {
        return false;
    };
    for e in env {
        let Some(v) = e.to_bytes().strip_prefix(b"LD_PRELOAD=") else {
            continue;
        };
        for part in v.split(|&b| b == b':' || b == b' ') {
            if part.rsplit(|&b| b == b'/').next() == Some(&ours[..])
                && std::path::Path::new(OsStr::from_bytes(part)).is_file()
            {
                return true;
            }
        }
    }
    false
}

/// Does the executable open as `fd` get the preload? `None`: cannot tell.
fn image_loads(fd: c_int, depth: u32) -> Option<bool> {
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if (st.st_mode & libc::S_ISUID != 0 && st.st_uid != uid)
        || (st.st_mode & libc::S_ISGID != 0 && st.st_gid != gid)
    {
        return Some(false); // AT_SECURE: the loader ignores LD_PRELOAD
    }
    // SAFETY: probing an extended attribute's size.
    let caps =
        unsafe { libc::fgetxattr(fd, c"security.capability".as_ptr(), std::ptr::null_mut(), 0) };
    if caps >= 0 {
        return Some(false);
    }
    let mut h = [0u8; 4096];
    // SAFETY: pread into our buffer.
    let n = unsafe { libc::pread(fd, h.as_mut_ptr() as *mut libc::c_void, h.len(), 0) };
    if n < 4 {
        return None;
    }
    let h = &h[..n as usize];
    if h.starts_with(b"#!") {
        if depth > 0 {
            return None;
        }
        let line = h[2..].split(|&b| b == b'\n').next()?;
        let line = std::str::from_utf8(line).ok()?.trim();
        let interp = line.split_whitespace().next()?;
        let c = CString::new(interp).ok()?;
        // SAFETY: opening the interpreter read-only.
        let ifd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if ifd < 0 {
            return None;
        }
        let r = image_loads(ifd, depth + 1);
        // SAFETY: ours.
        unsafe { real::close(ifd) };
        return r;
    }
    if !h.starts_with(b"\x7fELF") || h.len() < 64 {
        return None;
    }
    // ELF: dynamic if it has a PT_INTERP program header.
    let le = h[5] == 1;
    let rd = |o: usize, w: usize| -> Option<u64> {
        let b = h.get(o..o + w)?;
        let mut v = 0u64;
        for i in 0..w {
            let byte = if le { b[w - 1 - i] } else { b[i] };
            v = (v << 8) | byte as u64;
        }
        Some(v)
    };
    let (phoff, phentsize, phnum) = if h[4] == 2 {
        (rd(32, 8)?, rd(54, 2)?, rd(56, 2)?)
    } else {
        (rd(28, 4)?, rd(42, 2)?, rd(44, 2)?)
    };
    let mut ph = vec![0u8; (phentsize * phnum).min(1 << 16) as usize];
    // SAFETY: pread into our buffer.
    let n = unsafe {
        libc::pread(
            fd,
            ph.as_mut_ptr() as *mut libc::c_void,
            ph.len(),
            phoff as libc::off_t,
        )
    };
    if n != ph.len() as isize || phentsize < 4 {
        return None;
    }
    for i in 0..phnum as usize {
        let o = i * phentsize as usize;
        let b = &ph[o..o + 4];
        let ty = if le {
            u32::from_le_bytes(b.try_into().ok()?)
        } else {
            u32::from_be_bytes(b.try_into().ok()?)
        };
        if ty == libc::PT_INTERP {
            return Some(true);
        }
    }
    Some(false) // static
}

fn path_loads(dirfd: c_int, path: &CStr, flags: c_int) -> Option<bool> {
    // SAFETY: opening the executable read-only (an O_PATH-less open may fail
    // for an execute-only file: then we cannot tell).
    let fd = if path.to_bytes().is_empty() && flags & libc::AT_EMPTY_PATH != 0 {
        // SAFETY: duplicating the caller's descriptor.
        unsafe { libc::fcntl(dirfd, libc::F_DUPFD_CLOEXEC, 0) }
    } else {
        // SAFETY: openat on the caller's path.
        unsafe { libc::openat(dirfd, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
    };
    if fd < 0 {
        return None;
    }
    let r = image_loads(fd, 0);
    // SAFETY: ours.
    unsafe { real::close(fd) };
    r
}

/// The executable `execvp` would run for `file` (PATH search).
fn search(file: &CStr) -> Option<CString> {
    if file.to_bytes().contains(&b'/') {
        return Some(file.to_owned());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = dir.join(OsStr::from_bytes(file.to_bytes()));
        let c = CString::new(p.as_os_str().as_bytes()).ok()?;
        // SAFETY: access on a C string.
        if unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0 && p.is_file() {
            return Some(c);
        }
    }
    None
}

/// Will the new image, run with `envp`, load this library? Unknown counts as
/// yes: the state is passed, and a failing exec undoes everything.
fn loads(env: &[&CStr], image: Option<bool>) -> bool {
    preload_names_us(env) && image != Some(false)
}

// ---- the environment --------------------------------------------------------

/// `envp` without any `FIDO_NET_INHERIT`, plus `entry`. The returned vector
/// points into `envp` and `entry`.
fn with_var(env: &[&CStr], entry: Option<&CString>) -> Vec<*const c_char> {
    let mut v: Vec<*const c_char> = env
        .iter()
        .filter(|e| !e.to_bytes().starts_with(b"FIDO_NET_INHERIT="))
        .map(|e| e.as_ptr())
        .collect();
    if let Some(e) = entry {
        v.push(e.as_ptr());
    }
    v.push(std::ptr::null());
    v
}

fn environ() -> *const *const c_char {
    extern "C" {
        static environ: *const *const c_char;
    }
    // SAFETY: reading libc's environ pointer.
    unsafe { environ }
}

/// Prepares, runs `call` with the adjusted environment, undoes on failure.
fn around(
    kind: Kind,
    envp: *const *const c_char,
    image: impl FnOnce() -> Option<bool>,
    call: impl FnOnce(*const *const c_char) -> c_int,
) -> c_int {
    if table::entries().is_empty() && table::listener_fds().is_empty() {
        // Nothing accelerated: straight through (no variable can be stale:
        // the constructor removed it).
        return call(envp);
    }
    // SAFETY: the caller's environment list.
    let env = unsafe { env_list(envp) };
    let l = guard(true, || loads(&env, image()));
    let (val, undo) = guard((None, Undo::default()), || prepare(kind, l));
    let entry = val.and_then(|v| CString::new(format!("{VAR}={v}")).ok());
    let list = with_var(&env, entry.as_ref());
    let r = call(list.as_ptr());
    let e = errno();
    match kind {
        Kind::Exec => finish(undo, false),
        // posix_spawn returns 0 or an error number (not -1/errno).
        Kind::Spawn => finish(undo, r == 0),
    }
    set_errno(e);
    r
}

fn cstr<'a>(p: *const c_char) -> Option<&'a CStr> {
    // SAFETY: the caller's C string (or null).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
}

// ---- the exec family (the shims in lib.rs call these) ----------------------

pub unsafe fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    around(
        Kind::Exec,
        envp,
        || path_loads(libc::AT_FDCWD, cstr(path)?, 0),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::execve(path, argv, e) },
    )
}

pub unsafe fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: same contract, with the process's environment.
    unsafe { execve(path, argv, environ()) }
}

pub unsafe fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    around(
        Kind::Exec,
        envp,
        || path_loads(libc::AT_FDCWD, &search(cstr(file)?)?, 0),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::execvpe(file, argv, e) },
    )
}

pub unsafe fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: same contract, with the process's environment.
    unsafe { execvpe(file, argv, environ()) }
}

pub unsafe fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    around(
        Kind::Exec,
        envp,
        || image_loads(fd, 0),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::fexecve(fd, argv, e) },
    )
}

pub unsafe fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    around(
        Kind::Exec,
        envp,
        || path_loads(dirfd, cstr(path)?, flags),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::execveat(dirfd, path, argv, e, flags) },
    )
}

pub unsafe fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    around(
        Kind::Spawn,
        envp as *const *const c_char,
        || path_loads(libc::AT_FDCWD, cstr(path)?, 0),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::posix_spawn(pid, path, fa, attr, argv, e as *const *mut c_char) },
    )
}

pub unsafe fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    around(
        Kind::Spawn,
        envp as *const *const c_char,
        || path_loads(libc::AT_FDCWD, &search(cstr(file)?)?, 0),
        // SAFETY: forwarding with our environment list.
        |e| unsafe { real::posix_spawnp(pid, file, fa, attr, argv, e as *const *mut c_char) },
    )
}

/// How many argument slots the `execl*` wrappers read (see below).
pub const MAX_L: usize = 30;

/// The argument list of an `execl*` call, up to its NULL; for `execle` also
/// the environment pointer after it.
///
/// Rust cannot define C-variadic functions on stable, so the wrappers take
/// `MAX_L` pointer-sized parameters: on the Linux ABIs this library builds
/// for (x86-64 SysV, AArch64 AAPCS64), variadic pointer arguments are passed
/// exactly like fixed ones (registers, then the stack in order), so slot `i`
/// is the `i`-th argument. Slots after the terminator are never used (they
/// read the caller's frame, never written). A list longer than `MAX_L`
/// fails with E2BIG — a documented limit.
fn collect(
    args: &[*const c_char],
    with_env: bool,
) -> Option<(Vec<*const c_char>, *const *const c_char)> {
    let end = args.iter().position(|p| p.is_null())?;
    let mut v: Vec<*const c_char> = args[..end].to_vec();
    v.push(std::ptr::null());
    let env = if with_env {
        *args.get(end + 1)? as *const *const c_char
    } else {
        environ()
    };
    Some((v, env))
}

/// An `execl`-family call: `args` are the `MAX_L` argument slots its
/// wrapper received (see `collect`), `with_env` for `execle`; the argument
/// list goes to `exec` (`execve`, or `execvpe` for `execlp`).
///
/// # Safety
/// `args` holds the caller's argument list up to its NULL (and, with
/// `with_env`, the environment pointer after it), as `execl(3)` takes them.
pub unsafe fn execl(
    name: &str,
    path: *const c_char,
    args: &[*const c_char; MAX_L],
    with_env: bool,
    exec: unsafe fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int,
) -> c_int {
    let Some((argv, env)) = collect(args, with_env) else {
        debug!("{name}: more than {} arguments", MAX_L - 2);
        set_errno(libc::E2BIG);
        return -1;
    };
    // SAFETY: a NULL-terminated argument list built from the caller's.
    unsafe { exec(path, argv.as_ptr(), env) }
}

// ---- the new image ------------------------------------------------------------

struct SEntry {
    sock: c_int,
    ino: u64,
    segfd: c_int,
    side: usize,
    ring: usize,
    nonce: u64,
    held: bool,
    /// `sockopt::take_over` ran, and the program's TCP_NODELAY / TCP_CORK.
    opts: Option<(i32, i32)>,
}

fn parse_s(f: &str) -> Option<SEntry> {
    let mut it = f.split(',');
    let e = SEntry {
        sock: it.next()?.parse().ok()?,
        ino: it.next()?.parse().ok()?,
        segfd: it.next()?.parse().ok()?,
        side: it.next()?.parse().ok()?,
        ring: it.next()?.parse().ok()?,
        nonce: it.next()?.parse().ok()?,
        held: it.next()? == "1",
        opts: {
            let taken = it.next()? == "1";
            let nodelay = it.next()?.parse().ok()?;
            let cork = it.next()?.parse().ok()?;
            taken.then_some((nodelay, cork))
        },
    };
    (e.sock >= 0 && e.segfd >= 0 && e.side <= 1 && config::valid_ring_len(e.ring)).then_some(e)
}

/// (descriptor, inode) of this image's sockets: from /proc/self/fd, or —
/// without /proc — the numbers the entries name.
fn socket_fds(socks: &[SEntry]) -> Vec<(c_int, u64)> {
    let mut v = Vec::new();
    match std::fs::read_dir("/proc/self/fd") {
        Ok(dir) => {
            for d in dir.flatten().take(1 << 20) {
                let Some(fd) = d.file_name().to_str().and_then(|n| n.parse::<c_int>().ok()) else {
                    continue;
                };
                if let Ok(l) = std::fs::read_link(d.path()) {
                    let l = l.to_string_lossy();
                    if let Some(ino) = l
                        .strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .and_then(|n| n.parse::<u64>().ok())
                    {
                        v.push((fd, ino));
                    }
                }
            }
        }
        Err(_) => v.extend(socks.iter().map(|e| (e.sock, e.ino))),
    }
    v
}

/// Is `fd` still the socket `ino`, a TCP stream?
fn same_socket(fd: c_int, ino: u64) -> bool {
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
    ok && st.st_mode & libc::S_IFMT == libc::S_IFSOCK && st.st_ino == ino && is_tcp_stream(fd)
}

/// Maps and checks an inherited segment descriptor.
fn check_segment(e: &SEntry) -> Result<seg::Segment, String> {
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::fstat(e.segfd, &mut st) } != 0 {
        return Err(format!("descriptor {} is not open", e.segfd));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as usize != seg::seg_len(e.ring) {
        return Err(format!(
            "descriptor {} is not a segment of ring {}",
            e.segfd, e.ring
        ));
    }
    // Only shmem files (memfds) answer F_GET_SEALS.
    // SAFETY: F_GET_SEALS takes no argument.
    if unsafe { real::fcntl(e.segfd, libc::F_GET_SEALS, 0) } < 0 {
        return Err(format!("descriptor {} is not a memfd", e.segfd));
    }
    let s = seg::Segment::map(e.segfd, e.ring).map_err(|x| format!("mmap: {x}"))?;
    if !s.validate(e.nonce) {
        return Err("magic, version, ring size or nonce differ".into());
    }
    if s.hdr().state.load(Ordering::Acquire) != seg::ATTACHED {
        return Err("the segment is not attached".into());
    }
    if s.side(e.side).holders.load(Ordering::SeqCst) == 0 {
        return Err("our side has no holders".into());
    }
    Ok(s)
}

/// In the library's constructor: adopt what the previous image passed.
pub fn adopt() {
    let Some(v) = std::env::var_os(VAR) else {
        return;
    };
    // Removed at once: children must not see a stale list.
    // SAFETY: the constructor runs before the program's threads exist.
    unsafe { libc::unsetenv(c"FIDO_NET_INHERIT".as_ptr()) };
    let v = v.to_string_lossy().into_owned();
    let mut parts = v.split(';');
    if parts.next() != Some("1") {
        debug!("{VAR}: unknown version, ignored");
        return;
    }
    let mut socks: Vec<SEntry> = Vec::new();
    let mut listeners: Vec<(c_int, u64)> = Vec::new();
    for p in parts.take(1 << 16) {
        if let Some(f) = p.strip_prefix('S') {
            match parse_s(f) {
                Some(e) => socks.push(e),
                None => debug!("{VAR}: malformed entry {p:?}, ignored"),
            }
        } else if let Some(f) = p.strip_prefix('L') {
            let mut it = f.split(',');
            if let (Some(Ok(fd)), Some(Ok(ino))) = (
                it.next().map(str::parse::<c_int>),
                it.next().map(str::parse::<u64>),
            ) {
                listeners.push((fd, ino));
            }
        }
    }
    let sockets = socket_fds(&socks);
    // One segment descriptor per connection; several sockets may name it.
    let mut segfds: Vec<c_int> = socks.iter().map(|e| e.segfd).collect();
    segfds.sort_unstable();
    segfds.dedup();
    for segfd in segfds {
        let group: Vec<&SEntry> = socks.iter().filter(|e| e.segfd == segfd).collect();
        let first = group[0];
        let consistent = group.iter().all(|e| {
            e.side == first.side
                && e.ring == first.ring
                && e.nonce == first.nonce
                && e.held == first.held
        });
        // The sockets may sit at other numbers now (a spawn's dup2 actions):
        // every descriptor of ours that is that socket, found by inode.
        let mut mine: Vec<c_int> = Vec::new();
        for e in &group {
            for &(fd, ino) in &sockets {
                if ino == e.ino && fd != segfd && !mine.contains(&fd) && same_socket(fd, ino) {
                    mine.push(fd);
                }
            }
        }
        let seg = if consistent {
            check_segment(first)
        } else {
            Err("entries disagree".into())
        };
        match seg {
            Ok(s) if !mine.is_empty() => {
                // SAFETY: keeping the inherited descriptor, now close-on-exec.
                unsafe { real::fcntl(segfd, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong) };
                s.adopt(segfd);
                let fd = mine[0];
                let local = sock_name(fd, false)
                    .map(|a| format!("{}:{}", a.ip, a.port))
                    .unwrap_or_default();
                let peer = sock_name(fd, true)
                    .map(|a| format!("{}:{}", a.ip, a.port))
                    .unwrap_or_default();
                let c = Arc::new(Conn::new(
                    s,
                    first.side,
                    fd_nonblock(fd),
                    false,
                    None,
                    true,
                    local,
                    peer,
                ));
                if let Some((nodelay, cork)) = first.opts {
                    c.tcp_opts.app_nodelay.store(nodelay, Ordering::Relaxed);
                    c.tcp_opts.app_cork.store(cork, Ordering::Relaxed);
                    c.tcp_opts.taken.store(true, Ordering::Release);
                }
                // The new image may wait on the socket through an epoll
                // instance it inherited, which this image's wrappers never
                // saw being set up: kernel readiness must be exact on its
                // own (eager arming, see `wait`).
                c.make_eager();
                for &fd in &mine {
                    table::insert(fd, c.clone());
                }
                debug!("exec: adopted the accelerated connection on fd(s) {mine:?}");
                stats::count_inherited();
            }
            Ok(s) => {
                // None of its sockets reached us (a spawn's file actions
                // closed or replaced them): give back the child's hold.
                if first.held {
                    s.side(first.side).holders.fetch_sub(1, Ordering::SeqCst);
                }
                // SAFETY: the inherited descriptor, not the program's.
                unsafe { real::close(segfd) };
            }
            Err(why) => {
                // Close the descriptor only if it is a memfd (ours, passed
                // in): a stale or forged list must not close the program's.
                // SAFETY: F_GET_SEALS takes no argument.
                if unsafe { real::fcntl(segfd, libc::F_GET_SEALS, 0) } >= 0
                    && !group.iter().any(|e| e.sock == segfd)
                {
                    // SAFETY: a memfd passed to us.
                    unsafe { real::close(segfd) };
                }
                for &fd in &mine {
                    debug!(
                        "exec: fd {fd} was an accelerated connection but its segment is unusable ({why}): reset"
                    );
                    reset(fd);
                }
            }
        }
    }
    for (fd, ino) in listeners {
        if same_socket(fd, ino) && config::enabled() {
            if let Some(a) = sock_name(fd, false) {
                let key = broker::publish_listener(fd, &a.ip, a.port);
                table::add_listener(fd, key, broker::epoch());
            }
        }
    }
}

/// Resets a TCP connection (RST to the peer) that must not be read as
/// plain TCP.
fn reset(fd: c_int) {
    send_reset(fd);
}
