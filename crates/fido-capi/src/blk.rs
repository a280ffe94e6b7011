//! fido-blk C ABI (`include/fido/blk.h`): a handle around a domain and a
//! [`fido_blk::BlkClient`]; every call checks its pointers, catches panics
//! and returns 0 or a negative errno. Calls on one handle take turns (a lock):
//! the client's blocking helpers expect one caller at a time.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use fido::{Domain, JoinOptions};
use fido_blk::{BlkClient, BlkError};
use parking_lot::Mutex;

/// `fido_blk`.
pub struct FidoBlk(Mutex<BlkClient>);

/// `fido_blk_info` (the wire INFO, field for field).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct FidoBlkInfo {
    pub size: u64,
    pub logical_block: u32,
    pub max_transfer: u32,
    pub flags: u32,
    pub queue_depth: u32,
}

fn neg(e: rustix::io::Errno) -> c_int {
    -e.raw_os_error()
}

/// Runs `f`, turning a panic into -EFAULT (a panic must never unwind into C).
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(neg(rustix::io::Errno::FAULT))
}

/// The negative errno of `e` (see the header's table).
fn code(e: &BlkError) -> c_int {
    use rustix::io::Errno;
    match e {
        BlkError::Status(s) => -c_int::from(*s),
        BlkError::Disconnected => neg(Errno::NOTCONN),
        BlkError::Timeout => neg(Errno::TIMEDOUT),
        BlkError::Protocol(_) => neg(Errno::PROTO),
        BlkError::Invalid(_) => neg(Errno::INVAL),
        BlkError::Fido(e) if e.code() == Some(fido::ErrorCode::NoSuchService) => neg(Errno::NOENT),
        BlkError::Fido(fido::Error::BrokerUnavailable(_)) => neg(Errno::NOTCONN),
        BlkError::Fido(fido::Error::Invalid(_)) => neg(Errno::INVAL),
        BlkError::Fido(_) => neg(Errno::IO),
    }
}

fn status(r: Result<(), BlkError>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => code(&e),
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per the contract.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// # Safety
/// `device` and `domain_name` are NUL-terminated strings; `broker_path` null
/// or one; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_connect(
    broker_path: *const c_char,
    domain_name: *const c_char,
    device: *const c_char,
    out: *mut *mut FidoBlk,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let (Some(name), Some(device)) = (unsafe { text(domain_name) }, unsafe { text(device) }) else {
            return neg(rustix::io::Errno::INVAL);
        };
        if out.is_null() {
            return neg(rustix::io::Errno::INVAL);
        }
        let mut opts = JoinOptions::new(name).arena_len(256 << 20);
        if !broker_path.is_null() {
            // SAFETY: per the contract.
            let Some(p) = (unsafe { text(broker_path) }) else {
                return neg(rustix::io::Errno::INVAL);
            };
            opts = opts.broker(p);
        }
        let client = Domain::join(opts).map_err(BlkError::from).and_then(|d| BlkClient::connect(&d, device));
        match client {
            Ok(c) => {
                // SAFETY: `out` checked non-null, valid for a write per the
                // contract; C owns the box until fido_blk_close.
                unsafe { out.write(Box::into_raw(Box::new(FidoBlk(Mutex::new(c))))) };
                0
            }
            Err(e) => code(&e),
        }
    })
}

/// # Safety
/// `blk` is null or a handle from `fido_blk_connect`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_close(blk: *mut FidoBlk) {
    let _ = guard(|| {
        if !blk.is_null() {
            // SAFETY: ownership returns to Rust exactly once, per the contract.
            drop(unsafe { Box::from_raw(blk) });
        }
        0
    });
}

/// Runs `f` on the handle's client (-EINVAL for a null handle).
fn with(blk: Option<&FidoBlk>, f: impl FnOnce(&BlkClient) -> c_int) -> c_int {
    guard(|| match blk {
        Some(h) => f(&h.0.lock()),
        None => neg(rustix::io::Errno::INVAL),
    })
}

/// # Safety
/// `blk` is a live handle; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_get_info(blk: *mut FidoBlk, out: *mut FidoBlkInfo) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| {
        if out.is_null() {
            return neg(rustix::io::Errno::INVAL);
        }
        let i = c.info();
        // SAFETY: checked non-null; valid for a write per the contract.
        unsafe {
            out.write(FidoBlkInfo { size: i.size, logical_block: i.logical_block, max_transfer: i.max_transfer, flags: i.flags, queue_depth: i.queue_depth })
        };
        0
    })
}

