//! The guest side on a real guest (the test image of scripts/vm-image.sh with
//! `fido-guest-check` added, booted once for the binary). The test plays the
//! supervisor: it launches QEMU with fido-vm's command line, serves the
//! doorbell device, hot-plugs a peer arena read-only and answers the link's
//! Hello. In the guest, `fido-guest-check` opens the link and VFIO and:
//! - reads what the host wrote in the VM's own arena (mapped at its PGVAS
//!   slot address) and writes there for the host to read;
//! - maps the hot-plugged peer arena read-only, and fails to change it even
//!   through a writable mapping;
//! - rings a host peer through the BAR0 register (a byte on the host's socket);
//! - waits for its own doorbell (an MSI-X vector delivered to an eventfd) and
//!   echoes each ring back: the host measures the round trip;
//! - sends a request through the link transport and gets the reply's
//!   handles as descriptors (arena, ring token, liveness socket + hang-up);
//! - keeps reading a peer arena while the host unplugs it: zeros, no SIGBUS.

use fido_test_support::raw::{memfd, reopen, seal};
use fido_proto::guest::{decode_guest, encode_link, link_len, GuestMsg, Handle, HostMsg};
use fido_proto::{BrokerMsg, ClientMsg, Reply, Request, Status};
use fido_test_support::vm::{self, Console, BOOT_TIMEOUT};
use fido_vm::doorbell_server::{DoorbellServer, VectorKind};
use fido_vm::hotplug;
use fido_vm::qemu::{spawn, welcome, Accel, VmFds, VmSpec};
use fido_vm::qmp::Qmp;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{socketpair, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CMD: Duration = Duration::from_secs(60);
const QMP_TIMEOUT: Duration = Duration::from_secs(30);
/// Round trips measured (after `WARMUP` unmeasured ones).
const ROUNDS: usize = 500;
const WARMUP: usize = 20;

fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .unwrap()
}

fn pread(fd: &OwnedFd, off: u64, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    assert_eq!(rustix::io::pread(fd, &mut b, off).unwrap(), n);
    b
}

/// Waits for `fd` to become readable and empties it; false on timeout.
fn wait_rung(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    if !matches!(poll(&mut fds, Some(&ts)), Ok(n) if n > 0) {
        return false;
    }
    let mut buf = [0u8; 256];
    matches!(rustix::net::recv(fd, &mut buf, RecvFlags::DONTWAIT), Ok((n, _)) if n > 0)
}

/// The supervisor's end of the link: answers every Hello with the Welcome
/// (each run of fido-guest-check opens the port afresh), a `Reconnect`
/// with `Reconnected`, and a `Status`
/// request with a status reply carrying `handles`, then the hang-up of every
/// liveness handle among them; returns how many Hellos it answered when QEMU
/// closes the socket.
fn serve_link(
    sock: OwnedFd,
    welcome: fido_proto::guest::Welcome,
    handles: Vec<Handle>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut s = UnixStream::from(sock);
        s.set_nonblocking(false).unwrap();
        let mut hellos = 0;
        loop {
            let mut prefix = [0u8; 4];
            if s.read_exact(&mut prefix).is_err() {
                return hellos;
            }
            let Ok(n) = link_len(prefix) else {
                return hellos;
            };
            let mut body = vec![0u8; n];
            if s.read_exact(&mut body).is_err() {
                return hellos;
            }
            match decode_guest(&body) {
                Ok(GuestMsg::Hello { .. }) => {
                    hellos += 1;
                    s.write_all(&encode_link(&HostMsg::Welcome(welcome.clone())).unwrap())
                        .unwrap();
                }
                Ok(GuestMsg::Reconnect) => {
                    s.write_all(&encode_link(&HostMsg::Reconnected).unwrap())
                        .unwrap();
                }
                Ok(GuestMsg::Frame { frame, bells }) => {
                    assert!(bells.is_empty());
                    let Ok(ClientMsg::Request {
                        id,
                        body: Request::Status,
                    }) = fido_proto::decode::<ClientMsg>(&frame)
                    else {
                        panic!("the guest sent {frame:?}")
                    };
                    let status = Status {
                        broker_pid: 4242,
                        domains: vec![],
                        services: vec![],
                        connections: vec![],
                        pipe_engine: None,
                        pipes: vec![],
                        next: None,
                    };
                    let reply = BrokerMsg::Reply {
                        id,
                        body: Ok(Reply::Status(status)),
                    };
                    let frame = fido_proto::encode(&reply).unwrap();
                    let msg = HostMsg::Frame {
                        frame,
                        handles: handles.clone(),
                    };
                    s.write_all(&encode_link(&msg).unwrap()).unwrap();
                    for h in &handles {
                        if let Handle::Liveness { token } = h {
                            let hangup = HostMsg::Hangup { token: *token };
                            s.write_all(&encode_link(&hangup).unwrap()).unwrap();
                        }
                    }
                }
                other => panic!("unexpected from the guest: {other:?}"),
            }
        }
    })
}

