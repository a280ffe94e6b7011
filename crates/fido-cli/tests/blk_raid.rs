//! `fido blk raid1` and `fido blk raid0` as processes over `fido blk serve`
//! RAM disks: a mirror killed with SIGKILL in the middle of a write stream
//! costs the client nothing, the composition reports itself degraded
//! (stdout, `fido blk raid-status`), and the restarted (empty) mirror is
//! copied whole (`--full-resync`) until both hold the same bytes; SIGTERM
//! ends the composition cleanly.

use fido_test_support::bytes::pattern;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_blk::BlkClient;
use fido_test_support::{Defaults, TestBroker};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");
const T: Duration = Duration::from_secs(30);

/// A `fido` process whose stdout lines arrive on a channel; SIGKILLed and
/// reaped when dropped.
struct Proc {
    child: Child,
    lines: Receiver<String>,
}

impl Proc {
    fn start(broker: &Path, args: &[&str]) -> Proc {
        let mut child = Command::new(FIDO)
            .args(args)
            .arg("--socket")
            .arg(broker)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, lines }
    }

    /// Waits for a line containing `what`; returns it.
    fn expect(&self, what: &str) -> String {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(what) => return line,
                Ok(_) => {}
                Err(e) => panic!("no line with {what:?}: {e}"),
            }
        }
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn storage(broker: &Path, name: &str) -> Proc {
    let p = Proc::start(broker, &["blk", "serve", name, "--ram", "8M", "--arena", "64M"]);
    p.expect(&format!("serving blk:{name} "));
    p
}


fn read_all(c: &BlkClient, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = (len - out.len()).min(1 << 20);
        out.extend(c.read_at(out.len() as u64, n as u32).unwrap().to_vec());
    }
    out
}

#[test]
fn raid1_cli_degrades_on_kill_9_and_resyncs_a_restarted_ram_mirror() {
    const SIZE: usize = 8 << 20;
    let b = TestBroker::<Defaults>::start();
    let _m1 = storage(&b.socket, "m1");
    let mut m2 = storage(&b.socket, "m2");
    let mut raid = Proc::start(&b.socket, &["blk", "raid1", "r1", "--member", "m1", "--member", "m2", "--full-resync"]);
    let serving = raid.expect("serving blk:r1 raid1 ");
    assert!(serving.contains(&format!("size={SIZE}")), "{serving}");
    // The initial copy of m1 onto m2 (neither was declared clean).
    raid.expect("state=clean");

    let d = Domain::join(JoinOptions::new("raid-cli-client").broker(&b.socket).arena_len(64 << 20)).unwrap();
    let c = BlkClient::connect(&d, "r1").unwrap();
    let mut model = vec![0u8; SIZE];
    let chunk = 256 << 10;
    for pass in 0..2u64 {
        for k in 0..SIZE / chunk {
            let data = pattern(chunk, pass * 1000 + k as u64);
            c.write_at((k * chunk) as u64, &data, false).unwrap_or_else(|e| panic!("write {k} of pass {pass}: {e}"));
            model[k * chunk..(k + 1) * chunk].copy_from_slice(&data);
            if pass == 0 && k == 10 {
                m2.kill9();
            }
        }
    }
    c.flush().unwrap();
    raid.expect("state=degraded");
    // The registry has it too (published with the line just read, or soon after).
    let deadline = Instant::now() + T;
    loop {
        let status = Command::new(FIDO).args(["blk", "raid-status", "r1", "--socket"]).arg(&b.socket).output().unwrap();
        let text = String::from_utf8_lossy(&status.stdout).to_string();
        if status.status.success() && text.contains("state=degraded") {
            assert!(text.contains("member.1.state=down") && text.contains("member.0.state=up"), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "raid-status never said degraded: {text}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(read_all(&c, SIZE) == model, "degraded reads");

    // Back, empty: copied whole.
    let _m2 = storage(&b.socket, "m2");
    raid.expect("state=clean");
    for m in ["m1", "m2"] {
        let direct = BlkClient::connect(&d, m).unwrap();
        assert!(read_all(&direct, SIZE) == model, "mirror {m} after the resync");
    }

    // RAID-0 over the same two, from the command line too.
    let stripe = Proc::start(&b.socket, &["blk", "raid0", "s0", "--chunk", "64K", "--member", "m1", "--member", "m2"]);
    let line = stripe.expect("serving blk:s0 raid0 ");
    assert!(line.contains(&format!("size={}", 2 * SIZE)), "{line}");
    let s = BlkClient::connect(&d, "s0").unwrap();
    let data = pattern(1 << 20, 7);
    s.write_at(96 << 10, &data, true).unwrap();
    assert!(s.read_at(96 << 10, 1 << 20).unwrap().to_vec() == data);

    // SIGTERM: the composition stops after the requests in flight.
    drop(c);
    rustix::process::kill_process(rustix::process::Pid::from_raw(raid.child.id() as i32).unwrap(), rustix::process::Signal::TERM).unwrap();
    let deadline = Instant::now() + T;
    loop {
        if let Some(st) = raid.child.try_wait().unwrap() {
            assert!(st.success(), "fido blk raid1 exited with {st}");
            break;
        }
        assert!(Instant::now() < deadline, "fido blk raid1 did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}
