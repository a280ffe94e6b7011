//! The test guest boots and has what the VM domains need: its kernel, the
//! workspace's `fido`, VFIO behind the emulated Intel IOMMU (an ivshmem-plain
//! device bound to vfio-pci gets a /dev/vfio group), and the virtio-serial
//! control port found by name without udev, eth0 configured from the kernel
//! command line. A second, short boot checks the image with an added program
//! and the run-and-power-off mode.

use std::time::{Duration, Instant};

use fido_test_support::vm::{self, BootOptions, Console};

const CMD: Duration = Duration::from_secs(60);

/// One guest at a time: two TCG guests (and an image build) on a 2-core
/// machine slow each other down and blur the boot time measured.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The guest PCI address given to the ivshmem-plain device.
const IVSHMEM_BDF: &str = "0000:00:04.0";

#[test]
fn guest_boots_with_fido_vfio_and_the_control_port() {
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (scripts/install-test-deps.sh installs it)");
        return;
    }
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
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
        "-netdev",
        "user,id=net0",
        "-device",
        "virtio-net-pci,netdev=net0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();

    let mut guest = vm::boot_with(
        &image,
        &BootOptions {
            extra_qemu_args: args,
            extra_cmdline: "fido.ip=10.0.2.15/24 fido.gw=10.0.2.2 fido.hostname=smoke".into(),
            ..Default::default()
        },
    );
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

    // eth0 from fido.ip= / fido.gw=, the hostname from fido.hostname=.
    let addr = c.run_ok("ip -4 addr show dev eth0", CMD);
    assert!(addr.contains("inet 10.0.2.15/24"), "eth0: {addr}");
    let route = c.run_ok("ip route show default", CMD);
    assert!(route.contains("via 10.0.2.2 dev eth0"), "route: {route}");
    assert_eq!(c.run_ok("hostname", CMD), "smoke\n");

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

    // A command that outlives its timeout is an error; ^C ends it and the
    // next command's output is still exact.
    let err = c.run("sleep 1000", Duration::from_secs(2)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    c.interrupt().unwrap();
    assert_eq!(c.run("echo after", CMD).unwrap(), (0, "after\n".to_owned()));
    eprintln!("total {:.1?}", t0.elapsed());
}

/// `image_with` adds a dynamically linked host program (with its libraries),
/// and `fido.run=` runs a command instead of the shell, then powers off.
#[test]
fn added_program_runs_and_the_guest_powers_off() {
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (scripts/install-test-deps.sh installs it)");
        return;
    }
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let host_true = std::path::PathBuf::from("/usr/bin/true");
    let image = vm::image_with(&[(host_true, "/opt/added/true")]);
    let manifest = std::fs::read_to_string(image.dir.join("manifest")).unwrap();
    assert!(
        manifest.contains("/opt/added/true"),
        "manifest:\n{manifest}"
    );
    let mut guest = vm::boot_with(
        &image,
        &BootOptions {
            extra_cmdline: r#"fido.run="/opt/added/true && echo ADDED-RAN; exit 3""#.into(),
            wait_for_shell: false,
            ..Default::default()
        },
    );
    let status = guest.wait_exit(vm::BOOT_TIMEOUT);
    let transcript = guest.console.transcript();
    assert!(
        status.is_some(),
        "the guest did not power off:\n{transcript}"
    );
    assert!(
        transcript.contains("ADDED-RAN") && transcript.contains("fido.run: exit 3"),
        "transcript:\n{transcript}"
    );
}
