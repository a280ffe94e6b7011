//! `fido pipe serve DIR --port P`: a small static-file HTTP/1.1 server whose
//! response bodies are moved file→socket by a [`Mover`] (the broker's pipe
//! engine by default; `sendfile` or a read/write loop in this process for
//! comparison). The server itself only parses requests and writes headers.
//!
//! What it does: GET and HEAD of regular files under DIR (a directory serves
//! its `index.html`), persistent connections (HTTP/1.1 default, HTTP/1.0 with
//! `Connection: keep-alive`, pipelined requests answered in order),
//! `Content-Length` always, one byte range (`Range: bytes=a-b`, `a-`, `-n`;
//! several ranges are answered with the whole file, as RFC 9110 allows),
//! `Last-Modified`, a content type from the extension.
//!
//! What it refuses, with a status and never by crashing: other methods (405
//! with `Allow`), malformed requests, missing or repeated `Host` on HTTP/1.1,
//! framing that two parsers could read differently — `Transfer-Encoding`,
//! repeated `Content-Length`, a `Content-Length` that is not plain digits
//! (here), obs-fold, bare CR, a space before the colon (httparse) — all 400,
//! RFC 9112 §6.3 — heads over 16 KiB or 64 headers
//! (431), paths that leave DIR (`..` segments, encoded or not: 400; symlinks
//! out of DIR, absolute symlinks, anything but a regular file — FIFOs,
//! devices, sockets: 404, so the server says nothing about what exists), more
//! than `max_conns` connections at once or more than `max_conns_per_peer` from
//! one peer (503; a peer on this host is its uid, see [`crate::peers`]).
//! Every refusal closes the connection, so nothing pipelined behind it is read
//! as a request.
//!
//! Time limits: the request head (and a small body, read and discarded) must
//! arrive within `head_timeout` of its first byte (of the accept, for the
//! first request), however it trickles in (408); a connection idle between
//! requests, or a client that stops reading a response, is dropped after
//! `idle_timeout`. One client never holds up another (one thread per
//! connection).
//!
//! Files are opened with `openat2(DIR, path, RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`: the kernel resolves every component beneath the
//! directory descriptor opened at start, so a symlink swapped in under DIR
//! while a request is served cannot lead out of it (a check of the path
//! followed by an open by path could). `O_NONBLOCK` keeps a FIFO from blocking
//! the open; `fstat` on the descriptor then admits regular files only, and the
//! body is moved from that descriptor, never from the path again.

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

use crate::accept;
use crate::mover::Mover;
use crate::peers::{self, ConnLimits};
use crate::proxy::in_context;

/// Largest request head (request line and headers) accepted.
const MAX_HEAD: usize = 16 << 10;
/// Largest request body (Content-Length) read and discarded.
const MAX_DISCARD: u64 = 64 << 10;
const MAX_HEADERS: usize = 64;
/// After refusing a request, how long (and how many bytes) the server keeps
/// reading what the client still sends before closing: closing with unread
/// bytes makes the kernel send a reset, which can destroy the refusal before
/// the client reads it (nginx's lingering close).
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 64 << 10;

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub root: PathBuf,
    /// A connection idle between requests, or not reading a response, this
    /// long is closed.
    pub idle_timeout: Duration,
    /// A request head (and body) must arrive in full within this long.
    pub head_timeout: Duration,
    pub max_conns: usize,
    /// Connections one peer (a local uid, or a remote address) may hold.
    pub max_conns_per_peer: usize,
    /// Follow symlinks that stay beneath the root (`false`: refuse every
    /// symlink, `RESOLVE_NO_SYMLINKS`).
    pub follow_symlinks: bool,
}

impl ServeConfig {
    pub const DEFAULT_IDLE: Duration = Duration::from_secs(60);
    pub const DEFAULT_HEAD: Duration = Duration::from_secs(10);
    pub const DEFAULT_MAX_CONNS: usize = 1024;
    pub const DEFAULT_MAX_CONNS_PER_PEER: usize = 64;

