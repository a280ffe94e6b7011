//! fido-blk-vhost: a vhost-user-blk back end that serves a QEMU guest's
//! virtio-blk disk from a Fido block service (`blk:NAME`, docs/BLK-vhost.md).
//!
//! QEMU (`-device vhost-user-blk-pci,chardev=…`) shares the guest's RAM with
//! this process (a memfd, `share=on`) and hands it the virtqueues. Each
//! request the guest places there is checked, split into fido-blk requests of
//! at most the storage domain's `max_transfer`, and sent through one
//! pipelined [`fido_blk::BlkClient`]; replies complete out of order on a
//! completion thread, which writes the data and status into the guest's
//! buffers and returns the chain on the used ring. Built on rust-vmm's
//! `vhost-user-backend`, `vhost`, `virtio-queue` and `vm-memory`.
//!
//! Copies, counted in [`Stats`]: a write's payload is copied once, from the
//! guest's buffers into an arena buffer of this domain that the storage
//! domain then reads in place; a read's data is copied once, from the storage
//! domain's reply buffer (a read-only view) into the guest's buffers. Guest
//! RAM is not a Fido arena, so the storage domain cannot read or write it
//! directly.
//!
//! What this crate must never do: trust the guest (every descriptor chain is
//! validated — directions, lengths, `sector × 512` overflow, the device's
//! capacity — and a bad one costs that request an error status, never the
//! back end); write guest memory it was not asked to (only the device-writable
//! buffers of a chain and the used ring: QEMU maps every writable region of
//! the guest here, a VM domain's own arena BAR included); let one front end's
//! disconnect stop the service (the socket serves the next one).

mod device;
mod virtio;

pub use device::{Stats, VhostBlk, VhostBlkOptions, VhostError};
pub use virtio::{config_space, device_features, Desc, GuestRequest, Kind, Limits, Range, Seg};
