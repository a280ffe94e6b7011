//! The byte-stream side of the `vm` suite's cases, shared by the host and the
//! guest endpoint and by every stream baseline (virtio-net TCP, virtio-serial):
//! fixed-size messages on a byte stream, each written whole by its sender
//! ([`crate::fill`]: every byte, the sequence number in the first 8) and read
//! whole by its receiver, which folds every byte ([`checksum`]). A message whose
//! sequence number is [`END`] closes a stream; its sender then stops.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

/// Sequence number of the message that ends a stream (never a real message's).
pub const END: u64 = u64::MAX;

/// User-space buffer of a stream baseline's throughput side: small messages
/// are batched into few system calls (as a competent user would), messages
/// this large or larger go straight through.
pub const STREAM_BUFFER: usize = 256 << 10;

/// The receiver's pass over a message: every byte, as little-endian `u64`
/// words, `acc = rotl(acc + word, 1)`. The same fold as `PeerSlice::fold_u64`
/// with that closure over an aligned view (x86 is little-endian), so a Fido
/// receiver reading in place computes the same value.
#[inline]
pub fn checksum(buf: &[u8]) -> u64 {
    let mut acc = 0u64;
    let mut words = buf.chunks_exact(8);
    for w in &mut words {
        acc = acc
            .wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .rotate_left(1);
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        acc = acc.wrapping_add(u64::from_le_bytes(last)).rotate_left(1);
    }
    acc
}

/// [`checksum`] of `fill(buf, seq)` for a buffer of `size` bytes, computed
/// without the buffer: what the receiver of message `seq` must have folded.
pub fn expected_checksum(seq: u64, size: usize) -> u64 {
    assert!(
        size >= 8 && size.is_multiple_of(8),
        "message sizes are multiples of 8"
    );
    let byte = seq as u8 as u64;
    let word = byte * 0x0101_0101_0101_0101;
    let mut acc = seq.rotate_left(1);
    for _ in 1..size / 8 {
        acc = acc.wrapping_add(word).rotate_left(1);
    }
    acc
}

/// Sum (wrapping) of [`expected_checksum`] over messages `1..=count`: what a
/// sink that received `count` messages must report.
pub fn expected_stream_checksum(count: u64, size: usize) -> u64 {
    // Register arithmetic only (no buffer): about a nanosecond per word on
    // the host, small beside the time the stream took.
    let tail_words = size / 8 - 1;
    let mut sum = 0u64;
    for seq in 1..=count {
        let word = (seq as u8 as u64) * 0x0101_0101_0101_0101;
        let mut acc = seq.rotate_left(1);
        for _ in 0..tail_words {
            acc = acc.wrapping_add(word).rotate_left(1);
        }
        sum = sum.wrapping_add(acc);
    }
    sum
}

fn seq_of(buf: &[u8]) -> u64 {
    u64::from_le_bytes(buf[..8].try_into().expect("messages are at least 8 bytes"))
}

fn check_size(size: usize) -> anyhow::Result<()> {
    if size < 8 || !size.is_multiple_of(8) || size > 64 << 20 {
        bail!("message size {size} is not a multiple of 8 in 8..=64 MiB");
    }
    Ok(())
}

/// Echo side of a ping-pong: reads each message whole, folds it, checks its
/// sequence number, writes it back; returns the messages echoed when the
/// [`END`] message (echoed too) arrives.
pub fn echo<S: Read + Write>(s: &mut S, size: usize) -> anyhow::Result<u64> {
    check_size(size)?;
    let mut buf = vec![0u8; size];
    let mut n = 0u64;
    loop {
        s.read_exact(&mut buf).context("echo: reading a message")?;
        std::hint::black_box(checksum(&buf));
        let seq = seq_of(&buf);
        if seq != END && seq != n + 1 {
            bail!("echo: message {seq} arrived, expected {}", n + 1);
        }
        s.write_all(&buf).context("echo: writing the reply")?;
        if seq == END {
            s.flush()?;
            return Ok(n);
        }
        n += 1;
    }
}

/// Pinging side: for `warmup` then `duration`, writes message `k` (filled),
/// reads the reply whole and checks every byte of it against message `k`;
/// returns the timed round trips (ns). Ends the stream with [`END`].
pub fn ping_pong<S: Read + Write>(
    s: &mut S,
    size: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Vec<u64>> {
    check_size(size)?;
    let mut out = vec![0u8; size];
    let mut back = vec![0u8; size];
    let rtts = crate::time_round_trips(warmup, duration, |k| {
        crate::fill(&mut out, k);
        s.write_all(&out).context("ping: writing")?;
        s.read_exact(&mut back).context("ping: reading the reply")?;
        if checksum(&back) != expected_checksum(k, size) {
            bail!("ping: reply {k} does not carry message {k}'s bytes");
        }
        Ok(())
    })?;
    crate::fill(&mut out, END);
    s.write_all(&out)?;
    s.read_exact(&mut back)
        .context("ping: reading the END echo")?;
    Ok(rtts)
}

/// What a sink saw: messages before [`END`], the sum of their folds, and the
/// time from the first message's arrival to [`END`]'s (the first message is
/// not counted in the rate: its arrival starts the clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SinkReport {
    pub messages: u64,
    pub checksum: u64,
    pub timed_messages: u64,
    pub timed_ns: u64,
}