/// Waits until the guest's log file holds `needle`; returns the log.
fn wait_log(c: &mut Console, log: &str, needle: &str) -> String {
    let deadline = Instant::now() + CMD;
    loop {
        let text = c.run_ok(&format!("cat {log}"), CMD);
        if text.contains(needle) {
            return text;
        }
        assert!(
            !text.contains("result: FAIL"),
            "fido-guest-check failed:\n{text}"
        );
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in the guest's log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_guest_side_on_a_real_guest() {
    // The guest programs run in their own session (`setsid`), as a service
    // would: as background jobs of the console's interactive shell, a run
    // that had used VFIO sometimes took the shell down with it when it
    // exited (about one run in five under TCG; never with `setsid`, never
    // in the foreground, never for a run that failed before opening the
    // devices).
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (scripts/install-test-deps.sh installs it)");
        return;
    }
    let check = PathBuf::from(env!("CARGO_BIN_EXE_fido-guest-check"));
    let image = vm::image_with(&[(check, "/bin/fido-guest-check")]);
    let dir = tempfile::tempdir().unwrap();
    let mut spec = VmSpec::new("fido-guest-check", Accel::Tcg);
    spec.kernel = Some(image.kernel.clone());
    spec.initrd = Some(image.initrd.clone());
    spec.append = image.cmdline.clone();
    spec.serial = Some(dir.path().join("console.sock"));
    spec.arena_len = 1 << 20;
    spec.ports = 1;
    spec.max_peer_arena = 1 << 20;
    spec.vectors = 8;

    // The own arena, with a message from the host already in it.
    let arena = memfd(spec.arena_len);
    rustix::io::pwrite(&arena, b"host-to-guest", 0).unwrap();
    let (control, qemu_control) = pair();
    let (qmp_end, qemu_qmp) = pair();
    let (mut bell, qemu_bell) = DoorbellServer::new(spec.vectors, VectorKind::SocketPair).unwrap();
    let fds = VmFds {
        arena: arena.try_clone().unwrap(),
        control: qemu_control,
        qmp: qemu_qmp,
        doorbell: qemu_bell,
        tap: None,
    };
    let started = Instant::now();
    let qemu = spawn(&spec, fds).unwrap();
    let mut qmp = Qmp::connect(qmp_end, QMP_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}: {}", qemu.stderr_tail()));
    bell.complete_handshake(QMP_TIMEOUT).unwrap();
    // Two host peers: one the guest rings directly, one it rings through a
    // ring handle the link transport turned into a descriptor.
    let (host_wait, host_ring) = pair();
    let peer = bell.add_peer(host_ring.as_fd()).unwrap();
    let (handle_wait, handle_ring) = pair();
    let handle_peer = bell.add_peer(handle_ring.as_fd()).unwrap();
    let handles = vec![
        Handle::Arena {
            port: 0,
            len: 1 << 20,
        },
        Handle::Ring {
            peer: handle_peer,
            vector: 0,
        },
        Handle::Liveness { token: 7 },
    ];
    let link = serve_link(control, welcome(&spec, bell.own_peer()), handles);
    let mut c = Console::connect(spec.serial.as_ref().unwrap(), Duration::from_secs(10)).unwrap();
    c.wait_for_shell(BOOT_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}\n{}\n{}", c.transcript(), qemu.stderr_tail()));
    eprintln!("boot to shell: {:.1?}", started.elapsed());

    // A peer's arena, hot-plugged read-only under port 0.
    let peer_arena = memfd(1 << 20);
    rustix::io::pwrite(&peer_arena, b"peer-arena-bytes", 0).unwrap();
    // Sealed like every arena a domain grants (plug_arena checks it: an
    // unsealed one could be truncated under QEMU).
    seal(&peer_arena);
    let ro = reopen(&peer_arena, rustix::fs::OFlags::RDONLY);
    hotplug::plug_arena(&mut qmp, 0, ro.as_fd(), 1 << 20, spec.max_peer_arena).unwrap();

    let run = c
        .spawn(&format!(
            "setsid /bin/fido-guest-check --slot 1 --arena-expect 0=host-to-guest --arena-write 4096=guest-to-host \
             --peer 0=1048576 --peer-write 0=GUEST-WAS-HERE --ring {peer}:0 --echo {} {peer}:0 --status --hangup-wait",
            ROUNDS + WARMUP
        ))
        .unwrap();
    let log = wait_log(&mut c, &run.log, "bell: vector=");
    assert!(log.contains("arena-expect: 0 ok"), "{log}");
    assert!(
        log.contains("own-arena: 1048576 bytes at 0x101000000000"),
        "own arena not at PGVAS slot 1 (16 TiB + 64 GiB):\n{log}"
    );
    assert!(
        log.contains("peer-arena: port=0 head=\"peer-arena-bytes\""),
        "{log}"
    );
    assert!(
        log.contains("peer-write: port=0 reads-back=\"peer-arena-byt\""),
        "a guest write changed a read-only arena:\n{log}"
    );
    eprintln!(
        "{}",
        log.lines()
            .find(|l| l.starts_with("register:"))
            .unwrap_or("register: ?")
    );

    // The guest wrote into its own arena; the host's memfd shows it.
    assert_eq!(pread(&arena, 4096, 13), b"guest-to-host");
    // The read-only peer arena is unchanged on the host.
    assert_eq!(pread(&peer_arena, 0, 16), b"peer-arena-bytes");
    // The guest rang us once.
    assert!(
        wait_rung(host_wait.as_fd(), CMD),
        "the guest's ring never reached the host peer"
    );

    // Round trips: the host rings the guest's vector, the guest's eventfd
    // fires, it rings us back.
    let vector: u16 = log
        .lines()
        .find_map(|l| l.strip_prefix("bell: vector="))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!((1..spec.vectors).contains(&vector));
    let guest_bell = bell.own_ring_end(vector).unwrap();
    let mut times = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS + WARMUP {
        let t = Instant::now();
        rustix::net::send(guest_bell, &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL).unwrap();
        assert!(
            wait_rung(host_wait.as_fd(), Duration::from_secs(30)),
            "round {i}: no echo from the guest"
        );
        if i >= WARMUP {
            times.push(t.elapsed());
        }
    }
    times.sort();
    let pct = |p: usize| times[(times.len() * p / 100).min(times.len() - 1)];
    eprintln!(
        "doorbell round trip host -> guest -> host (TCG, {ROUNDS} rounds): median {:.1?}, p90 {:.1?}, p99 {:.1?}, min {:.1?}",
        pct(50),
        pct(90),
        pct(99),
        times[0]
    );
    let log = wait_log(&mut c, &run.log, "result: PASS");
    assert!(log.contains("echo: "), "{log}");

    // The link transport: a request out, the reply in with its handles as
    // descriptors — the hot-plugged arena, a ring token that rang our second
    // peer, a liveness socket that read EOF once the hang-up came.
    assert!(
        log.contains("status: broker pid 4242 with 0 domains"),
        "{log}"
    );
    assert!(
        log.contains("descriptor: arena head=\"peer-arena-bytes\""),
        "{log}"
    );
    let value = u32::from(handle_peer) << 16;
    let rung = format!("descriptor: ring Register {{ value: {value}, .. }} rung");
    assert!(log.contains(&rung), "{log}");
    assert!(log.contains("descriptor: liveness open=true"), "{log}");
    assert!(log.contains("liveness: 1 hung up"), "{log}");
    assert!(
        wait_rung(handle_wait.as_fd(), CMD),
        "the ring handle did not ring its peer"
    );

    // Revocation: the peer arena is unplugged while the guest maps it. The
    // guest then reads zeros, and does not die of SIGBUS (so the library
    // must stop trusting a peer's memory once the supervisor announces the
    // revocation, before the unplug — it cannot tell zeros from data).
    let watch = c
        .spawn("setsid /bin/fido-guest-check --peer-watch 0=8; echo exit=$?")
        .unwrap_or_else(|e| panic!("{e}\nconsole:\n{}", c.transcript()));
    wait_log(&mut c, &watch.log, "peer-watch: head=");
    let t = Instant::now();
    hotplug::unplug(&mut qmp, 0, Duration::from_secs(30)).unwrap();
    eprintln!("unplug took {:.2?}", t.elapsed());
    let log = wait_log(&mut c, &watch.log, "exit=");
    let zeros = format!("peer-watch: head={:?}", "\0".repeat(16));
    assert!(log.contains(&zeros), "no zeros after the unplug:\n{log}");
    assert!(
        log.contains("peer-watch: done") && log.contains("exit=0"),
        "{log}"
    );

    // Each run opened the link with a Hello.
    drop(c);
    drop(qmp);
    drop(qemu);
    assert_eq!(link.join().unwrap(), 2);
}
