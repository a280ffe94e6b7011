//! `fido pipe serve`, `fido pipe proxy` and `fido-bench pipe`, end to end: the
//! server is fetched with the real `curl` (Debian package) and raw sockets,
//! every body compared byte for byte with the file; the proxy carries a
//! transfer in both directions with a half-close in the middle; the bench runs
//! a small filter and writes well-formed records.
//!
//! Each server/proxy test runs once per strategy available in this build
//! (`fido` — the broker's pipe engine, against a private broker — plus
//! `sendfile` and `readwrite`, which need nothing).

use fido_test_support::bytes::pattern;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

/// A running `fido ...` process, killed and reaped when dropped.
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private `fido broker` in a temporary directory (for the `fido` strategy).
struct Broker {
    _p: Proc,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

fn broker() -> Broker {
    let dir = tempfile::tempdir().unwrap();
    let (p, socket) = broker_in(dir.path());
    Broker {
        _p: p,
        socket,
        _dir: dir,
    }
}

/// Starts `fido broker` with its socket and state in `dir`; waits for the socket.
fn broker_in(dir: &Path) -> (Proc, PathBuf) {
    broker_with(dir, &[])
}

fn broker_with(dir: &Path, extra: &[&str]) -> (Proc, PathBuf) {
    let socket = dir.join("broker.sock");
    let _ = std::fs::remove_file(&socket);
    let child = Command::new(FIDO)
        .args(["broker", "--socket"])
        .arg(&socket)
        .args(extra)
        // The quota test makes the broker warn on every refused pipe.
        .env("RUST_LOG", "error")
        .arg("--state-dir")
        .arg(dir.join("state"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let p = Proc { child };
    let t = Instant::now();
    while !socket.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "broker did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p, socket)
}

/// Strategies to test, and a broker when the engine is part of this build.
fn strategies() -> Vec<&'static str> {
    let mut v = vec!["sendfile", "readwrite"];
    if engine_built() {
        v.insert(0, "fido");
    }
    v
}

/// Whether this build has the pipe engine (`fido pipe serve --strategy fido`
/// starts instead of saying the engine is not available).
fn engine_built() -> bool {
    let out = Command::new(FIDO)
        .args([
            "pipe",
            "serve",
            "/nonexistent-dir",
            "--port",
            "0",
            "--strategy",
            "fido",
        ])
        .env("FIDO_BROKER", "/nonexistent/broker.sock")
        .output()
        .unwrap();
    !String::from_utf8_lossy(&out.stderr).contains("not available in this build")
}

/// Starts `fido pipe <args>` and returns it with the address it announced.
fn start(args: &[&str], broker: Option<&Path>) -> (Proc, SocketAddr) {
    let mut cmd = Command::new(FIDO);
    cmd.arg("pipe").args(args);
    if let Some(b) = broker {
        cmd.env("FIDO_BROKER", b);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let p = Proc { child };
    let addr = line
        .split_whitespace()
        .find_map(|w| {
            w.trim_start_matches("http://")
                .trim_end_matches('/')
                .parse::<SocketAddr>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no address announced: {line:?}"));
    (p, addr)
}


fn curl(args: &[&str]) -> std::process::Output {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "60"])
        .args(args)
        .output()
        .expect("curl must be installed (scripts/install-test-deps.sh)");
    out
}

/// A site with a big file, an empty one, an index, a secret next to (not under)
/// the root and a symlink pointing at it.
fn site() -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("www");
    std::fs::create_dir_all(root.join("sub")).unwrap();
    // Not a multiple of any chunk size, so the last piece is partial.
    let big = pattern(5 * (1 << 20) + 12_345, 7);
    std::fs::write(root.join("big.bin"), &big).unwrap();
    std::fs::write(root.join("empty.txt"), b"").unwrap();
    std::fs::write(root.join("sub/index.html"), b"<p>hi</p>\n").unwrap();
    std::fs::write(root.join("a b.txt"), b"space\n").unwrap();
    std::fs::write(top.path().join("secret"), b"do not serve\n").unwrap();
    std::os::unix::fs::symlink(top.path().join("secret"), root.join("evil")).unwrap();
    (top, root, big)
}

fn status_of(args: &[&str]) -> String {
    let out = curl(&[&["-o", "/dev/null", "-w", "%{http_code}"], args].concat());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn serve_files_with_curl() {
    let (_top, root, big) = site();
    let b = broker();
    for s in strategies() {
        let (_srv, addr) = start(
            &[
                "serve",
                root.to_str().unwrap(),
                "--port",
                "0",
                "--strategy",
                s,
            ],
            Some(&b.socket),
        );
        let url = |p: &str| format!("http://{addr}{p}");
        // GET: every byte equal.
        let out = curl(&[&url("/big.bin")]);
        assert!(
            out.status.success(),
            "{s}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout.len(), big.len(), "{s}: length");
        assert!(out.stdout == big, "{s}: body differs from the file");
        // HEAD: the length, no body.
        let out = curl(&["-I", &url("/big.bin")]);
        let head = String::from_utf8_lossy(&out.stdout).to_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{s}: {head}");
        assert!(
            head.contains(&format!("content-length: {}", big.len())),
            "{s}: {head}"
        );
        // Ranges, including the edges.
        let out = curl(&["-r", "1000-1999", &url("/big.bin")]);
        assert!(out.stdout == big[1000..2000], "{s}: range");
        let out = curl(&["-r", "-10", &url("/big.bin")]);
        assert!(out.stdout == big[big.len() - 10..], "{s}: suffix range");
        assert_eq!(
            status_of(&["-r", &format!("{}-", big.len()), &url("/big.bin")]),
            "416"
        );
        // Empty file, directory index, escaped name.
        let out = curl(&["-i", &url("/empty.txt")]);
        let t = String::from_utf8_lossy(&out.stdout).to_lowercase();
        assert!(t.contains("content-length: 0"), "{s}: {t}");
        assert_eq!(curl(&[&url("/sub/")]).stdout, b"<p>hi</p>\n");
        assert_eq!(curl(&[&url("/a%20b.txt")]).stdout, b"space\n");
        // Refusals.
        assert_eq!(status_of(&[&url("/missing")]), "404", "{s}");
        assert_eq!(
            status_of(&["--path-as-is", &url("/../secret")]),
            "400",
            "{s}"
        );
        assert_eq!(
            status_of(&["--path-as-is", &url("/sub/%2e%2e/%2e%2e/secret")]),
            "400",
            "{s}"
        );
        assert_eq!(
            status_of(&[&url("/evil")]),
            "404",
            "{s}: symlink out of the root"
        );
        assert_eq!(status_of(&["-X", "POST", &url("/big.bin")]), "405", "{s}");
        assert_eq!(status_of(&["-X", "DELETE", &url("/big.bin")]), "405", "{s}");
        // Keep-alive: curl reuses the connection for the second URL.
        let out = curl(&[
            "-v",
            "-o",
            "/dev/null",
            "-o",
            "/dev/null",
            &url("/big.bin"),
            &url("/sub/"),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Re-using existing connection"),
            "{s}: no keep-alive:\n{err}"
        );
    }
}

/// Reads one response (head + Content-Length body) from `r`.
fn read_response(r: &mut BufReader<TcpStream>) -> (String, Vec<u8>) {
    let mut head = String::new();
    loop {
        let mut l = String::new();
        assert!(
            r.read_line(&mut l).unwrap() > 0,
            "connection closed mid-head"
        );
        if l == "\r\n" {
            break;
        }
        head.push_str(&l);
    }
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .expect("content-length");
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    (head, body)
}

#[test]
fn serve_pipelined_and_malformed() {
    let (_top, root, big) = site();
    let b = broker();
    for s in strategies() {
        let (_srv, addr) = start(
            &[
                "serve",
                root.to_str().unwrap(),
                "--port",
                "0",
                "--strategy",
                s,
            ],
            Some(&b.socket),
        );
        // Three pipelined requests in one write, answered in order on one connection.
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(
            b"GET /big.bin HTTP/1.1\r\nHost: t\r\n\r\nGET /missing HTTP/1.1\r\nHost: t\r\n\r\nGET /sub/ HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let mut r = BufReader::new(c.try_clone().unwrap());
        let (h1, b1) = read_response(&mut r);
        assert!(h1.starts_with("HTTP/1.1 200"), "{s}: {h1}");
        assert!(b1 == big, "{s}: pipelined body differs");
        let (h2, _) = read_response(&mut r);
        assert!(h2.starts_with("HTTP/1.1 404"), "{s}: {h2}");
        let (h3, b3) = read_response(&mut r);
        assert!(
            h3.starts_with("HTTP/1.1 200") && h3.contains("Connection: close"),
            "{s}: {h3}"
        );
        assert_eq!(b3, b"<p>hi</p>\n");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{s}: bytes after Connection: close");
        // Garbage gets a 400 and the connection closes; the server lives on.
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(b"\x00\x01garbage\r\n\r\n").unwrap();
        let mut t = String::new();
        c.read_to_string(&mut t).unwrap();
        assert!(t.starts_with("HTTP/1.1 400"), "{s}: {t}");
        // A client that vanishes mid-body does not hurt the next one.
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /big.bin HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let mut few = [0u8; 100];
        c.read_exact(&mut few).unwrap();
        drop(c);
        let out = curl(&[&format!("http://{addr}/big.bin")]);
        assert!(out.stdout == big, "{s}: after an aborted client");
    }
}

/// Upstream for the proxy test: reads until the client half-closes, then
/// answers with the length and a digest of what it got, then `reply` bytes.
fn upstream(reply: Vec<u8>) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap(); // ends only if the half-close came through
        let d = digest(&got);
        s.write_all(&(got.len() as u64).to_le_bytes()).unwrap();
        s.write_all(&d.to_le_bytes()).unwrap();
        s.write_all(&reply).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
    });
    (addr, h)
}

fn digest(b: &[u8]) -> u64 {
    // FNV-1a: order-sensitive, enough to catch a lost, duplicated or swapped piece.
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x1000_0000_01b3)
    })
}