    /// Serving `root` with the default limits.
    pub fn new(root: impl Into<PathBuf>) -> ServeConfig {
        ServeConfig {
            root: root.into(),
            idle_timeout: Self::DEFAULT_IDLE,
            head_timeout: Self::DEFAULT_HEAD,
            max_conns: Self::DEFAULT_MAX_CONNS,
            max_conns_per_peer: Self::DEFAULT_MAX_CONNS_PER_PEER,
            follow_symlinks: true,
        }
    }
}

/// A bound server (the socket is listening once this exists).
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

struct Shared {
    /// DIR, opened once: every file is resolved beneath this descriptor.
    root: OwnedFd,
    resolve: ResolveFlags,
    mover: Arc<dyn Mover>,
    idle: Duration,
    head: Duration,
    limits: Arc<ConnLimits>,
}

/// How every file is opened: `O_NONBLOCK` so that a FIFO cannot block the
/// open (cleared again once `fstat` found a regular file), `O_NOCTTY` so that
/// a terminal never becomes ours.
const OPEN_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY)
    .union(OFlags::CLOEXEC);

impl Server {
    /// Binds `addr` and opens DIR.
    pub fn bind(addr: SocketAddr, cfg: ServeConfig, mover: Arc<dyn Mover>) -> io::Result<Server> {
        let what = || format!("serve root {}", cfg.root.display());
        let root = rustix::fs::open(
            &cfg.root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| in_context(e.into(), what()))?;
        let mut resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        if !cfg.follow_symlinks {
            resolve |= ResolveFlags::NO_SYMLINKS;
        }
        // No fallback to resolving paths in this process: that is the race openat2 closes.
        if let Err(e) = rustix::fs::openat2(&root, ".", OPEN_FLAGS, Mode::empty(), resolve) {
            let hint = if e == rustix::io::Errno::NOSYS {
                " (openat2 needs Linux 5.6 or later)"
            } else {
                ""
            };
            return Err(in_context(e.into(), format!("{}: openat2{hint}", what())));
        }
        let listener =
            TcpListener::bind(addr).map_err(|e| in_context(e, format!("binding {addr}")))?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                root,
                resolve,
                mover,
                idle: cfg.idle_timeout,
                head: cfg.head_timeout,
                limits: ConnLimits::new(cfg.max_conns, cfg.max_conns_per_peer),
            }),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts forever (each connection on its own thread).
    pub fn run(self) -> io::Result<()> {
        let mut backoff = accept::Backoff::default();
        loop {
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if accept::passing(&e) => continue,
                // Out of descriptors (or memory): keep serving, paced.
                Err(e) => {
                    backoff.failed(&e);
                    continue;
                }
            };
            backoff.succeeded();
            let who = match sock.local_addr() {
                Ok(local) => peers::identify(local, peer),
                Err(_) => continue, // reset before we got here
            };
            let slot = match self.shared.limits.admit(who) {
                Ok(slot) => slot,
                Err(why) => {
                    tracing::debug!("{peer} ({who}): {why:?} connection limit reached: 503");
                    // A fresh socket's buffer takes the short answer without blocking.
                    let mut s = sock;
                    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = s.write_all(&simple(503, "Service Unavailable", true, false));
                    continue;
                }
            };
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name("fido-serve-conn".into())
                .stack_size(256 << 10)
                .spawn(move || {
                    if let Err(e) = connection(&shared, sock) {
                        tracing::debug!("connection {peer}: {e}");
                    }
                    drop(slot);
                });
            if let Err(e) = spawned {
                tracing::warn!("spawning a connection thread: {e}");
            }
        }
    }
}

/// What one parsed request asks for.
struct Request {
    head_only: bool,
    keep_alive: bool,
    /// HTTP/1.0 asked for keep-alive explicitly: say so in the response.
    echo_keep_alive: bool,
    path: Vec<u8>,
    range: Option<Vec<u8>>,
    body: u64,
}

enum Parsed {
    Req(Request),
    /// A response to send before closing.
    Refuse(u16, &'static str, Option<&'static str>),
}

