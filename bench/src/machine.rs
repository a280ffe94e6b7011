//! Where a benchmark ran: one description shared by every suite, printed in each
//! table's header ([`Machine::header`]) and put in every JSON record (field `machine`,
//! see [`crate::write_json`]). Figures are only comparable between runs whose
//! `machine` says the same CPU, core count, placement, virtualization and kernel —
//! a cross-CPU wake-up costs ~2 µs on bare metal and 10–15 µs in some guests.
//!
//! Everything is read from the running system (procfs, sysfs, `/proc/sys/kernel/osrelease`,
//! `systemd-detect-virt`); a source that is missing reads as an empty string or 0,
//! never as an error: a benchmark never fails because it could not describe itself.

use std::process::Command;

use serde::Serialize;

/// The machine and the placement of one suite's processes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Machine {
    /// `hostname`.
    pub host: String,
    /// The first `model name` of /proc/cpuinfo.
    pub cpu: String,
    /// CPUs online (/sys/devices/system/cpu/online).
    pub cpus: usize,
    /// The CPUs this process may run on (its affinity mask), as a list such as `0-3,8`.
    pub cpus_allowed: String,
    /// NUMA nodes with CPUs (/sys/devices/system/node/has_cpu); 0 if unknown.
    pub numa_nodes: usize,
    /// Whether SMT siblings are active (/sys/devices/system/cpu/smt/active).
    pub smt: bool,
    /// Hypervisor (`kvm`, `microsoft`, ... from `systemd-detect-virt --vm`, else
    /// `unknown` when the CPU's hypervisor flag is set), or `none` on bare metal.
    pub virt: String,
    /// Container (`systemd-detect-virt --container`), or `none`.
    pub container: String,
    /// The kernel release (`uname -r`).
    pub kernel: String,
    /// The cpuidle driver and governor (`none` when the kernel has no idle driver:
    /// a guest then halts in the hypervisor). Idle states decide wake-up latency.
    pub cpuidle: String,
    /// Where the suite put its processes (pinning), in words.
    pub placement: String,
    /// Suite-specific facts (tool versions, the VM's accelerator).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Machine {
    /// Describes this machine; `placement` says where the suite runs its processes.
    pub fn describe(placement: impl Into<String>) -> Machine {
        let cpuinfo = read("/proc/cpuinfo");
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let hypervisor_flag = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .is_some_and(|l| l.split_whitespace().any(|f| f == "hypervisor"));
        let detect = |arg: &str| first_line("systemd-detect-virt", &[arg]);
        let virt = match detect("--vm") {
            v if !v.is_empty() && v != "none" => v,
            _ if hypervisor_flag => "unknown".to_string(),
            _ => "none".to_string(),
        };
        let container = match detect("--container") {
            c if c.is_empty() => "none".to_string(),
            c => c,
        };
        let cpuidle = {
            let driver = read("/sys/devices/system/cpu/cpuidle/current_driver");
            let governor = read("/sys/devices/system/cpu/cpuidle/current_governor");
            match (driver.trim(), governor.trim()) {
                ("", _) => "none".to_string(),
                (d, "") => d.to_string(),
                (d, g) => format!("{d}/{g}"),
            }
        };
        let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
        Machine {
            host: first_line("hostname", &[]),
            cpu,
            cpus: cpu_list_len(read("/sys/devices/system/cpu/online").trim())
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(0, |n| n.get())),
            cpus_allowed: allowed_cpus(),
            numa_nodes: cpu_list_len(read("/sys/devices/system/node/has_cpu").trim()).unwrap_or(0),
            smt: read("/sys/devices/system/cpu/smt/active").trim() == "1",
            virt,
            container,
            kernel,
            cpuidle,
            placement: placement.into(),
            extra: serde_json::Map::new(),
        }
    }

    /// This machine with the placement of the suites that pin their processes with
    /// [`crate::Placement`] (channel, rpc, pipe, net).
    pub fn pinned() -> Machine {
        Machine::describe(crate::Placement::detect().to_string())
    }

    /// Adds a suite-specific fact (`fio`'s version, the VM accelerator...).
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Machine {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    /// As a JSON object (the `machine` field of every record).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a Machine serializes")
    }

    /// The table header: `# machine: ...` and `# placement: ...`.
    pub fn header(&self) -> String {
        let mut s = format!(
            "# machine: {} ({} CPUs online, {} NUMA node(s), SMT {}), allowed CPUs {}; virt {}, container {}; \
             kernel {}; cpuidle {}; host {}",
            if self.cpu.is_empty() { "unknown CPU" } else { &self.cpu },
            self.cpus,
            self.numa_nodes,
            if self.smt { "on" } else { "off" },
            self.cpus_allowed,
            self.virt,
            self.container,
            self.kernel,
            self.cpuidle,
            self.host,
        );
        for (k, v) in &self.extra {
            let v = v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string());
            s.push_str(&format!("; {k} {v}"));
        }
        s.push_str("\n# placement: ");
        s.push_str(&self.placement);
        s
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(|l| l.trim().to_string()))
        .unwrap_or_default()
}

/// The number of CPUs in a kernel CPU list (`0-3,8,10-11`); `None` if it does not parse.
fn cpu_list_len(list: &str) -> Option<usize> {
    if list.is_empty() {
        return None;
    }
    let mut n = 0;
    for part in list.split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

/// This thread's affinity mask as a CPU list (`0-1`).
fn allowed_cpus() -> String {
    let Ok(set) = rustix::thread::sched_getaffinity(None) else {
        return String::new();
    };
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        while i + 1 < cpus.len() && cpus[i + 1] == cpus[i] + 1 {
            i += 1;
        }
        parts.push(if cpus[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", cpus[i])
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count() {
        assert_eq!(cpu_list_len("0-1"), Some(2));
        assert_eq!(cpu_list_len("0-3,8,10-11"), Some(7));
        assert_eq!(cpu_list_len("0"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("x"), None);
    }

    #[test]
    fn describes_this_machine() {
        let m = Machine::describe("nowhere").with("fio", "fio-3.33");
        assert!(m.cpus >= 1, "{m:?}");
        assert!(!m.kernel.is_empty() && !m.cpus_allowed.is_empty(), "{m:?}");
        let j = m.to_json();
        assert_eq!(j["placement"], "nowhere");
        assert_eq!(j["fio"], "fio-3.33");
        assert!(m.header().contains("# placement: nowhere"));
    }
}
