//! VMRPC C ABI (`include/fido/rpc.h`): as small as the paper's — set up and
//! destroy an RPC heap, malloc/free in it, bind to a service, call a method
//! by index, serve a table of handlers.
//!
//! A heap is a fido domain (its arena is the heap the peer reads). Arguments
//! are a root blob copied into the call (scalars, and `fido_rpc_ref`s —
//! global pointer + length — of heap memory); the server resolves each ref
//! against the caller's grant before reading it in place. Every function here
//! catches panics and returns a code instead.

use fido::{Domain, JoinOptions};
use fido_rpc::wire::{STATUS_APP_ERROR, STATUS_FAULT, STATUS_OK};
use fido_rpc::{CallOpts, Client, Ctx, Dispatch, Fault, RpcError, Server, ServerHandle, ServerOptions};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

pub const FIDO_OK: c_int = 0;
pub const FIDO_EINVAL: c_int = -22;
pub const FIDO_ENOMEM: c_int = -12;
pub const FIDO_ENOENT: c_int = -2;
pub const FIDO_ECONNRESET: c_int = -104;
pub const FIDO_ETIMEDOUT: c_int = -110;
pub const FIDO_EPROTO: c_int = -71;
pub const FIDO_ECANCELED: c_int = -125;
pub const FIDO_EIO: c_int = -5;
pub const FIDO_EPANIC: c_int = -131;

/// A global pointer and length in some domain's RPC heap.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fido_rpc_ref {
    pub addr: u64,
    pub len: u64,
}

/// An RPC heap: a domain joined to the broker; its arena is the heap.
pub struct fido_rpc_heap {
    domain: Domain,
    /// Blocks handed out by `fido_rpc_malloc`, by local address.
    blocks: Mutex<BTreeMap<usize, fido::Buf>>,
}

pub struct fido_rpc_client {
    client: Client,
}

/// A reply: its root and the server memory it points to stay valid until
/// `fido_rpc_reply_free`.
pub struct fido_rpc_reply {
    msg: fido::Msg,
    root: (*const u8, usize),
}

/// The call a handler is running (valid only during the handler).
pub struct fido_rpc_ctx {
    cx: *mut Ctx<'static>,
}

pub struct fido_rpc_server {
    _handle: ServerHandle,
}

/// A handler: `args`/`args_len` is the root the client sent; reply with
/// `fido_rpc_call_reply`. Return 0 (success), a positive application error
/// code (delivered to the caller as `fido_rpc_call`'s return value), or a
/// negative value (the call fails with FIDO_EPROTO at the caller).
pub type fido_rpc_handler = Option<unsafe extern "C" fn(user: *mut c_void, call: *mut fido_rpc_ctx, args: *const c_void, args_len: usize) -> c_int>;

fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

fn code_of(e: &RpcError) -> c_int {
    match e {
        RpcError::ServerGone(_) => FIDO_ECONNRESET,
        RpcError::DeadlineExceeded => FIDO_ETIMEDOUT,
        RpcError::Cancelled => FIDO_ECANCELED,
        RpcError::Memory(_) => FIDO_ENOMEM,
        RpcError::Invalid(_) => FIDO_EINVAL,
        RpcError::Fault(..) | RpcError::BadReply(_) => FIDO_EPROTO,
        RpcError::Fido(fido::Error::Broker(b)) if b.code == fido::ErrorCode::NoSuchService => FIDO_ENOENT,
        RpcError::Fido(fido::Error::BrokerUnavailable(_)) => FIDO_ENOENT,
        RpcError::Fido(fido::Error::Timeout) => FIDO_ETIMEDOUT,
        RpcError::Fido(fido::Error::PeerGone { .. } | fido::Error::Closed) => FIDO_ECONNRESET,
        RpcError::Fido(_) => FIDO_EIO,
    }
}

/// A C string argument as UTF-8 (`None` for null or invalid UTF-8).
///
/// # Safety
/// `p` is null or a NUL-terminated string alive for `'a`.
unsafe fn cstr<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string (header contract).
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Names an error code.
#[no_mangle]
pub extern "C" fn fido_rpc_strerror(code: c_int) -> *const c_char {
    let s: &'static CStr = match code {
        FIDO_OK => c"success",
        FIDO_EINVAL => c"invalid argument",
        FIDO_ENOMEM => c"out of heap memory",
        FIDO_ENOENT => c"no such service (or no broker)",
        FIDO_ECONNRESET => c"server gone",
        FIDO_ETIMEDOUT => c"deadline exceeded",
        FIDO_EPROTO => c"server fault or malformed reply",
        FIDO_ECANCELED => c"cancelled",
        FIDO_EIO => c"i/o or broker error",
        FIDO_EPANIC => c"internal error (caught panic)",
        c if c > 0 => c"application error",
        _ => c"unknown error",
    };
    s.as_ptr()
}

