//! The fido-blk wire format: what a client and a storage domain say to each
//! other over one Fido channel (docs/BLK.md, "Protocol").
//!
//! * The service of a block device `NAME` is `blk:NAME`.
//! * Right after accept the server sends one [`Info`] (inline, opcode 0, tag 0).
//! * A request's `tag` is the client's request id, its `opcode` the operation
//!   (`OP_*`). Its [`ReqHeader`] is the message's only segment (inline), except
//!   for WRITE: `Message::gather([header (16 B), payload...])`, the payload
//!   being the client's arena memory that the server hands to the kernel in place.
//! * A reply's `tag` is the request's id, its `opcode` a status: 0 or a
//!   positive errno. READ OK carries the data (the server's arena buffers);
//!   every other reply is inline and empty.
//!
//! Everything here is pure (no I/O): the parse functions take bytes and
//! lengths and say exactly what is wrong, so a hostile peer's message is
//! refused with a status and never trusted further.

use bytemuck::{Pod, Zeroable};

/// READ: `len` bytes at `offset`; the reply carries them.
pub const OP_READ: u16 = 1;
/// WRITE: the payload (segments after the header) to `offset`.
pub const OP_WRITE: u16 = 2;
/// FLUSH: every write acknowledged before it is durable when it completes.
pub const OP_FLUSH: u16 = 3;
/// DISCARD: the range may read back as anything (zeros here); space may be freed.
pub const OP_DISCARD: u16 = 4;
/// WRITE_ZEROES: the range reads back as zeros.
pub const OP_WRITE_ZEROES: u16 = 5;

/// Request flag: the write is durable when acknowledged (WRITE, WRITE_ZEROES, DISCARD).
pub const REQ_FUA: u32 = 1;
/// Request flag of WRITE_ZEROES: keep the range allocated (no hole punching).
pub const REQ_NO_UNMAP: u32 = 2;
/// Every request flag this version knows; others are refused with EINVAL.
pub const REQ_FLAGS_KNOWN: u32 = REQ_FUA | REQ_NO_UNMAP;

/// Info flag: every WRITE, DISCARD and WRITE_ZEROES is refused with EROFS.
pub const INFO_READ_ONLY: u32 = 1;
/// Info flag: FLUSH makes acknowledged writes durable.
pub const INFO_FLUSH: u32 = 2;
/// Info flag: [`REQ_FUA`] is honoured.
pub const INFO_FUA: u32 = 4;
/// Info flag: DISCARD frees space.
pub const INFO_DISCARD: u32 = 8;
/// Info flag: WRITE_ZEROES is done without sending zeros.
pub const INFO_WRITE_ZEROES: u32 = 16;
/// Info flag: several connections see one consistent device (a FLUSH on one
/// covers writes acknowledged on all).
pub const INFO_CAN_MULTI_CONN: u32 = 32;

/// Reply status: success.
pub const STATUS_OK: u16 = 0;
pub const EIO: u16 = libc::EIO as u16;
pub const EINVAL: u16 = libc::EINVAL as u16;
pub const ENOSPC: u16 = libc::ENOSPC as u16;
pub const EROFS: u16 = libc::EROFS as u16;
pub const EOPNOTSUPP: u16 = libc::EOPNOTSUPP as u16;
pub const ENOMEM: u16 = libc::ENOMEM as u16;

/// Opcode and tag of the INFO message.
pub const INFO_OPCODE: u16 = 0;
pub const INFO_TAG: u64 = 0;

/// The prefix of a block device's Fido service name.
pub const SERVICE_PREFIX: &str = "blk:";

/// What the server says about the device, once, right after accept.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Info {
    /// Device size in bytes (a multiple of `logical_block`).
    pub size: u64,
    /// 512 or 4096: every offset and length is a multiple of it.
    pub logical_block: u32,
    /// The largest READ or WRITE in bytes (a multiple of `logical_block`).
    pub max_transfer: u32,
    /// `INFO_*` bits.
    pub flags: u32,
    /// Requests the server keeps in flight per connection (a hint; more queue up).
    pub queue_depth: u32,
}

/// The header of every request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ReqHeader {
    pub offset: u64,
    pub len: u32,
    /// `REQ_*` bits.
    pub flags: u32,
}

