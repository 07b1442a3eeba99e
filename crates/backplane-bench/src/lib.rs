//! The backplane characterization lab: every data path measured side by side.
//!
//! - [`engine`]: sets up each path (the fabric's datagrams and the kernel and UCX baselines),
//!   runs the size sweeps, loss trials and zero-loss search, assembles the report;
//! - [`peer`]: the far side of each path, a `bench-peer` process driven over a pipe;
//! - [`drive`]: the client's sending and ping-pong loops, in the bench or in a client process;
//! - [`link`]: one trait over fabric datagrams, UDP, TCP and Unix sockets;
//! - [`stats`]: percentiles, jitter (FWHM), least-squares fits, confidence intervals;
//! - [`cpu`]: /proc/stat and getrusage accounting;
//! - [`memcpy`]: the physical limit (single-thread memcpy) and the `--load` writer;
//! - [`dma_path`]: the `fabric-raw` path, DMA jobs through the engine threads;
//! - [`netns`]: the veth pair between two namespaces;
//! - [`ucx`]: `ucx_perftest` runs (shared with `backplane perf`);
//! - [`perf_row`]: `backplane perf`'s rows: latency rows from histograms, UCX rows, medians
//!   over rounds;
//! - [`report`] and [`plot`]: JSON, CSV, Markdown, SVG and PNG;
//! - [`published`]: the seed documents' figures beside a `--link` run;
//! - [`teardown`]: nothing left behind, on error or Ctrl-C;
//! - [`progress`]: the progress bar.
#![deny(unsafe_code)]

pub mod cpu;
pub mod dma_path;
pub mod drive;
pub mod engine;
pub mod link;
pub mod memcpy;
pub mod netns;
pub mod peer;
pub mod perf_row;
pub mod pinning;
pub mod plot;
pub mod progress;
pub mod published;
pub mod report;
pub mod stats;
pub mod teardown;
pub mod ucx;
pub mod verbs_link;
