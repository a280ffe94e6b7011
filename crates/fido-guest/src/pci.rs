//! PCI devices through sysfs: finding the VM's Fido devices by address,
//! checking what they are, opening their BARs, and waiting for a device the
//! supervisor hot-plugged under a PCIe root port.
//!
//! Everything read here comes from the kernel's view of devices the host
//! chose, so each value is parsed strictly and a device that is not what the
//! supervisor announced is an error, never a guess.

use crate::GuestError;
use std::fs::{File, OpenOptions};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the kernel lists PCI devices (a parameter so tests can use a fake tree).
pub const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// Red Hat's virtio vendor id, which QEMU's ivshmem devices use.
pub const IVSHMEM_VENDOR: u16 = 0x1af4;
/// `ivshmem-plain` and `ivshmem-doorbell` (both 1af4:1110).
pub const IVSHMEM_DEVICE: u16 = 0x1110;
/// The BAR that holds an ivshmem device's shared memory.
pub const IVSHMEM_MEMORY_BAR: usize = 2;
/// The BAR that holds an ivshmem device's registers.
pub const IVSHMEM_REGISTER_BAR: usize = 0;

/// How often [`wait_for_child`] looks for a hot-plugged device.
const HOTPLUG_POLL: Duration = Duration::from_millis(10);

/// A PCI device in sysfs, by its address (`0000:00:04.0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    address: String,
    dir: PathBuf,
}

/// Whether `s` has the shape of a full PCI address, `DDDD:BB:SS.F` in hex, so
/// that it can be joined to a sysfs path safely.
pub fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

impl PciDevice {
    /// The device at `address` under the standard sysfs directory.
    pub fn open(address: &str) -> Result<PciDevice, GuestError> {
        PciDevice::open_in(Path::new(SYSFS_PCI_DEVICES), address)
    }

    /// The device at `address` under `root` (a sysfs `devices` directory).
    pub fn open_in(root: &Path, address: &str) -> Result<PciDevice, GuestError> {
        if !is_pci_address(address) {
            return Err(GuestError::Device(format!(
                "{address:?} is not a PCI address"
            )));
        }
        let dir = root.join(address);
        if !dir.join("vendor").exists() {
            return Err(GuestError::Device(format!(
                "no PCI device {address} (no {})",
                dir.display()
            )));
        }
        Ok(PciDevice {
            address: address.to_owned(),
            dir,
        })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// The device's sysfs directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `(vendor, device)` from the sysfs files (`0x1af4` and so on).
    pub fn ids(&self) -> Result<(u16, u16), GuestError> {
        let read = |name: &str| -> Result<u16, GuestError> {
            let text = read_small(&self.dir.join(name))?;
            parse_hex(&text)
                .and_then(|v| u16::try_from(v).ok())
                .ok_or_else(|| GuestError::Device(format!("{}: bad {name} {text:?}", self.address)))
        };
        Ok((read("vendor")?, read("device")?))
    }

    /// Fails unless this is an ivshmem device (1af4:1110).
    pub fn expect_ivshmem(&self) -> Result<(), GuestError> {
        let (vendor, device) = self.ids()?;
        if (vendor, device) != (IVSHMEM_VENDOR, IVSHMEM_DEVICE) {
            return Err(GuestError::Device(format!(
                "{} is {vendor:04x}:{device:04x}, not an ivshmem device ({IVSHMEM_VENDOR:04x}:{IVSHMEM_DEVICE:04x})",
                self.address
            )));
        }
        Ok(())
    }

    /// The size of BAR `bar` from the `resource` file (its lines are
    /// `start end flags` in hex; an unassigned BAR reads all zeros).
    pub fn bar_len(&self, bar: usize) -> Result<u64, GuestError> {
        let text = read_small(&self.dir.join("resource"))?;
        bar_len_from_resource(&text, bar).ok_or_else(|| {
            GuestError::Device(format!("{}: BAR {bar} is not assigned", self.address))
        })
    }

    /// Opens BAR `bar` for mapping (`resourceN`) and returns it with its length.
    /// A BAR whose memory decoding the kernel left off (a device no driver
    /// enabled, which is every ivshmem device in a guest) is enabled first
    /// through the sysfs `enable` file: otherwise the guest reads nothing
    /// behind the mapping.
    pub fn open_bar(&self, bar: usize, writable: bool) -> Result<(OwnedFd, u64), GuestError> {
        let len = self.bar_len(bar)?;
        self.enable()?;
        let path = self.dir.join(format!("resource{bar}"));
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(&path)
            .map_err(|e| GuestError::Device(format!("opening {}: {e}", path.display())))?;
        Ok((OwnedFd::from(file), len))
    }

    /// Turns on the device (memory decoding) unless it already is.
    pub fn enable(&self) -> Result<(), GuestError> {
        let path = self.dir.join("enable");
        match read_small(&path) {
            Ok(text) if text.trim() != "0" => return Ok(()),
            Ok(_) => {}
            // A kernel without the attribute: nothing to do.
            Err(_) if !path.exists() => return Ok(()),
            Err(e) => return Err(e),
        }
        write_sysfs(&path, "1")
    }

    /// The name of the driver bound to the device, if any.
    pub fn driver(&self) -> Option<String> {
        let link = std::fs::read_link(self.dir.join("driver")).ok()?;
        Some(link.file_name()?.to_string_lossy().into_owned())
    }

    /// The IOMMU group number (`iommu_group` link), if the device has one.
    pub fn iommu_group(&self) -> Option<u32> {
        let link = std::fs::read_link(self.dir.join("iommu_group")).ok()?;
        link.file_name()?.to_str()?.parse().ok()
    }

    /// Binds the device to `driver` (`driver_override`, unbind from the
    /// current one, `drivers_probe`), unless it is bound to it already.
    pub fn bind_to(&self, driver: &str) -> Result<(), GuestError> {
        if self.driver().as_deref() == Some(driver) {
            return Ok(());
        }
        write_sysfs(&self.dir.join("driver_override"), driver)?;
        if self.driver().is_some() {
            write_sysfs(&self.dir.join("driver/unbind"), &self.address)?;
        }
        let probe = self
            .dir
            .parent()
            .and_then(Path::parent)
            .map(|bus| bus.join("drivers_probe"));
        if let Some(probe) = probe {
            write_sysfs(&probe, &self.address)?;
        }
        match self.driver() {
            Some(d) if d == driver => Ok(()),
            other => Err(GuestError::Device(format!(
                "{} did not bind to {driver} (driver now: {})",
                self.address,
                other.as_deref().unwrap_or("none")
            ))),
        }
    }

    /// The device on the secondary bus of this root port (function 0 of
    /// device 0), if one is there now.
    pub fn child(&self) -> Option<PciDevice> {
        let entries = std::fs::read_dir(&self.dir).ok()?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if is_pci_address(name)
                && name.ends_with(":00.0")
                && entry.path().join("vendor").exists()
            {
                return Some(PciDevice {
                    address: name.to_owned(),
                    dir: entry.path(),
                });
            }
        }
        None
    }

