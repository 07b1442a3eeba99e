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

/// Makes `cmd` start in the network namespace `ns` (an open `/run/netns/NAME`), in a mount
/// namespace of its own where each `(file, over)` of `binds` is bound over `over` (a node's
/// `/etc/netns/NAME/hosts` over `/etc/hosts`) — what `ip netns exec` does, except that `/sys`
/// stays the one the caller sees (`ip netns exec` mounts the namespace's own there).
pub fn child_in_netns(
    cmd: &mut Command,
    ns: std::os::fd::OwnedFd,
    binds: Vec<(std::ffi::CString, std::ffi::CString)>,
) {
    use std::os::fd::AsRawFd;
    // SAFETY: between fork and exec the hook only makes system calls (setns, unshare, mount),
    // which are async-signal-safe, on an fd and strings made before the fork; it allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return fail();
            }
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            // Mounts made from here on stay in this namespace.
            let none = c"none".as_ptr();
            let flags = libc::MS_REC | libc::MS_SLAVE;
            if libc::mount(none, c"/".as_ptr(), none, flags, std::ptr::null()) != 0 {
                return fail();
            }
            for (file, over) in &binds {
                // (As `ip netns exec`: a file that cannot be bound leaves the host's.)
                libc::mount(
                    file.as_ptr(),
                    over.as_ptr(),
                    none,
                    libc::MS_BIND,
                    std::ptr::null(),
                );
            }
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
