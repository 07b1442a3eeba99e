//! Progress and warnings while a run goes: a progress bar on a terminal (stderr), one line per
//! path otherwise, and warnings that never garble the bar.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Where progress goes.
pub struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    /// A bar of `total` steps when stderr is a terminal; plain lines otherwise; nothing at all
    /// when `quiet`.
    pub fn new(total: u64, quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}",
                )
                .expect("static template"),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(200));
            b
        });
        Progress { bar, quiet }
    }

    /// A new phase (a path): the bar's message, or a line.
    pub fn phase(&self, msg: &str) {
        if crate::teardown::interrupted() {
            return;
        }
        match &self.bar {
            Some(b) => b.set_message(msg.to_string()),
            None if !self.quiet => eprintln!("bench: {msg}"),
            None => {}
        }
    }

    /// The current step within a phase (only shown on the bar).
    pub fn step(&self, msg: &str) {
        if let Some(b) = &self.bar {
            b.set_message(msg.to_string());
        }
    }

    /// Steps done.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
    }

    /// A warning: the run goes on.
    pub fn warn(&self, msg: &str) {
        if crate::teardown::interrupted() {
            return;
        }
        let line = format!("backplane: warning: {msg}");
        match &self.bar {
            Some(b) => b.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