pub const INFO_LEN: usize = std::mem::size_of::<Info>();
pub const HEADER_LEN: usize = std::mem::size_of::<ReqHeader>();
const _: () = assert!(INFO_LEN == 24 && HEADER_LEN == 16);

/// Why a message is not a valid fido-blk message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("INFO is {0} bytes, not {INFO_LEN}")]
    InfoLength(usize),
    #[error("INFO logical block {0} is neither 512 nor 4096")]
    InfoBlock(u32),
    #[error("INFO size {size} is not a multiple of the logical block {block}")]
    InfoSize { size: u64, block: u32 },
    #[error("INFO max_transfer {0} is not a positive multiple of the logical block")]
    InfoMaxTransfer(u32),
    #[error("INFO carries unknown flags {0:#x}")]
    InfoFlags(u32),
    #[error("INFO arrived with opcode {opcode} and tag {tag}")]
    InfoFraming { opcode: u16, tag: u64 },
    #[error("block service name {0:?}: 1..=124 bytes of [A-Za-z0-9_.:@+=-]")]
    Name(String),
}

impl Info {
    pub const KNOWN_FLAGS: u32 = INFO_READ_ONLY | INFO_FLUSH | INFO_FUA | INFO_DISCARD | INFO_WRITE_ZEROES | INFO_CAN_MULTI_CONN;

    /// Checks what a client must be able to rely on (a server is a peer too).
    pub fn validate(&self) -> Result<(), ProtoError> {
        if self.logical_block != 512 && self.logical_block != 4096 {
            return Err(ProtoError::InfoBlock(self.logical_block));
        }
        if self.size % u64::from(self.logical_block) != 0 {
            return Err(ProtoError::InfoSize { size: self.size, block: self.logical_block });
        }
        if self.max_transfer == 0 || self.max_transfer % self.logical_block != 0 {
            return Err(ProtoError::InfoMaxTransfer(self.max_transfer));
        }
        if self.flags & !Self::KNOWN_FLAGS != 0 {
            return Err(ProtoError::InfoFlags(self.flags & !Self::KNOWN_FLAGS));
        }
        Ok(())
    }

    pub fn read_only(&self) -> bool {
        self.flags & INFO_READ_ONLY != 0
    }
}

/// Parses and validates the INFO message's payload.
pub fn parse_info(opcode: u16, tag: u64, bytes: &[u8]) -> Result<Info, ProtoError> {
    if opcode != INFO_OPCODE || tag != INFO_TAG {
        return Err(ProtoError::InfoFraming { opcode, tag });
    }
    if bytes.len() != INFO_LEN {
        return Err(ProtoError::InfoLength(bytes.len()));
    }
    let info: Info = bytemuck::pod_read_unaligned(bytes);
    info.validate()?;
    Ok(info)
}

/// The service name of block device `name` (`blk:NAME`), checked.
pub fn service_name(name: &str) -> Result<String, ProtoError> {
    let ok = !name.is_empty()
        && name.len() + SERVICE_PREFIX.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:@+=-".contains(&b));
    if ok {
        Ok(format!("{SERVICE_PREFIX}{name}"))
    } else {
        Err(ProtoError::Name(name.to_string()))
    }
}

/// A request operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

impl Op {
    pub fn from_opcode(opcode: u16) -> Option<Op> {
        Some(match opcode {
            OP_READ => Op::Read,
            OP_WRITE => Op::Write,
            OP_FLUSH => Op::Flush,
            OP_DISCARD => Op::Discard,
            OP_WRITE_ZEROES => Op::WriteZeroes,
            _ => return None,
        })
    }

    pub fn opcode(self) -> u16 {
        match self {
            Op::Read => OP_READ,
            Op::Write => OP_WRITE,
            Op::Flush => OP_FLUSH,
            Op::Discard => OP_DISCARD,
            Op::WriteZeroes => OP_WRITE_ZEROES,
        }
    }

    /// Whether it changes the device (refused on a read-only one).
    pub fn modifies(self) -> bool {
        matches!(self, Op::Write | Op::Discard | Op::WriteZeroes)
    }
}

/// A request that passed [`check_request`]: every field may be relied on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    pub op: Op,
    pub offset: u64,
    pub len: u32,
    pub fua: bool,
    pub no_unmap: bool,
}

