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
//! with `Allow`), malformed requests, missing `Host` on HTTP/1.1, request
//! bodies with `Transfer-Encoding` (400), headers over 16 KiB (431), paths that
//! leave DIR — `..` segments, encoded or not, and symlinks resolving outside
//! DIR (404: the server does not say what exists outside), more than
//! `max_conns` connections at once (503). A client that stops reading or
//! sending is dropped after the idle timeout; one client never holds up another
//! (one thread per connection).

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::mover::Mover;
use crate::proxy::in_context;

/// Largest request head (request line and headers) accepted.
const MAX_HEAD: usize = 16 << 10;
/// Largest request body (Content-Length) read and discarded.
const MAX_DISCARD: u64 = 64 << 10;
const MAX_HEADERS: usize = 64;

/// Server settings.
#[derive(Clone)]
pub struct ServeConfig {
    pub root: PathBuf,
    pub idle_timeout: Duration,
    pub max_conns: usize,
}

/// A bound server (the socket is listening once this exists).
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

struct Shared {
    root: PathBuf,
    mover: Arc<dyn Mover>,
    idle: Duration,
    max_conns: usize,
    conns: AtomicUsize,
}

impl Server {
    /// Binds `addr` and checks DIR.
    pub fn bind(
        addr: SocketAddr,
        cfg: ServeConfig,
        mover: Arc<dyn Mover>,
    ) -> io::Result<Server> {
        let root = cfg
            .root
            .canonicalize()
            .map_err(|e| in_context(e, format!("serve root {}", cfg.root.display())))?;
        if !root.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("serve root {} is not a directory", root.display()),
            ));
        }
        let listener =
            TcpListener::bind(addr).map_err(|e| in_context(e, format!("binding {addr}")))?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                root,
                mover,
                idle: cfg.idle_timeout,
                max_conns: cfg.max_conns.max(1),
                conns: AtomicUsize::new(0),
            }),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts forever (each connection on its own thread).
    pub fn run(self) -> io::Result<()> {
        loop {
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                // Out of descriptors or a connection reset before accept: keep serving.
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let shared = self.shared.clone();
            if shared.conns.fetch_add(1, Ordering::SeqCst) >= shared.max_conns {
                shared.conns.fetch_sub(1, Ordering::SeqCst);
                let mut s = sock;
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = s.write_all(&simple(503, "Service Unavailable", true, false));
                continue;
            }
            let spawned = std::thread::Builder::new()
                .name("fido-serve-conn".into())
                .stack_size(256 << 10)
                .spawn({
                    let shared = shared.clone();
                    move || {
                        if let Err(e) = connection(&shared, sock) {
                            tracing::debug!("connection {peer}: {e}");
                        }
                        shared.conns.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("spawning a connection thread: {e}");
                shared.conns.fetch_sub(1, Ordering::SeqCst);
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
    sock.set_read_timeout(Some(sh.idle))?;
    sock.set_write_timeout(Some(sh.idle))?;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    loop {
        // Read until a complete head is buffered (pipelined bytes stay in `buf`).
        let (parsed, used) = loop {
            if !buf.is_empty() {
                match parse(&buf)? {
                    Some(x) => break x,
                    None if buf.len() >= MAX_HEAD => {
                        let _ = sock.write_all(&simple(
                            431,
                            "Request Header Fields Too Large",
                            true,
                            false,
                        ));
                        return Ok(());
                    }
                    None => {}
                }
            }
            let mut tmp = [0u8; 4096];
            let n = match sock.read(&mut tmp) {
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(()); // idle: close quietly
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Ok(()); // the client closed (mid-head or between requests)
            }
            buf.extend_from_slice(&tmp[..n]);
        };
        buf.drain(..used);
        let req = match parsed {
            Parsed::Refuse(code, reason, allow) => {
                let mut r = simple(code, reason, true, false);
                if let Some(a) = allow {
                    r = with_header(r, "Allow", a);
                }
                sock.write_all(&r)?;
                return Ok(());
            }
            Parsed::Req(r) => r,
        };
        // Discard a small request body (GET with a body is legal, if odd).
        if req.body > 0 {
            if req.body > MAX_DISCARD {
                sock.write_all(&simple(413, "Content Too Large", true, false))?;
                return Ok(());
            }
            let mut left = req.body;
            let have = (buf.len() as u64).min(left);
            buf.drain(..have as usize);
            left -= have;
            if left > 0 {
                let mut sink = (&mut sock).take(left);
                let got = io::copy(&mut sink, &mut io::sink())?;
                if got < left {
                    return Ok(());
                }
            }
        }
        if !respond(sh, &mut sock, &req)? || !req.keep_alive {
            return Ok(());
        }
    }
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
    let mut host = false;
    let mut conn_close = false;
    let mut conn_keep = false;
    let mut range = None;
    let mut body = 0u64;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("host") {
            host = true;
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
            return refuse(400, "Bad Request");
        } else if name.eq_ignore_ascii_case("content-length") {
            match std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                Some(n) => body = n,
                None => return refuse(400, "Bad Request"),
            }
        }
    }
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
    let Some((file, path)) = open_under(&sh.root, &rel) else {
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

/// Opens `root/rel` (a directory: its index.html) if, with every symlink
/// resolved, it is a regular file inside `root`.
fn open_under(root: &Path, rel: &Path) -> Option<(File, PathBuf)> {
    let mut p = root.join(rel).canonicalize().ok()?;
    if !p.starts_with(root) {
        return None;
    }
    if p.is_dir() {
        p = p.join("index.html").canonicalize().ok()?;
        if !p.starts_with(root) {
            return None;
        }
    }
    let f = File::open(&p).ok()?;
    // Checked on the open descriptor: a rename between the checks cannot swap in a
    // directory or a device.
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    Some((f, p))
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
}
