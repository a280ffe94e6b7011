//! `fido-guest-check`: checks, from inside a VM, that the guest side of Fido
//! works — finds the control port, opens the link and the devices, prints
//! what the supervisor announced, maps the VM's own arena (at its PGVAS slot
//! address when asked), rings peers and waits for its own doorbell.
//!
//! ```text
//! fido-guest-check [--port DEV] [--slot N]
//!                  [--arena-expect OFF=TEXT] [--arena-write OFF=TEXT]
//!                  [--peer PORT=LEN] [--peer-write PORT=TEXT]
//!                  [--ring PEER:VECTOR] [--echo COUNT PEER:VECTOR]
//!                  [--status] [--hangup-wait] [--peer-watch PORT=SECONDS]
//! ```
//! Each step prints one `name: value` line; the exit status is 0 only when
//! every step worked. Needs root (VFIO, sysfs).
//!
//! - `--slot N`: map the own arena at PGVAS slot N's address (default geometry).
//! - `--arena-expect OFF=TEXT`: the own arena holds TEXT at OFF (written by the host).
//! - `--arena-write OFF=TEXT`: write TEXT into the own arena at OFF (for the host to see).
//! - `--peer PORT=LEN`: open the arena hot-plugged under root port PORT
//!   (an index into the Welcome's ports) read-only, print its first bytes.
//! - `--peer-write PORT=TEXT`: try to write TEXT at offset 0 of that arena's
//!   BAR through a writable mapping (root can open it read-write) and print
//!   what reads back: a read-only arena must be unchanged.
//! - `--ring PEER:VECTOR`: ring that ivshmem peer once.
//! - `--echo COUNT PEER:VECTOR`: take a doorbell (prints its vector), then
//!   COUNT times: wait for it (30 s at most), ring PEER:VECTOR.
//! - `--status`: asks the broker for its status through the link (the
//!   supervisor relays it) and prints the answer and every descriptor that
//!   came with it as the link transport made it: an arena (its first bytes),
//!   a ring token (rung once), a liveness socket.
//! - `--hangup-wait`: then waits (30 s at most) until each liveness socket
//!   reads end-of-file (the supervisor reported the peer's hang-up).
//! - `--peer-watch PORT=SECONDS`: maps the arena under root port PORT and
//!   prints its first bytes each time they change, for SECONDS (what a guest
//!   sees while the host writes, or unplugs, that arena).

use fido_guest::Guest;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// How long `--echo` waits for each ring.
const ECHO_WAIT: Duration = Duration::from_secs(30);
/// How many bytes of a peer arena `--peer` prints.
const PEEK: usize = 16;

