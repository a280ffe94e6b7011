//! `uds`: a hand-written request/response over a Unix stream socket — the floor
//! any socket-based RPC pays. No framework, no serialization library: the client
//! writes the sequence straight into its (reused) send buffer in the obvious flat
//! layout, the server reads the fields in place from its (reused) receive buffer.
//!
//! Wire format (little endian). Request: `op u32` (0 null, 1 send, 2 recv),
//! `seq u32` (0 byte, 1 fixed, 2 var), `len u64`, `seed u64`, `body u64`, then
//! `body` bytes. Reply: `sum u64`, `body u64`, then `body` bytes. ByteSeq = the
//! bytes; FixedSeq = 16-byte `i32 i, i32 j, f64 d` records; VarSeq = `f64 d, u8 n,
//! n bytes` records. Every length is validated before use.
//!
//! `null-polled`: both ends read with `MSG_DONTWAIT` in a spin loop instead of
//! blocking.

use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};

use anyhow::{bail, Context as _};
use rustix::net::RecvFlags;

use super::data::{self, Dir, Seq, VAR_STR};
use super::{Case, RpcClient};

const REQ: usize = 32;
const REP: usize = 16;
/// Largest body either side accepts (LEN 10⁷ VarSeq is 190 MB).
const MAX_BODY: u64 = 1 << 30;

fn seq_code(s: Seq) -> u32 {
    match s {
        Seq::Byte => 0,
        Seq::Fixed => 1,
        Seq::Var => 2,
    }
}

fn code_seq(c: u32) -> anyhow::Result<Seq> {
    Ok(match c {
        0 => Seq::Byte,
        1 => Seq::Fixed,
        2 => Seq::Var,
        o => bail!("bad sequence code {o}"),
    })
}