    /// Waits up to `timeout` for a device to appear under this root port
    /// with BAR `bar` assigned and its `resourceN` file created (the kernel
    /// adds the device's directory before it assigns and publishes its BARs).
    /// A hot-plug takes 0.03–0.23 s on an idle machine; allow seconds.
    pub fn wait_for_child(&self, bar: usize, timeout: Duration) -> Result<PciDevice, GuestError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child() {
                if child.dir.join(format!("resource{bar}")).exists() && child.bar_len(bar).is_ok() {
                    return Ok(child);
                }
            }
            if Instant::now() >= deadline {
                return Err(GuestError::Device(format!(
                    "no device appeared under root port {} within {timeout:?}",
                    self.address
                )));
            }
            std::thread::sleep(HOTPLUG_POLL);
        }
    }
}

/// Parses `0x1af4` (sysfs ids) or plain hex.
fn parse_hex(text: &str) -> Option<u64> {
    let t = text.trim();
    let t = t.strip_prefix("0x").unwrap_or(t);
    if t.is_empty() || t.len() > 16 {
        return None;
    }
    u64::from_str_radix(t, 16).ok()
}

/// The length of BAR `bar` from the text of a sysfs `resource` file.
pub(crate) fn bar_len_from_resource(text: &str, bar: usize) -> Option<u64> {
    let line = text.lines().nth(bar)?;
    let mut fields = line.split_whitespace();
    let start = parse_hex(fields.next()?)?;
    let end = parse_hex(fields.next()?)?;
    if end <= start {
        return None;
    }
    end.checked_sub(start)?.checked_add(1)
}

/// Reads a small sysfs attribute.
fn read_small(path: &Path) -> Result<String, GuestError> {
    use std::io::Read;
    let mut text = String::new();
    File::open(path)
        .and_then(|f| f.take(4096).read_to_string(&mut text))
        .map_err(|e| GuestError::Device(format!("reading {}: {e}", path.display())))?;
    Ok(text)
}

/// Writes a sysfs attribute in one `write`, as the kernel expects.
pub(crate) fn write_sysfs(path: &Path, value: &str) -> Result<(), GuestError> {
    use std::io::Write;
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| GuestError::Device(format!("writing {value:?} to {}: {e}", path.display())))
}

