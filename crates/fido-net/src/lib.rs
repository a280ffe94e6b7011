//! `fido-net` (MMNet): a preload library (`libfido_net.so`, loaded by
//! `fido run -- CMD`) that moves the bytes of TCP connections between two
//! co-located programs, both running under Fido, onto shared-memory rings,
//! while every descriptor stays the real kernel TCP socket.
//!
//! Because the socket stays real, everything the kernel answers keeps its
//! meaning — `getsockname`/`getpeername`/socket options (Nagle and the cork
//! are answered back: `sockopt`), fork, dup, close, FIN and RST — and
//! readiness stays exact: poll/select/epoll compute it from the ring for
//! waits they see (`wait`, lazy arming), and one-byte doorbells on the TCP
//! stream make the kernel's own readiness exact otherwise (`conn`). Only the
//! payload takes the ring. Co-location is confirmed through the broker's
//! registry by both ends before the first byte (`broker`).
//!
//! What it must never do: change the behaviour of a connection it did not
//! accelerate (every call on such a descriptor goes straight to libc after one
//! table lookup), block or fail a program because the broker is missing or
//! slow (no broker: plain TCP), let a peer's corrupt segment touch memory
//! outside the ring (indices are validated; the connection is reset), or
//! panic across the C ABI.

#![allow(clippy::missing_safety_doc)]

mod broker;
mod conn;
mod inherit;
mod netns;
mod real;
mod seg;
mod sockopt;
mod table;
mod wait;

use conn::{Conn, Out};
use libc::{c_int, c_uint, c_ulong, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Default ring size per direction; `FIDO_NET_RING` (bytes, power of two,
/// 64 KiB..=64 MiB) overrides it.
const DEFAULT_RING: usize = 1 << 20;

pub(crate) fn valid_ring_len(n: usize) -> bool {
    n.is_power_of_two() && (64 << 10..=64 << 20).contains(&n)
}

fn ring_len() -> usize {
    static LEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let v = LEN.load(Ordering::Relaxed);
    if v != 0 {
        return v;
    }
    let v = std::env::var("FIDO_NET_RING")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| valid_ring_len(n))
        .unwrap_or(DEFAULT_RING);
    LEN.store(v, Ordering::Relaxed);
    v
}

/// `FIDO_NET_DEBUG=1`: one line on stderr per decision (why a connection is,
/// or is not, accelerated).
pub(crate) fn debug_on() -> bool {
    static ON: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);
    let v = ON.load(Ordering::Relaxed);
    if v != 2 {
        return v == 1;
    }
    let on = std::env::var_os("FIDO_NET_DEBUG").is_some_and(|v| v != "0");
    ON.store(on as u8, Ordering::Relaxed);
    on
}

macro_rules! debug {
    ($($t:tt)*) => {
        if $crate::debug_on() {
            let s = format!("fido-net[{}]: {}\n", std::process::id(), format_args!($($t)*));
            // SAFETY: writing a buffer to stderr.
            unsafe { libc::syscall(libc::SYS_write, 2, s.as_ptr(), s.len()) };
        }
    };
}
pub(crate) use debug;

fn set_errno(e: c_int) {
    // SAFETY: errno location of this thread.
    unsafe { *libc::__errno_location() = e };
}

fn errno() -> c_int {
    // SAFETY: errno location of this thread.
    unsafe { *libc::__errno_location() }
}

/// Runs `f`, turning a panic into an abort-free error: a bug in this library
/// must not unwind into C.
fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback)
}

// ---- constructor, fork ------------------------------------------------

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    if std::env::var_os("FIDO_NET").is_some_and(|v| v == "off" || v == "0") {
        broker::set_off();
    }
    // Read the configuration now: some programs (nginx) replace the
    // environment of the children they fork.
    broker::set_broker_path(fido::default_broker_path());
    debug_on();
    ring_len();
    conn::read_config();
    wait::read_config();
    inherit::set_owner();
    // Connections an earlier image passed across exec (FIDO_NET_INHERIT).
    guard((), inherit::adopt);
    // SAFETY: registering plain extern "C" handlers.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
}

extern "C" fn fork_prepare() {
    broker::fork_prepare();
    table::fork_prepare();
    wait::fork_prepare();
}
extern "C" fn fork_parent() {
    table::fork_parent();
    broker::fork_parent();
    guard((), wait::fork_after);
}
extern "C" fn fork_child() {
    table::fork_child();
    broker::fork_child();
    inherit::set_owner();
    guard((), wait::fork_after);
}

/// `fork`: the child holds every connection the parent holds. The holder
/// counts are raised *before* the fork so a parent closing its copy right
/// after cannot believe it was the last holder.
#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    let conns = table::all();
    for c in &conns {
        c.seg.side(c.me).holders.fetch_add(1, Ordering::SeqCst);
    }
    // SAFETY: forwarding.
    let pid = unsafe { real::fork() };
    if pid < 0 {
        for c in &conns {
            c.seg.side(c.me).holders.fetch_sub(1, Ordering::SeqCst);
        }
    }
    pid
}

// ---- addresses ----------------------------------------------------------

struct Addr {
    ip: String,
    port: u16,
    v4: bool,
    loopback: bool,
}