impl SinkReport {
    /// Bytes per second over the timed window.
    pub fn bytes_per_s(&self, size: usize) -> f64 {
        if self.timed_ns == 0 {
            return 0.0;
        }
        (self.timed_messages * size as u64) as f64 / (self.timed_ns as f64 / 1e9)
    }

    /// Fails unless the report is what a sink of `size`-byte messages that
    /// received `sent` messages, every byte intact, must report.
    pub fn verify(&self, sent: Option<u64>, size: usize) -> anyhow::Result<()> {
        if let Some(sent) = sent {
            if sent != self.messages {
                bail!(
                    "the source sent {sent} messages, the sink received {}",
                    self.messages
                );
            }
        }
        if self.messages < 2 {
            bail!("only {} messages arrived: nothing to time", self.messages);
        }
        let want = expected_stream_checksum(self.messages, size);
        if self.checksum != want {
            bail!(
                "the sink's checksum {:#x} over {} messages is not the sent bytes' {want:#x}",
                self.checksum,
                self.messages
            );
        }
        Ok(())
    }
}

/// Receiving side of a throughput case: reads messages whole (through a
/// [`STREAM_BUFFER`]), folding every byte and checking the order, until [`END`].
pub fn sink<S: Read>(s: &mut S, size: usize) -> anyhow::Result<SinkReport> {
    check_size(size)?;
    let mut s = std::io::BufReader::with_capacity(STREAM_BUFFER, s);
    let mut buf = vec![0u8; size];
    let mut n = 0u64;
    let mut sum = 0u64;
    let mut first: Option<Instant> = None;
    loop {
        s.read_exact(&mut buf).context("sink: reading a message")?;
        let seq = seq_of(&buf);
        if seq == END {
            let timed_ns = first.map_or(0, |t| t.elapsed().as_nanos() as u64);
            return Ok(SinkReport {
                messages: n,
                checksum: sum,
                timed_messages: n.saturating_sub(1),
                timed_ns,
            });
        }
        sum = sum.wrapping_add(checksum(&buf));
        if seq != n + 1 {
            bail!("sink: message {seq} arrived, expected {}", n + 1);
        }
        if first.is_none() {
            first = Some(Instant::now());
        }
        n += 1;
    }
}

/// Sending side of a throughput case: writes messages `1, 2, ...` (every byte
/// rewritten for each, through a [`STREAM_BUFFER`]) for `duration`, then
/// [`END`]; returns the messages sent.
pub fn source<S: Write>(s: &mut S, size: usize, duration: Duration) -> anyhow::Result<u64> {
    check_size(size)?;
    let mut s = std::io::BufWriter::with_capacity(STREAM_BUFFER, s);
    let mut buf = vec![0u8; size];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < duration {
        n += 1;
        crate::fill(&mut buf, n);
        s.write_all(&buf).context("source: writing")?;
    }
    crate::fill(&mut buf, END);
    s.write_all(&buf)?;
    s.flush()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_checksum_matches_a_filled_buffer() {
        for size in [8usize, 64, 4096, 65536] {
            for seq in [1u64, 2, 255, 256, 70_000] {
                let mut b = vec![0u8; size];
                crate::fill(&mut b, seq);
                assert_eq!(checksum(&b), expected_checksum(seq, size), "{size} {seq}");
            }
        }
        let sum = (1..=300u64).fold(0u64, |a, s| a.wrapping_add(expected_checksum(s, 64)));
        assert_eq!(expected_stream_checksum(300, 64), sum);
    }

    #[test]
    fn streams_over_a_socket_pair_verify_and_catch_corruption() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t =
            std::thread::spawn(move || source(&mut a, 4096, Duration::from_millis(50)).unwrap());
        let r = sink(&mut b, 4096).unwrap();
        let sent = t.join().unwrap();
        r.verify(Some(sent), 4096).unwrap();
        assert!(r.bytes_per_s(4096) > 0.0);
        let mut bad = r;
        bad.checksum ^= 1;
        assert!(bad.verify(Some(sent), 4096).is_err());
        assert!(r.verify(Some(sent + 1), 4096).is_err());

        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || echo(&mut b, 64).unwrap());
        let rtts = ping_pong(
            &mut a,
            64,
            Duration::from_millis(10),
            Duration::from_millis(30),
        )
        .unwrap();
        let echoed = t.join().unwrap();
        assert!(!rtts.is_empty());
        assert!(echoed as usize >= rtts.len());
    }

    #[test]
    fn a_reordered_stream_fails() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut m = vec![0u8; 64];
        for seq in [1u64, 3, END] {
            crate::fill(&mut m, seq);
            a.write_all(&m).unwrap();
        }
        assert!(sink(&mut b, 64).is_err());
    }
}
