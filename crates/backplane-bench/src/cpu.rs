//! CPU accounting: where the processor time of a measurement went.
//!
//! Two views, taken before and after each measurement point:
//! - the whole machine, from the `cpu` line of `/proc/stat` (user, nice, system, idle, iowait,
//!   irq, softirq, steal, in clock ticks), which also sees kernel work done in interrupt and
//!   softirq context on behalf of the traffic (the network stack's receive path);
//! - each side's own process or thread, from `getrusage(2)` (user and system time in
//!   microseconds), which is not polluted by whatever else the machine runs.
//!
//! Also the monotonic clock shared by every process of the host, so a peer process can time
//! stamp events the client compares with its own.

use std::mem::MaybeUninit;

use serde::{Deserialize, Serialize};

/// Nanoseconds on `CLOCK_MONOTONIC`, comparable between processes (and network namespaces).
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The `cpu` (all processors) line of `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcStat {
    /// Time in user mode (including nice).
    pub user: u64,
    /// Time in kernel mode, outside interrupts.
    pub system: u64,
    /// Idle, including waiting for I/O.
    pub idle: u64,
    /// Servicing hardware interrupts.
    pub irq: u64,
    /// Servicing softirqs (for the network stack: packet receive and transmit completion).
    pub softirq: u64,
    /// Stolen by the hypervisor.
    pub steal: u64,
    /// Number of processors (`cpuN` lines).
    pub cpus: u32,
}

impl ProcStat {
    /// Reads `/proc/stat` now.
    pub fn now() -> std::io::Result<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat")?).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "/proc/stat has no cpu line",
            )
        })
    }

    /// Parses the text of `/proc/stat`.
    pub fn parse(text: &str) -> Option<Self> {
        let mut out = None;
        let mut cpus = 0;
        for line in text.lines() {
            let mut f = line.split_ascii_whitespace();
            match f.next() {
                Some("cpu") => {
                    let v: Vec<u64> = f.map(|x| x.parse().unwrap_or(0)).collect();
                    let g = |i: usize| v.get(i).copied().unwrap_or(0);
                    out = Some(ProcStat {
                        user: g(0) + g(1),
                        system: g(2),
                        idle: g(3) + g(4),
                        irq: g(5),
                        softirq: g(6),
                        steal: g(7),
                        cpus: 0,
                    });
                }
                Some(c) if c.starts_with("cpu") => cpus += 1,
                _ => {}
            }
        }
        out.map(|mut s| {
            s.cpus = cpus.max(1);
            s
        })
    }

    /// Shares of the machine's time between `self` (earlier) and `later`.
    pub fn until(&self, later: &ProcStat) -> MachineCpu {
        let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
        let user = d(self.user, later.user);
        let system = d(self.system, later.system);
        let idle = d(self.idle, later.idle);
        let irq = d(self.irq, later.irq);
        let softirq = d(self.softirq, later.softirq);
        let steal = d(self.steal, later.steal);
        let total = user + system + idle + irq + softirq + steal;
        let pct = |x: f64| if total > 0.0 { 100.0 * x / total } else { 0.0 };
        MachineCpu {
            cpus: later.cpus,
            user_pct: pct(user),
            system_pct: pct(system),
            irq_pct: pct(irq),
            softirq_pct: pct(softirq),
            idle_pct: pct(idle),
            busy_pct: pct(user + system + irq + softirq),
        }
    }
}

/// The whole machine's processor time over an interval, in percent of all processors.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct MachineCpu {
    /// Processors of the machine.
    pub cpus: u32,
    /// User mode.
    pub user_pct: f64,
    /// Kernel mode outside interrupts.
    pub system_pct: f64,
    /// Hardware interrupts.
    pub irq_pct: f64,
    /// Softirqs.
    pub softirq_pct: f64,
    /// Idle.
    pub idle_pct: f64,
    /// user + system + irq + softirq.
    pub busy_pct: f64,
}

/// Whose resource usage `getrusage(2)` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// The whole calling process.
    Process,
    /// The calling thread only.
    Thread,
    /// Children of the calling process that have been waited for.
    Children,
}

/// User and system CPU time consumed, in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Rusage {
    /// User mode.
    pub user_us: u64,
    /// Kernel mode.
    pub system_us: u64,
}

impl Rusage {
    /// `getrusage(2)` now.
    pub fn now(who: Who) -> Self {
        let w = match who {
            Who::Process => libc::RUSAGE_SELF,
            Who::Thread => libc::RUSAGE_THREAD,
            Who::Children => libc::RUSAGE_CHILDREN,
        };
        let mut ru = MaybeUninit::<libc::rusage>::zeroed();
        #[allow(unsafe_code)] // rustix has no getrusage; this is the crate's only unsafe block
        // SAFETY: getrusage writes one `struct rusage` into the valid, writable, properly
        // aligned buffer we pass; it was zero-initialised, so it is fully initialised even if
        // the call failed (it cannot for these `who` values).
        let ru = unsafe {
            libc::getrusage(w, ru.as_mut_ptr());
            ru.assume_init()
        };
        let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        Rusage {
            user_us: us(ru.ru_utime),
            system_us: us(ru.ru_stime),
        }
    }

    /// Time used between `self` (earlier) and `later`.
    pub fn until(&self, later: &Rusage) -> Rusage {
        Rusage {
            user_us: later.user_us.saturating_sub(self.user_us),
            system_us: later.system_us.saturating_sub(self.system_us),
        }
    }

    /// User + system.
    pub fn total_us(&self) -> u64 {
        self.user_us + self.system_us
    }
}

/// One side's processor use over an interval, in percent of one processor.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct SideCpu {
    /// User mode.
    pub user_pct: f64,
    /// Kernel mode (system calls, and softirq work the kernel charged to this process).
    pub system_pct: f64,
}

impl SideCpu {
    /// Utilisation of `used` over `wall_ns` of elapsed time.
    pub fn of(used: Rusage, wall_ns: u64) -> Self {
        let wall_us = (wall_ns as f64 / 1000.0).max(1.0);
        SideCpu {
            user_pct: 100.0 * used.user_us as f64 / wall_us,
            system_pct: 100.0 * used.system_us as f64 / wall_us,
        }
    }

    /// user + system.
    pub fn total_pct(&self) -> f64 {
        self.user_pct + self.system_pct
    }
}

/// A snapshot of both views, for measuring an interval.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    at_ns: u64,
    machine: Option<ProcStat>,
    me: Rusage,
    who: Who,
}

impl Snapshot {
    /// Takes a snapshot of the machine and of `who` (this thread or process, or reaped children).
    pub fn take(who: Who) -> Self {
        Snapshot {
            at_ns: mono_ns(),
            machine: ProcStat::now().ok(),
            me: Rusage::now(who),
            who,
        }
    }

    /// The machine's shares, this side's utilisation, its raw usage and the elapsed time since
    /// the snapshot.
    pub fn finish(&self) -> (Option<MachineCpu>, SideCpu, Rusage, u64) {
        let later = Snapshot::take(self.who);
        let wall = later.at_ns.saturating_sub(self.at_ns);
        let used = self.me.until(&later.me);
        let machine = self.machine.zip(later.machine).map(|(a, b)| a.until(&b));
        (machine, SideCpu::of(used, wall), used, wall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn proc_stat_is_parsed_with_nice_in_user_and_iowait_in_idle() {
        let text = "cpu  100 5 50 1000 20 3 7 1 0 0\n\
                    cpu0 50 2 25 500 10 1 3 0 0 0\n\
                    cpu1 50 3 25 500 10 2 4 1 0 0\n\
                    intr 12345\n";
        let s = ProcStat::parse(text).unwrap();
        assert_eq!(
            s,
            ProcStat {
                user: 105,
                system: 50,
                idle: 1020,
                irq: 3,
                softirq: 7,
                steal: 1,
                cpus: 2
            }
        );
        assert!(ProcStat::parse("intr 1\n").is_none());
    }

    #[test]
    fn machine_shares_add_up_to_the_elapsed_ticks() {
        let a = ProcStat {
            user: 100,
            system: 100,
            idle: 100,
            irq: 0,
            softirq: 0,
            steal: 0,
            cpus: 2,
        };
        let b = ProcStat {
            user: 150,
            system: 120,
            idle: 120,
            irq: 0,
            softirq: 10,
            steal: 0,
            cpus: 2,
        };
        let m = a.until(&b);
        assert!((m.user_pct - 50.0).abs() < 1e-9);
        assert!((m.system_pct - 20.0).abs() < 1e-9);
        assert!((m.softirq_pct - 10.0).abs() < 1e-9);
        assert!((m.idle_pct - 20.0).abs() < 1e-9);
        assert!((m.busy_pct - 80.0).abs() < 1e-9);
    }

    fn spin(d: Duration) -> u64 {
        let end = Instant::now() + d;
        let mut x = 0u64;
        while Instant::now() < end {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        x
    }

    #[test]
    fn a_spinning_thread_is_charged_far_more_cpu_than_a_sleeping_one() {
        let busy = std::thread::spawn(|| {
            let s = Snapshot::take(Who::Thread);
            spin(Duration::from_millis(200));
            s.finish()
        })
        .join()
        .unwrap();
        let idle = std::thread::spawn(|| {
            let s = Snapshot::take(Who::Thread);
            std::thread::sleep(Duration::from_millis(200));
            s.finish()
        })
        .join()
        .unwrap();
        let (_, busy_side, busy_used, busy_wall) = busy;
        let (_, idle_side, idle_used, _) = idle;
        // A thread spinning for 200 ms was on a processor for some of that time (however
        // loaded the machine), and far more than one that slept.
        assert!(busy_wall >= 200_000_000);
        assert!(busy_used.total_us() > 10 * idle_used.total_us().max(1_000));
        assert!(busy_side.total_pct() > idle_side.total_pct());
        assert!(busy_used.user_us > busy_used.system_us);
        assert!(busy_side.total_pct() <= 100.0 + 5.0, "{busy_side:?}");
    }

    #[test]
    fn process_usage_includes_the_work_of_its_threads() {
        let before = Rusage::now(Who::Process);
        std::thread::spawn(|| spin(Duration::from_millis(100)))
            .join()
            .unwrap();
        let used = before.until(&Rusage::now(Who::Process));
        assert!(used.total_us() > 1_000, "{used:?}");
    }

    #[test]
    fn the_monotonic_clock_moves_forward_in_nanoseconds() {
        let a = mono_ns();
        std::thread::sleep(Duration::from_millis(2));
        let b = mono_ns();
        assert!(b >= a + 2_000_000);
    }
}