/// Sets up an RPC heap of `heap_len` bytes: joins the broker at $FIDO_BROKER
/// (or the default socket) as domain `name`.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_heap_setup(name: *const c_char, heap_len: usize, out: *mut *mut fido_rpc_heap) -> c_int {
    guard(FIDO_EPANIC, || {
        // SAFETY: header contract: `name` is a C string or NULL.
        let Some(name) = (unsafe { cstr(name) }) else { return FIDO_EINVAL };
        if out.is_null() || heap_len == 0 {
            return FIDO_EINVAL;
        }
        match Domain::join(JoinOptions::new(name).arena_len(heap_len as u64)) {
            Ok(domain) => {
                let h = Box::new(fido_rpc_heap { domain, blocks: Mutex::new(BTreeMap::new()) });
                // SAFETY: `out` is non-null and points to writable storage (contract).
                unsafe { *out = Box::into_raw(h) };
                FIDO_OK
            }
            Err(fido::Error::Invalid(_)) => FIDO_EINVAL,
            Err(_) => FIDO_ENOENT,
        }
    })
}

/// Destroys a heap (frees every block; leaves the broker). Clients and
/// servers made from it must be gone first.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_heap_destroy(heap: *mut fido_rpc_heap) {
    guard((), || {
        if !heap.is_null() {
            // SAFETY: `heap` came from fido_rpc_heap_setup and is destroyed once.
            drop(unsafe { Box::from_raw(heap) });
        }
    })
}

/// `len` bytes in the heap (64-byte aligned), or NULL.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_malloc(heap: *mut fido_rpc_heap, len: usize) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: a live heap handle (contract).
        let Some(h) = (unsafe { heap.as_ref() }) else { return std::ptr::null_mut() };
        if len == 0 {
            return std::ptr::null_mut();
        }
        match h.domain.alloc(len) {
            Ok(mut b) => {
                let p = b.as_mut_ptr();
                h.blocks.lock().insert(p as usize, b);
                p as *mut c_void
            }
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// Frees a block of `fido_rpc_malloc` (NULL and unknown pointers are ignored).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_free(heap: *mut fido_rpc_heap, p: *mut c_void) {
    guard((), || {
        // SAFETY: a live heap handle (contract).
        if let Some(h) = unsafe { heap.as_ref() } {
            h.blocks.lock().remove(&(p as usize));
        }
    })
}

/// The reference a peer can resolve for `len` bytes at `p` in this heap
/// (`{0, 0}` if the range is not inside one block of the heap).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_ref_of(heap: *mut fido_rpc_heap, p: *const c_void, len: usize) -> fido_rpc_ref {
    guard(fido_rpc_ref::default(), || {
        // SAFETY: a live heap handle (contract).
        let Some(h) = (unsafe { heap.as_ref() }) else { return fido_rpc_ref::default() };
        let a = p as usize;
        let blocks = h.blocks.lock();
        // The block containing `p`: the greatest start <= p.
        let found = blocks.range(..=a).next_back().filter(|(&start, b)| (a - start).checked_add(len).is_some_and(|end| end <= b.len()));
        match found {
            Some((&start, b)) => fido_rpc_ref { addr: b.gptr().addr() + (a - start) as u64, len: len as u64 },
            None => fido_rpc_ref::default(),
        }
    })
}

