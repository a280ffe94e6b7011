//! What the kernel says about a socket: its addresses (parsed from
//! `sockaddr`s), whether it is a TCP stream, whether it is non-blocking, and
//! whether an address is one of this network namespace's.
//!
//! Must never: change a socket; every call here only asks (through libc's
//! definitions, never this library's interposers).

use crate::{netns, real};
use libc::{c_int, c_void, sockaddr, socklen_t};

/// A TCP endpoint: the address as text (IPv4-mapped IPv6 as IPv4).
pub struct Addr {
    pub ip: String,
    pub port: u16,
    pub v4: bool,
    pub loopback: bool,
}

pub fn parse_addr(sa: *const sockaddr, len: socklen_t) -> Option<Addr> {
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

pub fn sock_name(fd: c_int, peer: bool) -> Option<Addr> {
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

pub fn is_tcp_stream(fd: c_int) -> bool {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt into an int.
    let r = unsafe {
        real::getsockopt(
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
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PROTOCOL,
            &mut proto as *mut c_int as *mut c_void,
            &mut len,
        )
    };
    r == 0 && proto == libc::IPPROTO_TCP
}

pub fn fd_nonblock(fd: c_int) -> bool {
    // SAFETY: F_GETFL has no argument.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Is `ip` (not loopback) one of our namespace's addresses (`Some(true)`),
/// reached straight over a veth into another namespace (`Some(false)`), or
/// elsewhere (`None`: not accelerated)?
pub fn in_our_netns(ip: &str) -> Option<bool> {
    match netns::route(ip.parse().ok()?) {
        netns::Route::Local => Some(true),
        netns::Route::Veth { .. } => Some(false),
        netns::Route::Other => None,
    }
}

/// The inode behind descriptor `fd` (a socket's, a memfd's), or `None` when
/// `fd` is not open: what tells the library whether a descriptor number it
/// remembers still names the same object.
pub fn fd_inode(fd: c_int) -> Option<u64> {
    // Under a seccomp filter fstat may be forbidden: unknown (the callers
    // then leave a descriptor alone).
    if crate::config::restricted() {
        return None;
    }
    // SAFETY: zeroed plain data, filled by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat into a local.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Whether descriptor `fd` is close-on-exec (an exec cannot hand it on).
pub fn fd_cloexec(fd: c_int) -> bool {
    if crate::config::restricted() {
        return true; // no fcntl; and no exec will follow under a filter we know of
    }
    // SAFETY: F_GETFD has no argument.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    fl >= 0 && fl & libc::FD_CLOEXEC != 0
}