#[derive(Default)]
struct Args {
    port: Option<PathBuf>,
    slot: Option<u32>,
    arena_expect: Vec<(u64, String)>,
    arena_write: Vec<(u64, String)>,
    peers: Vec<(u16, u64)>,
    peer_writes: Vec<(u16, String)>,
    rings: Vec<(u16, u16)>,
    echo: Option<(u64, u16, u16)>,
    status: bool,
    hangup_wait: bool,
    peer_watch: Option<(u16, u64)>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args::default();
    let mut it = std::env::args().skip(1);
    let split = |s: &str, sep: char| -> Result<(String, String), String> {
        s.split_once(sep)
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .ok_or_else(|| format!("{s:?}: expected A{sep}B"))
    };
    let num = |s: &str| -> Result<u64, String> {
        let r = match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => s.parse(),
        };
        r.map_err(|_| format!("{s:?} is not a number"))
    };
    let small = |s: &str| -> Result<u16, String> {
        u16::try_from(num(s)?).map_err(|_| format!("{s} is over 65535"))
    };
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--port" => args.port = Some(val()?.into()),
            "--slot" => {
                args.slot = Some(u32::try_from(num(&val()?)?).map_err(|_| "slot too large")?)
            }
            "--arena-expect" | "--arena-write" => {
                let (off, text) = split(&val()?, '=')?;
                let list = if a == "--arena-expect" {
                    &mut args.arena_expect
                } else {
                    &mut args.arena_write
                };
                list.push((num(&off)?, text));
            }
            "--peer" => {
                let (port, len) = split(&val()?, '=')?;
                args.peers.push((small(&port)?, num(&len)?));
            }
            "--peer-write" => {
                let (port, text) = split(&val()?, '=')?;
                args.peer_writes.push((small(&port)?, text));
            }
            "--ring" => {
                let (p, v) = split(&val()?, ':')?;
                args.rings.push((small(&p)?, small(&v)?));
            }
            "--echo" => {
                let count = num(&val()?)?;
                let (p, v) = split(&val()?, ':')?;
                args.echo = Some((count, small(&p)?, small(&v)?));
            }
            "--status" => args.status = true,
            "--peer-watch" => {
                let (port, secs) = split(&val()?, '=')?;
                args.peer_watch = Some((small(&port)?, num(&secs)?));
            }
            "--hangup-wait" => args.hangup_wait = true,
            "-h" | "--help" => {
                return Err(
                    "usage: see the top of crates/fido-guest/src/bin/fido-guest-check.rs".into(),
                )
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

/// A shared mapping of a BAR, read and written only with volatile byte
/// accesses: another domain (the host) writes this memory concurrently.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: u64, writable: bool, at: Option<u64>) -> Result<Mapping, String> {
        use rustix::mm::{MapFlags, ProtFlags};
        let len = usize::try_from(len).map_err(|_| "BAR too large")?;
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        let (addr, flags) = match at {
            Some(a) => (
                a as *mut std::ffi::c_void,
                MapFlags::SHARED | MapFlags::FIXED_NOREPLACE,
            ),
            None => (std::ptr::null_mut(), MapFlags::SHARED),
        };
        // SAFETY: a new shared mapping of a device BAR, at an address the
        // kernel picks or at a PGVAS slot address that FIXED_NOREPLACE
        // refuses if anything is mapped there; it aliases no Rust object and
        // is only reached through volatile accesses below.
        let ptr = unsafe { rustix::mm::mmap(addr, len, prot, flags, fd, 0) }
            .map_err(|e| format!("mmap: {e}"))?;
        if let Some(a) = at {
            if ptr as u64 != a {
                return Err(format!("mapped at {ptr:p}, not at {a:#x}"));
            }
        }
        Ok(Mapping {
            ptr: ptr as *mut u8,
            len,
        })
    }

    fn read(&self, off: u64, n: usize) -> Result<Vec<u8>, String> {
        let off = self.check(off, n)?;
        // SAFETY: `check` keeps [off, off + n) inside the mapping; each byte
        // is read volatile (the memory changes under us), no reference made.
        Ok((0..n)
            .map(|i| unsafe { std::ptr::read_volatile(self.ptr.add(off + i)) })
            .collect())
    }

    fn write(&self, off: u64, bytes: &[u8]) -> Result<(), String> {
        let off = self.check(off, bytes.len())?;
        for (i, b) in bytes.iter().enumerate() {
            // SAFETY: inside the mapping (checked), which is writable here
            // (only writable mappings are written); volatile, no reference.
            unsafe { std::ptr::write_volatile(self.ptr.add(off + i), *b) };
        }
        Ok(())
    }

    fn check(&self, off: u64, n: usize) -> Result<usize, String> {
        let off = usize::try_from(off).map_err(|_| "offset too large")?;
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(off),
            _ => Err(format!(
                "{n} bytes at {off} do not fit the {}-byte BAR",
                self.len
            )),
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes, no longer used.
        let _ = unsafe { rustix::mm::munmap(self.ptr as *mut std::ffi::c_void, self.len) };
    }
}

