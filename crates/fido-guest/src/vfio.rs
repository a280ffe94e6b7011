//! The doorbell device (`ivshmem-doorbell`) through VFIO type1: its register
//! BAR mapped (or written through the device descriptor), its MSI-X vectors
//! delivered to eventfds.
//!
//! The guest has an emulated IOMMU (`intel-iommu`), so the device sits in an
//! IOMMU group of its own and VFIO gives this process the device without any
//! kernel driver of ours. The device does no DMA, so no DMA mapping is made:
//! VFIO is only the way to reach its interrupts and registers from user space.
//!
//! The kernel's structures and ioctl numbers are written out below from
//! `include/uapi/linux/vfio.h` (stable ABI).

use crate::pci::PciDevice;
use crate::GuestError;
use rustix::event::{eventfd, EventfdFlags};
use std::ffi::c_void;
use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

// ioctl numbers: _IO(VFIO_TYPE, VFIO_BASE + n), VFIO_TYPE = ';', VFIO_BASE = 100.
const fn vfio_io(n: libc::c_ulong) -> libc::c_ulong {
    ((b';' as libc::c_ulong) << 8) | (100 + n)
}
const VFIO_GET_API_VERSION: libc::c_ulong = vfio_io(0);
const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
const VFIO_SET_IOMMU: libc::c_ulong = vfio_io(2);
const VFIO_GROUP_GET_STATUS: libc::c_ulong = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = vfio_io(6);
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: libc::c_ulong = vfio_io(10);

const VFIO_API_VERSION: libc::c_int = 0;
const VFIO_TYPE1_IOMMU: libc::c_ulong = 1;
const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
const VFIO_REGION_INFO_FLAG_READ: u32 = 1;
const VFIO_REGION_INFO_FLAG_WRITE: u32 = 2;
const VFIO_REGION_INFO_FLAG_MMAP: u32 = 4;
const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
const VFIO_PCI_MSIX_IRQ_INDEX: u32 = 2;
const VFIO_IRQ_INFO_EVENTFD: u32 = 1;
const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

/// PCI command register: its offset in config space and the bus-master bit
/// (MSI-X messages are memory writes by the device: without it none arrive).
const PCI_COMMAND: u64 = 4;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;

/// The ivshmem registers in BAR 0 (docs/specs/ivshmem-spec.rst).
const IVSHMEM_IVPOSITION: u64 = 8;
const IVSHMEM_DOORBELL: u64 = 12;
/// The register BAR is 256 bytes.
const IVSHMEM_REGISTERS_LEN: u64 = 256;

/// How long to wait for `/dev/vfio/N` after binding (devtmpfs creates it).
const GROUP_NODE_WAIT: Duration = Duration::from_secs(10);

#[repr(C)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct RegionInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    cap_offset: u32,
    size: u64,
    offset: u64,
}

#[repr(C)]
#[derive(Default)]
struct IrqInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    count: u32,
}

/// `struct vfio_irq_set` followed by its eventfd array (a flexible member).
#[repr(C)]
struct IrqSetHeader {
    argsz: u32,
    flags: u32,
    index: u32,
    start: u32,
    count: u32,
}

