//! The host side of a Fido VM domain: everything the per-VM supervisor needs
//! to run one QEMU guest as a Fido domain.
//!
//! - [`qemu`]: the accelerator choice, the QEMU command line (the VM's own
//!   arena as an `ivshmem-plain` device, the `ivshmem-doorbell` device, the
//!   virtio-serial control port, hot-plug root ports) and the QEMU process.
//! - [`qmp`]: a small synchronous QMP client that treats QEMU as untrusted.
//! - [`hotplug`]: hot-plugging a peer's arena read-only under a root port,
//!   unplugging it, and the book-keeping of which port holds which arena.
//! - [`doorbell_server`]: QEMU's ivshmem server protocol — the VM's own
//!   interrupt vectors and the doorbells of its peers — with the guard that
//!   keeps a hostile host peer from freezing the VM.
//! - [`relay`]: the guest's link to the broker — the broker protocol passes
//!   through, descriptors become handles (hot-plugged arenas, doorbell peer
//!   ids, liveness tokens) and back.
//! - [`supervisor`]: one VM's life — its arena, QEMU, the devices, and the
//!   loop that serves the relay (`fido vm run`).
//!
//! What this crate must never do: trust what QEMU (the VM owner's process)
//! writes on its sockets — every reply is parsed with bounds and a bad one is
//! an error for that VM, never a panic or a hang; hand QEMU a writable
//! descriptor of another domain's arena; or leave QEMU running without its
//! supervisor (QEMU dies with the thread that spawned it).

pub mod doorbell_server;
pub mod hotplug;
pub mod qemu;
pub mod qmp;
pub mod relay;
pub mod supervisor;

pub use doorbell_server::{DoorbellError, DoorbellServer, VectorKind};
pub use hotplug::{plug_arena, unplug, HotplugError, PeerArena, Ports};
pub use qemu::{choose_accel, detect_accel, launch, spawn, welcome, welcome_devices, Accel, LaunchError, Launched, NicSpec, QemuProcess, SpecError, VmFds, VmSpec};
pub use qmp::{Qmp, QmpError, QmpEvent};
