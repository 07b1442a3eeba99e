//! `backplane-fabricd`: a fabric's supervisor and node agents, for programs (and this crate's
//! tests) that start fabrics through `backplane::fabric::launch` without the `backplane`
//! command. Everything it does is `backplane::daemon`.
#![forbid(unsafe_code)]

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(backplane::daemon::main(&args));
}