/// Calls an ioctl whose argument is an integer (or none).
fn ioctl_value(
    fd: BorrowedFd<'_>,
    request: libc::c_ulong,
    value: libc::c_ulong,
) -> std::io::Result<libc::c_int> {
    // SAFETY: the VFIO ioctls called through here take their argument by
    // value (an integer or a descriptor number) and touch no memory of ours.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, value) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Calls an ioctl whose argument is a pointer to `arg`'s bytes.
///
/// # Safety
/// `request` must be one whose kernel side reads and writes at most
/// `size_of::<T>()` bytes at the pointer (the structure's `argsz`), and `T`
/// must accept any bytes the kernel writes (plain integers).
unsafe fn ioctl_ptr<T>(
    fd: BorrowedFd<'_>,
    request: libc::c_ulong,
    arg: &mut T,
) -> std::io::Result<()> {
    // SAFETY: the caller promises the request's size; `arg` is a live,
    // exclusive borrow for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg as *mut T as *mut c_void) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The doorbell register (BAR0 + 12) of the doorbell device: mapped when VFIO
/// allows it, else written through the device descriptor with `pwrite`.
pub struct Bar0Register {
    /// The mapped register page, when VFIO allows mapping BAR 0.
    mapping: Option<(NonNull<u8>, usize)>,
    device: OwnedFd,
    /// Where BAR 0 starts in the device descriptor's file offsets.
    region_offset: u64,
}

// SAFETY: the mapping is device memory (MMIO) that is only ever accessed with
// volatile 32-bit reads and writes, each a single bus transaction; no Rust
// reference to it exists, so sharing the pointer between threads is sound.
unsafe impl Send for Bar0Register {}
// SAFETY: as for Send: concurrent volatile register writes are what the
// device is designed for (each write is one complete doorbell).
unsafe impl Sync for Bar0Register {}

impl Bar0Register {
    fn write32(&self, offset: u64, value: u32) -> std::io::Result<()> {
        match self.mapping {
            Some((base, len)) => {
                debug_assert!(offset as usize + 4 <= len && offset % 4 == 0);
                // SAFETY: `offset` is one of the register offsets above, inside
                // the mapped BAR (at least 256 bytes, checked at mapping) and
                // 4-byte aligned; the pointer is to MMIO, written volatile and
                // never turned into a reference.
                unsafe {
                    std::ptr::write_volatile(base.as_ptr().add(offset as usize) as *mut u32, value)
                };
                Ok(())
            }
            None => {
                let n = rustix::io::pwrite(
                    &self.device,
                    &value.to_le_bytes(),
                    self.region_offset + offset,
                )?;
                if n != 4 {
                    return Err(std::io::Error::other(
                        "short write to the doorbell register",
                    ));
                }
                Ok(())
            }
        }
    }

    fn read32(&self, offset: u64) -> std::io::Result<u32> {
        match self.mapping {
            Some((base, len)) => {
                debug_assert!(offset as usize + 4 <= len && offset % 4 == 0);
                // SAFETY: as in `write32`: an aligned register inside the
                // mapped BAR, read volatile, no reference made.
                Ok(unsafe {
                    std::ptr::read_volatile(base.as_ptr().add(offset as usize) as *const u32)
                })
            }
            None => {
                let mut b = [0u8; 4];
                let n = rustix::io::pread(&self.device, &mut b, self.region_offset + offset)?;
                if n != 4 {
                    return Err(std::io::Error::other("short read of an ivshmem register"));
                }
                Ok(u32::from_le_bytes(b))
            }
        }
    }

    /// Whether the register is mapped (one store per ring) rather than
    /// written with a system call.
    pub fn is_mapped(&self) -> bool {
        self.mapping.is_some()
    }
}

impl fido_ring::doorbell::RingRegister for Bar0Register {
    #[inline]
    fn ring(&self, value: u32) -> std::io::Result<()> {
        self.write32(IVSHMEM_DOORBELL, value)
    }
}

impl Drop for Bar0Register {
    fn drop(&mut self) {
        if let Some((base, len)) = self.mapping.take() {
            // SAFETY: the mapping was made by `mmap` with this length and
            // nothing refers to it any more (we are being dropped).
            unsafe {
                let _ = rustix::mm::munmap(base.as_ptr() as *mut c_void, len);
            }
        }
    }
}

/// The doorbell device opened through VFIO, with MSI-X enabled.
pub struct VfioDoorbell {
    // Order matters for Drop: the device before its group, the group before
    // the container (the kernel tolerates any order, but this is the natural one).
    register: std::sync::Arc<Bar0Register>,
    _group: OwnedFd,
    _container: OwnedFd,
    /// How many MSI-X vectors are enabled (eventfds installed).
    vectors: u16,
}

impl VfioDoorbell {
    /// Binds `device` to vfio-pci if needed, opens it through its IOMMU
    /// group, maps BAR 0, turns bus mastering on and enables `vectors` MSI-X
    /// vectors, vector `v` signalling `eventfds[v]`.
    pub fn open(device: &PciDevice, eventfds: &[OwnedFd]) -> Result<VfioDoorbell, GuestError> {
        let vectors = u16::try_from(eventfds.len())
            .map_err(|_| GuestError::Device("too many vectors".into()))?;
        let err = |what: &str, e: std::io::Error| {
            GuestError::Device(format!("VFIO {what} ({}): {e}", device.address()))
        };
        ensure_vfio_pci_driver();
        device.bind_to("vfio-pci")?;
        let group_no = device.iommu_group().ok_or_else(|| {
            GuestError::Device(format!("{} has no IOMMU group: boot the guest with intel_iommu=on and an emulated IOMMU (-device intel-iommu)", device.address()))
        })?;
        let container =
            open_rw(Path::new("/dev/vfio/vfio")).map_err(|e| err("opening /dev/vfio/vfio", e))?;
        let version = ioctl_value(container.as_fd(), VFIO_GET_API_VERSION, 0)
            .map_err(|e| err("API version", e))?;
        if version != VFIO_API_VERSION {
            return Err(GuestError::Device(format!(
                "VFIO API version {version}, expected {VFIO_API_VERSION}"
            )));
        }
        if ioctl_value(container.as_fd(), VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU)
            .map_err(|e| err("CHECK_EXTENSION", e))?
            != 1
        {
            return Err(GuestError::Device(
                "VFIO has no type1 IOMMU (is vfio_iommu_type1 loaded?)".into(),
            ));
        }
        let group_path = format!("/dev/vfio/{group_no}");
        let group = wait_open(Path::new(&group_path), GROUP_NODE_WAIT)
            .map_err(|e| err(&format!("opening {group_path}"), e))?;
        let mut status = GroupStatus {
            argsz: std::mem::size_of::<GroupStatus>() as u32,
            flags: 0,
        };
        // SAFETY: VFIO_GROUP_GET_STATUS reads and writes a `struct vfio_group_status` (two u32s).
        unsafe { ioctl_ptr(group.as_fd(), VFIO_GROUP_GET_STATUS, &mut status) }
            .map_err(|e| err("GROUP_GET_STATUS", e))?;
        if status.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(GuestError::Device(format!(
                "IOMMU group {group_no} of {} is not viable: another device in it is bound to a host driver",
                device.address()
            )));
        }
        let mut container_fd: libc::c_int = container.as_raw_fd();
        // SAFETY: VFIO_GROUP_SET_CONTAINER reads one int (the container's descriptor number).
        unsafe { ioctl_ptr(group.as_fd(), VFIO_GROUP_SET_CONTAINER, &mut container_fd) }
            .map_err(|e| err("GROUP_SET_CONTAINER", e))?;
        ioctl_value(container.as_fd(), VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU)
            .map_err(|e| err("SET_IOMMU", e))?;
        let name = std::ffi::CString::new(device.address())
            .map_err(|_| GuestError::Device("PCI address with a NUL".into()))?;
        // SAFETY: VFIO_GROUP_GET_DEVICE_FD reads a NUL-terminated string, which
        // `name` is and outlives the call; it returns a new descriptor or -1.
        let raw =
            unsafe { libc::ioctl(group.as_raw_fd(), VFIO_GROUP_GET_DEVICE_FD, name.as_ptr()) };
        if raw < 0 {
            return Err(err("GROUP_GET_DEVICE_FD", std::io::Error::last_os_error()));
        }
        // SAFETY: the ioctl returned a fresh descriptor that nothing else owns.
        let device_fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };

        let bar0 = region_info(device_fd.as_fd(), VFIO_PCI_BAR0_REGION_INDEX)
            .map_err(|e| err("BAR 0 region info", e))?;
        if bar0.size < IVSHMEM_REGISTERS_LEN
            || bar0.flags & (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE)
                != (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE)
        {
            return Err(GuestError::Device(format!(
                "{}: BAR 0 is not a {IVSHMEM_REGISTERS_LEN}-byte register BAR",
                device.address()
            )));
        }
        let config = region_info(device_fd.as_fd(), VFIO_PCI_CONFIG_REGION_INDEX)
            .map_err(|e| err("config region info", e))?;
        set_command_bits(
            device_fd.as_fd(),
            config.offset,
            PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER,
        )
        .map_err(|e| err("setting bus master", e))?;

        let mapping = if bar0.flags & VFIO_REGION_INFO_FLAG_MMAP != 0 {
            map_registers(device_fd.as_fd(), &bar0)
        } else {
            None
        };
        let register = std::sync::Arc::new(Bar0Register {
            mapping,
            device: device_fd,
            region_offset: bar0.offset,
        });

        let mut irq = IrqInfo {
            argsz: std::mem::size_of::<IrqInfo>() as u32,
            index: VFIO_PCI_MSIX_IRQ_INDEX,
            ..Default::default()
        };
        // SAFETY: VFIO_DEVICE_GET_IRQ_INFO reads and writes a `struct vfio_irq_info` (four u32s).
        unsafe { ioctl_ptr(register.device.as_fd(), VFIO_DEVICE_GET_IRQ_INFO, &mut irq) }
            .map_err(|e| err("MSI-X info", e))?;
        if irq.flags & VFIO_IRQ_INFO_EVENTFD == 0 || irq.count < u32::from(vectors) {
            return Err(GuestError::Device(format!(
                "{}: the doorbell device has {} MSI-X vectors, the supervisor announced {vectors}",
                device.address(),
                irq.count
            )));
        }
        let doorbell = VfioDoorbell {
            register,
            _group: group,
            _container: container,
            vectors,
        };
        let fds: Vec<BorrowedFd<'_>> = eventfds.iter().map(|f| f.as_fd()).collect();
        doorbell
            .set_vector_eventfds(0, &fds)
            .map_err(|e| err("enabling MSI-X", e))?;
        Ok(doorbell)
    }

    /// Makes vectors `start..start + fds.len()` signal these eventfds from
    /// now on (each replaces the one the vector had).
    pub fn set_vector_eventfds(&self, start: u16, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        if fds.is_empty() || usize::from(start) + fds.len() > usize::from(self.vectors) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "vector out of range",
            ));
        }
        let header = std::mem::size_of::<IrqSetHeader>();
        let mut buf = vec![0u8; header + 4 * fds.len()];
        let head = IrqSetHeader {
            argsz: buf.len() as u32,
            flags: VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            index: VFIO_PCI_MSIX_IRQ_INDEX,
            start: u32::from(start),
            count: fds.len() as u32,
        };
        for (i, v) in [head.argsz, head.flags, head.index, head.start, head.count]
            .into_iter()
            .enumerate()
        {
            buf[4 * i..4 * i + 4].copy_from_slice(&v.to_ne_bytes());
        }
        for (i, fd) in fds.iter().enumerate() {
            let at = header + 4 * i;
            buf[at..at + 4].copy_from_slice(&fd.as_raw_fd().to_ne_bytes());
        }
        // SAFETY: VFIO_DEVICE_SET_IRQS reads `argsz` bytes: the header and
        // `count` 32-bit descriptor numbers, exactly `buf`'s length; the
        // descriptors are borrowed, so open for the call.
        let r = unsafe {
            libc::ioctl(
                self.register.device.as_raw_fd(),
                VFIO_DEVICE_SET_IRQS,
                buf.as_mut_ptr() as *mut c_void,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The doorbell register, to ring peers through.
    pub fn register(&self) -> &std::sync::Arc<Bar0Register> {
        &self.register
    }

    /// Our ivshmem peer id (the IVPosition register).
    pub fn own_peer(&self) -> std::io::Result<u32> {
        self.register.read32(IVSHMEM_IVPOSITION)
    }
}

/// Loads vfio-pci when its driver directory is missing (an image whose init
/// did not); failures show up as the bind error that follows.
fn ensure_vfio_pci_driver() {
    if Path::new("/sys/bus/pci/drivers/vfio-pci").exists() {
        return;
    }
    for module in ["vfio_iommu_type1", "vfio-pci"] {
        let _ = std::process::Command::new("modprobe")
            .arg(module)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn open_rw(path: &Path) -> std::io::Result<OwnedFd> {
    Ok(OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?
        .into())
}

/// Opens a device node that devtmpfs may create a moment after binding.
fn wait_open(path: &Path, timeout: Duration) -> std::io::Result<OwnedFd> {
    let deadline = Instant::now() + timeout;
    loop {
        match open_rw(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn region_info(device: BorrowedFd<'_>, index: u32) -> std::io::Result<RegionInfo> {
    let mut info = RegionInfo {
        argsz: std::mem::size_of::<RegionInfo>() as u32,
        index,
        ..Default::default()
    };
    // SAFETY: VFIO_DEVICE_GET_REGION_INFO reads and writes `argsz` bytes of a
    // `struct vfio_region_info` (32 bytes, all integers); with `argsz` this
    // size the kernel writes no capability chain after it.
    unsafe { ioctl_ptr(device, VFIO_DEVICE_GET_REGION_INFO, &mut info) }?;
    Ok(info)
}

/// Sets bits of the PCI command register through the config region.
fn set_command_bits(device: BorrowedFd<'_>, config_offset: u64, bits: u16) -> std::io::Result<()> {
    let mut b = [0u8; 2];
    if rustix::io::pread(device, &mut b, config_offset + PCI_COMMAND)? != 2 {
        return Err(std::io::Error::other(
            "short read of the PCI command register",
        ));
    }
    let command = u16::from_le_bytes(b) | bits;
    if rustix::io::pwrite(device, &command.to_le_bytes(), config_offset + PCI_COMMAND)? != 2 {
        return Err(std::io::Error::other(
            "short write of the PCI command register",
        ));
    }
    Ok(())
}

/// Maps BAR 0 (one page at least: VFIO maps whole pages) or returns `None`
/// when the kernel refuses, in which case the register is written with `pwrite`.
fn map_registers(device: BorrowedFd<'_>, bar0: &RegionInfo) -> Option<(NonNull<u8>, usize)> {
    let page = rustix::param::page_size() as u64;
    let len = bar0.size.div_ceil(page).checked_mul(page)?;
    let len = usize::try_from(len).ok()?;
    // SAFETY: a fresh shared mapping of the device's BAR 0 at an address the
    // kernel chooses; it aliases no Rust object and is only reached through
    // volatile accesses in `Bar0Register`.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            device,
            bar0.offset,
        )
    };
    match ptr {
        Ok(p) => NonNull::new(p as *mut u8).map(|p| (p, len)),
        Err(e) => {
            tracing::debug!("mapping the doorbell registers failed ({e}); ringing with pwrite");
            None
        }
    }
}

/// A fresh eventfd for an MSI-X vector: non-blocking (the wait end is polled
/// and drained, never read blocking) and close-on-exec.
pub fn vector_eventfd() -> std::io::Result<OwnedFd> {
    Ok(eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers the kernel's header defines (spot checks against
    /// include/uapi/linux/vfio.h).
    #[test]
    fn ioctl_numbers_match_the_kernel() {
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(std::mem::size_of::<RegionInfo>(), 32);
        assert_eq!(std::mem::size_of::<IrqInfo>(), 16);
        assert_eq!(std::mem::size_of::<IrqSetHeader>(), 20);
    }
}