/// `len` split into pieces of at most `max`, with their offsets.
fn pieces(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64, u32)> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |k| {
        let at = k * max;
        (at, offset + at, (len - at).min(max) as u32)
    })
}

/// # Safety
/// `blk` is a live handle; `buf` is valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_read(blk: *mut FidoBlk, offset: u64, buf: *mut c_void, len: usize) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| {
        if buf.is_null() || len == 0 {
            return neg(rustix::io::Errno::INVAL);
        }
        // SAFETY: the caller's buffer of `len` bytes, ours for the call.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, len) };
        for (at, off, n) in pieces(offset, len as u64, u64::from(c.info().max_transfer)) {
            let m = match c.read_at(off, n) {
                Ok(m) => m,
                Err(e) => return code(&e),
            };
            let mut pos = at as usize;
            for seg in m.segments() {
                pos += seg.copy_to(&mut dst[pos..pos + seg.len()]);
            }
        }
        0
    })
}

/// # Safety
/// `blk` is a live handle; `buf` is valid for `len` bytes of reads.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_write(blk: *mut FidoBlk, offset: u64, buf: *const c_void, len: usize, fua: c_int) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| {
        if buf.is_null() || len == 0 {
            return neg(rustix::io::Errno::INVAL);
        }
        // SAFETY: the caller's buffer of `len` bytes, read during the call.
        let src = unsafe { std::slice::from_raw_parts(buf as *const u8, len) };
        for (at, off, n) in pieces(offset, len as u64, u64::from(c.info().max_transfer)) {
            if let Err(e) = c.write_at(off, &src[at as usize..at as usize + n as usize], fua != 0) {
                return code(&e);
            }
        }
        0
    })
}

/// # Safety
/// `blk` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_flush(blk: *mut FidoBlk) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| status(c.flush()))
}

/// Splits a DISCARD / WRITE_ZEROES at 1 GiB (a request's length is 32 bits).
fn ranged(offset: u64, len: u64, mut op: impl FnMut(u64, u32) -> Result<(), BlkError>) -> c_int {
    if len == 0 {
        return neg(rustix::io::Errno::INVAL);
    }
    for (_, off, n) in pieces(offset, len, 1 << 30) {
        if let Err(e) = op(off, n) {
            return code(&e);
        }
    }
    0
}

/// # Safety
/// `blk` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_discard(blk: *mut FidoBlk, offset: u64, len: u64) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| ranged(offset, len, |o, n| c.discard(o, n, false)))
}

/// # Safety
/// `blk` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn fido_blk_write_zeroes(blk: *mut FidoBlk, offset: u64, len: u64, no_unmap: c_int) -> c_int {
    // SAFETY: null or a live handle per the contract; only shared access.
    let blk = unsafe { blk.as_ref() };
    with(blk, |c| ranged(offset, len, |o, n| c.write_zeroes(o, n, false, no_unmap != 0)))
}

#[no_mangle]
pub extern "C" fn fido_blk_strerror(code: c_int) -> *const c_char {
    use rustix::io::Errno;
    let e = code.checked_neg().unwrap_or(0);
    let s: &'static CStr = match e {
        0 => c"success",
        _ if e == Errno::IO.raw_os_error() => c"I/O error (the storage domain's backing failed)",
        _ if e == Errno::NOSPC.raw_os_error() => c"no space left on the backing",
        _ if e == Errno::ROFS.raw_os_error() => c"the device is read-only",
        _ if e == Errno::OPNOTSUPP.raw_os_error() => c"operation not supported by the storage domain",
        _ if e == Errno::INVAL.raw_os_error() => c"invalid argument (misaligned, out of range, or a null pointer)",
        _ if e == Errno::NOTCONN.raw_os_error() => c"the storage domain (or the broker) went away",
        _ if e == Errno::NOENT.raw_os_error() => c"no such block device",
        _ if e == Errno::TIMEDOUT.raw_os_error() => c"no answer in time",
        _ if e == Errno::PROTO.raw_os_error() => c"the storage domain broke the protocol",
        _ if e == Errno::NOMEM.raw_os_error() => c"out of arena memory",
        _ if e == Errno::FAULT.raw_os_error() => c"internal error (a bug; please report)",
        _ => c"system error (see errno)",
    };
    s.as_ptr()
}
