//! vPipe C ABI (`include/fido/pipe.h`): handles around [`fido_pipe::Client`],
//! [`fido_pipe::Pipe`] and [`fido_pipe::Pending`]; every call checks its
//! pointers, catches panics and returns 0 or a negative errno.

use std::ffi::{c_char, c_int, CStr};
use std::os::fd::BorrowedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};

use fido_pipe::{Client, ClientOptions, Error, Pending, Pipe, PipeOp, Transfer};

/// `fido_pipe_client`.
pub struct FidoPipeClient(Client);
/// `fido_pipe`.
pub struct FidoPipe(Pipe);
/// `fido_pipe_op`.
pub struct FidoPipeOp(Pending);

/// `fido_pipe_result`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct FidoPipeResult {
    pub moved: u64,
    pub consumed: u64,
    pub eof: i32,
    pub error: i32,
}

const EINVAL: c_int = -(rustix::io::Errno::INVAL.raw_os_error());
const EAGAIN: c_int = -(rustix::io::Errno::AGAIN.raw_os_error());
const EFAULT: c_int = -(rustix::io::Errno::FAULT.raw_os_error());

/// Runs `f`, turning a panic into -EFAULT (a panic must never unwind into C).
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(EFAULT)
}

/// 0 for success, else the error's negative errno: the C functions' convention.
fn status(r: fido_pipe::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

/// Gives a new handle to C through `out` and returns 0, or returns the error's
/// code and leaves `*out` untouched.
///
/// # Safety
/// `out` is non-null and valid for a write.
unsafe fn hand_out<H>(r: fido_pipe::Result<H>, out: *mut *mut H) -> c_int {
    match r {
        Ok(h) => {
            // SAFETY: per this function's contract; C owns the box until it
            // hands it back to the matching free/close/destroy.
            unsafe { out.write(Box::into_raw(Box::new(h))) };
            0
        }
        Err(e) => e.errno(),
    }
}

/// Writes `r` to `res` (if not null) and returns the code.
///
/// # Safety
/// `res` is null or points to writable memory for a `FidoPipeResult`.
unsafe fn report(r: fido_pipe::Result<Transfer>, res: *mut FidoPipeResult) -> c_int {
    let out = match &r {
        Ok(t) => FidoPipeResult {
            moved: t.moved,
            consumed: t.consumed,
            eof: t.eof as i32,
            error: 0,
        },
        Err(Error::Transfer {
            moved, consumed, ..
        })
        | Err(Error::Cancelled { moved, consumed }) => FidoPipeResult {
            moved: *moved,
            consumed: *consumed,
            eof: 0,
            error: r.as_ref().err().map_or(0, |e| e.errno()),
        },
        Err(e) => FidoPipeResult {
            error: e.errno(),
            ..Default::default()
        },
    };
    if !res.is_null() {
        // SAFETY: the caller promises `res` is valid for writes when not null.
        unsafe { res.write(out) };
    }
    out.error
}

fn op_of(kind: c_int, in_off: u64, len: u64, out_off: u64) -> Option<PipeOp> {
    Some(match kind {
        1 => PipeOp::FileToSocket { off: in_off, len },
        2 => PipeOp::SocketToSocket { len },
        3 => PipeOp::SocketToFile { off: out_off, len },
        4 => PipeOp::FileToFile {
            in_off,
            len,
            out_off,
        },
        _ => return None,
    })
}

/// A descriptor number from C as a borrowed descriptor; negative numbers are refused.
fn fd(raw: c_int) -> Option<BorrowedFd<'static>> {
    // SAFETY: the descriptor is only dup()ed for the duration of the call (a
    // closed number fails that dup with EBADF); it is never closed or kept.
    (raw >= 0).then(|| unsafe { BorrowedFd::borrow_raw(raw) })
}

/// # Safety
/// `name` is a NUL-terminated string; `broker_path` null or one; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_client_connect(
    broker_path: *const c_char,
    name: *const c_char,
    out: *mut *mut FidoPipeClient,
) -> c_int {
    guard(|| {
        if name.is_null() || out.is_null() {
            return EINVAL;
        }
        // SAFETY: checked non-null; the caller promises NUL termination.
        let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
            return EINVAL;
        };
        let mut opts = ClientOptions::new(name);
        if !broker_path.is_null() {
            // SAFETY: as above.
            let Ok(p) = unsafe { CStr::from_ptr(broker_path) }.to_str() else {
                return EINVAL;
            };
            opts = opts.broker(p);
        }
        // SAFETY: `out` checked non-null, valid for a write per the contract.
        unsafe { hand_out(Client::connect_with(opts).map(FidoPipeClient), out) }
    })
}