fn parse_addr(sa: *const sockaddr, len: socklen_t) -> Option<Addr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: reading the family of a caller-supplied sockaddr of `len` bytes.
    let fam = unsafe { (*sa).sa_family } as c_int;
    if fam == libc::AF_INET && len as usize >= std::mem::size_of::<libc::sockaddr_in>() {
        // SAFETY: checked family and length.
        let a = unsafe { &*(sa as *const libc::sockaddr_in) };
        let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        Some(Addr {
            ip: ip.to_string(),
            port: u16::from_be(a.sin_port),
            v4: true,
            loopback: ip.is_loopback() || ip.is_unspecified(),
        })
    } else if fam == libc::AF_INET6 && len as usize >= std::mem::size_of::<libc::sockaddr_in6>() {
        // SAFETY: checked family and length.
        let a = unsafe { &*(sa as *const libc::sockaddr_in6) };
        let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
        if let Some(v4) = ip.to_ipv4_mapped() {
            return Some(Addr {
                ip: v4.to_string(),
                port: u16::from_be(a.sin6_port),
                v4: true,
                loopback: v4.is_loopback(),
            });
        }
        Some(Addr {
            ip: ip.to_string(),
            port: u16::from_be(a.sin6_port),
            v4: false,
            loopback: ip.is_loopback() || ip.is_unspecified(),
        })
    } else {
        None
    }
}

fn sock_name(fd: c_int, peer: bool) -> Option<Addr> {
    // SAFETY: sockaddr_storage is large enough for any address.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let p = &mut ss as *mut _ as *mut sockaddr;
    // SAFETY: valid out-pointers.
    let r = unsafe {
        if peer {
            libc::getpeername(fd, p, &mut len)
        } else {
            libc::getsockname(fd, p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    parse_addr(p, len)
}

fn is_tcp_stream(fd: c_int) -> bool {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt into an int.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            &mut ty as *mut c_int as *mut c_void,
            &mut len,
        )
    };
    if r != 0 || ty != libc::SOCK_STREAM {
        return false;
    }
    let mut proto: c_int = 0;
    // SAFETY: as above.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PROTOCOL,
            &mut proto as *mut c_int as *mut c_void,
            &mut len,
        )
    };
    r == 0 && proto == libc::IPPROTO_TCP
}

fn fd_nonblock(fd: c_int) -> bool {
    // SAFETY: F_GETFL has no argument.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

// ---- listen / connect / accept ----------------------------------------

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::listen(fd, backlog) };
    if r == 0 && broker::enabled() && !table::is_listener(fd) {
        let e = errno();
        guard((), || {
            if is_tcp_stream(fd) {
                if let Some(a) = sock_name(fd, false) {
                    if let Some(key) = broker::publish_listener(&a.ip, a.port) {
                        table::add_listener(fd, key);
                    }
                }
            }
        });
        set_errno(e);
    }
    r
}

/// Prepares acceleration of a connect to a co-located listener: binds, makes
/// the segment and writes the request. `None`: stay plain TCP.
fn prepare_connect(fd: c_int, dst: &Addr, same: bool) -> Option<Arc<Conn>> {
    if broker::find_listener(&dst.ip, dst.v4, dst.port, same).is_none() {
        debug!(
            "connect fd {fd} to {}:{}: no listener under fido{}",
            dst.ip,
            dst.port,
            if same {
                ""
            } else {
                " that the route provably leads to"
            }
        );
        broker::count_plain();
        return None;
    }
    let mut local = sock_name(fd, false)?;
    if local.port == 0 {
        // Bind now so the request can name our port before the SYN leaves.
        // SAFETY: zeroed storage, filled as the socket's own family.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
        // SAFETY: getsockname into storage.
        if unsafe { libc::getsockname(fd, &mut ss as *mut _ as *mut sockaddr, &mut len) } != 0 {
            return None;
        }
        // Keep the family (and, for an explicit bind to an address, the
        // address); port 0 asks the kernel to choose.
        match ss.ss_family as c_int {
            libc::AF_INET => {
                // SAFETY: family checked.
                let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
                a.sin_port = 0;
            }
            libc::AF_INET6 => {
                // SAFETY: family checked.
                let a = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
                a.sin6_port = 0;
            }
            _ => return None,
        }
        // SAFETY: binding the caller's socket to its own family's any-address.
        if unsafe { libc::bind(fd, &ss as *const _ as *const sockaddr, len) } != 0 {
            return None;
        }
        local = sock_name(fd, false)?;
    }
    let rl = ring_len();
    // SAFETY: creating an anonymous memfd.
    let memfd = unsafe { libc::memfd_create(c"fido-net".as_ptr(), libc::MFD_CLOEXEC) };
    if memfd < 0 {
        return None;
    }
    let cleanup = |m: c_int| {
        // SAFETY: our own descriptor.
        unsafe { real::close(m) };
    };
    // SAFETY: sizing our own memfd.
    if unsafe { libc::ftruncate(memfd, seg::seg_len(rl) as libc::off_t) } != 0 {
        cleanup(memfd);
        return None;
    }
    let Ok(segm) = seg::Segment::map(memfd, rl) else {
        cleanup(memfd);
        return None;
    };
    segm.retain(memfd);
    let mut nb = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(nb.as_mut_ptr() as *mut c_void, 8, 0) };
    let nonce = u64::from_ne_bytes(nb);
    segm.init(nonce);
    segm.side(seg::CLIENT)
        .pid
        .store(std::process::id(), Ordering::Relaxed);
    let key = broker::request_key(&dst.ip, dst.port, local.port, broker::netns());
    debug!(
        "connect fd {fd} {}:{} -> {}:{}: requesting {key}",
        local.ip, local.port, dst.ip, dst.port
    );
    if let Err(why) = broker::write_request(&key, memfd, nonce, rl) {
        debug!("connect fd {fd}: request refused ({why}): plain TCP");
        broker::count_plain();
        cleanup(memfd);
        return None;
    }
    Some(broker::new_conn(
        segm,
        seg::CLIENT,
        fd_nonblock(fd),
        memfd,
        Some(key),
        false,
        format!("{}:{}", local.ip, local.port),
        format!("{}:{}", dst.ip, dst.port),
    ))
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let prepared = if broker::enabled() && table::lookup(fd).is_none() {
        guard(None, || {
            let mut dst = parse_addr(addr, len)?;
            // The kernel connects the unspecified address to loopback; the
            // server sees (and looks the request up by) that address.
            if dst.ip == "0.0.0.0" {
                dst.ip = "127.0.0.1".into();
            } else if dst.ip == "::" {
                dst.ip = "::1".into();
            }
            if !is_tcp_stream(fd) {
                return None;
            }
            let same = dst.loopback || in_our_netns(&dst.ip)?;
            prepare_connect(fd, &dst, same)
        })
    } else {
        None
    };
    let Some(c) = prepared else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real::connect(fd, addr, len) };
    };
    table::insert(fd, c.clone());
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::connect(fd, addr, len) };
    let e = errno();
    if r == 0 {
        c.connected.store(true, Ordering::SeqCst);
    } else if e == libc::EINPROGRESS || e == libc::EINTR {
    } else {
        // Refused, unreachable, ...: forget it; the socket is the kernel's.
        if let Some((c, _)) = table::remove(fd) {
            c.release(fd);
            if let Some(k) = &c.request_key {
                broker::delete_key(k);
            }
            // The holder count went to 0 on a socket that never carried data.
        }
    }
    set_errno(e);
    r
}

