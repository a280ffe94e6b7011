//! fido-rpc's server dispatch on any bytes a client could send.
//!
//! The input is `mode` (1 byte) followed by the "client's memory": it is
//! placed at a fake global address (`BASE`) and its first bytes are the call's
//! first segment, so headers, roots, handles and the data they point to all
//! come from the fuzzer. Mode bits help it past the magic: bit 0 writes the
//! magic, bit 1 points the root inside the memory, bit 2 disables the
//! signature check, bit 3 picks the file service instead of the bench service,
//! bit 4 sends the first 32 bytes as an inline call (header and root in the
//! descriptor) instead of a framed one.
//!
//! Property: `dispatch_call` never panics and never reports a handler panic
//! (`Fault::Panicked` would mean generated decoding or a handler tripped on
//! input); every handle the server resolves lies inside the memory; a reply
//! can always be built.

use fido_examples::services::bench::{BenchImpl, BenchServer};
use fido_examples::services::files::{FileServer, FilesServer};
use fido_rpc::wire::{CallHeader, HEADER_LEN, MAGIC, STATUS_FAULT};
use fido_rpc::{dispatch_call, reply_message, CallBytes, Dispatch, Fault, PeerMemory};
use fido_shm::{AddressSpace, Arena, ModeRequest, PeerSlice, PgvasGeometry, UnplacedArena};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// Where the fake client memory starts.
pub const BASE: u64 = 0x7000_0000_0000;

struct Fake {
    mem: Vec<u64>,
    len: usize,
}

impl PeerMemory for Fake {
    fn bytes(&self, addr: u64, len: u64) -> Option<PeerSlice<'_>> {
        let off = addr.checked_sub(BASE)?;
        let end = off.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        let all: &[u8] = bytemuck_bytes(&self.mem);
        Some(PeerSlice::from_own(&all[off as usize..end as usize]))
    }
    // Like a real message (`fido::Msg`): the grant as one window, so the
    // handles are checked by `View`'s inline range check, the path the
    // server takes.
    fn window(&self) -> Option<(u64, PeerSlice<'_>)> {
        Some((BASE, PeerSlice::from_own(&bytemuck_bytes(&self.mem)[..self.len])))
    }
}

fn bytemuck_bytes(v: &[u64]) -> &[u8] {
    fido_rpc::bytemuck::cast_slice(v)
}

struct Env {
    arena: Arc<Arena>,
    bench: BenchServer<BenchImpl>,
    files: FilesServer<FileServer>,
    _space: Arc<AddressSpace>,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let space = Arc::new(AddressSpace::new(PgvasGeometry::DEFAULT, ModeRequest::ForceSwizzle).expect("address space"));
        let arena = UnplacedArena::create(8 << 20, false).expect("arena").place(&space, 1, 1).expect("place");
        let fs = FileServer::new(&arena, None);
        Env { files: FilesServer(fs), bench: BenchServer(BenchImpl), arena, _space: space }
    })
}

/// Runs one input; panics if the property fails. Returns the reply's status
/// and fault code.
pub fn run(data: &[u8]) -> Option<(u32, u32)> {
    let (&mode, rest) = data.split_first()?;
    // Aligned copy (u64 words) so in-place slices of u64 fields can be valid.
    let mut mem = vec![0u64; rest.len().div_ceil(8).max(HEADER_LEN / 8)];
    let len = rest.len().max(HEADER_LEN);
    fido_rpc::bytemuck::cast_slice_mut::<u64, u8>(&mut mem)[..rest.len()].copy_from_slice(rest);
    {
        let bytes: &mut [u8] = fido_rpc::bytemuck::cast_slice_mut(&mut mem);
        let mut h: CallHeader = fido_rpc::bytemuck::pod_read_unaligned(&bytes[..HEADER_LEN]);
        if mode & 1 != 0 {
            h.magic = MAGIC;
        }
        if mode & 2 != 0 {
            h.root_addr = BASE + h.root_addr % len as u64;
            h.root_len %= 256;
        }
        if mode & 4 != 0 {
            h.sig = 0;
        }
        // No deadlines: they depend on the clock, not the input.
        h.deadline_ns = 0;
        h.method %= 16;
        bytes[..HEADER_LEN].copy_from_slice(fido_rpc::bytemuck::bytes_of(&h));
    }
    let fake = Fake { mem, len };
    let e = env();
    let svc: &dyn Dispatch = if mode & 8 != 0 { &e.files } else { &e.bench };
    let first = fake.bytes(BASE, len as u64).expect("first segment");
    let cancelled = AtomicBool::new(false);
    let open = || true;
    // Mode bit 4: the input's first bytes as an inline call instead (deadline
    // cleared and method folded, as above).
    let mut inline = [0u8; fido_rpc::fido::INLINE_BYTES];
    let n = rest.len().min(inline.len());
    inline[..n].copy_from_slice(&rest[..n]);
    if n >= 16 {
        inline[8..16].fill(0);
        let m = u32::from_ne_bytes(inline[..4].try_into().expect("4 bytes")) % 16;
        inline[..4].copy_from_slice(&m.to_ne_bytes());
    }
    let call = if mode & 16 != 0 { CallBytes::Inline(&inline[..n]) } else { CallBytes::Framed(first) };
    let out = dispatch_call(svc, call, &fake, 1, 2, &cancelled, &open, &e.arena);
    if out.status == STATUS_FAULT {
        assert_ne!(out.fault, Fault::Panicked as u32, "a handler or decoder panicked on this input");
    }
    let r = (out.status, out.fault);
    // The reply can be built (or fails cleanly for lack of memory).
    let _ = reply_message(&e.arena, 1, out);
    Some(r)
}