/// Reads exactly `buf.len()` bytes, blocking or spinning.
fn read_full(s: &mut UnixStream, buf: &mut [u8], polled: bool) -> std::io::Result<()> {
    if !polled {
        return s.read_exact(buf);
    }
    let mut got = 0;
    let mut spins = 0u32;
    while got < buf.len() {
        match rustix::net::recv(&*s, &mut buf[got..], RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok((n, _)) => {
                got += n;
                spins = 0;
            }
            Err(rustix::io::Errno::AGAIN) => {
                spins += 1;
                if spins.is_multiple_of(1 << 14) {
                    // A peer sharing our CPU gets to run.
                    rustix::thread::sched_yield();
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Appends the FixedSeq of `seed` in wire form; returns its checksum.
fn put_fixed(out: &mut Vec<u8>, len: usize, seed: u64) -> u64 {
    out.reserve(16 * len);
    let mut sum = 0u64;
    for k in 0..len {
        let f = data::fixed_at(seed, k);
        sum = sum.wrapping_add(data::fixed_sum(&f));
        out.extend_from_slice(&f.i.to_le_bytes());
        out.extend_from_slice(&f.j.to_le_bytes());
        out.extend_from_slice(&f.d.to_le_bytes());
    }
    sum
}

fn fold_fixed(body: &[u8], len: usize) -> anyhow::Result<u64> {
    if body.len() != 16 * len {
        bail!("FixedSeq body of {} bytes for LEN {len}", body.len());
    }
    Ok(body.chunks_exact(16).fold(0u64, |a, r| {
        let f = data::Fixed {
            i: i32::from_le_bytes(r[0..4].try_into().unwrap()),
            j: i32::from_le_bytes(r[4..8].try_into().unwrap()),
            d: f64::from_le_bytes(r[8..16].try_into().unwrap()),
        };
        a.wrapping_add(data::fixed_sum(&f))
    }))
}

fn put_var(out: &mut Vec<u8>, len: usize, seed: u64) -> u64 {
    out.reserve((9 + VAR_STR) * len);
    let mut sum = 0u64;
    for k in 0..len {
        let s = data::var_str_at(seed, k);
        let d = data::var_d_at(k);
        sum = sum.wrapping_add(data::var_sum(&s, d));
        out.extend_from_slice(&d.to_le_bytes());
        out.push(s.len() as u8);
        out.extend_from_slice(&s);
    }
    sum
}

fn fold_var(mut body: &[u8], len: usize) -> anyhow::Result<u64> {
    let mut sum = 0u64;
    for _ in 0..len {
        if body.len() < 9 {
            bail!("VarSeq body truncated");
        }
        let d = f64::from_le_bytes(body[..8].try_into().unwrap());
        let n = body[8] as usize;
        let Some(s) = body.get(9..9 + n) else {
            bail!("VarSeq string runs past the body");
        };
        sum = sum.wrapping_add(data::var_sum(s, d));
        body = &body[9 + n..];
    }
    if !body.is_empty() {
        bail!("{} bytes after the last VarSeq element", body.len());
    }
    Ok(sum)
}

/// Appends the wire form of the sequence to `out`; returns its checksum.
fn put_seq(out: &mut Vec<u8>, seq: Seq, len: usize, seed: u64) -> u64 {
    match seq {
        Seq::Byte => {
            let at = out.len();
            out.resize(at + seq.elements(len), 0);
            data::fill_bytes(&mut out[at..], seed)
        }
        Seq::Fixed => put_fixed(out, len, seed),
        Seq::Var => put_var(out, len, seed),
    }
}

fn fold_seq(body: &[u8], seq: Seq, len: usize) -> anyhow::Result<u64> {
    match seq {
        Seq::Byte => {
            if body.len() != seq.elements(len) {
                bail!("ByteSeq body of {} bytes for LEN {len}", body.len());
            }
            Ok(data::sum_bytes(body))
        }
        Seq::Fixed => fold_fixed(body, len),
        Seq::Var => fold_var(body, len),
    }
}

/// Server: one connection, requests until the client hangs up.
pub fn serve(addr: &str, case: Case) -> anyhow::Result<()> {
    let polled = case == Case::NullPolled;
    let _ = std::fs::remove_file(addr);
    let l = UnixListener::bind(addr).with_context(|| format!("binding {addr}"))?;
    super::emit_ready()?;
    let (mut s, _) = l.accept()?;
    let mut req = [0u8; REQ];
    let mut body = Vec::new();
    let mut reply = Vec::new();
    loop {
        match read_full(&mut s, &mut req, polled) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let op = u32::from_le_bytes(req[0..4].try_into().unwrap());
        let len = u64_at(&req, 8);
        let seed = u64_at(&req, 16);
        let blen = u64_at(&req, 24);
        if blen > MAX_BODY || len > MAX_BODY {
            bail!("request body {blen} / LEN {len} over the limit");
        }
        let len = len as usize;
        body.resize(blen as usize, 0);
        read_full(&mut s, &mut body, polled)?;
        reply.clear();
        reply.resize(REP, 0);
        let sum = match op {
            0 => 0,
            1 => fold_seq(
                &body,
                code_seq(u32::from_le_bytes(req[4..8].try_into().unwrap()))?,
                len,
            )?,
            2 => {
                let seq = code_seq(u32::from_le_bytes(req[4..8].try_into().unwrap()))?;
                put_seq(&mut reply, seq, len, seed)
            }
            o => bail!("bad op {o}"),
        };
        let blen = (reply.len() - REP) as u64;
        reply[0..8].copy_from_slice(&data::server_sum(sum).to_le_bytes());
        reply[8..16].copy_from_slice(&blen.to_le_bytes());
        s.write_all(&reply)?;
    }
}

pub struct Client {
    s: UnixStream,
    polled: bool,
    buf: Vec<u8>,
    rep: Vec<u8>,
}

impl Client {
    pub fn connect(addr: &str, case: Case) -> anyhow::Result<Client> {
        let s = UnixStream::connect(addr).with_context(|| format!("connecting {addr}"))?;
        Ok(Client {
            s,
            polled: case == Case::NullPolled,
            buf: Vec::new(),
            rep: Vec::new(),
        })
    }

    fn round_trip(&mut self, op: u32, seq: Seq, len: usize, seed: u64) -> anyhow::Result<u64> {
        let blen = self.buf.len() - REQ;
        self.buf[0..4].copy_from_slice(&op.to_le_bytes());
        self.buf[4..8].copy_from_slice(&seq_code(seq).to_le_bytes());
        self.buf[8..16].copy_from_slice(&(len as u64).to_le_bytes());
        self.buf[16..24].copy_from_slice(&seed.to_le_bytes());
        self.buf[24..32].copy_from_slice(&(blen as u64).to_le_bytes());
        self.s.write_all(&self.buf)?;
        let mut hdr = [0u8; REP];
        read_full(&mut self.s, &mut hdr, self.polled)?;
        let sum = u64_at(&hdr, 0);
        let rlen = u64_at(&hdr, 8);
        if rlen > MAX_BODY {
            bail!("reply body {rlen} over the limit");
        }
        self.rep.resize(rlen as usize, 0);
        read_full(&mut self.s, &mut self.rep, self.polled)?;
        Ok(sum)
    }
}

impl RpcClient for Client {
    fn null(&mut self) -> anyhow::Result<()> {
        self.buf.clear();
        self.buf.resize(REQ, 0);
        self.round_trip(0, Seq::Byte, 0, 0)?;
        Ok(())
    }

    fn call(&mut self, seq: Seq, dir: Dir, len: usize, seed: u64) -> anyhow::Result<()> {
        match dir {
            Dir::Send => {
                self.buf.clear();
                self.buf.resize(REQ, 0);
                let want = put_seq(&mut self.buf, seq, len, seed);
                let got = self.round_trip(1, seq, len, seed)?;
                data::check("uds send", got, want)
            }
            Dir::Recv => {
                self.buf.clear();
                self.buf.resize(REQ, 0);
                let sum = self.round_trip(2, seq, len, seed)?;
                let got = fold_seq(&self.rep, seq, len)?;
                data::check("uds recv", got, sum)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_forms_fold_to_the_expected_sums() {
        for seq in Seq::ALL {
            let mut b = Vec::new();
            let s = put_seq(&mut b, seq, 50, 9);
            assert_eq!(s, data::expected(seq, 50, 9));
            assert_eq!(fold_seq(&b, seq, 50).unwrap(), s);
            assert!(fold_seq(&b[..b.len() - 1], seq, 50).is_err());
        }
    }
}