/// Is `ip` (not loopback) one of our namespace's addresses (`Some(true)`),
/// reached straight over a veth into another namespace (`Some(false)`), or
/// elsewhere (`None`: not accelerated)?
fn in_our_netns(ip: &str) -> Option<bool> {
    match netns::route(ip.parse().ok()?) {
        netns::Route::Local => Some(true),
        netns::Route::Veth { .. } => Some(false),
        netns::Route::Other => None,
    }
}

/// Server side: attach to the client's segment if it asked for acceleration.
/// Any failure leaves the connection plain TCP: the client, not seeing the
/// attach, abandons the segment before its first byte.
fn attach(nfd: c_int, flags: c_int) {
    let Some(peer) = sock_name(nfd, true) else {
        return;
    };
    let same = if peer.loopback {
        true
    } else {
        match in_our_netns(&peer.ip) {
            Some(s) => s,
            None => return,
        }
    };
    let Some(local) = sock_name(nfd, false) else {
        return;
    };
    let Some((key, req)) = broker::read_request(&local.ip, local.port, &peer.ip, peer.port, same)
    else {
        debug!(
            "accept fd {nfd}: no request for {}:{} <- {}:{}",
            local.ip, local.port, peer.ip, peer.port
        );
        broker::count_plain();
        return;
    };
    let path = format!("/proc/{}/fd/{}\0", req.pid, req.memfd);
    // SAFETY: opening a NUL-terminated path.
    let mfd = unsafe {
        libc::open(
            path.as_ptr() as *const libc::c_char,
            libc::O_RDWR | libc::O_CLOEXEC,
        )
    };
    if mfd < 0 {
        debug!(
            "accept fd {nfd}: cannot open {}: {}",
            path.trim_end_matches('\0'),
            std::io::Error::last_os_error()
        );
        return;
    }
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    let ok = unsafe { libc::fstat(mfd, &mut st) } == 0
        && st.st_size as usize == seg::seg_len(req.ring_len);
    let segm = if ok {
        seg::Segment::map(mfd, req.ring_len).ok()
    } else {
        None
    };
    if let Some(s) = &segm {
        s.retain(mfd);
    }
    // SAFETY: our own descriptor (the mapping stays).
    unsafe { real::close(mfd) };
    let Some(segm) = segm.filter(|s| s.validate(req.nonce)) else {
        debug!("accept fd {nfd}: segment rejected");
        return;
    };
    // Claim the request through the broker: the step the `net` policy
    // can refuse. Refused: abandon at once (one CAS decides for both ends),
    // so the client does not wait for an attach that never comes.
    if let Err(why) = broker::claim(&key) {
        debug!("accept fd {nfd}: {why}: plain TCP");
        let _ = segm.hdr().state.compare_exchange(
            seg::PENDING,
            seg::ABANDONED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        broker::count_plain();
        return;
    }
    segm.side(seg::SERVER).holders.store(1, Ordering::SeqCst);
    segm.side(seg::SERVER)
        .pid
        .store(std::process::id(), Ordering::Relaxed);
    if segm
        .hdr()
        .state
        .compare_exchange(
            seg::PENDING,
            seg::ATTACHED,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        // The client gave up waiting: plain TCP on both ends.
        debug!("accept fd {nfd}: client already abandoned");
        broker::count_plain();
        return;
    }
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    let c = broker::new_conn(
        segm,
        seg::SERVER,
        nonblock,
        -1,
        None,
        true,
        format!("{}:{}", local.ip, local.port),
        format!("{}:{}", peer.ip, peer.port),
    );
    sockopt::take_over(nfd, &c);
    table::insert(nfd, c);
    debug!("accept fd {nfd}: attached {key}");
    broker::count_accelerated();
}

/// `accept`/`accept4` for an interposed call.
///
/// # Safety
/// `addr` and `len` are what the program passed to `accept4(2)`: null, or
/// valid for the kernel to write a peer address of `*len` bytes.
unsafe fn accept_common(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let nfd = unsafe { real::accept4(fd, addr, len, flags) };
    if nfd >= 0 && broker::enabled() {
        let e = errno();
        guard((), || attach(nfd, flags));
        set_errno(e);
    }
    nfd
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: same contract.
    unsafe { accept_common(fd, addr, len, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: same contract.
    unsafe { accept_common(fd, addr, len, flags) }
}

// ---- data path ------------------------------------------------------------

/// The connection behind `fd`, if its data travels on a ring now.
fn active(fd: c_int) -> Option<Arc<Conn>> {
    let c = table::lookup(fd)?;
    match c.state() {
        seg::ATTACHED => {
            on_ring(fd, &c);
            Some(c)
        }
        seg::ABANDONED => {
            // Plain TCP for good: the segment descriptor is not needed.
            c.seg.drop_kept();
            None
        }
        _ => {
            if !c.connected.load(Ordering::Relaxed) {
                // A non-blocking connect in progress: the kernel answers.
                sock_name(fd, true)?;
                c.connected.store(true, Ordering::SeqCst);
            }
            let e = errno();
            let ring = guard(false, || c.decide());
            if ring {
                sockopt::take_over(fd, &c);
            }
            set_errno(e);
            ring.then_some(c)
        }
    }
}

/// The connection behind `fd` if its data already travels on a ring (no
/// waiting for a pending decision: a wait wrapper leaves those to the kernel).
fn attached(fd: c_int) -> Option<Arc<Conn>> {
    let c = table::lookup(fd)?;
    if c.state() != seg::ATTACHED || c.broken.load(Ordering::Relaxed) {
        return None;
    }
    on_ring(fd, &c);
    Some(c)
}

/// Bookkeeping owed once an attached connection is used through `fd`: a
/// client that has not yet seen the decision closes its kept request state,
/// and the real socket's Nagle and cork are taken over (`sockopt`).
fn on_ring(fd: c_int, c: &Conn) {
    if c.me == seg::CLIENT && c.memfd.load(Ordering::Relaxed) >= 0 {
        c.decide();
    }
    sockopt::take_over(fd, c);
}

/// An interposed data call on `fd`: through the ring when the connection is
/// accelerated (`ring`), else — or when the ring hands the call back to the
/// kernel — libc's (`kernel`).
fn dispatch(fd: c_int, ring: impl FnOnce(&Conn) -> Out, kernel: impl Fn() -> ssize_t) -> ssize_t {
    match active(fd) {
        None => kernel(),
        Some(c) => finish(ring(&c), kernel),
    }
}

fn finish(o: Out, kernel: impl FnOnce() -> ssize_t) -> ssize_t {
    match o {
        Out::Done(n) => n as ssize_t,
        Out::Err(e) => {
            set_errno(e);
            -1
        }
        Out::Kernel => kernel(),
    }
}

/// The program's `iovec` array as slices (`None` when `cnt` is out of range).
///
/// # Safety
/// As for `readv(2)`: `iov` points to `cnt` entries, each naming memory the
/// caller may write, none overlapping, alive for `'a`.
unsafe fn iov_mut<'a>(iov: *const iovec, cnt: c_int) -> Option<Vec<&'a mut [u8]>> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) || (cnt > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(cnt as usize);
    for i in 0..cnt as usize {
        // SAFETY: the caller passes `cnt` iovecs describing writable buffers.
        let e = unsafe { &*iov.add(i) };
        if e.iov_len > 0 {
            // SAFETY: as above.
            v.push(unsafe { std::slice::from_raw_parts_mut(e.iov_base as *mut u8, e.iov_len) });
        }
    }
    Some(v)
}

/// The program's `iovec` array as read-only slices.
///
/// # Safety
/// As for `writev(2)`: `iov` points to `cnt` entries naming readable memory
/// alive for `'a`.
unsafe fn iov_ref<'a>(iov: *const iovec, cnt: c_int) -> Option<Vec<&'a [u8]>> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) || (cnt > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(cnt as usize);
    for i in 0..cnt as usize {
        // SAFETY: the caller passes `cnt` iovecs describing readable buffers.
        let e = unsafe { &*iov.add(i) };
        if e.iov_len > 0 {
            // SAFETY: as above.
            v.push(unsafe { std::slice::from_raw_parts(e.iov_base as *const u8, e.iov_len) });
        }
    }
    Some(v)
}

fn do_recv(c: &Conn, fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> Out {
    if flags & (libc::MSG_OOB | libc::MSG_ERRQUEUE) != 0 {
        return Out::Kernel;
    }
    if n > 0 && buf.is_null() {
        return Out::Err(libc::EFAULT);
    }
    let mut bufs: Vec<&mut [u8]> = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's buffer of `n` bytes.
        vec![unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, n) }]
    };
    guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, flags))
}

