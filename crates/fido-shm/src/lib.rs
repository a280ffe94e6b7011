//! `fido-shm`: a domain's exportable memory. It creates the domain's **arena**
//! (a sealed, sparse memfd), hands out **read-only grants** of it, maps peers'
//! grants into the **PGVAS window** (the same address in every domain, or a
//! swizzle table when the window cannot be reserved), provides **the one
//! pointer resolver** ([`AddressSpace::resolve`]) that turns a [`GPtr`] into a
//! local pointer, and the **arena allocator** behind [`Arena::alloc`].
//!
//! What it must never do: write a peer's memory (peers are mapped `PROT_READ`
//! from `O_RDONLY` file descriptions; the kernel enforces it), map a grant
//! writable (grants are checked for seals and access mode *before* mapping), or
//! dereference a global pointer that was not bounds-checked against a live
//! mapping (only `resolve` translates, and it checks the window, the slot and
//! `offset + len` against the mapping it returns — and keeps alive).
//!
//! Peer memory is never handed out as `&[u8]`: a [`PeerSlice`] reads it with
//! volatile loads (the `peer` module says why).
//!
//! Layout: `map` holds the mappings and the PGVAS reservation and nearly all the
//! `unsafe`; `buf` the slice views of owned buffers and `peer` the views of peers'
//! memory (the rest of the `unsafe`);
//! `grant` memfd creation, sealing and grant checks; `space` the slot table and
//! resolver; `arena` the owner's arena; `alloc` the allocator (its module docs
//! describe the design and worst-case waste).

mod alloc;
mod arena;
mod buf;
mod error;
mod grant;
mod map;
mod peer;
mod space;

pub use alloc::{ArenaStats, ALIGN, UNIT};
pub use arena::{Arena, UnplacedArena};
pub use buf::Buf;
pub use error::ShmError;
pub use fido_proto::PgvasGeometry;
pub use grant::{check_device, check_grant};
pub use map::Mapping;
pub use peer::{PeerSlice, PeerSliceOf, READ_CHUNK};
pub use space::AddressSpace;

/// A global pointer: an address in the PGVAS window, `G(slot) + offset`,
/// identical in every domain. Only [`AddressSpace::resolve`] turns it into
/// something dereferenceable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
#[repr(transparent)]
pub struct GPtr(pub u64);

impl GPtr {
    pub const NULL: GPtr = GPtr(0);

    pub fn addr(self) -> u64 {
        self.0
    }

    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// `self + n`, or `None` on u64 overflow. (Staying inside an arena is
    /// checked by `resolve`, not here.) Named by the API contract; deliberately
    /// not `std::ops::Add`, which could not report overflow.
    #[allow(clippy::should_implement_trait)]
    pub fn add(self, n: u64) -> Option<GPtr> {
        self.0.checked_add(n).map(GPtr)
    }
}

impl std::fmt::LowerHex for GPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

/// How global pointers become local ones in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressMode {
    /// The window is reserved: a global pointer *is* the local address.
    Pgvas,
    /// The window could not be reserved: arenas are mapped anywhere and
    /// translated through the slot table.
    Swizzle,
}

/// What `AddressSpace::new` should try.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ModeRequest {
    /// PGVAS if the window can be reserved, else swizzle (with a warning).
    #[default]
    Auto,
    /// Never reserve the window (tests, or when the address range is needed).
    ForceSwizzle,
}

// The lead's code shares these across threads; fail the build, not a user, if
// a field change ever removes Send or Sync.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<AddressSpace>();
    send_sync::<Mapping>();
    send_sync::<UnplacedArena>();
    send_sync::<Arena>();
    send_sync::<Buf>();
    send_sync::<PeerSlice<'static>>();
    send_sync::<ShmError>();
};