/// Validates one request as from a hostile peer, given its opcode, the header
/// it carried (`None`: the message had no well-formed 16-byte header
/// segment) and, for WRITE, the total length of the payload segments.
/// The error is the status to reply with.
///
/// Rules: known op (else EOPNOTSUPP); header present (else EINVAL); known
/// flags; READ/WRITE: `0 < len <= max_transfer`; DISCARD/WRITE_ZEROES:
/// `0 < len` (any multiple of the block up to 4 GiB - 1 block, not bounded by
/// max_transfer: nothing is transferred); offset and len multiples of the
/// logical block; `offset + len <= size` without overflow; WRITE payload ==
/// len; modifying ops refused with EROFS on a read-only device. FLUSH ignores
/// offset and len (both must be 0).
pub fn check_request(info: &Info, opcode: u16, header: Option<ReqHeader>, payload_len: u64) -> Result<Checked, u16> {
    let op = Op::from_opcode(opcode).ok_or(EOPNOTSUPP)?;
    let h = header.ok_or(EINVAL)?;
    if h.flags & !REQ_FLAGS_KNOWN != 0 {
        return Err(EINVAL);
    }
    if op != Op::Write && payload_len != 0 {
        return Err(EINVAL);
    }
    if op.modifies() && info.read_only() {
        return Err(EROFS);
    }
    let checked = Checked { op, offset: h.offset, len: h.len, fua: h.flags & REQ_FUA != 0, no_unmap: h.flags & REQ_NO_UNMAP != 0 };
    if op == Op::Flush {
        return if h.offset == 0 && h.len == 0 { Ok(checked) } else { Err(EINVAL) };
    }
    let block = u64::from(info.logical_block);
    if h.len == 0 || h.offset % block != 0 || u64::from(h.len) % block != 0 {
        return Err(EINVAL);
    }
    if matches!(op, Op::Read | Op::Write) && h.len > info.max_transfer {
        return Err(EINVAL);
    }
    match h.offset.checked_add(u64::from(h.len)) {
        Some(end) if end <= info.size => {}
        _ => return Err(EINVAL),
    }
    if op == Op::Write && payload_len != u64::from(h.len) {
        return Err(EINVAL);
    }
    Ok(checked)
}

/// The header as the 16 bytes that travel.
pub fn header_bytes(offset: u64, len: u32, flags: u32) -> [u8; HEADER_LEN] {
    bytemuck::cast(ReqHeader { offset, len, flags })
}