fn connection(sh: &Shared, mut sock: TcpStream) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_write_timeout(Some(sh.idle))?;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    // When the current request's head (and body) must be in. The first one is
    // due `head` after the accept; later ones `head` after their first byte.
    let mut due = Some(Instant::now() + sh.head);
    loop {
        // Read until a complete head is buffered (pipelined bytes stay in `buf`).
        let (parsed, used) = loop {
            if !buf.is_empty() {
                due.get_or_insert_with(|| Instant::now() + sh.head);
                match parse(&buf)? {
                    Some(x) => break x,
                    None if buf.len() >= MAX_HEAD => {
                        let r = simple(431, "Request Header Fields Too Large", true, false);
                        return refuse(&mut sock, &r);
                    }
                    None => {}
                }
            }
            let mut tmp = [0u8; 4096];
            match read_by(&mut sock, &mut tmp, due, sh.idle)? {
                Got::Bytes(n) => buf.extend_from_slice(&tmp[..n]),
                // The client closed (mid-head or between requests), or stayed silent
                // longer than the idle timeout.
                Got::Eof | Got::Idle => return Ok(()),
                Got::Late => return too_slow(&mut sock),
            }
        };
        buf.drain(..used);
        let req = match parsed {
            Parsed::Refuse(code, reason, allow) => {
                let mut r = simple(code, reason, true, false);
                if let Some(a) = allow {
                    r = with_header(r, "Allow", a);
                }
                return refuse(&mut sock, &r);
            }
            Parsed::Req(r) => r,
        };
        // Discard a small request body (GET with a body is legal, if odd), under
        // the head's deadline; never read past it (the next request may follow).
        if req.body > 0 {
            if req.body > MAX_DISCARD {
                return refuse(&mut sock, &simple(413, "Content Too Large", true, false));
            }
            let mut left = req.body;
            let have = (buf.len() as u64).min(left);
            buf.drain(..have as usize);
            left -= have;
            while left > 0 {
                let mut tmp = [0u8; 4096];
                let want = (left as usize).min(tmp.len());
                match read_by(&mut sock, &mut tmp[..want], due, sh.idle)? {
                    Got::Bytes(n) => left -= n as u64,
                    Got::Eof | Got::Idle => return Ok(()),
                    Got::Late => return too_slow(&mut sock),
                }
            }
        }
        due = None;
        if !respond(sh, &mut sock, &req)? || !req.keep_alive {
            return Ok(());
        }
    }
}

/// What one read of a request brought.
enum Got {
    Bytes(usize),
    Eof,
    /// Nothing for the idle timeout.
    Idle,
    /// The request's deadline passed.
    Late,
}