/// # Safety
/// `client` is null or a handle from `fido_pipe_client_connect`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_client_close(client: *mut FidoPipeClient) {
    let _ = guard(|| {
        if !client.is_null() {
            // SAFETY: ownership returns to Rust exactly once, per the contract.
            drop(unsafe { Box::from_raw(client) });
        }
        0
    });
}

/// # Safety
/// `client` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_client_domain(client: *const FidoPipeClient) -> u64 {
    // SAFETY: null-checked; live per the contract.
    unsafe { client.as_ref() }.map_or(0, |c| c.0.domain())
}

/// # Safety
/// `client` is a live handle; `domain` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_set_weight(
    client: *mut FidoPipeClient,
    domain: *const c_char,
    weight: u32,
) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let (Some(c), false) = (unsafe { client.as_ref() }, domain.is_null()) else {
            return EINVAL;
        };
        // SAFETY: non-null, NUL-terminated per the contract.
        let Ok(d) = unsafe { CStr::from_ptr(domain) }.to_str() else {
            return EINVAL;
        };
        status(c.0.set_weight(d, weight))
    })
}

/// # Safety
/// `client` is a live handle; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_create(
    client: *mut FidoPipeClient,
    in_fd: c_int,
    out_fd: c_int,
    out: *mut *mut FidoPipe,
) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(c) = (unsafe { client.as_ref() }) else {
            return EINVAL;
        };
        let (Some(i), Some(o), false) = (fd(in_fd), fd(out_fd), out.is_null()) else {
            return EINVAL;
        };
        // SAFETY: `out` checked non-null, valid for a write per the contract.
        unsafe { hand_out(c.0.create(i, o).map(FidoPipe), out) }
    })
}

/// # Safety
/// `pipe` is null or a live handle, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_destroy(pipe: *mut FidoPipe) -> c_int {
    guard(|| {
        if pipe.is_null() {
            return EINVAL;
        }
        // SAFETY: ownership returns to Rust exactly once, per the contract.
        let p = unsafe { Box::from_raw(pipe) };
        status(p.0.destroy())
    })
}

/// # Safety
/// `pipe` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_cancel(pipe: *mut FidoPipe) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(p) = (unsafe { pipe.as_ref() }) else {
            return EINVAL;
        };
        status(p.0.cancel())
    })
}

/// # Safety
/// `pipe` is a live handle; `res` null or valid for a write.
unsafe fn run(pipe: *mut FidoPipe, op: PipeOp, res: *mut FidoPipeResult) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(p) = (unsafe { pipe.as_ref() }) else {
            return EINVAL;
        };
        // SAFETY: `res` per the contract.
        unsafe { report(p.0.run(op), res) }
    })
}

/// # Safety
/// `pipe` is a live handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_file_to_socket(
    pipe: *mut FidoPipe,
    off: u64,
    len: u64,
    res: *mut FidoPipeResult,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { run(pipe, PipeOp::FileToSocket { off, len }, res) }
}

/// # Safety
/// `pipe` is a live handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_socket_to_socket(
    pipe: *mut FidoPipe,
    len: u64,
    res: *mut FidoPipeResult,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { run(pipe, PipeOp::SocketToSocket { len }, res) }
}

/// # Safety
/// `pipe` is a live handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_socket_to_file(
    pipe: *mut FidoPipe,
    off: u64,
    len: u64,
    res: *mut FidoPipeResult,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { run(pipe, PipeOp::SocketToFile { off, len }, res) }
}

/// # Safety
/// `pipe` is a live handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_file_to_file(
    pipe: *mut FidoPipe,
    in_off: u64,
    len: u64,
    out_off: u64,
    res: *mut FidoPipeResult,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        run(
            pipe,
            PipeOp::FileToFile {
                in_off,
                len,
                out_off,
            },
            res,
        )
    }
}

/// # Safety
/// `client` is a live handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_once(
    client: *mut FidoPipeClient,
    in_fd: c_int,
    out_fd: c_int,
    kind: c_int,
    in_off: u64,
    len: u64,
    out_off: u64,
    res: *mut FidoPipeResult,
) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(c) = (unsafe { client.as_ref() }) else {
            return EINVAL;
        };
        let (Some(i), Some(o), Some(op)) =
            (fd(in_fd), fd(out_fd), op_of(kind, in_off, len, out_off))
        else {
            return EINVAL;
        };
        // SAFETY: `res` per the contract.
        unsafe { report(c.0.once(i, o, op), res) }
    })
}

