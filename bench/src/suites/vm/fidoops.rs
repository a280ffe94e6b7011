//! The Fido side of the `vm` suite's cases, the same on the host and in a
//! guest (a guest's `fido` library reaches its broker through the VM's
//! supervisor; the calls are the same): ping-pong, echo, source and sink over
//! a [`fido::Channel`], with the byte-for-byte checks of [`super::stream`].
//! Every message is a fresh buffer of the sender's arena, written whole
//! ([`crate::fill`]); every receiver folds every byte in place, through the
//! read-only view of the sender's arena (no copy).

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use fido::{Channel, Domain, WaitStrategy};

use super::stream::{expected_checksum, SinkReport, END, STREAM_BUFFER};

/// How long an endpoint waits for its peer to connect.
pub const ACCEPT: Duration = Duration::from_secs(60);
/// How long a receiver waits for the next message before it calls the
/// stream stalled (a hung or dead peer fails the case, never the run).
pub const STALL: Duration = Duration::from_secs(60);

/// Whether a channel error means the peer closed it (not a failure).
pub fn is_end(e: &fido::Error) -> bool {
    matches!(e, fido::Error::Closed | fido::Error::PeerGone { .. })
}

/// `poll` (both ends spin: `fido-polled`) or `block` (doorbells: `fido`).
pub fn parse_wait(s: &str) -> anyhow::Result<WaitStrategy> {
    Ok(match s {
        "poll" => WaitStrategy::BusyPoll,
        "block" => WaitStrategy::Block,
        o => bail!("unknown wait strategy `{o}` (poll or block)"),
    })
}

/// A failed send or receive of message `k`, with both sides' ring words
/// (what a stalled channel needs to be understood).
fn stalled(e: fido::Error, ch: &Channel, k: u64) -> anyhow::Error {
    anyhow::anyhow!("{e} at message {k} ({})", ch.ring_state())
}

/// Folds every byte of a received message in place; returns (sequence number, fold).
fn fold_msg(m: &fido::Msg, size: usize) -> anyhow::Result<(u64, u64)> {
    let v = one_segment(m)?;
    if v.len() != size {
        bail!("a message of {} bytes arrived, expected {size}", v.len());
    }
    fold_record(v)
}

fn one_segment(m: &fido::Msg) -> anyhow::Result<fido::PeerSlice<'_>> {
    m.as_slice()
        .with_context(|| format!("expected one segment, got {}", m.segment_count()))
}

/// Folds one record (a message's bytes) in place: (sequence number, fold).
fn fold_record(v: fido::PeerSlice<'_>) -> anyhow::Result<(u64, u64)> {
    let sum = v.fold_u64(0u64, |acc, w| acc.wrapping_add(w).rotate_left(1));
    let seq = v
        .read_obj::<[u8; 8]>(0)
        .map(u64::from_le_bytes)
        .context("message under 8 bytes")?;
    Ok((seq, sum))
}

/// How many `size`-byte messages a batching source packs into one Fido
/// message: as many as fill [`STREAM_BUFFER`], the user-space buffer of the
/// stream baselines (which batch small messages into few system calls), at
/// least one.
pub fn batch_for(size: usize) -> usize {
    (STREAM_BUFFER / size.max(1)).max(1)
}

fn send_filled(d: &Domain, ch: &Channel, size: usize, seq: u64) -> Result<(), fido::Error> {
    let mut b = d.alloc(size)?;
    crate::fill(&mut b, seq);
    ch.send(b).map_err(|e| e.error)
}

/// Echo side: folds each message, answers with a fresh message carrying the
/// same bytes; returns the messages echoed when [`END`] (echoed too) arrives
/// or the peer closes.
pub fn echo(d: &Domain, ch: &Channel, size: usize) -> anyhow::Result<u64> {
    let mut n = 0u64;
    loop {
        let m = match ch.recv_timeout(STALL) {
            Ok(m) => m,
            Err(e) if is_end(&e) => return Ok(n),
            Err(e) => return Err(stalled(e, ch, n + 1)),
        };
        let (seq, sum) = fold_msg(&m, size)?;
        std::hint::black_box(sum);
        drop(m);
        if seq != END && seq != n + 1 {
            bail!("echo: message {seq} arrived, expected {}", n + 1);
        }
        match send_filled(d, ch, size, seq) {
            Ok(()) => {}
            Err(e) if is_end(&e) => return Ok(n),
            Err(e) => return Err(e.into()),
        }
        if seq == END {
            return Ok(n);
        }
        n += 1;
    }
}

