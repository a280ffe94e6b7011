//! `fido blk serve` as a separate process, killed with SIGKILL: writes
//! acknowledged after FLUSH or with FUA survive; requests in flight when it
//! dies fail (no hang, no wrong block) and the client resumes once it is
//! restarted on the same file. Plus the shell client (`fido blk info/write/read`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_blk::{BlkClient, BlkError};
use fido_test_support::{Defaults, TestBroker};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");
const T: Duration = Duration::from_secs(30);

/// A storage domain process, SIGKILLed and reaped when dropped.
struct Storage(Child);

impl Storage {
    fn start(broker: &Path, name: &str, file: &Path) -> Storage {
        let mut child = Command::new(FIDO)
            .args(["blk", "serve", name, "--file"])
            .arg(file)
            .arg("--socket")
            .arg(broker)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with(&format!("serving blk:{name} ")), "fido blk serve printed {line:?}");
        Storage(child)
    }

    fn kill9(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The bytes of 512-byte block `block` as written by pass `seed`.
fn block_bytes(block: u64, seed: u64) -> [u8; 512] {
    let mut out = [0u8; 512];
    let mut x = (block + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed.wrapping_mul(0xd6e8_feb8_6659_fd93) | 1;
    for b in out.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    out
}

fn fill(c: &BlkClient, offset: u64, len: usize, seed: u64) -> fido::Buf {
    let mut b = c.alloc(len).unwrap();
    for (i, chunk) in b.chunks_mut(512).enumerate() {
        chunk.copy_from_slice(&block_bytes(offset / 512 + i as u64, seed));
    }
    b
}

/// Which pass each 512-byte block of `data` (read at `offset`) holds, if any of `seeds`.
fn passes(data: &[u8], offset: u64, seeds: &[u64]) -> Vec<Option<u64>> {
    data.chunks(512)
        .enumerate()
        .map(|(i, blk)| seeds.iter().copied().find(|&s| blk == block_bytes(offset / 512 + i as u64, s)))
        .collect()
}

fn join(b: &TestBroker<Defaults>, name: &str) -> Domain {
    Domain::join(JoinOptions::new(name).broker(&b.socket).arena_len(256 << 20).ring_entries(2048)).unwrap()
}

/// Reads with the client until the restarted storage domain answers.
fn read_after_restart(c: &BlkClient, offset: u64, len: u32) -> Vec<u8> {
    let deadline = Instant::now() + T;
    loop {
        match c.read_at(offset, len) {
            Ok(m) => return m.to_vec(),
            Err(e) => {
                assert!(Instant::now() < deadline, "the client never resumed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[test]
fn flushed_and_fua_writes_survive_kill_9() {
    let b = TestBroker::<Defaults>::start();
    let img = b.dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let mut storage = Storage::start(&b.socket, "dur", &img);
    let d = join(&b, "client");
    let c = BlkClient::connect(&d, "dur").unwrap();
    const CHUNK: usize = 64 << 10;
    // Region A: FUA writes. Region B: plain writes, then FLUSH.
    for i in 0..32u64 {
        let off = i * CHUNK as u64;
        c.submit_write(i, off, vec![fill(&c, off, CHUNK, 7)], true).unwrap();
    }
    for i in 0..32u64 {
        let off = (4 << 20) + i * CHUNK as u64;
        c.submit_write(100 + i, off, vec![fill(&c, off, CHUNK, 8)], false).unwrap();
    }
    for _ in 0..64 {
        c.complete(T).unwrap().result.unwrap();
    }
    c.flush().unwrap();
    storage.kill9();

    // The next call sees the loss (or connects again and fails: nothing serves).
    assert!(matches!(c.flush(), Err(BlkError::Disconnected) | Err(BlkError::Fido(_))));
    let _storage = Storage::start(&b.socket, "dur", &img);
    let a = read_after_restart(&c, 0, 2 << 20);
    assert!(passes(&a, 0, &[7]).iter().all(|p| *p == Some(7)), "a FUA write was lost");
    for part in 0..2u64 {
        let off = (4 << 20) + part * (1 << 20);
        let got = c.read_at(off, 1 << 20).unwrap().to_vec();
        assert!(passes(&got, off, &[8]).iter().all(|p| *p == Some(8)), "a flushed write was lost");
    }
}

#[test]
fn storage_killed_mid_io_fails_in_flight_requests_then_resumes() {
    let b = TestBroker::<Defaults>::start();
    let img = b.dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let mut storage = Storage::start(&b.socket, "mid", &img);
    let d = join(&b, "client");
    let c = BlkClient::connect(&d, "mid").unwrap();
    const CHUNK: usize = 128 << 10;
    const N: u64 = 256;
    // Everything holds pass 1 first.
    for i in 0..N {
        let off = i * CHUNK as u64;
        c.submit_write(i, off, vec![fill(&c, off, CHUNK, 1)], false).unwrap();
    }
    for _ in 0..N {
        c.complete(T).unwrap().result.unwrap();
    }
    c.flush().unwrap();

    // Pass 2 writes and reads of everything, then SIGKILL while they run
    // (the payloads are built first so that submitting takes no time).
    let bufs: Vec<_> = (0..N).map(|i| fill(&c, i * CHUNK as u64, CHUNK, 2)).collect();
    for (i, buf) in (0..N).zip(bufs) {
        c.submit_write(i, i * CHUNK as u64, vec![buf], false).unwrap();
        c.submit_read(10_000 + i, ((i * 7919) % N) * CHUNK as u64, CHUNK as u32).unwrap();
    }
    let (mut ok_writes, mut failed) = (Vec::new(), 0);
    for k in 0..2 * N {
        let done = c.complete(T).expect("every request in flight completes (no hang)");
        if k == 0 {
            // Killed once the first request completed: the rest are in flight.
            storage.kill9();
        }
        match done.result {
            Ok(None) => ok_writes.push(done.id),
            Ok(Some(data)) => {
                let off = (((done.id - 10_000) * 7919) % N) * CHUNK as u64;
                let got = data.to_vec();
                assert!(passes(&got, off, &[1, 2]).iter().all(Option::is_some), "a READ returned a wrong block");
            }
            Err(BlkError::Disconnected) => failed += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!(c.in_flight(), 0);
    assert!(matches!(c.complete(Duration::from_millis(100)), Err(BlkError::Disconnected) | Err(BlkError::Timeout)));
    eprintln!("killed mid-I/O: {} writes acknowledged, {failed} requests failed", ok_writes.len());
    assert!(failed > 0, "the kill found nothing in flight; the test proves nothing");
    assert!(failed < 2 * N, "the first completion was a success");

    let _storage = Storage::start(&b.socket, "mid", &img);
    let all = read_after_restart(&c, 0, 4 << 20);
    let mut whole = all;
    for off in (4u64 << 20..N * CHUNK as u64).step_by(4 << 20) {
        whole.extend(c.read_at(off, 4 << 20).unwrap().to_vec());
    }
    let which = passes(&whole, 0, &[1, 2]);
    assert!(which.iter().all(Option::is_some), "a block holds neither pass after the restart");
    for id in ok_writes {
        let first = (id * CHUNK as u64 / 512) as usize;
        assert!(which[first..first + CHUNK / 512].iter().all(|p| *p == Some(2)), "acknowledged write {id} is not on the device");
    }
}

#[test]
fn shell_client_round_trip() {
    let b = TestBroker::<Defaults>::start();
    let img = b.dir.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(4 << 20).unwrap();
    let _storage = Storage::start(&b.socket, "sh", &img);
    let fido = |args: &[&str]| {
        let out = Command::new(FIDO).args(args).arg("--socket").arg(&b.socket).env_remove("RUST_LOG").output().unwrap();
        assert!(out.status.success(), "fido {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let info = String::from_utf8(fido(&["blk", "info", "sh"])).unwrap();
    assert!(info.contains("size: 4194304") && info.contains("logical_block: 512"), "{info}");
    let data: Vec<u8> = (0..16u64).flat_map(|k| block_bytes(k, 3)).collect();
    let input = b.dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    fido(&["blk", "write", "sh", "1M", "--fua", "--in", input.to_str().unwrap()]);
    assert_eq!(fido(&["blk", "read", "sh", "1M", "8192"]), data);
    fido(&["blk", "write-zeroes", "sh", "1M", "4096"]);
    let back = fido(&["blk", "read", "sh", "1M", "8192"]);
    assert!(back[..4096].iter().all(|&x| x == 0) && back[4096..] == data[4096..]);
    fido(&["blk", "flush", "sh"]);
    // The bytes are in the file.
    let file = std::fs::read(&img).unwrap();
    assert!(file[(1 << 20) + 4096..(1 << 20) + 8192] == data[4096..]);
    // A misaligned read is refused with a clear message and a failure status.
    let out = Command::new(FIDO).args(["blk", "read", "sh", "100", "512", "--socket"]).arg(&b.socket).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("EINVAL"));
}
