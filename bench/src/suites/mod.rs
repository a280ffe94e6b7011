//! Fido's side of each suite, measured in the same invocation as its baselines:
//! [`channel`] (then [`crate::channel_baselines`]), [`rpc`] (with the systems of
//! [`crate::rpc`]), [`pipe`] (the broker's pipe engine against sendfile/splice,
//! read/write and nginx), [`net`] (real TCP programs under MMNet), [`net_apps`] (issue #19's programs: the
//! compatibility table of docs/NET.md) and [`vm`]
//! (host↔VM and VM↔VM: fido vs virtio-net TCP and virtio-serial) and [`blk`]
//! (MMBlk through NBD and fio, against nbdkit, qemu-nbd and the file itself). Every Fido
//! case runs against an embedded broker in a temporary directory; helper
//! processes are this binary re-executed (`fido-bench __bench-peer fido ...`,
//! `__pipe-role`, `__pipe-app`, `__demo-role`).

pub mod blk;
mod blk_vm;
pub mod channel;
pub mod net;
pub mod net_apps;
pub mod pipe;
pub mod rpc;
pub mod vm;
