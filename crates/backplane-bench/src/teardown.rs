//! Leaving nothing behind: every resource a bench run creates (a temporary fabric, peer
//! processes, network namespaces, socket directories) registers how to remove it here.
//!
//! A [`Guard`] removes its resource when dropped, so errors unwind cleanly; on SIGINT,
//! SIGTERM or SIGHUP a watcher thread runs every action still registered (newest first) and
//! exits with 130, so Ctrl-C in the middle of a measurement also leaves nothing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Once};

type Action = Box<dyn FnOnce() + Send>;

static ACTIONS: Mutex<BTreeMap<u64, (String, Action)>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(1);
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Actions being run by a dropped guard right now (on whichever thread).
static RUNNING: AtomicU64 = AtomicU64::new(0);

/// Whether a signal is ending the run (output from the measuring thread is noise by then).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Removes one registered resource when dropped (or when a signal ends the run).
#[must_use = "the resource is removed when the guard is dropped"]
pub struct Guard {
    id: u64,
}

impl Guard {
    /// Forgets the action: the resource is left in place.
    pub fn disarm(self) {
        take(self.id);
        std::mem::forget(self);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Counted while it runs, so a signal's clean-up waits for it before the process exits.
        let Some((_, f)) = take_counted(self.id) else {
            return;
        };
        f();
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }
}

fn take(id: u64) -> Option<(String, Action)> {
    ACTIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id)
}

/// [`take`], counting the action as running in the same critical section.
fn take_counted(id: u64) -> Option<(String, Action)> {
    let mut a = ACTIONS.lock().unwrap_or_else(|e| e.into_inner());
    let got = a.remove(&id);
    if got.is_some() {
        RUNNING.fetch_add(1, Ordering::SeqCst);
    }
    got
}

/// Registers `f` to remove a resource described by `what`.
///
/// Once a signal is ending the run, the measuring thread goes on until the process exits, and
/// what it started after the clean-up ran outlived the run (the next round's `ucx_perftest`
/// server: one interrupted `perf --peer-via` in four; the next path's temporary fabric of
/// `bench`). So a registration then removes its resource at once (a process started just
/// before it) and the thread waits there for the exit: it starts nothing more (a fabric is
/// registered before it is started).
pub fn register(what: impl Into<String>, f: impl FnOnce() + Send + 'static) -> Guard {
    match register_unless(&INTERRUPTED, what, f) {
        Some(g) => g,
        None => loop {
            std::thread::park();
        },
    }
}

/// [`register`], or `None` once `ending` (a signal is ending the run: [`INTERRUPTED`]), `f`
/// run at once.
fn register_unless(
    ending: &AtomicBool,
    what: impl Into<String>,
    f: impl FnOnce() + Send + 'static,
) -> Option<Guard> {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    {
        let mut a = ACTIONS.lock().unwrap_or_else(|e| e.into_inner());
        // (Read under the lock the clean-up empties the map with: a registration it did not
        // see sees the flag, and counts as running before the lock is let go, so the
        // clean-up waits for it.)
        if !ending.load(Ordering::SeqCst) {
            a.insert(id, (what.into(), Box::new(f)));
            return Some(Guard { id });
        }
        RUNNING.fetch_add(1, Ordering::SeqCst);
    }
    f();
    RUNNING.fetch_sub(1, Ordering::SeqCst);
    None
}

/// Runs every registered action, newest first, then waits (up to 30 s) for actions other
/// threads' guards are running at that moment. Returns what it removed itself.
pub fn run_all() -> Vec<String> {
    let mut done = Vec::new();
    loop {
        let next = {
            let mut a = ACTIONS.lock().unwrap_or_else(|e| e.into_inner());
            a.pop_last()
        };
        match next {
            Some((_, (what, f))) => {
                f();
                done.push(what);
            }
            None => break,
        }
    }
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while RUNNING.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    done
}

/// Descriptions of the actions registered now.
pub fn pending() -> Vec<String> {
    ACTIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .map(|(w, _)| w.clone())
        .collect()
}

/// Sends SIGKILL to a process we started (by its pid, never by name) and reaps it, so no
/// zombie is left while this process goes on. Call it only while the child has not been
/// waited for (its pid cannot have been reused): disarm the guard after waiting yourself.
pub fn kill_pid(pid: u32) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::empty());
    }
}

/// Registers a child process to be killed and reaped (see [`kill_pid`]).
pub fn child(what: impl Into<String>, pid: u32) -> Guard {
    register(what, move || kill_pid(pid))
}

/// `Command::output` for a child that must not outlive an interrupted run: while it runs it is
/// registered to be killed and reaped.
pub trait OutputGuarded {
    /// Runs the command to completion like `output()`, stdout and stderr captured.
    fn output_guarded(&mut self, what: &str) -> std::io::Result<std::process::Output>;
}

impl OutputGuarded for std::process::Command {
    fn output_guarded(&mut self, what: &str) -> std::io::Result<std::process::Output> {
        use std::process::Stdio;
        let c = self.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let guard = child(format!("{what} {}", c.id()), c.id());
        let out = c.wait_with_output();
        guard.disarm(); // reaped by wait_with_output
        out
    }
}

