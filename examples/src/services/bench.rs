//! The VMRPC paper's benchmark service (its Table 2): a null call, and
//! sequences sent to or received from the server — ByteSeq (bytes), FixedSeq
//! (fixed-size structs), VarSeq (structs holding a variable-length string).
//! The server touches every element and returns a checksum the client can
//! compare with [`byteseq_sum`], [`fixed_sum`], [`var_sum`].

use fido_rpc::{Ctx, Fault, Frame, RpcError, ShmSlice, ShmStr};
use bytemuck::{Pod, Zeroable};
use fido::{PeerSlice, PeerSliceOf};

/// A FixedSeq element (24 bytes, no padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Fixed {
    pub a: u64,
    pub b: u64,
    pub c: u32,
    pub d: u32,
}

/// A VarSeq element: a number and a string (POD + `ShmStr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Var {
    pub id: u64,
    pub name: ShmStr,
}

#[fido_rpc::service]
pub trait Bench: Send + Sync + 'static {
    /// Nothing in, nothing out.
    fn null(&self, cx: &mut Ctx<'_>);
    /// Sum of the bytes.
    fn byteseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<u8>) -> Result<u64, Fault>;
    /// `len` bytes built by the server (`byteseq_byte(i)`).
    fn byteseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<u8>, Fault>;
    fn fixedseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<Fixed>) -> Result<u64, Fault>;
    fn fixedseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<Fixed>, Fault>;
    fn varseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<Var>) -> Result<u64, Fault>;
    fn varseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<Var>, Fault>;
    /// Does nothing; never answered.
    #[oneway]
    fn poke(&self, cx: &mut Ctx<'_>, n: u64);
}

/// The `i`th byte of a ByteSeq.
#[inline]
pub fn byteseq_byte(i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(7)
}
/// The `i`th element of a FixedSeq.
#[inline]
pub fn fixed_elem(i: usize) -> Fixed {
    Fixed { a: i as u64, b: (i as u64).wrapping_mul(3), c: i as u32 ^ 0x55, d: 1 }
}
/// The string of the `i`th VarSeq element: 8 to 23 bytes.
pub fn var_name(i: usize, out: &mut [u8; 24]) -> &[u8] {
    let n = 8 + i % 16;
    for (j, b) in out[..n].iter_mut().enumerate() {
        *b = b'a' + ((i + j) % 26) as u8;
    }
    &out[..n]
}

/// Σ bytes, read in place (chunk by chunk: see [`PeerSlice::read_chunks`]).
pub fn byteseq_sum(d: PeerSliceOf<'_, u8>) -> u64 {
    let mut s = 0u64;
    d.as_bytes().read_chunks(|c| s += c.iter().map(|&b| b as u64).sum::<u64>());
    s
}
pub fn fixed_sum(d: PeerSliceOf<'_, Fixed>) -> u64 {
    d.iter().fold(0u64, |s, f| s.wrapping_add(f.a).wrapping_add(f.b).wrapping_add(f.c as u64).wrapping_add(f.d as u64))
}
/// Sum over elements of `id` plus the string's bytes; strings resolved with `str`.
pub fn var_sum<'a>(d: PeerSliceOf<'_, Var>, mut str: impl FnMut(ShmStr) -> Result<PeerSlice<'a>, Fault>) -> Result<u64, Fault> {
    let mut s = 0u64;
    for v in d.iter() {
        s = s.wrapping_add(v.id);
        str(v.name)?.read_chunks(|c| {
            for &b in c {
                s = s.wrapping_add(b as u64);
            }
        });
    }
    Ok(s)
}

/// Builds a ByteSeq of `len` in `frame`.
pub fn make_byteseq(frame: &mut Frame, len: usize) -> Result<ShmSlice<u8>, RpcError> {
    let (h, dst) = frame.alloc_slice::<u8>(len)?;
    for (i, b) in dst.iter_mut().enumerate() {
        *b = byteseq_byte(i);
    }
    Ok(h)
}
pub fn make_fixedseq(frame: &mut Frame, len: usize) -> Result<ShmSlice<Fixed>, RpcError> {
    frame.fill_slice(len, fixed_elem)
}
pub fn make_varseq(frame: &mut Frame, len: usize) -> Result<ShmSlice<Var>, RpcError> {
    let mut tmp = [0u8; 24];
    frame.slice_with(len, |i, f| {
        let name = var_name(i, &mut tmp);
        let s = f.bytes(name)?;
        Ok(Var { id: i as u64, name: ShmStr { addr: s.addr(), len: s.len() } })
    })
}
/// The checksum of `make_byteseq(len)` etc., computed without building it.
pub fn expected_byteseq(len: usize) -> u64 {
    (0..len).map(|i| byteseq_byte(i) as u64).sum()
}
pub fn expected_fixedseq(len: usize) -> u64 {
    (0..len).fold(0u64, |s, i| {
        let f = fixed_elem(i);
        s.wrapping_add(f.a).wrapping_add(f.b).wrapping_add(f.c as u64).wrapping_add(f.d as u64)
    })
}
pub fn expected_varseq(len: usize) -> u64 {
    let mut tmp = [0u8; 24];
    (0..len).fold(0u64, |s, i| {
        let n = var_name(i, &mut tmp).iter().map(|&b| b as u64).sum::<u64>();
        s.wrapping_add(i as u64).wrapping_add(n)
    })
}

/// The server: touches every element.
#[derive(Default)]
pub struct BenchImpl;

fn mem(e: RpcError) -> Fault {
    tracing::warn!("bench reply: {e}");
    Fault::ServerMemory
}

impl Bench for BenchImpl {
    fn null(&self, _cx: &mut Ctx<'_>) {}
    fn byteseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<u8>) -> Result<u64, Fault> {
        Ok(byteseq_sum(cx.slice(data)?))
    }
    fn byteseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<u8>, Fault> {
        make_byteseq(cx.frame().map_err(mem)?, len as usize).map_err(mem)
    }
    fn fixedseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<Fixed>) -> Result<u64, Fault> {
        Ok(fixed_sum(cx.slice(data)?))
    }
    fn fixedseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<Fixed>, Fault> {
        make_fixedseq(cx.frame().map_err(mem)?, len as usize).map_err(mem)
    }
    fn varseq_send(&self, cx: &mut Ctx<'_>, data: ShmSlice<Var>) -> Result<u64, Fault> {
        let view = cx.view();
        var_sum(view.slice(data)?, |s| view.str(s).map(|r| r.as_bytes()))
    }
    fn varseq_recv(&self, cx: &mut Ctx<'_>, len: u64) -> Result<ShmSlice<Var>, Fault> {
        make_varseq(cx.frame().map_err(mem)?, len as usize).map_err(mem)
    }
    fn poke(&self, _cx: &mut Ctx<'_>, _n: u64) {}
}