/// Binds to `service` (connects).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_bind(heap: *mut fido_rpc_heap, service: *const c_char, out: *mut *mut fido_rpc_client) -> c_int {
    guard(FIDO_EPANIC, || {
        // SAFETY: contract: a live heap, a C string, writable `out`.
        let (Some(h), Some(service)) = (unsafe { heap.as_ref() }, unsafe { cstr(service) }) else { return FIDO_EINVAL };
        if out.is_null() {
            return FIDO_EINVAL;
        }
        match Client::connect(&h.domain, service) {
            Ok(client) => {
                // SAFETY: `out` checked non-null.
                unsafe { *out = Box::into_raw(Box::new(fido_rpc_client { client })) };
                FIDO_OK
            }
            Err(e) => code_of(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn fido_rpc_unbind(client: *mut fido_rpc_client) {
    guard((), || {
        if !client.is_null() {
            // SAFETY: from fido_rpc_bind, freed once.
            drop(unsafe { Box::from_raw(client) });
        }
    })
}

/// Calls method `index` with the root `args` (`args_len` bytes, copied; may
/// hold `fido_rpc_ref`s into the heap). `timeout_ms` 0 = none. On 0, `*out`
/// is the reply (free it with `fido_rpc_reply_free`); a positive return is
/// the handler's application error code; negative is a FIDO_E* code.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_call(
    client: *mut fido_rpc_client,
    index: u32,
    args: *const c_void,
    args_len: usize,
    timeout_ms: u32,
    out: *mut *mut fido_rpc_reply,
) -> c_int {
    guard(FIDO_EPANIC, || {
        // SAFETY: a live client handle (contract).
        let Some(c) = (unsafe { client.as_ref() }) else { return FIDO_EINVAL };
        if out.is_null() || (args.is_null() && args_len > 0) {
            return FIDO_EINVAL;
        }
        let root: &[u8] = if args_len == 0 {
            &[]
        } else {
            // SAFETY: the caller passes `args_len` readable bytes at `args`.
            unsafe { std::slice::from_raw_parts(args as *const u8, args_len) }
        };
        let frame = match c.client.frame() {
            Ok(f) => f,
            Err(e) => return code_of(&e),
        };
        let opts = CallOpts { timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms as u64)), cancel: None };
        let msg = match c.client.call_raw(index, fido_rpc::wire::SIG_ANY, frame, root, &opts) {
            Ok(m) => m,
            Err(e) => return code_of(&e),
        };
        // The root may live inside the message itself (an inline reply):
        // parse it once the message is in its box, where it stays until
        // `fido_rpc_reply_free`. Header copied out once, then checked
        // (either form).
        let mut r = Box::new(fido_rpc_reply { msg, root: (std::ptr::null(), 0) });
        let Ok((status, fault, root)) = fido_rpc::reply_parts(&r.msg) else { return FIDO_EPROTO };
        let app_code = root.read_obj::<i32>(0).map(|c| c.max(1));
        let root = (root.as_ptr(), root.len());
        match status {
            STATUS_OK => {
                r.root = root;
                // SAFETY: `out` checked non-null.
                unsafe { *out = Box::into_raw(r) };
                FIDO_OK
            }
            STATUS_APP_ERROR => app_code.unwrap_or(FIDO_EPROTO),
            STATUS_FAULT if fault == Fault::DeadlineExceeded as u32 => FIDO_ETIMEDOUT,
            STATUS_FAULT if fault == Fault::Cancelled as u32 => FIDO_ECANCELED,
            _ => FIDO_EPROTO,
        }
    })
}

/// The reply's root (the handler's `fido_rpc_call_reply` bytes).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_reply_data(reply: *const fido_rpc_reply, len: *mut usize) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: a live reply (contract).
        let Some(r) = (unsafe { reply.as_ref() }) else { return std::ptr::null() };
        if !len.is_null() {
            // SAFETY: checked non-null.
            unsafe { *len = r.root.1 };
        }
        r.root.0 as *const c_void
    })
}

/// Server memory a reply refers to, checked against the server's grant; NULL
/// if outside it. Valid until `fido_rpc_reply_free`.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_reply_resolve(reply: *const fido_rpc_reply, r: fido_rpc_ref) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: a live reply (contract).
        let Some(rep) = (unsafe { reply.as_ref() }) else { return std::ptr::null() };
        match fido_rpc::View::new(&rep.msg).bytes(r.addr, r.len) {
            Ok(b) if !b.is_empty() => b.as_ptr() as *const c_void,
            _ => std::ptr::null(),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn fido_rpc_reply_free(reply: *mut fido_rpc_reply) {
    guard((), || {
        if !reply.is_null() {
            // SAFETY: from fido_rpc_call, freed once.
            drop(unsafe { Box::from_raw(reply) });
        }
    })
}

/// Inside a handler: the caller's memory `r` refers to, checked against the
/// caller's grant (read-only; NULL if outside it).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_call_resolve(call: *mut fido_rpc_ctx, r: fido_rpc_ref) -> *const c_void {
    guard(std::ptr::null(), || {
        // SAFETY: `call` is the live handle passed to the running handler.
        let Some(c) = (unsafe { call.as_ref() }) else { return std::ptr::null() };
        // SAFETY: `cx` outlives the handler call (see `CService::dispatch`).
        let cx = unsafe { &*c.cx };
        match cx.view().bytes(r.addr, r.len) {
            Ok(b) if !b.is_empty() => b.as_ptr() as *const c_void,
            _ => std::ptr::null(),
        }
    })
}

/// Inside a handler: `len` bytes in the server's heap that travel with the
/// reply (freed when the caller frees it); `*r` is their reference.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_call_alloc(call: *mut fido_rpc_ctx, len: usize, r: *mut fido_rpc_ref) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the live handle of the running handler; `cx` outlives it.
        let Some(c) = (unsafe { call.as_mut() }) else { return std::ptr::null_mut() };
        // SAFETY: `c.cx` is the context of the handler now running, which
        // outlives this call (the handler is what calls us).
        let cx = unsafe { &mut *c.cx };
        if r.is_null() || len == 0 {
            return std::ptr::null_mut();
        }
        let Ok(frame) = cx.frame() else { return std::ptr::null_mut() };
        match frame.alloc_slice::<u8>(len) {
            Ok((h, mem)) => {
                // SAFETY: `r` checked non-null.
                unsafe { *r = fido_rpc_ref { addr: h.addr(), len: h.len() } };
                mem.as_mut_ptr() as *mut c_void
            }
            Err(_) => std::ptr::null_mut(),
        }
    })
}

