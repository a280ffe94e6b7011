//! Whether this guest's machine keeps memory shared with the host coherent
//! enough for Fido: refuses a QEMU TCG guest with one *possible* CPU.
//!
//! QEMU's multi-threaded TCG translates a machine whose `maxcpus` is 1 as not
//! parallel. QEMU 7.2 then emits no host barrier for the guest's `mfence` or
//! `lock`ed instructions, and every version turns the guest's `lock`ed
//! read-modify-writes into plain loads and stores. A guest alone cannot tell
//! the difference; a guest sharing a ring with a host process loses
//! wake-ups (a store→load reordering that the fences on both sides forbid)
//! and could lose updates. `scripts/tcg-litmus.c` shows it: the store-buffering
//! outcome x86 forbids comes hundreds to thousands of times in 10^6 rounds
//! with `-smp 1`, never with `-smp 1,maxcpus=2` (docs/VM.md §3). `fido vm run` always gives a TCG
//! guest two possible CPUs (`fido_vm::qemu::tcg_smp`); this check catches a
//! VM started another way.
//!
//! What this module must never do: refuse a machine that is sound (KVM, or
//! TCG with two possible CPUs or more) — it names the one unsound case.

use crate::GuestError;

/// The hypervisor vendor QEMU's TCG reports in CPUID leaf 0x4000_0000.
const TCG_VENDOR: &[u8; 12] = b"TCGTCGTCGTCG";

/// Where the kernel lists the CPUs this machine may ever have.
const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";

/// Fails when this guest runs under QEMU's TCG with one possible CPU.
pub(crate) fn check() -> Result<(), GuestError> {
    let possible = std::fs::read_to_string(POSSIBLE_CPUS).unwrap_or_default();
    match problem(hypervisor_vendor().as_ref(), &possible) {
        Some(why) => Err(GuestError::Machine(why)),
        None => Ok(()),
    }
}

/// Why a machine with hypervisor vendor `vendor` (CPUID leaf 0x4000_0000, if
/// it has one) and the possible-CPU list `possible` (the kernel's list format,
/// "0", "0-3", "0,2-3") cannot share memory with the host, or `None`. An
/// unreadable list is not taken for one CPU.
pub fn problem(vendor: Option<&[u8; 12]>, possible: &str) -> Option<String> {
    if vendor != Some(TCG_VENDOR) || cpu_count(possible) != Some(1) {
        return None;
    }
    Some(format!(
        "this guest runs under QEMU's TCG with one possible CPU ({POSSIBLE_CPUS} is {:?}): \
         TCG then leaves out the guest's memory barriers and makes its locked instructions \
         non-atomic, which corrupts memory shared with the host; start QEMU with \
         `-smp 1,maxcpus=2` or more (`fido vm run` does)",
        possible.trim()
    ))
}

/// How many CPUs a kernel CPU list names ("0", "0-3", "0,2-3"), or `None`
/// if it is not one.
fn cpu_count(list: &str) -> Option<u32> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let mut n: u32 = 0;
    for part in list.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<u32>().ok()?, hi.parse::<u32>().ok()?),
            None => {
                let one = part.parse::<u32>().ok()?;
                (one, one)
            }
        };
        n = n.checked_add(hi.checked_sub(lo)?.checked_add(1)?)?;
    }
    Some(n)
}

/// The 12-byte hypervisor vendor of CPUID leaf 0x4000_0000, if the CPU says
/// it runs under a hypervisor (CPUID.1:ECX bit 31).
#[cfg(target_arch = "x86_64")]
fn hypervisor_vendor() -> Option<[u8; 12]> {
    use std::arch::x86_64::__cpuid;
    // SAFETY: CPUID exists on every x86-64 CPU, reads no memory and has no
    // side effects; leaves a CPU does not know return zeros or its highest
    // basic leaf, never a fault. (Safe to call from Rust 1.87 on.)
    #[allow(unused_unsafe)]
    let (leaf1, hv) = unsafe { (__cpuid(1), __cpuid(0x4000_0000)) };
    if leaf1.ecx & (1 << 31) == 0 {
        return None;
    }
    let mut vendor = [0u8; 12];
    vendor[..4].copy_from_slice(&hv.ebx.to_le_bytes());
    vendor[4..8].copy_from_slice(&hv.ecx.to_le_bytes());
    vendor[8..].copy_from_slice(&hv.edx.to_le_bytes());
    Some(vendor)
}

#[cfg(not(target_arch = "x86_64"))]
fn hypervisor_vendor() -> Option<[u8; 12]> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_kernel_cpu_lists() {
        assert_eq!(cpu_count("0\n"), Some(1));
        assert_eq!(cpu_count("0-1"), Some(2));
        assert_eq!(cpu_count("0,2-3"), Some(3));
        assert_eq!(cpu_count(""), None);
        assert_eq!(cpu_count("x"), None);
        assert_eq!(cpu_count("3-1"), None);
        assert_eq!(cpu_count("0-4294967295"), None);
    }

    #[test]
    fn refuses_only_tcg_with_one_possible_cpu() {
        let why = problem(Some(TCG_VENDOR), "0\n").expect("TCG, one CPU");
        assert!(why.contains("maxcpus=2") && why.contains("\"0\""), "{why}");
        assert_eq!(problem(Some(TCG_VENDOR), "0-1\n"), None);
        assert_eq!(problem(Some(b" KVMKVMKVM  "), "0\n"), None);
        assert_eq!(problem(None, "0\n"), None);
        assert_eq!(problem(Some(TCG_VENDOR), ""), None);
    }

    /// This process's own machine: a host, a KVM guest or a TCG guest with
    /// two possible CPUs passes (the tests never run in the one that fails).
    #[test]
    fn this_machine_passes() {
        check().expect("the test machine is sound");
    }
}
