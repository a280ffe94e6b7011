//! The test guest boots and has what the VM domains need: its kernel, the
//! workspace's `fido`, VFIO behind the emulated Intel IOMMU (an ivshmem-plain
//! device bound to vfio-pci gets a /dev/vfio group), and the virtio-serial
//! control port found by name without udev. One boot for the whole binary.

use std::time::{Duration, Instant};

use fido_test_support::vm::{self, Console};

const CMD: Duration = Duration::from_secs(60);

/// The guest PCI address given to the ivshmem-plain device.
const IVSHMEM_BDF: &str = "0000:00:04.0";

#[test]
fn guest_boots_with_fido_vfio_and_the_control_port() {
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (scripts/install-test-deps.sh installs it)");
        return;
    }
    let t0 = Instant::now();
    let image = vm::image();
    eprintln!(
        "image {} ready in {:.1?}",
        image.dir.display(),
        t0.elapsed()
    );

    // A 1 MiB shared arena as the ivshmem-plain device's memory (QEMU needs a
    // power-of-two size), and the control port, as the supervisor gives them.
    let arena_dir = tempfile::tempdir().unwrap();
    let arena = arena_dir.path().join("arena");
    std::fs::File::create(&arena)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let control = arena_dir.path().join("control.sock");
    let args: Vec<String> = [
        "-object",
        &format!(
            "memory-backend-file,id=arena,mem-path={},size=1M,share=on",
            arena.display()
        ),
        "-device",
        "ivshmem-plain,memdev=arena,addr=0x4",
        "-device",
        "virtio-serial-pci",
        "-chardev",
        &format!(
            "socket,id=ctl,path={},server=on,wait=off",
            control.display()
        ),
        "-device",
        "virtserialport,chardev=ctl,name=org.fido.broker",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();

    let mut guest = vm::boot_plain(&image, &args);
    eprintln!("boot to shell: {:.2?} wall (TCG)", guest.boot_time);
    let c: &mut Console = &mut guest.console;

    let release = c.run_ok("uname -r", CMD);
    let manifest = std::fs::read_to_string(image.dir.join("manifest")).unwrap();
    assert!(
        release.trim().ends_with("-amd64") && manifest.contains(release.trim()),
        "guest kernel {release:?} is not the image's (manifest:\n{manifest})"
    );

    let version = c.run_ok("/bin/fido --version", CMD);
    assert!(
        version.starts_with("fido "),
        "fido --version printed {version:?}"
    );

    // A failing command's status and output come back exactly.
    let (code, out) = c
        .run(
            "echo out; echo err >&2; exit_with() { return $1; }; exit_with 7",
            CMD,
        )
        .unwrap();
    assert_eq!((code, out.as_str()), (7, "out\nerr\n"));

    // VFIO: bind the ivshmem-plain device to vfio-pci; its IOMMU group's
    // character device appears.
    let dev = format!("/sys/bus/pci/devices/{IVSHMEM_BDF}");
    assert_eq!(
        c.run_ok(&format!("cat {dev}/vendor {dev}/device"), CMD),
        "0x1af4\n0x1110\n"
    );
    c.run_ok(&format!("echo vfio-pci > {dev}/driver_override && echo {IVSHMEM_BDF} > /sys/bus/pci/drivers_probe"), CMD);
    let driver = c.run_ok(&format!("readlink {dev}/driver"), CMD);
    assert!(
        driver.trim().ends_with("/vfio-pci"),
        "ivshmem bound to {driver:?}"
    );
    let group = c.run_ok(&format!("basename $(readlink {dev}/iommu_group)"), CMD);
    let group = group.trim();
    assert!(
        !group.is_empty() && group.bytes().all(|b| b.is_ascii_digit()),
        "iommu group {group:?}"
    );
    c.run_ok(
        &format!("test -c /dev/vfio/{group} && test -c /dev/vfio/vfio"),
        CMD,
    );

    // The control port, found the way Domain::join finds it (no udev).
    let ports = c.run_ok(
        "for p in /sys/class/virtio-ports/*; do echo $(basename $p) $(cat $p/name); done",
        CMD,
    );
    let port = ports
        .lines()
        .find_map(|l| l.strip_suffix(" org.fido.broker"))
        .unwrap_or_else(|| panic!("no org.fido.broker port in {ports:?}"));
    c.run_ok(&format!("test -c /dev/{port}"), CMD);

    // Background commands: spawn returns the pid; the log holds the output.
    let bg = c.spawn("echo started; sleep 30").unwrap();
    assert!(bg.pid > 1);
    let deadline = Instant::now() + CMD;
    while c.run_ok(&format!("cat {}", bg.log), CMD) != "started\n" {
        assert!(
            Instant::now() < deadline,
            "background command printed nothing"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    c.run_ok(&format!("kill {}", bg.pid), CMD);
    eprintln!("total {:.1?}", t0.elapsed());
}