/// Inside a handler: the result (copied into the reply's root).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_call_reply(call: *mut fido_rpc_ctx, data: *const c_void, len: usize) -> c_int {
    guard(FIDO_EPANIC, || {
        // SAFETY: the live handle of the running handler; `cx` outlives it.
        let Some(c) = (unsafe { call.as_mut() }) else { return FIDO_EINVAL };
        if data.is_null() && len > 0 {
            return FIDO_EINVAL;
        }
        // SAFETY: `cx` points to the running handler's context, alive for the call.
        let cx = unsafe { &mut *c.cx };
        // SAFETY: `len` readable bytes at `data` (contract).
        let b = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(data as *const u8, len) } };
        cx.reply_raw(STATUS_OK, b);
        FIDO_OK
    })
}

/// Inside a handler: 1 if the caller cancelled, its deadline passed or it is
/// gone; 0 otherwise.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_call_cancelled(call: *mut fido_rpc_ctx) -> c_int {
    guard(1, || {
        // SAFETY: the live handle of the running handler.
        let Some(c) = (unsafe { call.as_ref() }) else { return 1 };
        // SAFETY: `cx` points to the running handler's context, alive for the call.
        c_int::from(unsafe { &*c.cx }.is_cancelled())
    })
}

struct CService {
    table: Vec<fido_rpc_handler>,
    user: usize,
}

impl Dispatch for CService {
    fn methods(&self) -> &'static [&'static str] {
        &[]
    }
    fn dispatch(&self, method: u32, _sig: u32, cx: &mut Ctx<'_>) -> Result<(), Fault> {
        let Some(Some(h)) = self.table.get(method as usize).copied() else { return Err(Fault::UnknownMethod) };
        let root = cx.root_bytes();
        // The handle lives on this stack frame and is valid only during the
        // handler: the lifetime is erased for C and nothing keeps it after.
        let mut call = fido_rpc_ctx { cx: (cx as *mut Ctx<'_>).cast::<Ctx<'static>>() };
        // SAFETY: a C function from the table the server was given; `root`
        // is readable for `root.len()` bytes for the whole call.
        let rc = unsafe { h(self.user as *mut c_void, &mut call, root.as_ptr() as *const c_void, root.len()) };
        match rc {
            0 => Ok(()),
            n if n > 0 => {
                cx.reply_raw(STATUS_APP_ERROR, &n.to_ne_bytes());
                Ok(())
            }
            _ => {
                let _ = STATUS_FAULT;
                Err(Fault::Refused)
            }
        }
    }
}

/// Serves `service` with a table of `count` handlers (method index = table
/// index) on `workers` threads per connection. Handlers may run concurrently
/// on several threads (with the same `user` pointer).
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_serve(
    heap: *mut fido_rpc_heap,
    service: *const c_char,
    table: *const fido_rpc_handler,
    count: u32,
    user: *mut c_void,
    workers: u32,
    out: *mut *mut fido_rpc_server,
) -> c_int {
    guard(FIDO_EPANIC, || {
        // SAFETY: contract: a live heap, a C string, `count` handlers at `table`.
        let (Some(h), Some(service)) = (unsafe { heap.as_ref() }, unsafe { cstr(service) }) else { return FIDO_EINVAL };
        if out.is_null() || (table.is_null() && count > 0) {
            return FIDO_EINVAL;
        }
        // SAFETY: `count` handlers readable at `table` (contract, checked non-null above).
        let table = if count == 0 { Vec::new() } else { unsafe { std::slice::from_raw_parts(table, count as usize) }.to_vec() };
        let svc = CService { table, user: user as usize };
        match Server::spawn(&h.domain, service, svc, ServerOptions { workers: workers.max(1) as usize, wait: None }) {
            Ok(handle) => {
                // SAFETY: `out` checked non-null.
                unsafe { *out = Box::into_raw(Box::new(fido_rpc_server { _handle: handle })) };
                FIDO_OK
            }
            Err(RpcError::Fido(fido::Error::Broker(b))) if b.code == fido::ErrorCode::ServiceTaken => FIDO_EINVAL,
            Err(e) => code_of(&e),
        }
    })
}

/// Stops serving (waits for running handlers) and frees the server.
#[no_mangle]
pub unsafe extern "C" fn fido_rpc_server_stop(server: *mut fido_rpc_server) {
    guard((), || {
        if !server.is_null() {
            // SAFETY: from fido_rpc_serve, stopped once.
            drop(unsafe { Box::from_raw(server) });
        }
    })
}