#[test]
fn proxy_both_ways_with_half_close() {
    let b = broker();
    for s in strategies() {
        let request = pattern(3 * (1 << 20) + 77, 11);
        let reply = pattern(4 * (1 << 20) + 5, 13);
        let (up, uh) = upstream(reply.clone());
        let (_p, addr) = start(
            &["proxy", "127.0.0.1:0", &up.to_string(), "--strategy", s],
            Some(&b.socket),
        );
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut w = c.try_clone().unwrap();
        let req = request.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&req).unwrap();
            w.shutdown(Shutdown::Write).unwrap();
        });
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        writer.join().unwrap();
        uh.join().unwrap();
        assert_eq!(back.len(), 16 + reply.len(), "{s}: reply length");
        assert_eq!(
            u64::from_le_bytes(back[..8].try_into().unwrap()),
            request.len() as u64,
            "{s}"
        );
        assert_eq!(
            u64::from_le_bytes(back[8..16].try_into().unwrap()),
            digest(&request),
            "{s}"
        );
        assert!(back[16..] == reply[..], "{s}: reply differs");
    }
}

#[test]
fn proxy_in_front_of_serve_with_curl() {
    let (_top, root, big) = site();
    let b = broker();
    let s = strategies()[0];
    let (_srv, srv) = start(
        &[
            "serve",
            root.to_str().unwrap(),
            "--port",
            "0",
            "--strategy",
            s,
        ],
        Some(&b.socket),
    );
    let (_p, px) = start(
        &["proxy", "127.0.0.1:0", &srv.to_string(), "--strategy", s],
        Some(&b.socket),
    );
    let out = curl(&[
        &format!("http://{px}/big.bin"),
        &format!("http://{px}/big.bin"),
    ]);
    assert!(
        out.stdout.len() == 2 * big.len()
            && out.stdout[..big.len()] == big[..]
            && out.stdout[big.len()..] == big[..]
    );
    // Upstream gone: the client connection is closed, the proxy keeps running.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (_p2, px2) = start(
        &["proxy", "127.0.0.1:0", &dead.to_string(), "--strategy", s],
        Some(&b.socket),
    );
    let mut c = TcpStream::connect(px2).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut v = Vec::new();
    let _ = c.read_to_end(&mut v);
    assert!(v.is_empty());
    let mut c = TcpStream::connect(px2).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = c.read_to_end(&mut v);
}