fn run(args: Args) -> Result<(), String> {
    let port = match args.port {
        Some(p) => p,
        None => Guest::detect()
            .ok_or("no virtio-serial port named org.fido.broker: not a Fido guest")?,
    };
    println!("port: {}", port.display());
    let guest = Guest::open(&port).map_err(|e| e.to_string())?;
    let w = guest.welcome();
    println!(
        "welcome: arena={} arena_len={} doorbell={} vectors={} own_peer={} ports={} max_peer_arena={}",
        w.arena,
        w.arena_len,
        w.doorbell,
        w.vectors,
        w.own_peer,
        w.ports.len(),
        w.max_peer_arena
    );
    println!(
        "register: {}",
        if guest.register_is_mapped() {
            "mapped"
        } else {
            "pwrite"
        }
    );

    let (arena_fd, arena_len) = guest.own_arena().map_err(|e| e.to_string())?;
    let at = args.slot.map(|s| {
        let g = fido_proto::PgvasGeometry::DEFAULT;
        g.base + u64::from(s) * g.slot_size
    });
    let arena = Mapping::new(&arena_fd, arena_len, true, at)?;
    println!("own-arena: {} bytes at {:p}", arena_len, arena.ptr);
    for (off, text) in &args.arena_expect {
        let got = arena.read(*off, text.len())?;
        if got != text.as_bytes() {
            return Err(format!(
                "own arena at {off}: {:?}, expected {text:?}",
                String::from_utf8_lossy(&got)
            ));
        }
        println!("arena-expect: {off} ok");
    }
    for (off, text) in &args.arena_write {
        arena.write(*off, text.as_bytes())?;
        println!("arena-write: {off} done");
    }

    for (port, len) in &args.peers {
        let root = w
            .ports
            .get(usize::from(*port))
            .ok_or_else(|| format!("no port {port}"))?;
        let fd = guest
            .open_peer_arena(root, *len, Duration::from_secs(20))
            .map_err(|e| e.to_string())?;
        let peer = Mapping::new(&fd, *len, false, None)?;
        let head = peer.read(0, PEEK.min(*len as usize))?;
        println!(
            "peer-arena: port={port} head={:?}",
            String::from_utf8_lossy(&head)
        );
    }
    for (port, text) in &args.peer_writes {
        let root = w
            .ports
            .get(usize::from(*port))
            .ok_or_else(|| format!("no port {port}"))?;
        let device = fido_guest::pci::PciDevice::open(root)
            .and_then(|p| p.wait_for_child(2, Duration::from_secs(20)))
            .map_err(|e| e.to_string())?;
        let (fd, len) = device.open_bar(2, true).map_err(|e| e.to_string())?;
        let peer = Mapping::new(&fd, len, true, None)?;
        peer.write(0, text.as_bytes())?;
        let back = peer.read(0, text.len())?;
        println!(
            "peer-write: port={port} reads-back={:?}",
            String::from_utf8_lossy(&back)
        );
    }

    let register = guest.register();
    for (peer, vector) in &args.rings {
        register
            .ring((u32::from(*peer) << 16) | u32::from(*vector))
            .map_err(|e| format!("ring: {e}"))?;
        println!("ring: {peer}:{vector}");
    }
    if let Some((count, peer, vector)) = args.echo {
        let bell = guest.new_bell().map_err(|e| e.to_string())?;
        let v = guest
            .bell_vector(bell.wait.as_fd())
            .ok_or("the new bell has no vector")?;
        println!("bell: vector={v}");
        let value = (u32::from(peer) << 16) | u32::from(vector);
        let started = Instant::now();
        for i in 0..count {
            let woke = fido_ring::doorbell::block_on(bell.wait.as_fd(), None, Some(ECHO_WAIT))
                .map_err(|e| format!("wait: {e}"))?;
            if !woke.rung {
                return Err(format!(
                    "echo: ring {i} of {count} did not come within {ECHO_WAIT:?}"
                ));
            }
            register.ring(value).map_err(|e| format!("ring: {e}"))?;
        }
        println!("echo: {count} in {:?}", started.elapsed());
    }
    if let Some((port, secs)) = args.peer_watch {
        let root = w
            .ports
            .get(usize::from(port))
            .ok_or_else(|| format!("no port {port}"))?;
        let fd = guest
            .open_peer_arena(root, 4096, Duration::from_secs(20))
            .map_err(|e| e.to_string())?;
        let map = Mapping::new(&fd, 4096, false, None)?;
        let end = Instant::now() + Duration::from_secs(secs);
        let mut last = Vec::new();
        while Instant::now() < end {
            let head = map.read(0, PEEK)?;
            if head != last {
                println!("peer-watch: head={:?}", String::from_utf8_lossy(&head));
                last = head;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("peer-watch: done");
    }
    if args.status {
        status(&guest, args.hangup_wait)?;
    }
    println!("result: PASS");
    Ok(())
}

/// `--status`: one request through the link transport, as the `fido`
/// library's session would send it.
fn status(guest: &std::sync::Arc<Guest>, hangup_wait: bool) -> Result<(), String> {
    use fido_control::Received;
    use fido_proto::{BrokerMsg, ClientMsg, Reply, Request};
    let transport = guest.connector().connect().map_err(|e| e.to_string())?;
    let frame = fido_proto::encode(&ClientMsg::Request {
        id: 1,
        body: Request::Status,
    })
    .map_err(|e| e.to_string())?;
    transport
        .send(&frame, &[])
        .map_err(|e| format!("sending: {e}"))?;
    let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
    let deadline = Instant::now() + ECHO_WAIT;
    let (len, fds) = loop {
        match transport
            .recv(
                &mut buf,
                Some(deadline.saturating_duration_since(Instant::now())),
            )
            .map_err(|e| format!("receiving: {e}"))?
        {
            Received::Frame {
                len,
                fds,
                truncated: false,
            } => break (len, fds),
            Received::Frame {
                truncated: true, ..
            } => return Err("truncated answer".into()),
            Received::Closed => return Err("the broker connection closed".into()),
            Received::Idle if Instant::now() < deadline => {}
            Received::Idle => return Err(format!("no answer within {ECHO_WAIT:?}")),
        }
    };
    match fido_proto::decode::<BrokerMsg>(&buf[..len]).map_err(|e| format!("answer: {e}"))? {
        BrokerMsg::Reply {
            id: 1,
            body: Ok(Reply::Status(st)),
        } => {
            println!(
                "status: broker pid {} with {} domains, {} services",
                st.broker_pid,
                st.domains.len(),
                st.services.len()
            )
        }
        BrokerMsg::Reply {
            id: 1,
            body: Err(e),
        } => println!("status: refused: {e}"),
        other => return Err(format!("unexpected answer {other:?}")),
    }
    let mut liveness = Vec::new();
    for fd in fds {
        let stat = rustix::fs::fstat(&fd).map_err(|e| format!("fstat: {e}"))?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::Socket {
            println!(
                "descriptor: liveness open={}",
                !fido_ring::doorbell::peer_hung_up(fd.as_fd())
            );
            liveness.push(fd);
            continue;
        }
        let copy = fd.try_clone().map_err(|e| e.to_string())?;
        match guest.ring_end(copy) {
            Ok(ring) => {
                ring.ring().map_err(|e| format!("ring: {e}"))?;
                println!("descriptor: ring {ring:?} rung");
            }
            Err(_) => {
                // An arena: a BAR file, whose size is the BAR's.
                let len = u64::try_from(stat.st_size).unwrap_or(0);
                if len == 0 {
                    return Err("a descriptor that is neither socket, ring token nor arena".into());
                }
                let map = Mapping::new(&fd, len, false, None)?;
                let head = map.read(0, PEEK.min(len as usize))?;
                println!(
                    "descriptor: arena head={:?}",
                    String::from_utf8_lossy(&head)
                );
            }
        }
    }
    if hangup_wait {
        // The transport applies hang-ups as it reads the link, which a
        // session's reader thread does all the time: do it here.
        let deadline = Instant::now() + ECHO_WAIT;
        while !liveness
            .iter()
            .all(|fd| fido_ring::doorbell::peer_hung_up(fd.as_fd()))
        {
            if Instant::now() >= deadline {
                return Err(format!(
                    "a liveness socket did not hang up within {ECHO_WAIT:?}"
                ));
            }
            let got = transport
                .recv(&mut buf, Some(Duration::from_millis(100)))
                .map_err(|e| format!("receiving: {e}"))?;
            if let Received::Closed = got {
                return Err("the broker connection closed".into());
            }
        }
        println!("liveness: {} hung up", liveness.len());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fido-guest-check: {e}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("result: FAIL: {e}");
            ExitCode::FAILURE
        }
    }
}
