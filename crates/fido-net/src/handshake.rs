//! Setting up acceleration of one TCP connection, and learning its fate.
//!
//! The client, before its SYN leaves, binds, makes the segment and offers
//! it to the broker with its socket (`prepare_connect`); the server, at
//! accept, claims it with the accepted socket — the broker hands it over only
//! when the kernel shows the offering socket is this connection's other end
//! — maps it and marks it attached (`attach`); the client, before its first
//! byte, waits (bounded) for that mark or abandons the segment (`decide`) —
//! one CAS on the segment's state decides for both ends. The broker requests
//! are `broker`'s.
//! `active`/`attached` give the connection behind a descriptor to the data
//! path and the waits once its fate allows the ring.
//!
//! Must never: accelerate a connection both ends have not confirmed, or make
//! a program wait longer than `FIDO_NET_ATTACH_MS` for a server that never
//! attaches: any failure leaves the connection plain TCP.

use crate::addr::{fd_nonblock, in_our_netns, sock_name, Addr};
use crate::conn::Conn;
use crate::sys::{debug, errno, guard, set_errno};
use crate::{broker, config, real, seg, sockopt, stats, table};
use libc::{c_int, c_void, sockaddr, socklen_t};
use std::os::fd::IntoRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prepares acceleration of a connect to a co-located listener: binds, makes
/// the segment and offers it. `None`: stay plain TCP.
pub fn prepare_connect(fd: c_int, dst: &Addr, same: bool) -> Option<Arc<Conn>> {
    // In our namespace the broker's check of the offer against the kernel's
    // listeners is authoritative, so a listener found a moment ago is not
    // looked up again (`broker::found_recently`).
    let known = same && broker::found_recently(&dst.ip, dst.port);
    if !known && broker::find_listener(&dst.ip, dst.v4, dst.port, same).is_none() {
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
        stats::count_plain();
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
    let remote = std::net::SocketAddr::new(dst.ip.parse().ok()?, dst.port);
    let rl = config::ring_len();
    // SAFETY: creating an anonymous memfd.
    let memfd = unsafe {
        libc::memfd_create(
            c"fido-net".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
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
    // Sealed at its size: the server maps it, and a file that shrank under
    // a mapping would fault there (the broker insists on these seals).
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: sealing our own memfd (libc's fcntl: not a program descriptor).
    if unsafe { real::fcntl(memfd, libc::F_ADD_SEALS, seals as libc::c_ulong) } != 0 {
        cleanup(memfd);
        return None;
    }
    let Ok(segm) = seg::Segment::map(memfd, rl) else {
        cleanup(memfd);
        return None;
    };
    // A descriptor of the segment is kept only for a socket an exec could
    // hand on (not close-on-exec); `socket::dup_into` and `fcntl` get one
    // when the program makes it inheritable later.
    if !crate::addr::fd_cloexec(fd) {
        segm.retain(memfd);
    }
    let mut nb = [0u8; 8];
    // SAFETY: getrandom into a local buffer.
    unsafe { libc::getrandom(nb.as_mut_ptr() as *mut c_void, 8, 0) };
    let nonce = u64::from_ne_bytes(nb);
    segm.init(nonce);
    segm.side(seg::CLIENT)
        .pid
        .store(std::process::id(), Ordering::Relaxed);
    let offered = broker::offer(fd, memfd, remote, nonce, rl);
    // The broker holds the segment now and the mapping is ours: the
    // descriptor would only take a number from the program's budget.
    cleanup(memfd);
    let offer = match offered {
        Ok(id) => id,
        Err(why) => {
            broker::forget_found(&dst.ip, dst.port);
            debug!("connect fd {fd}: request refused ({why}): plain TCP");
            stats::count_plain();
            return None;
        }
    };
    debug!(
        "connect fd {fd} {}:{} -> {}:{}: offered (offer {offer})",
        local.ip, local.port, dst.ip, dst.port
    );
    Some(Arc::new(Conn::new(
        segm,
        seg::CLIENT,
        fd_nonblock(fd),
        true,
        Some(offer),
        false,
        format!("{}:{}", local.ip, local.port),
        format!("{}:{}", dst.ip, dst.port),
    )))
}

/// Server side: attach to the client's segment if it asked for acceleration.
/// Any failure leaves the connection plain TCP: the client, not seeing the
/// attach, abandons the segment before its first byte.
pub fn attach(nfd: c_int, flags: c_int) {
    let Some(peer) = sock_name(nfd, true) else {
        return;
    };
    // A peer neither in our namespace nor behind a direct veth cannot be
    // under fido on this host: not worth a broker round trip.
    if !peer.loopback && in_our_netns(&peer.ip).is_none() {
        return;
    }
    let Some(local) = sock_name(nfd, false) else {
        return;
    };
    let claim = match broker::claim(nfd) {
        Ok(c) => c,
        Err(why) => {
            debug!(
                "accept fd {nfd}: no offer for {}:{} <- {}:{} ({why})",
                local.ip, local.port, peer.ip, peer.port
            );
            stats::count_plain();
            return;
        }
    };
    let ring_len = claim.ring_len as usize;
    let mfd = claim.segment.into_raw_fd();
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    let ok = config::valid_ring_len(ring_len)
        && unsafe { libc::fstat(mfd, &mut st) } == 0
        && st.st_size as usize == seg::seg_len(ring_len);
    let segm = if ok {
        seg::Segment::map(mfd, ring_len).ok()
    } else {
        None
    };
    if let Some(s) = &segm {
        // Kept only for a socket an exec could hand on (see prepare_connect).
        if flags & libc::SOCK_CLOEXEC == 0 {
            s.retain(mfd);
        }
    }
    // SAFETY: our own descriptor (the mapping stays).
    unsafe { real::close(mfd) };
    let Some(segm) = segm.filter(|s| s.validate(claim.nonce)) else {
        debug!("accept fd {nfd}: segment rejected");
        return;
    };
    // The `net` policy refuses this server acceleration: abandon at once
    // (one CAS decides for both ends), so the client does not wait for an
    // attach that never comes.
    if let Some(why) = claim.refusal {
        debug!("accept fd {nfd}: {why}: plain TCP");
        let _ = segm.hdr().state.compare_exchange(
            seg::PENDING,
            seg::ABANDONED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        stats::count_plain();
        return;
    }
    segm.side(seg::SERVER).holders.store(1, Ordering::SeqCst);
    segm.side(seg::SERVER)
        .pid
        .store(std::process::id(), Ordering::Relaxed);
    // Claimed, not yet attached: the connection goes on the ring at this
    // socket's first use (`server_attach`), so a socket handed to another
    // process before any I/O (`SCM_RIGHTS`: Node's cluster, preforked
    // workers) is decided by its sender as plain TCP (`passing`) instead of
    // reaching a process that does not know the ring.
    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
    let c = Arc::new(Conn::new(
        segm,
        seg::SERVER,
        nonblock,
        false,
        None,
        true,
        format!("{}:{}", local.ip, local.port),
        format!("{}:{}", peer.ip, peer.port),
    ));
    table::insert(nfd, c);
    debug!(
        "accept fd {nfd}: claimed {}:{} <- {}:{}",
        local.ip, local.port, peer.ip, peer.port
    );
}

/// Server, at the first use of a claimed connection: attach (one CAS
/// `PENDING -> ATTACHED` decides for both ends). False: the client gave up
/// waiting, or the socket was handed away; plain TCP.
fn server_attach(c: &Conn) -> bool {
    match c.seg.hdr().state.compare_exchange(
        seg::PENDING,
        seg::ATTACHED,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            // The client may sleep on the state word (`decide`).
            crate::sys::futex_wake(&c.seg.hdr().state, u32::MAX);
            debug!("server {} <- {}: attached", c.local, c.peer);
            stats::count_accelerated();
            true
        }
        Err(now) => {
            if now == seg::ABANDONED {
                debug!("server {} <- {}: client already abandoned; plain TCP", c.local, c.peer);
                stats::count_plain();
            }
            now == seg::ATTACHED
        }
    }
}

/// The first use of `fd` by this process if it names a claimed, not yet
/// attached server connection: attach it now (poll, select, epoll_ctl and
/// shutdown call this; the data path does it through `active`).
pub fn first_use(fd: c_int) {
    if let Some(c) = table::lookup(fd) {
        if c.me == seg::SERVER && c.state() == seg::PENDING {
            let e = errno();
            if guard(false, || server_attach(&c)) {
                sockopt::take_over(fd, &c.tcp_opts);
            }
            set_errno(e);
        }
    }
}

/// The connection behind `fd`, if its data travels on a ring now.
pub fn active(fd: c_int) -> Option<Arc<Conn>> {
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
            let ring = guard(false, || decide(&c));
            if ring {
                sockopt::take_over(fd, &c.tcp_opts);
            }
            set_errno(e);
            ring.then_some(c)
        }
    }
}

/// The connection behind `fd` if its data already travels on a ring (no
/// waiting for a pending decision: a wait wrapper leaves those to the kernel).
pub fn attached(fd: c_int) -> Option<Arc<Conn>> {
    let c = table::lookup(fd)?;
    if c.me == seg::SERVER && c.state() == seg::PENDING {
        first_use(fd);
    }
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
    if c.me == seg::CLIENT && c.undecided.load(Ordering::Relaxed) {
        decide(c);
    }
    sockopt::take_over(fd, &c.tcp_opts);
}

/// Client, before its first byte: wait (bounded) for the server to
/// attach; if it does not, abandon so both ends stay plain TCP. Server, at
/// its first use: attach. Returns true when the ring is to be used.
pub fn decide(c: &Conn) -> bool {
    if c.me == seg::SERVER {
        return server_attach(c);
    }
    let h = c.seg.hdr();
    let mut st = h.state.load(Ordering::Acquire);
    if st == seg::PENDING {
        let t0 = Instant::now();
        let limit = config::attach_wait();
        let mut i = 0u32;
        let me = std::process::id();
        while st == seg::PENDING && t0.elapsed() < limit {
            // The server end was claimed by this very process (a program
            // talking to itself, one thread or several): it attaches at its
            // first use, which may come only after this write returns, so
            // attach for it now — the ring is read by this process.
            if c.seg.side(seg::SERVER).pid.load(Ordering::Relaxed) == me
                && h
                    .state
                    .compare_exchange(seg::PENDING, seg::ATTACHED, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                debug!("client {} -> {}: server end is ours: attached", c.local, c.peer);
                stats::count_accelerated();
                st = seg::ATTACHED;
                break;
            }
            if i < 1000 {
                std::hint::spin_loop();
            } else {
                // Sleep on the state word: the server's attach wakes us at
                // once (it used to be 200 µs sleeps, a quarter of a short
                // connection's whole life). The 10 ms slices bound the
                // checks below.
                let left = limit.saturating_sub(t0.elapsed()).min(Duration::from_millis(10));
                crate::sys::futex_wait(&h.state, seg::PENDING, left);
                // Our offer lived in a broker that is gone: nobody can claim
                // it any more, so do not wait out the limit.
                if broker::lost() {
                    debug!("client {} -> {}: broker lost", c.local, c.peer);
                    break;
                }
            }
            i += 1;
            st = h.state.load(Ordering::Acquire);
        }
        if st == seg::PENDING {
            st = match h.state.compare_exchange(
                seg::PENDING,
                seg::ABANDONED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    debug!(
                        "client {} -> {}: server did not attach in {:?}; plain TCP",
                        c.local, c.peer, limit
                    );
                    stats::count_plain();
                    if let Some(o) = c.offer {
                        broker::withdraw_offer(o);
                    }
                    seg::ABANDONED
                }
                Err(now) => now,
            };
        }
    }
    if st != seg::PENDING && c.undecided.swap(false, Ordering::SeqCst) && st == seg::ATTACHED {
        stats::count_accelerated();
    }
    st == seg::ATTACHED
}