fn do_send(c: &Conn, fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> Out {
    if flags & libc::MSG_OOB != 0 {
        return Out::Err(libc::EOPNOTSUPP);
    }
    if n > 0 && buf.is_null() {
        return Out::Err(libc::EFAULT);
    }
    let bufs: Vec<&[u8]> = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's buffer of `n` bytes.
        vec![unsafe { std::slice::from_raw_parts(buf as *const u8, n) }]
    };
    guard(Out::Err(libc::EIO), || c.send(fd, &bufs, flags))
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        |c| do_recv(c, fd, buf, n, 0),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::read(fd, buf, n) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure path.
        unsafe { libc::abort() };
    }
    // SAFETY: same contract.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        |c| do_recv(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::recv(fd, buf, n, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure path.
        unsafe { libc::abort() };
    }
    // SAFETY: same contract.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    match active(fd) {
        // SAFETY: forwarding.
        None => unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) },
        Some(c) => {
            let r = finish(do_recv(&c, fd, buf, n, flags), || {
                // SAFETY: forwarding.
                unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) }
            });
            if r >= 0 && !addr.is_null() && !alen.is_null() {
                // TCP reports no source address.
                // SAFETY: the caller's length out-pointer.
                unsafe { *alen = 0 };
            }
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure path.
        unsafe { libc::abort() };
    }
    // SAFETY: same contract.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::readv(fd, iov, cnt) };
    };
    // SAFETY: the caller's iovecs.
    let Some(mut bufs) = (unsafe { iov_mut(iov, cnt) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, 0));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::readv(fd, iov, cnt) })
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::recvmsg(fd, msg, flags) };
    };
    if msg.is_null() || flags & (libc::MSG_OOB | libc::MSG_ERRQUEUE) != 0 {
        // SAFETY: forwarding.
        return unsafe { real::recvmsg(fd, msg, flags) };
    }
    // SAFETY: the caller's msghdr.
    let m = unsafe { &mut *msg };
    // SAFETY: the caller's iovecs.
    let Some(mut bufs) = (unsafe { iov_mut(m.msg_iov, m.msg_iovlen as c_int) }) else {
        set_errno(libc::EMSGSIZE);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, flags));
    // SAFETY: forwarding.
    let r = finish(o, || unsafe { real::recvmsg(fd, msg, flags) });
    if r >= 0 {
        m.msg_namelen = 0;
        m.msg_controllen = 0;
        m.msg_flags = 0;
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, 0),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::write(fd, buf, n) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::send(fd, buf, n, flags) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::sendto(fd, buf, n, flags, addr, alen) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::writev(fd, iov, cnt) };
    };
    // SAFETY: the caller's iovecs.
    let Some(bufs) = (unsafe { iov_ref(iov, cnt) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.send(fd, &bufs, 0));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::writev(fd, iov, cnt) })
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::sendmsg(fd, msg, flags) };
    };
    if msg.is_null() || flags & libc::MSG_OOB != 0 {
        // SAFETY: forwarding.
        return unsafe { real::sendmsg(fd, msg, flags) };
    }
    // SAFETY: the caller's msghdr.
    let m = unsafe { &*msg };
    // SAFETY: the caller's iovecs.
    let Some(bufs) = (unsafe { iov_ref(m.msg_iov, m.msg_iovlen as c_int) }) else {
        set_errno(libc::EMSGSIZE);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.send(fd, &bufs, flags));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::sendmsg(fd, msg, flags) })
}

