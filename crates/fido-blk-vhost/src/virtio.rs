//! The virtio-blk side: the features and configuration space the guest sees,
//! and the validation of a guest's descriptor chain into a request.
//!
//! Everything here reads guest memory only to copy small things out of it
//! (the 16-byte request header, discard/write-zeroes segments) and decides
//! from those copies; nothing is written. A chain that breaks a rule becomes
//! a request with an error status (or, when the chain has no device-writable
//! byte for a status at all, one that can only be returned unanswered).

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

use virtio_bindings::virtio_blk::{
    virtio_blk_config, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_WRITE_ZEROES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// virtio-blk addresses the device in 512-byte sectors whatever its block size.
pub const SECTOR: u64 = 512;
/// The bytes of a GET_ID answer.
pub const ID_BYTES: usize = 20;
/// The request header (`virtio_blk_outhdr`: type, ioprio, sector).
const HEADER_LEN: usize = 16;
/// One discard / write-zeroes segment (`virtio_blk_discard_write_zeroes`).
const DWZ_SEG_LEN: usize = 16;
/// Discard and write-zeroes segments one request may carry (advertised).
pub const MAX_DWZ_SEGS: u32 = 32;
/// The largest segment the guest is told to use (`size_max`).
const SIZE_MAX: u32 = 1 << 20;
/// Descriptors one chain may have (an indirect table may list up to 65535).
const MAX_CHAIN: usize = 1024;

/// The device as the guest sees it: the storage domain's INFO and our options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes (a multiple of `logical_block`).
    pub capacity: u64,
    /// 512 or 4096: offsets and lengths must be multiples of it.
    pub logical_block: u32,
    /// The largest single fido-blk READ or WRITE (guest requests are split to it).
    pub max_transfer: u32,
    pub read_only: bool,
    /// The storage domain honours FLUSH (the guest is told it has a write cache).
    pub flush: bool,
    pub discard: bool,
    pub write_zeroes: bool,
    pub num_queues: u16,
    pub queue_size: u16,
}

impl Limits {
    /// Data descriptors per request the guest is told it may use.
    pub fn seg_max(&self) -> u32 {
        u32::from(self.queue_size).saturating_sub(2).max(1)
    }

    /// The largest segment the guest is told to use.
    pub fn size_max(&self) -> u32 {
        SIZE_MAX.min(self.max_transfer)
    }

    /// The most data bytes one READ or WRITE may carry: what a guest that
    /// honours `seg_max` and `size_max` can send. Larger is refused.
    pub fn max_request(&self) -> u64 {
        u64::from(self.seg_max()) * u64::from(self.size_max())
    }

    /// The most bytes of one fido-blk DISCARD or WRITE_ZEROES (a u32 length,
    /// a block multiple).
    pub fn max_ranged(&self) -> u64 {
        u64::from(u32::MAX / self.logical_block * self.logical_block)
    }
}

/// The virtio and vhost-user feature bits offered to the front end.
pub fn device_features(l: &Limits) -> u64 {
    let mut f = 1u64 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_EVENT_IDX
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | 1 << VIRTIO_BLK_F_SIZE_MAX
        | 1 << VIRTIO_BLK_F_SEG_MAX
        | 1 << VIRTIO_BLK_F_BLK_SIZE
        | 1 << VIRTIO_BLK_F_MQ;
    if l.flush {
        f |= 1 << VIRTIO_BLK_F_FLUSH;
    }
    if l.read_only {
        f |= 1 << VIRTIO_BLK_F_RO;
    } else {
        if l.discard {
            f |= 1 << VIRTIO_BLK_F_DISCARD;
        }
        if l.write_zeroes {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
    }
    f
}

/// The device's configuration space (`struct virtio_blk_config`, little endian).
pub fn config_space(l: &Limits) -> Vec<u8> {
    use std::mem::offset_of;
    let mut c = vec![0u8; std::mem::size_of::<virtio_blk_config>()];
    let mut put = |at: usize, bytes: &[u8]| c[at..at + bytes.len()].copy_from_slice(bytes);
    let ranged_sectors = (l.max_ranged() / SECTOR) as u32;
    put(
        offset_of!(virtio_blk_config, capacity),
        &(l.capacity / SECTOR).to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, size_max),
        &l.size_max().to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, seg_max),
        &l.seg_max().to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, blk_size),
        &l.logical_block.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, num_queues),
        &l.num_queues.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, max_discard_sectors),
        &ranged_sectors.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, max_discard_seg),
        &MAX_DWZ_SEGS.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, discard_sector_alignment),
        &(l.logical_block / SECTOR as u32).to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, max_write_zeroes_sectors),
        &ranged_sectors.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, max_write_zeroes_seg),
        &MAX_DWZ_SEGS.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, write_zeroes_may_unmap),
        &[u8::from(l.discard)],
    );
    c
}