/// Pinging side: message `k` out, its echo back and checked byte for byte;
/// returns the timed round trips (ns), then ends the stream with [`END`].
pub fn ping_pong(
    d: &Domain,
    ch: &Channel,
    size: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Vec<u64>> {
    let rtts = crate::time_round_trips(warmup, duration, |k| {
        send_filled(d, ch, size, k).map_err(|e| stalled(e, ch, k))?;
        let m = ch.recv_timeout(STALL).map_err(|e| stalled(e, ch, k))?;
        let (seq, sum) = fold_msg(&m, size)?;
        if seq != k || sum != expected_checksum(k, size) {
            bail!("ping: reply {seq} does not carry message {k}'s bytes");
        }
        Ok(())
    })?;
    send_filled(d, ch, size, END)?;
    let m = ch.recv_timeout(ACCEPT).context("ping: the END echo")?;
    drop(m);
    Ok(rtts)
}

/// Sending side of a throughput case: fresh filled messages of `size` bytes
/// for `duration`, then [`END`]; returns the messages sent (before END).
/// `batch` messages travel in each Fido message (one buffer, one
/// descriptor), each written whole in place as if sent alone: 1 is a
/// descriptor per message, [`batch_for`] batches as the stream baselines do.
pub fn source(d: &Domain, ch: &Channel, size: usize, batch: usize, duration: Duration) -> anyhow::Result<u64> {
    if batch == 0 || size < 8 {
        bail!("source: batch {batch} of {size}-byte messages");
    }
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < duration {
        let mut b = d.alloc(size * batch)?;
        for record in b.chunks_exact_mut(size) {
            n += 1;
            crate::fill(record, n);
        }
        ch.send(b).map_err(|e| e.error)?;
    }
    send_filled(d, ch, size, END)?;
    Ok(n)
}

/// Receiving side: folds every message in place, checks the order, until
/// [`END`]. A Fido message may carry several `size`-byte messages back to
/// back (a batching [`source`]); each is checked as if it came alone.
pub fn sink(ch: &Channel, size: usize) -> anyhow::Result<SinkReport> {
    let mut n = 0u64;
    let mut sum = 0u64;
    let mut first: Option<Instant> = None;
    loop {
        let m = ch.recv_timeout(STALL).map_err(|e| stalled(e, ch, n + 1))?;
        let v = one_segment(&m)?;
        if v.is_empty() || v.len() % size != 0 {
            bail!("a message of {} bytes arrived, expected a multiple of {size}", v.len());
        }
        for at in (0..v.len()).step_by(size) {
            let record = v.subslice(at, size).expect("inside the message");
            let (seq, s) = fold_record(record)?;
            if seq == END {
                return Ok(SinkReport {
                    messages: n,
                    checksum: sum,
                    timed_messages: n.saturating_sub(1),
                    timed_ns: first.map_or(0, |t| t.elapsed().as_nanos() as u64),
                });
            }
            if seq != n + 1 {
                bail!("sink: message {seq} arrived, expected {}", n + 1);
            }
            sum = sum.wrapping_add(s);
            if first.is_none() {
                first = Some(Instant::now());
            }
            n += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fido::JoinOptions;

    /// The Fido side of every case, between two host domains (the calls a
    /// guest makes are the same): echoes checked byte for byte, a stream
    /// whose count and checksum verify, nothing copied.
    #[test]
    fn ping_pong_and_stream_between_two_domains() {
        let broker = fido_demo::proc::EmbeddedBroker::start("fido-bench-vm-test-").unwrap();
        let join = |name: &str| {
            Domain::join(
                JoinOptions::new(name)
                    .broker(broker.socket())
                    .arena_len(16 << 20)
                    .ring_entries(16)
                    // Other tests of this process may hold the PGVAS window.
                    .swizzle(true),
            )
            .unwrap()
        };
        let (a, b) = (join("vm-test-a"), join("vm-test-b"));
        let svc = format!("vm-test-echo-{}", std::process::id());
        let l = b.offer(&svc).unwrap();
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let ch = l.accept_timeout(ACCEPT).unwrap();
            echo(&b2, &ch, 4096).unwrap()
        });
        let ch = a.connect(&svc).unwrap();
        let rtts = ping_pong(
            &a,
            &ch,
            4096,
            Duration::from_millis(10),
            Duration::from_millis(50),
        )
        .unwrap();
        let echoed = t.join().unwrap();
        assert!(!rtts.is_empty());
        assert!(echoed as usize >= rtts.len());
        drop(ch);

        // One descriptor per message, then batched as the stream baselines
        // batch (64 four-KiB messages, 4096 of 64 bytes per descriptor).
        for (size, batch) in [(4096, 1), (4096, batch_for(4096)), (64, batch_for(64))] {
            let svc = format!("vm-test-stream-{}-{size}-{batch}", std::process::id());
            let l = b.offer(&svc).unwrap();
            let b2 = b.clone();
            let t = std::thread::spawn(move || {
                let ch = l.accept_timeout(ACCEPT).unwrap();
                let n = source(&b2, &ch, size, batch, Duration::from_millis(50)).unwrap();
                let _ = fido_demo::pipeline::drain(&ch, Duration::from_secs(5));
                n
            });
            let ch = a.connect(&svc).unwrap();
            let report = sink(&ch, size).unwrap();
            let sent = t.join().unwrap();
            assert!(sent as usize >= batch, "{size} B x {batch}: {sent} sent");
            assert_eq!(sent % batch as u64, 0, "whole batches");
            report.verify(Some(sent), size).unwrap();
            drop(ch);
        }
        assert_eq!(batch_for(64), 4096);
        assert_eq!(batch_for(STREAM_BUFFER * 2), 1);
        assert_eq!(a.counters().bytes_copied + b.counters().bytes_copied, 0);
        drop((a, b));
        std::thread::sleep(Duration::from_millis(400));
        broker.stop().unwrap();
    }
}
