//! The few system calls the `backplane` binary makes itself, in one place: the rest of the
//! crate denies unsafe code. Everything that touches shared memory or the fabric lives in the
//! library; these are process plumbing.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Restores SIGPIPE's default disposition, so a closed pipe (`backplane status | head`) ends
/// the command quietly, like any Unix filter.
pub fn default_sigpipe() {
    // SAFETY: restoring the default disposition of SIGPIPE is always sound.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// Makes `cmd` start with SIGPIPE's default disposition, the one a shell would give it.
pub fn child_default_sigpipe(cmd: &mut Command) {
    // SAFETY: between fork and exec the hook only calls signal(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            Ok(())
        });
    }
}

/// Clock ticks per second (the unit of /proc/PID/stat's CPU times).
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// The time-stamp counter (perftest's `get_cycles`).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn tsc() -> u64 {
    // SAFETY: RDTSC has no memory effects; every x86_64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}
