//! The `backplane` command. Each subcommand lives in its own file under `cmd/`.

mod cmd;

use clap::Parser;

fn main() {
    // A closed pipe (`backplane status | head`) ends us quietly, like any Unix filter.
    // SAFETY: restoring the default disposition of SIGPIPE is always sound.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = cmd::Cli::parse();
    if let Err(e) = cmd::run(cli) {
        eprintln!("backplane: {e:#}");
        std::process::exit(1);
    }
}