/// # Safety
/// `pipe` is a live handle; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_start(
    pipe: *mut FidoPipe,
    kind: c_int,
    in_off: u64,
    len: u64,
    out_off: u64,
    out: *mut *mut FidoPipeOp,
) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(p) = (unsafe { pipe.as_ref() }) else {
            return EINVAL;
        };
        let (Some(op), false) = (op_of(kind, in_off, len, out_off), out.is_null()) else {
            return EINVAL;
        };
        // SAFETY: `out` checked non-null, valid for a write per the contract.
        unsafe { hand_out(p.0.start(op).map(FidoPipeOp), out) }
    })
}

/// # Safety
/// `client` is a live handle; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_start_once(
    client: *mut FidoPipeClient,
    in_fd: c_int,
    out_fd: c_int,
    kind: c_int,
    in_off: u64,
    len: u64,
    out_off: u64,
    out: *mut *mut FidoPipeOp,
) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(c) = (unsafe { client.as_ref() }) else {
            return EINVAL;
        };
        let (Some(i), Some(o), Some(op), false) = (
            fd(in_fd),
            fd(out_fd),
            op_of(kind, in_off, len, out_off),
            out.is_null(),
        ) else {
            return EINVAL;
        };
        // SAFETY: `out` checked non-null, valid for a write per the contract.
        unsafe { hand_out(c.0.start_once(i, o, op).map(FidoPipeOp), out) }
    })
}

/// # Safety
/// `op` is a live op handle.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_op_fd(op: *mut FidoPipeOp) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(o) = (unsafe { op.as_ref() }) else {
            return EINVAL;
        };
        match o.0.bell_fd() {
            Ok(fd) => fd,
            Err(e) => e.errno(),
        }
    })
}

/// # Safety
/// `op` is a live op handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_op_poll(op: *mut FidoPipeOp, res: *mut FidoPipeResult) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract (exclusive use during the call).
        let Some(o) = (unsafe { op.as_mut() }) else {
            return EINVAL;
        };
        match o.0.try_result() {
            None => EAGAIN,
            // SAFETY: `res` per the contract.
            Some(r) => unsafe { report(r, res) },
        }
    })
}

/// # Safety
/// `op` is a live op handle; `res` null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_op_wait(op: *mut FidoPipeOp, res: *mut FidoPipeResult) -> c_int {
    guard(|| {
        // SAFETY: null-checked; live per the contract.
        let Some(o) = (unsafe { op.as_mut() }) else {
            return EINVAL;
        };
        loop {
            if let Some(r) = o.0.wait_timeout(std::time::Duration::from_secs(3600)) {
                // SAFETY: `res` per the contract.
                return unsafe { report(r, res) };
            }
        }
    })
}

/// # Safety
/// `op` is null or a live op handle, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fido_pipe_op_free(op: *mut FidoPipeOp) {
    let _ = guard(|| {
        if !op.is_null() {
            // SAFETY: ownership returns to Rust exactly once, per the contract.
            drop(unsafe { Box::from_raw(op) });
        }
        0
    });
}

/// A static, NUL-terminated description of a return code.
#[no_mangle]
pub extern "C" fn fido_pipe_strerror(code: c_int) -> *const c_char {
    use rustix::io::Errno;
    let e = -code;
    let s: &'static CStr = match e {
        0 => c"success",
        _ if e == Errno::BADF.raw_os_error() => {
            c"bad descriptor (closed, wrong type or access mode, or not fitting the operation)"
        }
        _ if e == Errno::DQUOT.raw_os_error() => c"pipe quota of this domain is spent",
        _ if e == Errno::PERM.raw_os_error() => c"denied by the broker's policy",
        _ if e == Errno::BUSY.raw_os_error() => c"an operation already runs on this pipe",
        _ if e == Errno::NOENT.raw_os_error() => c"no such pipe or domain",
        _ if e == Errno::CANCELED.raw_os_error() => c"cancelled",
        _ if e == Errno::NOTCONN.raw_os_error() => c"no broker (or it went away)",
        _ if e == Errno::AGAIN.raw_os_error() => c"still running",
        _ if e == Errno::PIPE.raw_os_error() => c"the sink's reader went away (EPIPE)",
        _ if e == Errno::CONNRESET.raw_os_error() => c"connection reset by peer",
        _ if e == Errno::INVAL.raw_os_error() => c"invalid argument",
        _ if e == Errno::IO.raw_os_error() => c"I/O error",
        _ if e == Errno::NOSPC.raw_os_error() => c"no space left on device",
        _ if e == Errno::PROTO.raw_os_error() => c"protocol error talking to the broker",
        _ if e == Errno::FAULT.raw_os_error() => c"internal error (a bug; please report)",
        _ => c"system error (see errno)",
    };
    s.as_ptr()
}