/// One descriptor of a chain, as the guest wrote it (not yet trusted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub writable: bool,
}

/// A stretch of guest memory a request reads or fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A DISCARD or WRITE_ZEROES range, checked against the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub offset: u64,
    pub len: u64,
    /// WRITE_ZEROES may deallocate (VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
    pub unmap: bool,
}

/// What a valid chain asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// IN: `len` bytes at `offset` into the device-writable `data`.
    Read {
        offset: u64,
        len: u64,
        data: Vec<Seg>,
    },
    /// OUT: the device-readable `data` (`len` bytes) to `offset`.
    Write {
        offset: u64,
        len: u64,
        data: Vec<Seg>,
    },
    Flush,
    /// GET_ID: up to [`ID_BYTES`] into `data`.
    GetId {
        data: Vec<Seg>,
    },
    Discard(Vec<Range>),
    WriteZeroes(Vec<Range>),
}

/// A guest's chain, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestRequest {
    /// The status byte: the last byte of the chain's last descriptor, which
    /// is device-writable; `None` when the chain has no such byte (it can
    /// only be returned with nothing written).
    pub status: Option<GuestAddress>,
    /// The request, or the virtio status it is answered with at once.
    pub outcome: Result<Kind, u8>,
}

const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// Validates a chain: readable descriptors first, then writable ones; the
/// last byte of the last (writable) descriptor is the status; a 16-byte
/// header at the start of the readable part; lengths and sectors within the
/// device (`sector × 512` and `offset + len` without overflow, block
/// aligned). Unknown types are UNSUPP, everything else that is wrong IOERR.
pub fn parse<M: GuestMemory + ?Sized>(descs: &[Desc], mem: &M, l: &Limits) -> GuestRequest {
    let status = status_byte(descs);
    GuestRequest {
        status,
        outcome: if status.is_some() {
            parse_kind(descs, mem, l)
        } else {
            Err(IOERR)
        },
    }
}

fn status_byte(descs: &[Desc]) -> Option<GuestAddress> {
    let last = descs.last()?;
    if !last.writable || last.len == 0 {
        return None;
    }
    last.addr
        .checked_add(u64::from(last.len) - 1)
        .map(GuestAddress)
}

fn parse_kind<M: GuestMemory + ?Sized>(descs: &[Desc], mem: &M, l: &Limits) -> Result<Kind, u8> {
    if descs.len() > MAX_CHAIN {
        return Err(IOERR);
    }
    // Readable part, then writable part; nothing readable after a writable one.
    let split = descs.iter().position(|d| d.writable).unwrap_or(descs.len());
    if descs[split..].iter().any(|d| !d.writable) {
        return Err(IOERR);
    }
    for d in descs {
        d.addr.checked_add(u64::from(d.len)).ok_or(IOERR)?;
    }
    let readable = segs(&descs[..split]);
    let writable = segs(&descs[split..]);
    let mut header = [0u8; HEADER_LEN];
    let after_header = gather(mem, &readable, &mut header)?;
    let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    // Every writable byte but the status.
    let out_area = trim_end(&writable, 1);
    match kind {
        VIRTIO_BLK_T_IN => {
            let len = total(&out_area);
            let offset = check_range(l, sector, len)?;
            if len > l.max_request() {
                return Err(IOERR);
            }
            Ok(Kind::Read {
                offset,
                len,
                data: out_area,
            })
        }
        VIRTIO_BLK_T_OUT => {
            if l.read_only {
                return Err(IOERR);
            }
            let len = total(&after_header);
            let offset = check_range(l, sector, len)?;
            if len > l.max_request() {
                return Err(IOERR);
            }
            Ok(Kind::Write {
                offset,
                len,
                data: after_header,
            })
        }
        VIRTIO_BLK_T_FLUSH => {
            if l.flush {
                Ok(Kind::Flush)
            } else {
                Err(UNSUPP)
            }
        }
        VIRTIO_BLK_T_GET_ID => Ok(Kind::GetId { data: out_area }),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let discard = kind == VIRTIO_BLK_T_DISCARD;
            if !(if discard { l.discard } else { l.write_zeroes }) {
                return Err(UNSUPP);
            }
            if l.read_only {
                return Err(IOERR);
            }
            let bytes = total(&after_header);
            let count = bytes / DWZ_SEG_LEN as u64;
            if bytes == 0 || bytes % DWZ_SEG_LEN as u64 != 0 || count > u64::from(MAX_DWZ_SEGS) {
                return Err(IOERR);
            }
            let mut raw = vec![0u8; bytes as usize];
            gather(mem, &after_header, &mut raw)?;
            let mut ranges = Vec::with_capacity(count as usize);
            for s in raw.chunks_exact(DWZ_SEG_LEN) {
                let sector = u64::from_le_bytes(s[0..8].try_into().expect("8 bytes"));
                let sectors = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
                let flags = u32::from_le_bytes(s[12..16].try_into().expect("4 bytes"));
                // A discard has no flags; write-zeroes knows only UNMAP.
                let known = if discard {
                    0
                } else {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                };
                if flags & !known != 0 {
                    return Err(UNSUPP);
                }
                let len = u64::from(sectors) * SECTOR;
                if len == 0 {
                    return Err(IOERR);
                }
                let offset = check_range(l, sector, len)?;
                ranges.push(Range {
                    offset,
                    len,
                    unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
                });
            }
            Ok(if discard {
                Kind::Discard(ranges)
            } else {
                Kind::WriteZeroes(ranges)
            })
        }
        _ => Err(UNSUPP),
    }
}