/// What a hostile root in the guest can do to a BAR it was given to read:
/// map the sysfs resource file at `path` read-write (root may), write `value`
/// at `offset` (rounded down to a 4-byte word) and read the word back.
/// Returns (the word before, the word after). Used by `fido guest __poke`,
/// the VM isolation tests: a peer's arena must read the same afterwards.
pub fn write_through_mapping(path: &Path, offset: u64, value: u32) -> std::io::Result<(u32, u32)> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let page = offset & !4095;
    // SAFETY: a fresh shared mapping of one page of the file; nothing else in
    // this process refers to it, and it is unmapped below.
    let map = unsafe {
        rustix::mm::mmap(std::ptr::null_mut(), 4096, rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE, rustix::mm::MapFlags::SHARED, &file, page)
    }?;
    let word = map.cast::<u8>().wrapping_add(((offset - page) & !3) as usize).cast::<u32>();
    // SAFETY: `word` is 4-byte aligned and inside the page mapped above;
    // volatile: device memory, each access must happen.
    let (before, after) = unsafe {
        let before = word.read_volatile();
        word.write_volatile(value);
        (before, word.read_volatile())
    };
    // SAFETY: the mapping made above, no longer referred to.
    unsafe { rustix::mm::munmap(map, 4096) }?;
    Ok((before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked_before_they_touch_a_path() {
        assert!(is_pci_address("0000:00:04.0"));
        assert!(is_pci_address("0000:1f:1F.7"));
        for bad in [
            "",
            "../../etc/pa",
            "0000:00:04",
            "0000/00:04.0",
            "0000:00:04.0/",
            "g000:00:04.0",
            "0000:00:04.00",
        ] {
            assert!(!is_pci_address(bad), "{bad:?}");
            assert!(PciDevice::open_in(Path::new("/nonexistent"), bad).is_err());
        }
    }

    #[test]
    fn bar_lengths_come_from_the_resource_file() {
        let text = "0x00000000fe800000 0x00000000fe8000ff 0x0000000000040200\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x0000008000000000 0x0000008003ffffff 0x000000000014220c\n";
        assert_eq!(bar_len_from_resource(text, 0), Some(256));
        assert_eq!(bar_len_from_resource(text, 1), None, "an unassigned BAR");
        assert_eq!(bar_len_from_resource(text, 2), Some(64 << 20));
        assert_eq!(bar_len_from_resource(text, 5), None);
        assert_eq!(bar_len_from_resource("junk here\n", 0), None);
        assert_eq!(
            bar_len_from_resource("0x10 0x0f 0x0\n", 0),
            None,
            "end before start"
        );
    }

    /// A fake sysfs tree: a root port with a hot-plugged ivshmem device, whose
    /// BAR file opens read-only and whose child appears after a delay.
    #[test]
    fn a_hot_plugged_child_is_found_and_checked() {
        let root = tempfile::tempdir().unwrap();
        let port = root.path().join("0000:00:10.0");
        std::fs::create_dir_all(&port).unwrap();
        std::fs::write(port.join("vendor"), "0x1b36\n").unwrap();
        std::fs::write(port.join("device"), "0x000c\n").unwrap();
        let port_dev = PciDevice::open_in(root.path(), "0000:00:10.0").unwrap();
        assert!(
            port_dev.expect_ivshmem().is_err(),
            "a root port is not an ivshmem device"
        );
        assert!(port_dev
            .wait_for_child(IVSHMEM_MEMORY_BAR, Duration::from_millis(50))
            .is_err());
        let child_dir = port.join("0000:01:00.0");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            std::fs::create_dir_all(&child_dir).unwrap();
            std::fs::write(child_dir.join("device"), "0x1110\n").unwrap();
            std::fs::write(
                child_dir.join("resource"),
                "0x0 0xff 0x0\n0x0 0x0 0x0\n0x100000 0x1fffff 0x0\n",
            )
            .unwrap();
            std::fs::write(child_dir.join("resource2"), vec![0u8; 16]).unwrap();
            std::fs::write(child_dir.join("enable"), "1\n").unwrap();
            // Last: `vendor` is what makes the directory count as a device.
            std::fs::write(child_dir.join("vendor"), "0x1af4\n").unwrap();
        });
        let child = port_dev
            .wait_for_child(IVSHMEM_MEMORY_BAR, Duration::from_secs(10))
            .unwrap();
        writer.join().unwrap();
        assert_eq!(child.address(), "0000:01:00.0");
        child.expect_ivshmem().unwrap();
        let (_fd, len) = child.open_bar(IVSHMEM_MEMORY_BAR, false).unwrap();
        assert_eq!(len, 1 << 20);
    }
}