/// `sendfile` into an accelerated socket: the file's bytes go on the ring.
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    let Some(c) = active(out) else {
        // SAFETY: forwarding.
        return unsafe { real::sendfile(out, inp, off, count) };
    };
    // Read at an explicit offset so bytes the socket did not take are not
    // consumed from the file.
    let mut pos = if off.is_null() {
        // SAFETY: lseek on the caller's descriptor.
        let p = unsafe { libc::lseek(inp, 0, libc::SEEK_CUR) };
        if p < 0 {
            return -1;
        }
        p
    } else {
        // SAFETY: the caller's offset pointer.
        unsafe { *off }
    };
    let mut buf = Vec::new();
    let mut done: usize = 0;
    while done < count {
        // Straight from the file into the ring while it has room.
        match guard(Err(Out::Err(libc::EIO)), || {
            c.send_file_now(out, inp, pos, count - done)
        }) {
            Ok((k, eof)) => {
                done += k;
                pos += k as libc::off_t;
                if eof {
                    break;
                }
                if k > 0 {
                    continue;
                }
            }
            Err(Out::Err(e)) => {
                if done > 0 {
                    break;
                }
                set_errno(e);
                return -1;
            }
            Err(_) => {
                if done > 0 {
                    break;
                }
                // SAFETY: forwarding (the kernel reports EPIPE and friends).
                return unsafe { real::sendfile(out, inp, off, count) };
            }
        }
        if done > 0 {
            break; // the ring is full: a partial write, as TCP returns one
        }
        // Full ring before the first byte: wait for room through `send`
        // (blocking, or EAGAIN when non-blocking) with one bounce buffer.
        if buf.is_empty() {
            buf = vec![0u8; count.min(64 << 10)];
        }
        let want = (count - done).min(buf.len());
        // SAFETY: pread into our buffer.
        let n = unsafe { libc::pread(inp, buf.as_mut_ptr() as *mut c_void, want, pos) };
        if n < 0 {
            if done > 0 {
                break;
            }
            return -1;
        }
        if n == 0 {
            break;
        }
        let flags = if done > 0 { libc::MSG_DONTWAIT } else { 0 };
        let o = guard(Out::Err(libc::EIO), || {
            c.send(out, &[&buf[..n as usize]], flags)
        });
        let k = match o {
            Out::Done(k) => k,
            Out::Err(e) => {
                if done > 0 {
                    break;
                }
                set_errno(e);
                return -1;
            }
            Out::Kernel => {
                if done > 0 {
                    break;
                }
                // SAFETY: forwarding (the kernel reports EPIPE and friends).
                return unsafe { real::sendfile(out, inp, off, count) };
            }
        };
        done += k;
        pos += k as libc::off_t;
        if k < n as usize {
            break;
        }
    }
    if off.is_null() {
        // SAFETY: advancing the caller's file offset by what was sent.
        unsafe { libc::lseek(inp, pos, libc::SEEK_SET) };
    } else {
        // SAFETY: the caller's offset pointer.
        unsafe { *off = pos };
    }
    done as ssize_t
}