/// `sector` and `len` as a byte range inside the device: no overflow, block aligned.
fn check_range(l: &Limits, sector: u64, len: u64) -> Result<u64, u8> {
    let offset = sector.checked_mul(SECTOR).ok_or(IOERR)?;
    let end = offset.checked_add(len).ok_or(IOERR)?;
    let block = u64::from(l.logical_block);
    if end > l.capacity || offset % block != 0 || len % block != 0 {
        return Err(IOERR);
    }
    Ok(offset)
}

fn segs(descs: &[Desc]) -> Vec<Seg> {
    descs
        .iter()
        .filter(|d| d.len > 0)
        .map(|d| Seg {
            addr: GuestAddress(d.addr),
            len: d.len,
        })
        .collect()
}

fn total(segs: &[Seg]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// `segs` without their last `n` bytes.
fn trim_end(segs: &[Seg], mut n: u32) -> Vec<Seg> {
    let mut out = segs.to_vec();
    while n > 0 {
        let Some(last) = out.last_mut() else { break };
        if last.len > n {
            last.len -= n;
            n = 0;
        } else {
            n -= last.len;
            out.pop();
        }
    }
    out
}

/// Copies the first `dst.len()` bytes of `segs` into `dst` (our own memory);
/// returns the segments after them. IOERR if `segs` is shorter or not guest memory.
fn gather<M: GuestMemory + ?Sized>(mem: &M, segs: &[Seg], dst: &mut [u8]) -> Result<Vec<Seg>, u8> {
    let mut done = 0usize;
    let mut rest = Vec::new();
    for s in segs {
        let want = dst.len() - done;
        if want == 0 {
            rest.push(*s);
            continue;
        }
        let n = want.min(s.len as usize);
        mem.read_slice(&mut dst[done..done + n], s.addr)
            .map_err(|_| IOERR)?;
        done += n;
        if n < s.len as usize {
            rest.push(Seg {
                addr: s.addr.unchecked_add(n as u64),
                len: s.len - n as u32,
            });
        }
    }
    if done < dst.len() {
        return Err(IOERR);
    }
    Ok(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn limits() -> Limits {
        Limits {
            capacity: 1 << 20,
            logical_block: 512,
            max_transfer: 64 << 10,
            read_only: false,
            flush: true,
            discard: true,
            write_zeroes: true,
            num_queues: 1,
            queue_size: 128,
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn r(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: false,
        }
    }
    fn w(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: true,
        }
    }

    #[test]
    fn read_write_flush_get_id() {
        let m = mem();
        let l = limits();
        header(&m, 0, VIRTIO_BLK_T_IN, 8);
        let req = parse(&[r(0, 16), w(0x1000, 4096), w(0x3000, 1)], &m, &l);
        assert_eq!(req.status, Some(GuestAddress(0x3000)));
        assert_eq!(
            req.outcome,
            Ok(Kind::Read {
                offset: 4096,
                len: 4096,
                data: vec![Seg {
                    addr: GuestAddress(0x1000),
                    len: 4096
                }]
            })
        );
        // Data and status in one writable descriptor; header and data in one readable one.
        let req = parse(&[r(0, 16), w(0x1000, 513)], &m, &l);
        assert_eq!(
            req.outcome.unwrap(),
            Kind::Read {
                offset: 4096,
                len: 512,
                data: vec![Seg {
                    addr: GuestAddress(0x1000),
                    len: 512
                }]
            }
        );
        header(&m, 0, VIRTIO_BLK_T_OUT, 1);
        let req = parse(&[r(0, 16 + 1024), w(0x3000, 1)], &m, &l);
        assert_eq!(
            req.outcome.unwrap(),
            Kind::Write {
                offset: 512,
                len: 1024,
                data: vec![Seg {
                    addr: GuestAddress(16),
                    len: 1024
                }]
            }
        );
        header(&m, 0, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            parse(&[r(0, 16), w(0x3000, 1)], &m, &l).outcome,
            Ok(Kind::Flush)
        );
        header(&m, 0, VIRTIO_BLK_T_GET_ID, 0);
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 20), w(0x3000, 1)], &m, &l)
                .outcome
                .unwrap(),
            Kind::GetId {
                data: vec![Seg {
                    addr: GuestAddress(0x1000),
                    len: 20
                }]
            }
        );
        // A header split over two descriptors.
        header(&m, 0x100, VIRTIO_BLK_T_IN, 2);
        let req = parse(
            &[r(0x100, 5), r(0x105, 11), w(0x1000, 512), w(0x3000, 1)],
            &m,
            &l,
        );
        assert!(matches!(
            req.outcome,
            Ok(Kind::Read {
                offset: 1024,
                len: 512,
                ..
            })
        ));
    }

    #[test]
    fn hostile_chains_get_a_status_or_none() {
        let m = mem();
        let l = limits();
        let ioerr = Err(IOERR);
        header(&m, 0, VIRTIO_BLK_T_IN, 0);
        // No writable status byte: nothing can be answered.
        assert_eq!(parse(&[r(0, 16), r(0x1000, 512)], &m, &l).status, None);
        assert_eq!(parse(&[r(0, 16), w(0x1000, 0)], &m, &l).status, None);
        assert_eq!(parse(&[], &m, &l).status, None);
        // Readable after writable.
        assert_eq!(
            parse(
                &[r(0, 16), w(0x1000, 512), r(0x2000, 16), w(0x3000, 1)],
                &m,
                &l
            )
            .outcome,
            ioerr
        );
        // Short header.
        assert_eq!(parse(&[r(0, 15), w(0x3000, 1)], &m, &l).outcome, ioerr);
        // Header outside guest memory.
        assert_eq!(
            parse(&[r(2 << 20, 16), w(0x3000, 1)], &m, &l).outcome,
            ioerr
        );
        // An address that wraps.
        assert_eq!(
            parse(&[r(0, 16), w(u64::MAX - 10, 512), w(0x3000, 1)], &m, &l).outcome,
            ioerr
        );
        // Sector * 512 overflows; past the end; misaligned length; too long.
        header(&m, 0, VIRTIO_BLK_T_IN, u64::MAX / 256);
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 512), w(0x3000, 1)], &m, &l).outcome,
            ioerr
        );
        header(&m, 0, VIRTIO_BLK_T_IN, (1 << 20) / 512 - 1);
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 1024), w(0x3000, 1)], &m, &l).outcome,
            ioerr
        );
        assert!(parse(&[r(0, 16), w(0x1000, 512), w(0x3000, 1)], &m, &l)
            .outcome
            .is_ok());
        header(&m, 0, VIRTIO_BLK_T_IN, 0);
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 100), w(0x3000, 1)], &m, &l).outcome,
            ioerr
        );
        let big = Limits {
            capacity: 1 << 40,
            queue_size: 4,
            ..l
        };
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 4 << 20), w(0x3000, 1)], &m, &big).outcome,
            ioerr,
            "over seg_max × size_max"
        );
        let block4k = Limits {
            logical_block: 4096,
            ..l
        };
        header(&m, 0, VIRTIO_BLK_T_IN, 1);
        assert_eq!(
            parse(&[r(0, 16), w(0x1000, 4096), w(0x3000, 1)], &m, &block4k).outcome,
            ioerr,
            "offset not 4 KiB aligned"
        );
        // Unknown type; flush without FLUSH; write to a read-only device.
        header(&m, 0, 77, 0);
        assert_eq!(
            parse(&[r(0, 16), w(0x3000, 1)], &m, &l).outcome,
            Err(UNSUPP)
        );
        header(&m, 0, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            parse(&[r(0, 16), w(0x3000, 1)], &m, &Limits { flush: false, ..l }).outcome,
            Err(UNSUPP)
        );
        header(&m, 0, VIRTIO_BLK_T_OUT, 0);
        assert_eq!(
            parse(
                &[r(0, 16 + 512), w(0x3000, 1)],
                &m,
                &Limits {
                    read_only: true,
                    ..l
                }
            )
            .outcome,
            ioerr
        );
        // Too many descriptors.
        let mut many = vec![r(0, 16)];
        many.extend((0..MAX_CHAIN).map(|i| w(0x1000 + i as u64 * 512, 512)));
        assert_eq!(
            parse(
                &many,
                &m,
                &Limits {
                    capacity: 1 << 40,
                    ..l
                }
            )
            .outcome,
            ioerr
        );
    }

    #[test]
    fn discard_and_write_zeroes_segments() {
        let m = mem();
        let l = limits();
        header(&m, 0, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let seg = |at: u64, sector: u64, n: u32, flags: u32| {
            let mut s = [0u8; 16];
            s[0..8].copy_from_slice(&sector.to_le_bytes());
            s[8..12].copy_from_slice(&n.to_le_bytes());
            s[12..16].copy_from_slice(&flags.to_le_bytes());
            m.write_slice(&s, GuestAddress(at)).unwrap();
        };
        seg(16, 4, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
        seg(32, 100, 1, 0);
        let req = parse(&[r(0, 48), w(0x3000, 1)], &m, &l);
        assert_eq!(
            req.outcome.unwrap(),
            Kind::WriteZeroes(vec![
                Range {
                    offset: 2048,
                    len: 4096,
                    unmap: true
                },
                Range {
                    offset: 51200,
                    len: 512,
                    unmap: false
                }
            ])
        );
        // Unknown flag; a partial segment; past the end; zero sectors; discard with UNMAP.
        seg(16, 4, 8, 2);
        assert_eq!(
            parse(&[r(0, 32), w(0x3000, 1)], &m, &l).outcome,
            Err(UNSUPP)
        );
        seg(16, 4, 8, 0);
        assert_eq!(parse(&[r(0, 40), w(0x3000, 1)], &m, &l).outcome, Err(IOERR));
        seg(16, 2047, 2, 0);
        assert_eq!(parse(&[r(0, 32), w(0x3000, 1)], &m, &l).outcome, Err(IOERR));
        seg(16, 0, 0, 0);
        assert_eq!(parse(&[r(0, 32), w(0x3000, 1)], &m, &l).outcome, Err(IOERR));
        header(&m, 0, VIRTIO_BLK_T_DISCARD, 0);
        seg(16, 0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP);
        assert_eq!(
            parse(&[r(0, 32), w(0x3000, 1)], &m, &l).outcome,
            Err(UNSUPP)
        );
        seg(16, 0, 8, 0);
        assert_eq!(
            parse(&[r(0, 32), w(0x3000, 1)], &m, &l).outcome.unwrap(),
            Kind::Discard(vec![Range {
                offset: 0,
                len: 4096,
                unmap: false
            }])
        );
        assert_eq!(
            parse(
                &[r(0, 32), w(0x3000, 1)],
                &m,
                &Limits {
                    discard: false,
                    ..l
                }
            )
            .outcome,
            Err(UNSUPP)
        );
        // Too many segments.
        assert_eq!(
            parse(
                &[r(0, 16), r(0x4000, 16 * (MAX_DWZ_SEGS + 1)), w(0x3000, 1)],
                &m,
                &l
            )
            .outcome,
            Err(IOERR)
        );
    }

    #[test]
    fn config_space_fields() {
        let l = limits();
        let c = config_space(&l);
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            2048,
            "capacity in sectors"
        );
        assert_eq!(
            u32::from_le_bytes(c[20..24].try_into().unwrap()),
            512,
            "blk_size"
        );
        assert_eq!(
            u16::from_le_bytes(c[34..36].try_into().unwrap()),
            1,
            "num_queues"
        );
        let f = device_features(&l);
        assert!(f & (1 << VIRTIO_BLK_F_FLUSH) != 0 && f & (1 << VIRTIO_BLK_F_RO) == 0);
        let ro = device_features(&Limits {
            read_only: true,
            ..l
        });
        assert!(ro & (1 << VIRTIO_BLK_F_RO) != 0 && ro & (1 << VIRTIO_BLK_F_DISCARD) == 0);
    }
}
