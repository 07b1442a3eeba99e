//! The `backplane` command. Each subcommand lives in its own file under `cmd/`.

mod cmd;

use clap::Parser;

fn main() {
    // A closed pipe (`backplane status | head`) ends us quietly, like any Unix filter.
    // SAFETY: restoring the default disposition of SIGPIPE is always sound.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
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
