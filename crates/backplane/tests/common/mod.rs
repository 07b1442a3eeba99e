//! Shared harness for the library's multi-process tests: fabrics started and stopped through
//! `backplane::fabric::launch` with this crate's `backplane-fabricd` (no CLI involved),
//! leftovers found, and this test binary re-run as a child process playing a role.
#![allow(dead_code)]

use std::path::PathBuf;

use backplane::fabric::launch::{self, Options};

mod shared;
pub use shared::*;

/// The fabric processes' executable, built with this crate.
pub const FABRICD: &str = env!("CARGO_BIN_EXE_backplane-fabricd");

/// A copy of a memory region's bytes (regions are read by copy: peers may write them).
pub fn bytes(mr: &backplane::verbs::Mr) -> Vec<u8> {
    mr.to_vec(0, mr.len())
        .expect("a region holds its own length")
}

/// A running fabric without networking (8 MiB windows), stopped on drop.
pub struct Fab {
    pub name: String,
}

impl Fab {
    /// A fabric of `nodes` nodes whose dead agents are restarted after a second.
    pub fn up(test: &str, nodes: u32) -> Fab {
        Self::up_restarting(test, nodes, 1000)
    }

    /// A fabric restarting a dead agent after `restart_delay_ms` (0: it stays DOWN).
    pub fn up_restarting(test: &str, nodes: u32, restart_delay_ms: u64) -> Fab {
        let name = name(test);
        let o = Options {
            window_size: 8 << 20,
            restart_delay_ms,
            ..Options::new(&name, nodes, PathBuf::from(FABRICD))
        };
        if let Err(e) = launch::start(&o) {
            panic!("fabric {name} did not start: {e}");
        }
        Fab { name }
    }

    /// The status report, as `backplane status --json` prints it.
    pub fn status(&self) -> serde_json::Value {
        let f = backplane::fabric::Fabric::attach(&self.name).expect("attach");
        serde_json::to_value(f.status().expect("status")).expect("status JSON")
    }

    pub fn supervisor_pid(&self) -> i32 {
        self.status()["supervisor_pid"].as_i64().unwrap() as i32
    }
}

impl Drop for Fab {
    fn drop(&mut self) {
        let _ = launch::stop(&self.name);
    }
}
