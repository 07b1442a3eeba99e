//! `backplane down`: stop a fabric and remove every OS resource it created.

use backplane::fabric::launch::{self, Stopped};

use super::NameArg;

/// Arguments of `down`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    name: NameArg,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let name = &a.name.name;
    match launch::stop(name)? {
        Stopped::Clean => println!("fabric '{name}' is down"),
        Stopped::Stale => println!(
            "fabric '{name}' was not running; removed what a crashed supervisor left behind"
        ),
    }
    Ok(())
}