/// One read, waiting at most until `due` (if any) and at most `idle`.
fn read_by(
    sock: &mut TcpStream,
    buf: &mut [u8],
    due: Option<Instant>,
    idle: Duration,
) -> io::Result<Got> {
    loop {
        let wait = match due {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => left.min(idle),
                _ => return Ok(Got::Late),
            },
            None => idle,
        };
        sock.set_read_timeout(Some(wait))?;
        match sock.read(buf) {
            Ok(0) => return Ok(Got::Eof),
            Ok(n) => return Ok(Got::Bytes(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if due.is_some_and(|d| Instant::now() >= d) {
                    return Ok(Got::Late);
                }
                return Ok(Got::Idle);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The request did not arrive in time: 408, then close.
fn too_slow(sock: &mut TcpStream) -> io::Result<()> {
    refuse(sock, &simple(408, "Request Timeout", true, false))
}

/// Sends a final answer and closes the connection, reading for a moment what
/// the client still sends (see [`LINGER`]).
fn refuse(sock: &mut TcpStream, answer: &[u8]) -> io::Result<()> {
    sock.write_all(answer)?;
    let _ = sock.shutdown(Shutdown::Write);
    let until = Instant::now() + LINGER;
    let mut left = LINGER_BYTES;
    let mut tmp = [0u8; 4096];
    while left > 0 {
        let Some(wait) = until
            .checked_duration_since(Instant::now())
            .filter(|w| !w.is_zero())
        else {
            break;
        };
        sock.set_read_timeout(Some(wait))?;
        match sock.read(&mut tmp) {
            Ok(0) => break,
            Ok(n) => left = left.saturating_sub(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    Ok(())
}

/// `Ok(None)`: the head is not complete yet. Second value: bytes consumed.
fn parse(buf: &[u8]) -> io::Result<Option<(Parsed, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let used = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Ok(Some((
                Parsed::Refuse(431, "Request Header Fields Too Large", None),
                buf.len(),
            )))
        }
        Err(_) => return Ok(Some((Parsed::Refuse(400, "Bad Request", None), buf.len()))),
    };
    let refuse = |c, r| Ok(Some((Parsed::Refuse(c, r, None), used)));
    let version = req.version.unwrap_or(1);
    let method = req.method.unwrap_or("");
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            return Ok(Some((
                Parsed::Refuse(405, "Method Not Allowed", Some("GET, HEAD")),
                used,
            )))
        }
    };
    let mut hosts = 0;
    let mut conn_close = false;
    let mut conn_keep = false;
    let mut range = None;
    let mut body: Option<u64> = None;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("host") {
            hosts += 1;
        } else if name.eq_ignore_ascii_case("connection") {
            for tok in h.value.split(|b| *b == b',') {
                let tok = tok.trim_ascii();
                if tok.eq_ignore_ascii_case(b"close") {
                    conn_close = true;
                } else if tok.eq_ignore_ascii_case(b"keep-alive") {
                    conn_keep = true;
                }
            }
        } else if name.eq_ignore_ascii_case("range") {
            range = Some(h.value.to_vec());
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // No transfer coding is implemented, so the body's end is unknown.
            return refuse(400, "Bad Request");
        } else if name.eq_ignore_ascii_case("content-length") {
            // Exactly one, plain digits: a second one, a list, a sign or anything
            // else is a length another parser may read differently (RFC 9112 §6.3).
            match (body, content_length(h.value)) {
                (None, Some(n)) => body = Some(n),
                _ => return refuse(400, "Bad Request"),
            }
        }
    }
    let body = body.unwrap_or(0);
    // RFC 9112 §3.2: more than one Host is an error, whatever the version.
    if hosts > 1 {
        return refuse(400, "Bad Request");
    }
    let host = hosts == 1;
    if version == 1 && !host {
        return refuse(400, "Bad Request");
    }
    let keep_alive = if version == 1 {
        !conn_close
    } else {
        conn_keep && !conn_close
    };
    let target = req.path.unwrap_or("").as_bytes();
    Ok(Some((
        Parsed::Req(Request {
            head_only,
            keep_alive,
            echo_keep_alive: version == 0 && keep_alive,
            path: target.to_vec(),
            range,
            body,
        }),
        used,
    )))
}

/// A `Content-Length` value: 1*DIGIT (surrounding blanks allowed), in range.
fn content_length(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// Sends the response. `Ok(false)`: the connection must close (the body could
/// not be sent in full, so the client cannot find the next response).
fn respond(sh: &Shared, sock: &mut TcpStream, req: &Request) -> io::Result<bool> {
    let send_err = |sock: &mut TcpStream, code, reason| -> io::Result<bool> {
        let mut r = simple(code, reason, !req.keep_alive, req.head_only);
        if req.echo_keep_alive {
            r = with_header(r, "Connection", "keep-alive");
        }
        sock.write_all(&r)?;
        Ok(true)
    };
    let Some(rel) = resolve_target(&req.path) else {
        return send_err(sock, 400, "Bad Request");
    };
    let Some((file, path)) = open_under(sh, &rel) else {
        return send_err(sock, 404, "Not Found");
    };
    let meta = file.metadata()?;
    let size = meta.len();
    let (status, start, len) = match req.range.as_deref().map(|r| parse_range(r, size)) {
        None | Some(RangeAns::Ignore) => (200, 0, size),
        Some(RangeAns::Part(a, b)) => (206, a, b - a + 1),
        Some(RangeAns::Unsatisfiable) => {
            let mut r = simple(416, "Range Not Satisfiable", !req.keep_alive, req.head_only);
            r = with_header(r, "Content-Range", &format!("bytes */{size}"));
            sock.write_all(&r)?;
            return Ok(true);
        }
    };
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\nServer: fido\r\nDate: {}\r\nContent-Type: {}\r\nContent-Length: {len}\r\nAccept-Ranges: bytes\r\n",
        if status == 200 { "OK" } else { "Partial Content" },
        httpdate::fmt_http_date(SystemTime::now()),
        content_type(&path),
    );
    if let Ok(m) = meta.modified() {
        head.push_str(&format!(
            "Last-Modified: {}\r\n",
            httpdate::fmt_http_date(m)
        ));
    }
    if status == 206 {
        head.push_str(&format!(
            "Content-Range: bytes {start}-{}/{size}\r\n",
            start + len - 1
        ));
    }
    if !req.keep_alive {
        head.push_str("Connection: close\r\n");
    } else if req.echo_keep_alive {
        head.push_str("Connection: keep-alive\r\n");
    }
    head.push_str("\r\n");
    let body = !req.head_only && len > 0;
    // MSG_MORE: the head leaves in the same segment as the start of the body.
    let flags = if body {
        rustix::net::SendFlags::MORE
    } else {
        rustix::net::SendFlags::empty()
    };
    let mut h = head.as_bytes();
    while !h.is_empty() {
        match rustix::net::send(sock.as_fd(), h, flags) {
            Ok(n) => h = &h[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if !body {
        return Ok(true);
    }
    let sent = sh
        .mover
        .file_to_socket(file.as_fd(), start, len, sock.as_fd())?;
    if sent < len {
        // The file shrank under us: the promised length cannot be kept.
        tracing::warn!(
            "{}: sent {sent} of {len} bytes (file truncated?)",
            path.display()
        );
        return Ok(false);
    }
    Ok(true)
}

/// Decodes the request target into a relative path made of normal components
/// only. `None` for anything that is not an origin-form path, has bad escapes,
/// NUL bytes or a `..` segment (the latter could only mean leaving DIR).
fn resolve_target(target: &[u8]) -> Option<PathBuf> {
    let mut path = target.split(|b| *b == b'?' || *b == b'#').next()?;
    // Absolute form (`GET http://host/x`), which servers must accept (RFC 9112
    // §3.2.2): only the path matters here.
    for scheme in [&b"http://"[..], &b"https://"[..]] {
        if path.len() > scheme.len() && path[..scheme.len()].eq_ignore_ascii_case(scheme) {
            let rest = &path[scheme.len()..];
            path = match rest.iter().position(|b| *b == b'/') {
                Some(i) => &rest[i..],
                None => b"/",
            };
        }
    }
    if path.first() != Some(&b'/') {
        return None;
    }
    let mut dec = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        if path[i] == b'%' {
            let hex = path.get(i + 1..i + 3)?;
            let v = u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
            dec.push(v);
            i += 3;
        } else {
            dec.push(path[i]);
            i += 1;
        }
    }
    if dec.contains(&0) {
        return None;
    }
    let mut rel = PathBuf::new();
    for seg in dec.split(|b| *b == b'/') {
        match seg {
            b"" | b"." => {}
            b".." => return None,
            s => rel.push(std::ffi::OsStr::from_bytes(s)),
        }
    }
    // Belt and braces: only plain names survive.
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return None;
    }
    Some(rel)
}

/// Opens `rel` beneath DIR (a directory: its `index.html`) if it is a regular
/// file; returns it with the path it was opened as (for its content type).
/// `None` for anything else: missing, a symlink out of DIR (or any symlink,
/// with `--no-symlinks`), a FIFO, a device, a socket.
fn open_under(sh: &Shared, rel: &Path) -> Option<(File, PathBuf)> {
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let (fd, kind) = open_beneath(sh, rel)?;
    match kind {
        FileType::RegularFile => Some((File::from(fd), rel.to_path_buf())),
        FileType::Directory => {
            // Resolved from DIR again: if the directory was swapped meanwhile,
            // this finds another file beneath DIR, never one outside it.
            let index = rel.join("index.html");
            match open_beneath(sh, &index)? {
                (fd, FileType::RegularFile) => Some((File::from(fd), index)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `openat2` beneath DIR, then `fstat`; a regular file's `O_NONBLOCK` is
/// cleared (it only guarded the open, and the movers expect blocking I/O).
fn open_beneath(sh: &Shared, rel: &Path) -> Option<(OwnedFd, FileType)> {
    let fd = match rustix::fs::openat2(&sh.root, rel, OPEN_FLAGS, Mode::empty(), sh.resolve) {
        Ok(fd) => fd,
        Err(e) => {
            // EXDEV: the path leads out of DIR; ELOOP: a symlink with --no-symlinks.
            tracing::debug!("{}: {e}", rel.display());
            return None;
        }
    };
    let kind = FileType::from_raw_mode(rustix::fs::fstat(&fd).ok()?.st_mode);
    if kind == FileType::RegularFile {
        rustix::fs::fcntl_setfl(&fd, OFlags::empty()).ok()?;
    }
    Some((fd, kind))
}

enum RangeAns {
    Ignore,
    Part(u64, u64),
    Unsatisfiable,
}

/// One `bytes=` range against a file of `size` bytes (inclusive bounds).
fn parse_range(v: &[u8], size: u64) -> RangeAns {
    let Ok(v) = std::str::from_utf8(v) else {
        return RangeAns::Ignore;
    };
    let Some(spec) = v.trim().strip_prefix("bytes=") else {
        return RangeAns::Ignore;
    };
    if spec.contains(',') {
        return RangeAns::Ignore;
    }
    let Some((a, b)) = spec.trim().split_once('-') else {
        return RangeAns::Ignore;
    };
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| s.parse::<u64>().ok();
    if a.is_empty() {
        // Suffix: the last n bytes.
        return match num(b) {
            Some(0) => RangeAns::Unsatisfiable,
            Some(_) if size == 0 => RangeAns::Unsatisfiable,
            Some(n) => RangeAns::Part(size - n.min(size), size - 1),
            None => RangeAns::Ignore,
        };
    }
    let Some(start) = num(a) else {
        return RangeAns::Ignore;
    };
    let end = if b.is_empty() {
        size.saturating_sub(1)
    } else {
        match num(b) {
            Some(e) if e >= start => e.min(size.saturating_sub(1)),
            _ => return RangeAns::Ignore,
        }
    };
    if start >= size {
        return RangeAns::Unsatisfiable;
    }
    RangeAns::Part(start, end)
}

fn content_type(p: &Path) -> &'static str {
    let ext = p
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "txt" | "md" => "text/plain; charset=utf-8",
        "css" => "text/css",
        "js" | "mjs" => "text/javascript",
        "json" => "application/json",
        "xml" => "application/xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "webp" => "image/webp",
        "ico" => "image/x-icon",
        "pdf" => "application/pdf",
        "wasm" => "application/wasm",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        _ => "application/octet-stream",
    }
}

/// A complete response with a short text body (or none for HEAD).
fn simple(code: u16, reason: &str, close: bool, head_only: bool) -> Vec<u8> {
    let body = format!("{code} {reason}\n");
    let mut r = format!(
        "HTTP/1.1 {code} {reason}\r\nServer: fido\r\nDate: {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n{}\r\n",
        httpdate::fmt_http_date(SystemTime::now()),
        body.len(),
        if close { "Connection: close\r\n" } else { "" },
    );
    if !head_only {
        r.push_str(&body);
    }
    r.into_bytes()
}

/// Inserts a header line into a response built by [`simple`].
fn with_header(resp: Vec<u8>, name: &str, value: &str) -> Vec<u8> {
    let s = String::from_utf8(resp).expect("ascii");
    let i = s.find("\r\n").expect("status line") + 2;
    format!("{}{name}: {value}\r\n{}", &s[..i], &s[i..]).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(
            resolve_target(b"/a/b.txt?x=1").unwrap(),
            PathBuf::from("a/b.txt")
        );
        assert_eq!(resolve_target(b"/a%20b").unwrap(), PathBuf::from("a b"));
        assert_eq!(resolve_target(b"/").unwrap(), PathBuf::new());
        assert!(resolve_target(b"/../etc/passwd").is_none());
        assert!(resolve_target(b"/a/%2e%2e/%2e%2e/x").is_none());
        assert!(resolve_target(b"/a%2f..%2fb").is_none());
        assert!(resolve_target(b"/a%00").is_none());
        assert!(resolve_target(b"/a%4").is_none());
        assert_eq!(resolve_target(b"http://x/a?q").unwrap(), PathBuf::from("a"));
        assert_eq!(resolve_target(b"HTTP://x").unwrap(), PathBuf::new());
        assert!(resolve_target(b"http://x/../y").is_none());
        assert!(resolve_target(b"ftp://x/").is_none());
        assert!(resolve_target(b"*").is_none());
    }

    #[test]
    fn ranges() {
        let p = |s: &str| match parse_range(s.as_bytes(), 100) {
            RangeAns::Ignore => "ignore".to_string(),
            RangeAns::Unsatisfiable => "416".to_string(),
            RangeAns::Part(a, b) => format!("{a}-{b}"),
        };
        assert_eq!(p("bytes=0-9"), "0-9");
        assert_eq!(p("bytes=90-"), "90-99");
        assert_eq!(p("bytes=90-500"), "90-99");
        assert_eq!(p("bytes=-10"), "90-99");
        assert_eq!(p("bytes=-500"), "0-99");
        assert_eq!(p("bytes=100-"), "416");
        assert_eq!(p("bytes=-0"), "416");
        assert_eq!(p("bytes=5-2"), "ignore");
        assert_eq!(p("bytes=0-1,5-6"), "ignore");
        assert_eq!(p("items=0-1"), "ignore");
    }

    #[test]
    fn heads() {
        let ok = |s: &str| match parse(s.as_bytes()).unwrap() {
            Some((Parsed::Req(r), n)) => {
                format!("ok ka={} head={} n={n}", r.keep_alive, r.head_only)
            }
            Some((Parsed::Refuse(c, _, _), _)) => format!("refuse {c}"),
            None => "partial".into(),
        };
        assert_eq!(
            ok("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            "ok ka=true head=false n=27"
        );
        assert_eq!(ok("HEAD / HTTP/1.0\r\n\r\n"), "ok ka=false head=true n=19");
        assert_eq!(
            ok("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
            "ok ka=false head=false n=46"
        );
        assert_eq!(ok("GET / HTTP/1.1\r\n\r\n"), "refuse 400");
        assert_eq!(ok("POST / HTTP/1.1\r\nHost: x\r\n\r\n"), "refuse 405");
        assert_eq!(
            ok("GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"),
            "refuse 400"
        );
        assert_eq!(ok("GET / HTTP/1.1\r\nHost"), "partial");
        assert_eq!(ok("G\0T / HTTP/1.1\r\n\r\n"), "refuse 400");
    }

    /// Framing two parsers could read differently is refused (RFC 9112 §6.3):
    /// what a request smuggler needs. Some of it httparse refuses itself
    /// (space before the colon, obs-fold, bare CR, NUL); checked here all
    /// the same, since the server's safety depends on it.
    #[test]
    fn ambiguous_framing() {
        let status = |extra: &str| {
            let h = format!("GET / HTTP/1.1\r\nHost: x\r\n{extra}\r\n");
            match parse(h.as_bytes()).unwrap() {
                Some((Parsed::Req(r), _)) => format!("ok body={}", r.body),
                Some((Parsed::Refuse(c, _, _), _)) => format!("refuse {c}"),
                None => "partial".into(),
            }
        };
        assert_eq!(status("Content-Length: 5\r\n"), "ok body=5");
        assert_eq!(status("Content-Length:  5 \r\n"), "ok body=5");
        assert_eq!(
            status("Content-Length: 0\r\nContent-Length: 42\r\n"),
            "refuse 400"
        );
        assert_eq!(
            status("Content-Length: 5\r\nContent-Length: 5\r\n"),
            "refuse 400"
        );
        assert_eq!(
            status("content-length: 5\r\nCONTENT-LENGTH: 5\r\n"),
            "refuse 400"
        );
        for bad in [
            "+5",
            "-5",
            "5,5",
            "5, 5",
            "5 5",
            "0x5",
            "5e1",
            "",
            "99999999999999999999999",
        ] {
            assert_eq!(
                status(&format!("Content-Length: {bad}\r\n")),
                "refuse 400",
                "{bad:?}"
            );
        }
        assert_eq!(status("Transfer-Encoding: identity\r\n"), "refuse 400");
        assert_eq!(
            status("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
            "refuse 400"
        );
        assert_eq!(status("Content-Length : 5\r\n"), "refuse 400");
        assert_eq!(status("X-A: a\r\n b\r\n"), "refuse 400", "obs-fold");
        assert_eq!(status("X-A: a\rb\r\n"), "refuse 400", "bare CR");
        assert_eq!(status("X-A: a\0b\r\n"), "refuse 400");
        assert_eq!(status("Host: y\r\n"), "refuse 400", "two Hosts");
        assert_eq!(
            match parse(b"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n").unwrap() {
                Some((Parsed::Refuse(c, _, _), _)) => c,
                _ => 0,
            },
            400
        );
    }

    /// Random heads made of the pieces smugglers use never panic the parser,
    /// and whatever it accepts has exactly one reading: at most one
    /// Content-Length of plain digits, no Transfer-Encoding, one Host.
    #[test]
    fn random_heads_have_one_reading() {
        const NAMES: &[&str] = &[
            "Content-Length",
            "content-length",
            "Transfer-Encoding",
            "Host",
            "X-A",
            "Content-Length ",
        ];
        const SEPS: &[&str] = &[":", ": ", " :", ":\t"];
        const VALUES: &[&str] = &[
            "0", "5", "42", "+", "-", ",", " ", "chunked", "identity", "\0", "\r", "\u{e9}",
        ];
        const ENDS: &[&str] = &["\r\n", "\r\n", "\r\n", "\n", "\r\n "];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut accepted, mut with_length) = (0, 0);
        for _ in 0..50_000 {
            let mut h = String::from("GET / HTTP/1.1\r\nHost: x\r\n");
            let pick = |from: &[&'static str], r: u64| from[(r % from.len() as u64) as usize];
            for _ in 0..next() % 4 {
                h.push_str(pick(NAMES, next()));
                h.push_str(pick(SEPS, next()));
                for _ in 0..1 + next() % 3 {
                    h.push_str(pick(VALUES, next()));
                }
                h.push_str(pick(ENDS, next()));
            }
            h.push_str("\r\n");
            let Some((Parsed::Req(req), _)) = parse(h.as_bytes()).unwrap() else {
                continue;
            };
            accepted += 1;
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut r = httparse::Request::new(&mut headers);
            r.parse(h.as_bytes()).unwrap();
            let named = |n: &str| {
                r.headers
                    .iter()
                    .filter(|x| x.name.eq_ignore_ascii_case(n))
                    .count()
            };
            assert_eq!(named("transfer-encoding"), 0, "{h:?}");
            assert_eq!(named("host"), 1, "{h:?}");
            match r
                .headers
                .iter()
                .find(|x| x.name.eq_ignore_ascii_case("content-length"))
            {
                None => assert_eq!(req.body, 0, "{h:?}"),
                Some(cl) => {
                    assert_eq!(named("content-length"), 1, "{h:?}");
                    let digits = cl.value.trim_ascii();
                    assert!(digits.iter().all(u8::is_ascii_digit), "{h:?}");
                    let n: u64 = std::str::from_utf8(digits).unwrap().parse().unwrap();
                    assert_eq!(req.body, n, "{h:?}");
                    with_length += 1;
                }
            }
        }
        // The mix reaches both sides: plain heads, and heads with a length.
        assert!(
            accepted > 1000 && with_length > 100,
            "{accepted} {with_length}"
        );
    }
}