/// Hand-written seeds: well-formed calls of every method (mode 0: nothing
/// patched), plus a few broken ones.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    fn call(method: u32, root: &[u8], data: &[u8], files: bool) -> Vec<u8> {
        // memory: header (64) | root (at 64, padded to 64) | data (at 128+)
        let mut mem = vec![0u8; 128];
        let h = CallHeader {
            magic: MAGIC,
            method,
            sig: 0,
            _reserved: 0,
            deadline_ns: 0,
            root_addr: BASE + 64,
            root_len: root.len() as u64,
            _pad: [0; 3],
        };
        mem[..64].copy_from_slice(fido_rpc::bytemuck::bytes_of(&h));
        mem[64..64 + root.len()].copy_from_slice(root);
        mem.extend_from_slice(data);
        let mut v = vec![if files { 8 } else { 0 }];
        v.extend_from_slice(&mem);
        v
    }
    let handle = |off: u64, len: u64| [(BASE + off).to_ne_bytes(), len.to_ne_bytes()].concat();
    let u64b = |x: u64| x.to_ne_bytes().to_vec();
    let mut s = vec![
        ("null".to_string(), call(0, &[], &[], false)),
        ("byteseq_send".into(), call(1, &handle(128, 16), &[7u8; 16], false)),
        ("byteseq_recv".into(), call(2, &u64b(100), &[], false)),
        ("fixedseq_send".into(), call(3, &handle(128, 2), &[3u8; 48], false)),
        ("fixedseq_recv".into(), call(4, &u64b(10), &[], false)),
        ("varseq_recv".into(), call(6, &u64b(10), &[], false)),
        ("poke".into(), call(7, &u64b(1), &[], false)),
        ("unknown_method".into(), call(9, &[], &[], false)),
        ("bad_root".into(), call(1, &handle(1 << 40, 16), &[], false)),
        ("files_stat".into(), call(1, &handle(128, 4), b"name", true)),
        ("files_put".into(), call(2, &[handle(128, 4), handle(132, 4)].concat(), b"namedata", true)),
        ("files_read".into(), call(0, &[handle(128, 4), u64b(0), u64b(4)].concat(), b"name", true)),
    ];
    // Inline calls: method, signature (0: any), deadline, then the root.
    let inline = |method: u32, root: &[u8]| [&[16u8][..], &method.to_ne_bytes(), &[0; 12], root].concat();
    s.push(("inline_null".into(), inline(0, &[])));
    s.push(("inline_byteseq_recv".into(), inline(2, &u64b(100))));
    s.push(("inline_short".into(), vec![16, 1, 2, 3]));
    // varseq_send: two elements {id, name} with names after them.
    let mut data = Vec::new();
    data.extend_from_slice(&1u64.to_ne_bytes());
    data.extend_from_slice(&handle(128 + 48, 3));
    data.extend_from_slice(&2u64.to_ne_bytes());
    data.extend_from_slice(&handle(128 + 51, 2));
    data.extend_from_slice(b"abcde");
    s.push(("varseq_send".into(), call(5, &handle(128, 2), &data, false)));
    s
}