/// [`OutputGuarded::output_guarded`] for a client whose server is the process `server`: if
/// the server is gone (exited, a zombie) for `grace` while the client still runs, the client
/// is killed — a `ucx_perftest` client whose server died mid-run waited forever (seen once
/// between two hosts, in the hosts test).
pub fn output_unless_server_gone(
    cmd: &mut std::process::Command,
    what: &str,
    server: u32,
    grace: std::time::Duration,
) -> std::io::Result<std::process::Output> {
    use std::process::Stdio;
    use std::sync::atomic::{AtomicBool, Ordering};
    let c = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let pid = c.id();
    let guard = child(format!("{what} {pid}"), pid);
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let watchdog = std::thread::spawn(move || {
        let mut gone_since: Option<std::time::Instant> = None;
        while !d.load(Ordering::Acquire) {
            // Third field of /proc/PID/stat: the state ('Z': exited, not reaped yet).
            let alive = std::fs::read_to_string(format!("/proc/{server}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
                })
                .unwrap_or(false);
            if alive {
                gone_since = None;
            } else if gone_since
                .get_or_insert_with(std::time::Instant::now)
                .elapsed()
                > grace
            {
                if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                    // Not reaped here: the client's pid stays ours until `wait_with_output`.
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    });
    let out = c.wait_with_output();
    done.store(true, Ordering::Release);
    let _ = watchdog.join();
    guard.disarm(); // reaped by wait_with_output
    out
}

/// Registers the temporary fabric `name` to be stopped (supervisor, agents, namespaces,
/// shared memory). Register it before starting the fabric, so no moment is uncovered, and
/// start it inside [`starting`]: a stop that comes while the start is under way waits for it
/// (stopped before its supervisor ran, the start went on and the fabric outlived the run —
/// `bench` interrupted in its first seconds left one in two tries of three).
pub fn fabric(name: &str) -> Guard {
    let n = name.to_string();
    register(format!("fabric {name}"), move || {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while is_starting(&n) && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = backplane::fabric::launch::stop(&n);
    })
}

/// Fabrics this process is starting right now (see [`starting`]).
static STARTING: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn is_starting(name: &str) -> bool {
    STARTING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|n| n == name)
}

/// Runs `start`, the start of the fabric `name` registered with [`fabric`]: a stop of it meanwhile
/// (a signal's clean-up) waits until `start` returned.
pub fn starting<R>(name: &str, start: impl FnOnce() -> R) -> R {
    struct Mark(String);
    impl Drop for Mark {
        fn drop(&mut self) {
            let mut s = STARTING.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = s.iter().position(|n| *n == self.0) {
                s.swap_remove(i);
            }
        }
    }
    STARTING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(name.to_owned());
    let _mark = Mark(name.to_owned());
    start()
}

/// Installs the SIGINT/SIGTERM/SIGHUP watcher (once per process). SIGPIPE is caught too, so
/// writing to a peer that the clean-up just killed is an error (EPIPE) the run unwinds from,
/// not the death of the process half-way through its clean-up: callers must handle EPIPE on
/// their own output from then on.
pub fn install_signal_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGPIPE, SIGTERM};
        let _ = signal_hook::flag::register(SIGPIPE, std::sync::Arc::new(AtomicBool::new(false)));
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                INTERRUPTED.store(true, Ordering::SeqCst);
                eprintln!("\nbackplane: interrupted (signal {sig}); cleaning up");
                run_all();
                // The measuring thread may be starting a process right now (its registration
                // then removes it at once, see `register`): a moment for it, and for that.
                std::thread::sleep(std::time::Duration::from_millis(100));
                run_all();
                std::process::exit(130);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;

    /// The tests take turns: `run_all` runs every action registered, another test's too.
    static SERIAL: Mutex<()> = Mutex::new(());

    #[test]
    fn guards_run_once_on_drop_or_run_all_and_disarmed_ones_never() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let n = Arc::new(AtomicU32::new(0));
        let c = n.clone();
        let g = register("test a", move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        drop(g);
        assert_eq!(n.load(Ordering::SeqCst), 1);

        let c = n.clone();
        let g = register("test b", move || {
            c.fetch_add(10, Ordering::SeqCst);
        });
        let c = n.clone();
        let d = register("test c", move || {
            c.fetch_add(100, Ordering::SeqCst);
        });
        d.disarm();
        let done = run_all();
        assert!(done.contains(&"test b".to_string()));
        drop(g); // already run: nothing more
        assert_eq!(n.load(Ordering::SeqCst), 11);
        assert!(!pending().contains(&"test c".to_string()));
    }

    #[test]
    fn once_interrupted_a_registration_removes_its_resource_at_once_and_gives_no_guard() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let n = Arc::new(AtomicU32::new(0));
        let c = n.clone();
        let ending = AtomicBool::new(true);
        let g = register_unless(&ending, "test late", move || {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert!(g.is_none(), "no guard: the caller waits for the exit");
        assert_eq!(n.load(Ordering::SeqCst), 1, "removed when registered");
        assert!(!pending().contains(&"test late".to_string()));
    }

    #[test]
    fn a_fabrics_stop_waits_for_its_start_under_way() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let name = "bp-teardown-test-start";
        let g = fabric(name);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            starting(name, || {
                tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
            })
        });
        rx.recv().unwrap();
        // (No such fabric runs: the stop itself finds nothing; what is timed is the wait.)
        let t0 = std::time::Instant::now();
        drop(g);
        assert!(
            t0.elapsed() >= std::time::Duration::from_millis(200),
            "stopped after {:?}, while its start was under way",
            t0.elapsed()
        );
        t.join().unwrap();
        assert!(!is_starting(name));
    }

    #[test]
    fn a_client_whose_server_is_gone_is_killed_not_waited_for() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut server = std::process::Command::new("true").spawn().unwrap();
        let pid = server.id();
        server.wait().unwrap(); // gone
        let t0 = std::time::Instant::now();
        let out = output_unless_server_gone(
            std::process::Command::new("sleep").arg("60"),
            "test client",
            pid,
            std::time::Duration::from_millis(200),
        )
        .unwrap();
        assert!(!out.status.success(), "{out:?}");
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "waited {:?}",
            t0.elapsed()
        );
    }
}
