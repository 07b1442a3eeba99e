//! The link alone: a ping-pong of small messages over [`Link`] — the active messages with a
//! reply endpoint that the fabric's endpoints send between hosts, written in place
//! (`send_with`) and read where UCX received them (`poll_some_with`) — to put beside
//! `ucx_perftest -t tag_lat` between the same two hosts: what UCX costs the fabric before any
//! of its own layers (session 34: the same, median ~1.0 over 14 alternating pairs).
//!
//! ```sh
//! link_pingpong server PORT                   # on one host (UCX_TLS as for the fabric)
//! link_pingpong client IP:PORT [ITERS] [SIZE] # on the other: median and mean one way, µs
//! ```
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use backplane_ucx::{EpId, Event, Link};

fn usage() -> ExitCode {
    eprintln!("usage: link_pingpong server PORT | client IP:PORT [ITERS] [SIZE]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["server", port] => match port.parse::<u16>() {
            Ok(p) => serve(p),
            Err(_) => return usage(),
        },
        ["client", addr, rest @ ..] if rest.len() <= 2 => {
            let (Ok(addr), Ok(iters), Ok(size)) = (
                addr.parse::<SocketAddr>(),
                rest.first().map_or(Ok(20_000), |s| s.parse::<usize>()),
                rest.get(1).map_or(Ok(8), |s| s.parse::<usize>()),
            ) else {
                return usage();
            };
            client(addr, iters.max(1), size.clamp(1, 65536))
        }
        _ => return usage(),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("link_pingpong: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Sends every message back to whoever sent it, until killed.
fn serve(port: u16) -> Result<(), String> {
    let listen = SocketAddr::from(([0, 0, 0, 0], port));
    let mut link = Link::open(Some(listen)).map_err(|e| e.to_string())?;
    let mut events = Vec::new();
    // What goes back, and to whom: the bytes one after another (kept from turn to turn, so
    // that the server allocates nothing per message, as the fabric's endpoints do not).
    let (mut back, mut bytes): (Vec<(EpId, usize)>, Vec<u8>) = (Vec::new(), Vec::new());
    loop {
        let mut deliver = |from: Option<EpId>, msg: &[u8]| {
            let Some(ep) = from else { return false };
            back.push((ep, msg.len()));
            bytes.extend_from_slice(msg);
            true
        };
        link.poll_some_with(&mut events, &mut deliver);
        for ev in events.drain(..) {
            if let Event::Message(Some(ep), msg) = ev {
                back.push((ep, msg.len()));
                bytes.extend_from_slice(&msg);
            }
        }
        let mut at = 0;
        for (ep, len) in back.drain(..) {
            send(&mut link, ep, &bytes[at..at + len])?;
            at += len;
        }
        bytes.clear();
    }
}

fn send(link: &mut Link, ep: EpId, msg: &[u8]) -> Result<(), String> {
    link.send_with(ep, msg.len(), |buf| {
        buf.copy_from_slice(msg);
        Some(msg.len())
    })
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// `iters` round trips of `size` bytes after a tenth as many unmeasured.
fn client(addr: SocketAddr, iters: usize, size: usize) -> Result<(), String> {
    let mut link = Link::open(None).map_err(|e| e.to_string())?;
    let ep = link.connect(addr).map_err(|e| e.to_string())?;
    let msg = vec![7u8; size];
    let mut events = Vec::new();
    let warm = (iters / 10).max(100);
    let mut one_way = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        let start = Instant::now();
        send(&mut link, ep, &msg)?;
        let deadline = start + Duration::from_secs(10);
        loop {
            let mut got = false;
            let mut deliver = |_: Option<EpId>, _: &[u8]| {
                got = true;
                true
            };
            link.poll_some_with(&mut events, &mut deliver);
            for ev in events.drain(..) {
                match ev {
                    Event::Message(..) => got = true,
                    Event::Failed(_, e) => return Err(format!("{addr}: {e}")),
                    _ => {}
                }
            }
            if got {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("no answer from {addr} in 10 s"));
            }
        }
        if i >= warm {
            one_way.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    one_way.sort_by(f64::total_cmp);
    let mean = one_way.iter().sum::<f64>() / one_way.len() as f64;
    println!(
        "link one way, {size} B, {iters} round trips: median {:.3} us, mean {mean:.3} us",
        one_way[one_way.len() / 2]
    );
    Ok(())
}