/// `splice` to or from an accelerated socket: the kernel would move the bytes
/// on the TCP stream (where only doorbells travel), so they go through the
/// ring instead. Into the socket: at most what the ring can take is read
/// from the pipe (nothing read is lost). Out of the socket: the bytes are
/// peeked, written to the pipe, and only what the pipe took is consumed.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let nb = flags & libc::SPLICE_F_NONBLOCK != 0;
    if let Some(c) = active(fd_out) {
        if !off_in.is_null() || !off_out.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        let room = c.free_space();
        if room == 0 && (nb || c.nonblock.load(Ordering::Relaxed)) {
            set_errno(libc::EAGAIN);
            return -1;
        }
        let want = len
            .min(64 << 10)
            .min(if room == 0 { 64 << 10 } else { room });
        let mut buf = vec![0u8; want];
        // SAFETY: reading the caller's pipe into our buffer.
        let n = unsafe { libc::read(fd_in, buf.as_mut_ptr() as *mut c_void, want) };
        if n <= 0 {
            return n;
        }
        let o = guard(Out::Err(libc::EIO), || {
            c.send(fd_out, &[&buf[..n as usize]], 0)
        });
        return match o {
            Out::Done(k) => k as ssize_t,
            Out::Err(e) => {
                set_errno(e);
                -1
            }
            Out::Kernel => {
                // The peer is gone: let the kernel report it on the socket.
                // SAFETY: writing our buffer to the caller's socket.
                unsafe {
                    real::send(
                        fd_out,
                        buf.as_ptr() as *const c_void,
                        n as usize,
                        libc::MSG_NOSIGNAL,
                    )
                }
            }
        };
    }
    if let Some(c) = active(fd_in) {
        if !off_in.is_null() || !off_out.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        let want = len.min(64 << 10);
        let mut buf = vec![0u8; want];
        let peek = if nb {
            libc::MSG_PEEK | libc::MSG_DONTWAIT
        } else {
            libc::MSG_PEEK
        };
        let n = match guard(Out::Err(libc::EIO), || {
            c.recv(fd_in, &mut [&mut buf[..]], peek)
        }) {
            Out::Done(n) => n,
            Out::Err(e) => {
                set_errno(e);
                return -1;
            }
            // SAFETY: forwarding.
            Out::Kernel => {
                return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) }
            }
        };
        if n == 0 {
            return 0;
        }
        // SAFETY: writing our buffer to the caller's pipe.
        let w = unsafe { libc::write(fd_out, buf.as_ptr() as *const c_void, n) };
        if w <= 0 {
            return w;
        }
        let mut scratch = vec![0u8; w as usize];
        let _ = guard(Out::Err(libc::EIO), || {
            c.recv(fd_in, &mut [&mut scratch[..]], libc::MSG_DONTWAIT)
        });
        return w;
    }
    // SAFETY: forwarding.
    unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: same contract (off_t is 64-bit here).
    unsafe { sendfile(out, inp, off, count) }
}

// ---- descriptors ----------------------------------------------------------