#[test]
fn serve_drops_a_client_that_stops_reading() {
    let top = tempfile::tempdir().unwrap();
    // Far more than loopback socket buffers hold, so the server must wait on us.
    let big = pattern(48 << 20, 5);
    std::fs::write(top.path().join("huge.bin"), &big).unwrap();
    let b = broker();
    let mut servers = Vec::new();
    let mut stalled = Vec::new();
    for s in strategies() {
        let (p, addr) = start(
            &[
                "serve",
                top.path().to_str().unwrap(),
                "--port",
                "0",
                "--strategy",
                s,
                "--idle-secs",
                "1",
            ],
            Some(&b.socket),
        );
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /huge.bin HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        stalled.push((s, c));
        servers.push((p, addr));
    }
    // Read nothing for well over the 1 s timeout.
    std::thread::sleep(Duration::from_secs(5));
    for ((s, mut c), (_, addr)) in stalled.into_iter().zip(&servers) {
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got); // EOF or a reset: either way it ends
        assert!(
            got.len() < big.len(),
            "{s}: a stalled client still got the whole body"
        );
        // The server is fine for everybody else.
        let out = curl(&[&format!("http://{addr}/huge.bin")]);
        assert!(
            out.stdout == big,
            "{s}: body differs after dropping a stalled client"
        );
    }
}

