//! The `backplane` command. Each subcommand lives in its own file under `cmd/`; the few
//! system calls it makes itself are in `sys.rs`, the only module allowed unsafe code.
#![deny(unsafe_code)]

mod cmd;
#[allow(unsafe_code)]
mod sys;

use clap::Parser;

fn main() {
    sys::default_sigpipe();
    let cli = cmd::Cli::parse();
    let r = cmd::run(cli);
    if backplane_bench::teardown::interrupted() {
        // A signal ended the run and the clean-up thread is removing what it started (which
        // is likely why the command failed): it exits with 130 when done.
        loop {
            std::thread::park();
        }
    }
    if let Err(e) = r {
        eprintln!("backplane: {e:#}");
        std::process::exit(1);
    }
}