/// The close of `fd` as far as we are concerned (before the real close).
fn forget_fd(fd: c_int) {
    seg::forget_kept(fd);
    wait::forget(fd);
    if let Some((c, last)) = table::remove(fd) {
        if last {
            broker::count_closed(&c);
            if c.me == seg::CLIENT && c.state() == seg::PENDING {
                if let Some(k) = &c.request_key {
                    broker::delete_key(k);
                }
            }
            c.release(fd);
        }
    }
    if let Some(key) = table::remove_listener(fd) {
        broker::withdraw(&key);
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    guard((), || forget_fd(fd));
    // SAFETY: forwarding.
    unsafe { real::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(c) = table::lookup(fd) {
        c.shutdown(how);
    }
    // SAFETY: forwarding.
    unsafe { real::shutdown(fd, how) }
}

fn dup_into(old: c_int, new: c_int) {
    if new < 0 {
        return;
    }
    wait::duplicated(old);
    if let Some(c) = table::lookup(old) {
        table::insert(new, c);
    }
    table::dup_listener(old, new);
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::dup(fd) };
    guard((), || dup_into(fd, r));
    r
}

/// `dup2`/`dup3` for an interposed call.
///
/// # Safety
/// Same contract as `dup3(2)` (any integers are allowed; only the descriptor
/// table is touched).
unsafe fn dup2_common(old: c_int, new: c_int, flags: Option<c_int>) -> c_int {
    // SAFETY: F_GETFD probes `old` (dup2 fails with EBADF if it is invalid).
    let old_ok = unsafe { real::fcntl(old, libc::F_GETFD, 0) } >= 0;
    if old_ok && old != new {
        // dup2 closes `new` first.
        guard((), || forget_fd(new));
    }
    // SAFETY: forwarding.
    let r = unsafe {
        match flags {
            None => real::dup2(old, new),
            Some(f) => real::dup3(old, new, f),
        }
    };
    if r >= 0 && old != new {
        guard((), || dup_into(old, r));
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: same contract.
    unsafe { dup2_common(old, new, None) }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: same contract.
    unsafe { dup2_common(old, new, Some(flags)) }
}

/// `fcntl` for an interposed call.
///
/// # Safety
/// `arg` is what the program passed to `fcntl(2)` for `cmd` (for the
/// commands that take a pointer, a valid one).
unsafe fn fcntl_common(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if r >= 0 {
        match cmd {
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => guard((), || dup_into(fd, r)),
            libc::F_SETFL => {
                if let Some(c) = table::lookup(fd) {
                    c.nonblock
                        .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
                    if arg as c_int & libc::O_ASYNC != 0 {
                        // SIGIO readiness is the kernel's alone.
                        c.make_eager();
                    }
                }
            }
            _ => {}
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: same contract.
    unsafe { fcntl_common(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: same contract.
    unsafe { fcntl_common(fd, cmd, arg) }
}

/// The accelerated connection behind `fd` whose TCP options we own (see
/// `sockopt`), if any.
fn owns_opts(fd: c_int, level: c_int, name: c_int) -> Option<Arc<Conn>> {
    if !sockopt::owned(level, name) {
        return None;
    }
    table::lookup(fd).filter(|c| c.tcp_opts_taken.load(Ordering::Acquire))
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(c) = guard(None, || owns_opts(fd, level, name)) {
        // SAFETY: the program's arguments, under setsockopt's contract.
        let e = unsafe { sockopt::set(&c, name, val, len) };
        if e != 0 {
            set_errno(e);
            return -1;
        }
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real::setsockopt(fd, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET && name == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        // An error one of our peeks took from the kernel is reported here
        // once, as the kernel would have.
        // SAFETY: the program's length pointer (non-null).
        let want = unsafe { *len } as usize;
        if want >= std::mem::size_of::<c_int>() {
            if let Some(e) = table::lookup(fd).and_then(|c| c.take_kernel_err()) {
                // SAFETY: the program gave at least an int's room.
                unsafe {
                    (val as *mut c_int).write_unaligned(e);
                    *len = std::mem::size_of::<c_int>() as socklen_t;
                }
                return 0;
            }
        }
    }
    if let Some(c) = guard(None, || owns_opts(fd, level, name)) {
        // SAFETY: the program's arguments, under getsockopt's contract.
        let e = unsafe { sockopt::get(&c, name, val, len) };
        if e != 0 {
            set_errno(e);
            return -1;
        }
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real::getsockopt(fd, level, name, val, len) }
}

// ---- waiting: poll, select, epoll (readiness of lazy rings: see wait.rs) ----

/// Runs a wait wrapper; a bug in it (a panic) must not unwind into C: the
/// program sees an interrupted call, which every caller of these retries.
fn wait_guard(f: impl FnOnce() -> c_int) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_errno(libc::EINTR);
        -1
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_create(size) };
    guard((), || wait::epoll_created(r));
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_create1(flags) };
    guard((), || wait::epoll_created(r));
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
    if r == 0 {
        let e = errno();
        // SAFETY: the kernel accepted `ev` (null only for EPOLL_CTL_DEL).
        let evr = unsafe { ev.as_ref() };
        guard((), || wait::epoll_ctl_done(epfd, op, fd, evr));
        set_errno(e);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, std::ptr::null(), || {
                real::epoll_wait(epfd, evs, max, timeout)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, mask, || {
                real::epoll_pwait(epfd, evs, max, timeout, mask)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some((dl, zero)) = wait::dl_ts(ts) else {
        // SAFETY: forwarding (the kernel reports the bad timeout).
        return unsafe { real::epoll_pwait2(epfd, evs, max, ts, mask) };
    };
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, mask, || {
                real::epoll_pwait2(epfd, evs, max, ts, mask)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::poll_common(fds, n, dl, zero, std::ptr::null(), || {
                real::poll(fds, n, timeout)
            })
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some((dl, zero)) = wait::dl_ts(ts) else {
        // SAFETY: forwarding (the kernel reports the bad timeout).
        return unsafe { real::ppoll(fds, n, ts, mask) };
    };
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe { wait::poll_common(fds, n, dl, zero, mask, || real::ppoll(fds, n, ts, mask)) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if fdslen / std::mem::size_of::<libc::pollfd>() < n as usize {
        // SAFETY: libc's check, which reports the overflow and aborts.
        return unsafe { real::__poll_chk(fds, n, timeout, fdslen) };
    }
    // SAFETY: same contract as poll.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if fdslen / std::mem::size_of::<libc::pollfd>() < n as usize {
        // SAFETY: libc's check, which reports the overflow and aborts.
        return unsafe { real::__ppoll_chk(fds, n, ts, mask, fdslen) };
    }
    // SAFETY: same contract as ppoll.
    unsafe { ppoll(fds, n, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the program's timeval, if any.
    let tvv = unsafe { tv.as_ref() }.copied();
    let valid = tvv.is_none_or(|t| t.tv_sec >= 0 && (0..1_000_000).contains(&t.tv_usec));
    if valid {
        let dl = tvv.map(|t| {
            std::time::Instant::now()
                + std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000)
        });
        let zero = tvv.is_some_and(|t| t.tv_sec == 0 && t.tv_usec == 0);
        let mut fixed = None;
        let r = wait_guard(|| {
            // SAFETY: the program's sets.
            fixed = unsafe { wait::select_common(nfds, rd, wr, ex, dl, zero, std::ptr::null()) };
            fixed.unwrap_or(0)
        });
        if fixed.is_some() || r < 0 {
            if let (Some(dl), false) = (dl, tv.is_null()) {
                // Linux select reports the time left.
                let left = dl.saturating_duration_since(std::time::Instant::now());
                // SAFETY: the program's non-null timeval.
                unsafe {
                    (*tv).tv_sec = left.as_secs() as libc::time_t;
                    (*tv).tv_usec = left.subsec_micros() as libc::suseconds_t;
                }
            }
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::select(nfds, rd, wr, ex, tv) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some((dl, zero)) = wait::dl_ts(ts) {
        let mut fixed = None;
        let r = wait_guard(|| {
            // SAFETY: the program's sets and mask.
            fixed = unsafe { wait::select_common(nfds, rd, wr, ex, dl, zero, mask) };
            fixed.unwrap_or(0)
        });
        if fixed.is_some() || r < 0 {
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::pselect(nfds, rd, wr, ex, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    if let Some(c) = table::lookup(fd).filter(|c| c.state() == seg::ATTACHED) {
        match req {
            libc::FIONREAD if !arg.is_null() => {
                // SAFETY: FIONREAD's argument is an int out-pointer.
                unsafe {
                    *(arg as *mut c_int) = c.readable_bytes().min(c_int::MAX as usize) as c_int
                };
                return 0;
            }
            libc::TIOCOUTQ if !arg.is_null() => {
                // SAFETY: SIOCOUTQ's argument is an int out-pointer.
                unsafe {
                    *(arg as *mut c_int) = c.unsent_bytes().min(c_int::MAX as usize) as c_int
                };
                return 0;
            }
            libc::FIONBIO if !arg.is_null() => {
                // SAFETY: FIONBIO's argument points to an int.
                let on = unsafe { *(arg as *const c_int) } != 0;
                // SAFETY: forwarding.
                let r = unsafe { real::ioctl(fd, req, arg) };
                if r == 0 {
                    c.nonblock.store(on, Ordering::Relaxed);
                }
                return r;
            }
            _ => {}
        }
    }
    // SAFETY: forwarding.
    unsafe { real::ioctl(fd, req, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        guard((), || {
            for fd in table::fds().into_iter().chain(seg::kept_fds()) {
                if fd >= 0 && (first..=last).contains(&(fd as c_uint)) {
                    forget_fd(fd);
                }
            }
        });
    }
    // SAFETY: forwarding.
    unsafe { real::close_range(first, last, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: same semantics as close_range(low, ~0, 0).
    unsafe { close_range(low.max(0) as c_uint, c_uint::MAX, 0) };
}

/// Programs that create an io_uring may move socket I/O out of our sight:
/// new connections of this process stay plain TCP from then on. (liburing
/// enters the kernel through libc's `syscall`.)
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: libc::c_long,
    a1: libc::c_long,
    a2: libc::c_long,
    a3: libc::c_long,
    a4: libc::c_long,
    a5: libc::c_long,
    a6: libc::c_long,
) -> libc::c_long {
    if n == libc::SYS_io_uring_setup {
        broker::set_off();
    }
    guard((), || wait::raw_syscall(n));
    // SAFETY: forwarding the caller's system call (extra arguments are ignored
    // by the kernel).
    unsafe { real::syscall(n, [a1, a2, a3, a4, a5, a6]) }
}