/// A short name of an errno status for messages ("EIO", ...).
pub fn status_name(status: u16) -> String {
    match status {
        STATUS_OK => "OK".into(),
        EIO => "EIO".into(),
        EINVAL => "EINVAL".into(),
        ENOSPC => "ENOSPC".into(),
        EROFS => "EROFS".into(),
        EOPNOTSUPP => "EOPNOTSUPP".into(),
        ENOMEM => "ENOMEM".into(),
        n => format!("errno {n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> Info {
        Info { size: 1 << 20, logical_block: 512, max_transfer: 64 << 10, flags: INFO_FLUSH | INFO_FUA, queue_depth: 64 }
    }

    fn h(offset: u64, len: u32, flags: u32) -> Option<ReqHeader> {
        Some(ReqHeader { offset, len, flags })
    }

    #[test]
    fn info_round_trip_and_hostile_infos() {
        let i = info();
        let bytes = bytemuck::bytes_of(&i);
        assert_eq!(parse_info(0, 0, bytes), Ok(i));
        assert_eq!(parse_info(1, 0, bytes), Err(ProtoError::InfoFraming { opcode: 1, tag: 0 }));
        assert_eq!(parse_info(0, 0, &bytes[..23]), Err(ProtoError::InfoLength(23)));
        let bad = |f: &dyn Fn(&mut Info)| {
            let mut x = info();
            f(&mut x);
            parse_info(0, 0, bytemuck::bytes_of(&x))
        };
        assert_eq!(bad(&|x| x.logical_block = 1024), Err(ProtoError::InfoBlock(1024)));
        assert!(matches!(bad(&|x| x.size = 1000), Err(ProtoError::InfoSize { .. })));
        assert_eq!(bad(&|x| x.max_transfer = 0), Err(ProtoError::InfoMaxTransfer(0)));
        assert_eq!(bad(&|x| x.max_transfer = 700), Err(ProtoError::InfoMaxTransfer(700)));
        assert_eq!(bad(&|x| x.flags = 1 << 9), Err(ProtoError::InfoFlags(1 << 9)));
    }

    #[test]
    fn good_requests_pass() {
        let i = info();
        assert_eq!(check_request(&i, OP_READ, h(512, 4096, 0), 0).unwrap().op, Op::Read);
        let w = check_request(&i, OP_WRITE, h(0, 4096, REQ_FUA), 4096).unwrap();
        assert!(w.fua && w.op == Op::Write);
        assert_eq!(check_request(&i, OP_READ, h((1 << 20) - 512, 512, 0), 0).unwrap().len, 512);
        assert_eq!(check_request(&i, OP_FLUSH, h(0, 0, 0), 0).unwrap().op, Op::Flush);
        // DISCARD may exceed max_transfer (nothing moves).
        assert!(check_request(&i, OP_DISCARD, h(0, 1 << 20, 0), 0).is_ok());
        assert!(check_request(&i, OP_WRITE_ZEROES, h(0, 1 << 19, REQ_NO_UNMAP), 0).unwrap().no_unmap);
    }

    #[test]
    fn hostile_requests_get_a_status() {
        let i = info();
        assert_eq!(check_request(&i, 99, h(0, 512, 0), 0), Err(EOPNOTSUPP));
        assert_eq!(check_request(&i, 0, h(0, 512, 0), 0), Err(EOPNOTSUPP));
        assert_eq!(check_request(&i, OP_READ, None, 0), Err(EINVAL));
        assert_eq!(check_request(&i, OP_READ, h(0, 0, 0), 0), Err(EINVAL), "zero length");
        assert_eq!(check_request(&i, OP_READ, h(1, 512, 0), 0), Err(EINVAL), "misaligned offset");
        assert_eq!(check_request(&i, OP_READ, h(0, 511, 0), 0), Err(EINVAL), "misaligned length");
        assert_eq!(check_request(&i, OP_READ, h(0, 128 << 10, 0), 0), Err(EINVAL), "over max_transfer");
        assert_eq!(check_request(&i, OP_READ, h(1 << 20, 512, 0), 0), Err(EINVAL), "past the end");
        assert_eq!(check_request(&i, OP_READ, h(u64::MAX - 511, 512, 0), 0), Err(EINVAL), "overflowing end");
        assert_eq!(check_request(&i, OP_DISCARD, h(u64::MAX - 511, u32::MAX - 511, 0), 0), Err(EINVAL));
        assert_eq!(check_request(&i, OP_READ, h(0, 512, 4), 0), Err(EINVAL), "unknown flag");
        assert_eq!(check_request(&i, OP_READ, h(0, 512, 0), 512), Err(EINVAL), "payload on a read");
        assert_eq!(check_request(&i, OP_WRITE, h(0, 512, 0), 511), Err(EINVAL), "short payload");
        assert_eq!(check_request(&i, OP_WRITE, h(0, 512, 0), 1024), Err(EINVAL), "long payload");
        assert_eq!(check_request(&i, OP_FLUSH, h(0, 512, 0), 0), Err(EINVAL));
        let ro = Info { flags: INFO_READ_ONLY, ..info() };
        assert_eq!(check_request(&ro, OP_WRITE, h(0, 512, 0), 512), Err(EROFS));
        assert_eq!(check_request(&ro, OP_DISCARD, h(0, 512, 0), 0), Err(EROFS));
        assert_eq!(check_request(&ro, OP_WRITE_ZEROES, h(0, 512, 0), 0), Err(EROFS));
        assert!(check_request(&ro, OP_READ, h(0, 512, 0), 0).is_ok());
        assert!(check_request(&ro, OP_FLUSH, h(0, 0, 0), 0).is_ok());
    }

    #[test]
    fn service_names() {
        assert_eq!(service_name("disk0").unwrap(), "blk:disk0");
        assert!(service_name("").is_err());
        assert!(service_name("a/b").is_err());
        assert!(service_name(&"x".repeat(125)).is_err());
        assert!(service_name(&"x".repeat(124)).is_ok());
    }
}