#[test]
fn serve_heals_after_a_broker_restart() {
    if !engine_built() {
        return;
    }
    let (_top, root, big) = site();
    let dir = tempfile::tempdir().unwrap();
    let (b1, socket) = broker_in(dir.path());
    let (_srv, addr) = start(
        &[
            "serve",
            root.to_str().unwrap(),
            "--port",
            "0",
            "--strategy",
            "fido",
        ],
        Some(&socket),
    );
    let url = format!("http://{addr}/big.bin");
    assert!(curl(&[&url]).stdout == big);
    drop(b1); // SIGKILL: the engine and the server's session die with it
    let (_b2, _) = broker_in(dir.path());
    // The first requests may fail (the server notices the dead session); it rejoins
    // on its own (at most one try per second) and serves again.
    let t = Instant::now();
    loop {
        let out = curl(&[&url]);
        if out.stdout == big {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the server never rejoined the new broker"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn serve_over_the_pipe_quota_falls_back_in_process() {
    if !engine_built() {
        return;
    }
    let (_top, root, big) = site();
    let dir = tempfile::tempdir().unwrap();
    // One pipe at a time for our uid: concurrent bodies exceed it.
    let uid = rustix::process::geteuid().as_raw();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        format!("[[rule]]\nname = \"tiny\"\nuids = [{uid}]\npipes = 1\n"),
    )
    .unwrap();
    let (_b, socket) = broker_with(dir.path(), &["--policy", policy.to_str().unwrap()]);
    let (_srv, addr) = start(
        &[
            "serve",
            root.to_str().unwrap(),
            "--port",
            "0",
            "--strategy",
            "fido",
        ],
        Some(&socket),
    );
    let url = format!("http://{addr}/big.bin");
    let fetchers: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || curl(&[&url, &url, &url]).stdout)
        })
        .collect();
    for f in fetchers {
        let got = f.join().unwrap();
        assert_eq!(got.len(), 3 * big.len());
        assert!(got.chunks(big.len()).all(|c| c == big), "a body differs");
    }
}
