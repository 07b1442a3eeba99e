//! The far side of every measured path: a `bench-peer` process.
//!
//! The bench starts one peer per path (on node 2 for the fabric, inside the second network
//! namespace for veth paths). The peer sets up its side of the path, prints one `ready` line
//! on stdout, and from then on takes commands as JSON lines on stdin and answers on stdout.
//! The control channel is a pipe, not the path under test, so a lossy path cannot lose a
//! command, and end of file on stdin (the bench died) ends the peer.
//!
//! Commands: `echo` (ping-pong: receive a message of `size` bytes, send one back), `sink`
//! (receive and count everything, with loss/duplicate/reorder accounting on datagram paths),
//! `stop` (finish the current operation, drain what the client says it sent, report), `quit`.

use std::io::{self, BufRead, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use backplane::dgram::{Addr, DgramError, Wait};
use backplane::fabric::Fabric;
use serde::{Deserialize, Serialize};

use crate::cpu::{mono_ns, Rusage, Who};
use crate::drive::{self, Sent};
use crate::link::{
    chunk_lens, put_stamp, stamp_of, touch, FabricLink, Link, StreamLink, UdpLink, MAX_UDP,
};
use crate::verbs_link::{Mode, VerbsLink};

/// Which kind of link a peer serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerKind {
    /// Fabric datagrams.
    Fabric,
    /// Fabric RDMA verbs: a stream of RDMA_WRITE_WITH_IMM.
    VerbsWrite,
    /// Fabric RDMA verbs: a stream of SENDs.
    VerbsSend,
    /// Fabric RDMA verbs: announced chunks pulled with RDMA_READ.
    VerbsRead,
    /// UDP.
    Udp,
    /// TCP.
    Tcp,
    /// Unix domain stream socket.
    Unix,
    /// The client side of TCP: connects to `at` and runs the bench's sending and ping-pong
    /// loops itself (`send`, `ping`), for a client that must be a process of its own.
    TcpClient,
}

impl PeerKind {
    /// The `--kind` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerKind::Fabric => "fabric",
            PeerKind::VerbsWrite => "verbs-write",
            PeerKind::VerbsSend => "verbs-send",
            PeerKind::VerbsRead => "verbs-read",
            PeerKind::Udp => "udp",
            PeerKind::Tcp => "tcp",
            PeerKind::Unix => "unix",
            PeerKind::TcpClient => "tcp-client",
        }
    }
    /// The verbs stream mode of a verbs kind.
    pub fn verbs_mode(self) -> Option<Mode> {
        match self {
            PeerKind::VerbsWrite => Some(Mode::WriteImm),
            PeerKind::VerbsSend => Some(Mode::Send),
            PeerKind::VerbsRead => Some(Mode::Read),
            _ => None,
        }
    }
    /// Parses the `--kind` spelling.
    pub fn parse(s: &str) -> Option<Self> {
        [
            PeerKind::Fabric,
            PeerKind::VerbsWrite,
            PeerKind::VerbsSend,
            PeerKind::VerbsRead,
            PeerKind::Udp,
            PeerKind::Tcp,
            PeerKind::Unix,
            PeerKind::TcpClient,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// Where the peer listens: the first line (JSON) on the peer's standard input, before any
/// command, so the compiler checks both ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerConfig {
    /// Link kind.
    pub kind: PeerKind,
    /// Fabric: fabric name. Sockets: address to bind (`IP:PORT`) or Unix socket path.
    pub at: String,
    /// Fabric: node slot.
    pub node: u32,
    /// Fabric: port.
    pub port: u32,
}

/// A command to the peer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Command {
    /// Ping-pong messages of `size` bytes.
    Echo {
        /// Message size.
        size: u64,
        /// Datagram paths: the first round's stamp; lower stamps are stragglers of an
        /// earlier operation and are ignored.
        #[serde(default)]
        base: u64,
    },
    /// Receive and count everything.
    Sink {
        /// Datagram paths: the first datagram's stamp; lower stamps are stragglers of an
        /// earlier operation and are neither counted nor tracked.
        #[serde(default)]
        base: u64,
    },
    /// Finish the operation. The client sent `sent_bytes` in `sent_dgrams` datagrams (0 on
    /// streams), the first `skip_bytes` of them warm-up. `lossy`: stop draining after a quiet
    /// spell instead of waiting for every byte.
    Stop {
        /// Bytes the client sent (accepted by the path).
        sent_bytes: u64,
        /// Datagrams the client sent (accepted by the path).
        sent_dgrams: u64,
        /// Warm-up bytes at the start, left out of the throughput window.
        skip_bytes: u64,
        /// Whether the path may lose data.
        lossy: bool,
    },
    /// A client (`tcp-client`): send messages of `size` bytes for `warm_ns` + `dur_ns`,
    /// answered with [`Reply::Client`].
    Send {
        /// Message size.
        size: u64,
        /// Measured time, nanoseconds.
        dur_ns: u64,
        /// Warm-up before it, nanoseconds.
        warm_ns: u64,
    },
    /// A client (`tcp-client`): ping-pong messages of `size` bytes for `warm_ns` + `dur_ns`,
    /// answered with [`Reply::Client`].
    Ping {
        /// Message size.
        size: u64,
        /// Measured time, nanoseconds.
        dur_ns: u64,
        /// Warm-up before it, nanoseconds.
        warm_ns: u64,
    },
    /// End the peer.
    Quit,
}

/// What a client process reports after `send` or `ping`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientRun {
    /// `send`: what was sent.
    pub sent: Sent,
    /// `ping`: one-way latencies in ns, as (value, count) pairs.
    pub latency: Vec<(u64, u64)>,
    /// CPU the client process used during the run (the library's threads included).
    pub cpu: Rusage,
    /// Elapsed time of the run.
    pub wall_ns: u64,
}

/// What the peer reports after `stop`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerResult {
    /// Bytes received.
    pub bytes: u64,
    /// Datagrams received (0 on streams).
    pub dgrams: u64,
    /// Distinct sequence stamps received.
    pub unique: u64,
    /// Datagrams whose stamp had been seen before.
    pub duplicates: u64,
    /// Datagrams that arrived after one with a higher stamp.
    pub reordered: u64,
    /// Messages echoed (`echo`).
    pub echoed: u64,
    /// Bytes received inside the throughput window (after `skip_bytes`).
    pub window_bytes: u64,
    /// Length of the throughput window, nanoseconds of the monotonic clock.
    pub window_ns: u64,
    /// CPU the peer process used during the operation.
    pub cpu: Rusage,
    /// Elapsed time from the start of the operation to the last data received.
    pub cpu_wall_ns: u64,
    /// Set when the peer stopped draining before receiving all the client sent.
    pub short: bool,
}

/// A peer's one-line reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reply {
    /// Set up; for socket paths the address to connect to.
    Ready {
        /// Address (`IP:PORT` or path), empty for the fabric.
        addr: String,
    },
    /// The operation started.
    Started,
    /// The operation's result.
    Done(PeerResult),
    /// A client's run (`send`, `ping`).
    Client(ClientRun),
    /// Something failed; the peer exits.
    Error {
        /// One line.
        message: String,
    },
}

fn say(r: &Reply) {
    let mut out = io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, r);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// How long the handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Runs a peer: set up, print `ready`, serve commands from stdin until `quit` or end of file.
/// The `bench-peer` process: reads its [`PeerConfig`] (the first line on standard input),
/// then serves commands until told to quit.
pub fn run_peer_from_stdin() -> anyhow::Result<()> {
    let mut line = String::new();
    io::stdin()
        .read_line(&mut line)
        .context("cannot read the bench peer's configuration")?;
    let cfg: PeerConfig =
        serde_json::from_str(&line).context("malformed bench peer configuration")?;
    run_peer(&cfg)
}

/// Serves one peer of configuration `cfg` (see [`run_peer_from_stdin`]).
pub fn run_peer(cfg: &PeerConfig) -> anyhow::Result<()> {
    match serve(cfg) {
        Ok(()) => Ok(()),
        Err(e) => {
            say(&Reply::Error {
                message: format!("{e:#}"),
            });
            Err(e)
        }
    }
}

fn serve(cfg: &PeerConfig) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel::<Command>();
    std::thread::spawn(move || {
        for line in io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            match serde_json::from_str::<Command>(&line) {
                Ok(c) => {
                    if tx.send(c).is_err() {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        let _ = tx.send(Command::Quit);
    });
    let _fabric; // kept alive as long as the endpoint
    let mut link: Box<dyn Link> = match cfg.kind {
        PeerKind::Fabric => {
            let f = Fabric::attach(&cfg.at)?;
            let mut ep = f.node(cfg.node)?.bind(cfg.port)?;
            say(&Reply::Ready {
                addr: String::new(),
            });
            let mut hello = [0u8; 16];
            let (_, client) = ep
                .recv(&mut hello, Wait::For(HANDSHAKE))
                .context("the bench client never said hello")?;
            ep.send(client, b"ok", Wait::Forever)?;
            _fabric = Some(f);
            Box::new(FabricLink::new(ep, client))
        }
        PeerKind::VerbsWrite | PeerKind::VerbsSend | PeerKind::VerbsRead => {
            let f = Fabric::attach(&cfg.at)?;
            say(&Reply::Ready {
                addr: String::new(),
            });
            let mode = cfg.kind.verbs_mode().expect("a verbs kind");
            let link = VerbsLink::accept(&f.node(cfg.node)?, cfg.port, mode, HANDSHAKE)
                .context("the bench client never connected")?;
            _fabric = Some(f);
            Box::new(link)
        }
        PeerKind::Udp => {
            _fabric = None;
            let s = UdpSocket::bind(&cfg.at).with_context(|| format!("cannot bind {}", cfg.at))?;
            say(&Reply::Ready {
                addr: s.local_addr()?.to_string(),
            });
            s.set_read_timeout(Some(HANDSHAKE))?;
            let mut hello = [0u8; 16];
            let (_, client) = s
                .recv_from(&mut hello)
                .context("the bench client never said hello")?;
            s.connect(client)?;
            s.send(b"ok")?;
            Box::new(UdpLink::new(s))
        }
        PeerKind::Tcp => {
            _fabric = None;
            let l =
                TcpListener::bind(&cfg.at).with_context(|| format!("cannot bind {}", cfg.at))?;
            say(&Reply::Ready {
                addr: l.local_addr()?.to_string(),
            });
            let (s, _) = l.accept()?;
            s.set_nodelay(true)?;
            Box::new(StreamLink::new(s))
        }
        PeerKind::TcpClient => {
            _fabric = None;
            let to: SocketAddr = cfg
                .at
                .parse()
                .with_context(|| format!("bad address {}", cfg.at))?;
            let s = std::net::TcpStream::connect_timeout(&to, HANDSHAKE)
                .with_context(|| format!("cannot connect to {to}"))?;
            s.set_nodelay(true)?;
            say(&Reply::Ready {
                addr: s.local_addr()?.to_string(),
            });
            Box::new(StreamLink::new(s))
        }
        PeerKind::Unix => {
            _fabric = None;
            let path = PathBuf::from(&cfg.at);
            let l = UnixListener::bind(&path)
                .with_context(|| format!("cannot bind {}", path.display()))?;
            say(&Reply::Ready {
                addr: cfg.at.clone(),
            });
            let (s, _) = l.accept()?;
            let _ = std::fs::remove_file(&path);
            Box::new(StreamLink::new(s))
        }
    };
    loop {
        let cmd = rx.recv().unwrap_or(Command::Quit);
        let r = match cmd {
            Command::Echo { size, base } => {
                say(&Reply::Started);
                echo(link.as_mut(), size, base, &rx)?
            }
            Command::Sink { base } => {
                say(&Reply::Started);
                sink(link.as_mut(), base, &rx)?
            }
            Command::Send {
                size,
                dur_ns,
                warm_ns,
            }
            | Command::Ping {
                size,
                dur_ns,
                warm_ns,
            } => {
                let (t0, cpu0) = (mono_ns(), Rusage::now(Who::Process));
                let (dur, warm) = (Duration::from_nanos(dur_ns), Duration::from_nanos(warm_ns));
                let (sent, latency) = if matches!(cmd, Command::Send { .. }) {
                    let sent = drive::send_for(link.as_mut(), size, 0, dur, warm)?;
                    (sent, Vec::new())
                } else {
                    let p = drive::ping_for(link.as_mut(), size, 0, dur, warm, false)?;
                    (Sent::default(), drive::hist_to_pairs(&p.hist))
                };
                say(&Reply::Client(ClientRun {
                    sent,
                    latency,
                    cpu: cpu0.until(&Rusage::now(Who::Process)),
                    wall_ns: mono_ns() - t0,
                }));
                continue;
            }
            Command::Stop { .. } => PeerResult::default(),
            Command::Quit => return Ok(()),
        };
        say(&Reply::Done(r));
    }
}

/// How often an idle peer looks for a command.
const POLL: Duration = Duration::from_millis(5);

/// Ping-pong: collect a message of `size` bytes, send one of `size` bytes back, until `stop`.
/// On datagram paths every datagram of round r carries stamp r; datagrams of older rounds
/// (late arrivals of a round the client gave up on) are ignored.
fn echo(
    link: &mut dyn Link,
    size: u64,
    base: u64,
    rx: &mpsc::Receiver<Command>,
) -> anyhow::Result<PeerResult> {
    let t0 = mono_ns();
    let cpu0 = Rusage::now(Who::Process);
    let mut reply = vec![0xC3u8; size as usize];
    let dgram = link.max_dgram();
    let (mut round, mut got, mut echoed, mut last) = (base, 0u64, 0u64, t0);
    let mut bytes = 0u64;
    loop {
        let want = (size - got).max(1) as usize;
        let mut stamp = None;
        let n = link.recv(POLL, want, &mut |p| {
            stamp = stamp_of(p);
            touch(p);
        })?;
        let Some(n) = n else {
            match rx.try_recv() {
                Ok(Command::Stop { .. })
                | Ok(Command::Quit)
                | Err(mpsc::TryRecvError::Disconnected) => break,
                _ => continue,
            }
        };
        bytes += n as u64;
        if dgram.is_some() {
            match stamp {
                // Shorter than a stamp: a stray hello (every chunk of a message carries one).
                None => continue,
                Some(s) if s < round => continue, // a late datagram of an abandoned round
                Some(s) if s > round => {
                    round = s;
                    got = 0;
                }
                Some(_) => {}
            }
        }
        got += n as u64;
        if got >= size {
            got = 0;
            match dgram {
                Some(m) => {
                    let mut off = 0;
                    for len in chunk_lens(size as usize, m) {
                        let c = &mut reply[off..off + len];
                        put_stamp(c, round);
                        link.send(c)?;
                        off += len;
                    }
                }
                None => link.send(&reply)?,
            }
            echoed += 1;
            last = mono_ns();
        }
    }
    Ok(PeerResult {
        bytes,
        echoed,
        cpu: cpu0.until(&Rusage::now(Who::Process)),
        cpu_wall_ns: last.saturating_sub(t0).max(1),
        ..PeerResult::default()
    })
}

/// Loss, duplicate and reorder accounting over sequence stamps.
#[derive(Debug, Default)]
pub struct SeqTracker {
    seen: Vec<u64>,
    max: Option<u64>,
    /// Distinct stamps seen.
    pub unique: u64,
    /// Stamps seen again.
    pub duplicates: u64,
    /// Stamps that arrived after a higher one.
    pub reordered: u64,
}

/// Stamps above this are not tracked (a bitmap of 2^32 bits would be 512 MiB).
const MAX_TRACKED: u64 = 1 << 32;

impl SeqTracker {
    /// Records one stamp.
    pub fn see(&mut self, s: u64) {
        if s >= MAX_TRACKED {
            return;
        }
        let (w, b) = ((s / 64) as usize, s % 64);
        if w >= self.seen.len() {
            self.seen.resize((w + 1).next_power_of_two(), 0);
        }
        if self.seen[w] & (1 << b) != 0 {
            self.duplicates += 1;
            return;
        }
        self.seen[w] |= 1 << b;
        self.unique += 1;
        match self.max {
            Some(m) if s < m => self.reordered += 1,
            _ => self.max = Some(s),
        }
    }
}

/// Receives and counts until `stop`, then drains what the client says it sent.
fn sink(
    link: &mut dyn Link,
    base: u64,
    rx: &mpsc::Receiver<Command>,
) -> anyhow::Result<PeerResult> {
    let t0 = mono_ns();
    let cpu0 = Rusage::now(Who::Process);
    let dgram = link.max_dgram().is_some();
    let mut seq = SeqTracker::default();
    let (mut bytes, mut dgrams) = (0u64, 0u64);
    // Clock samples (ns, cumulative bytes): read every 16 receptions or 64 KiB, kept every
    // 100 µs, so the throughput window can start where the warm-up bytes end.
    let mut samples: Vec<(u64, u64)> = vec![(t0, 0)];
    let mut last = (t0, 0u64);
    let (mut since_clock, mut bytes_since_clock) = (0u32, 0u64);
    let mut stop: Option<(Command, Instant)> = None;
    let max = if dgram { MAX_UDP + 1 } else { 256 << 10 };
    let mut short = false;
    loop {
        let mut stale = false;
        let n = link.recv(POLL, max, &mut |p| {
            if dgram {
                match stamp_of(p) {
                    Some(s) if s < base => stale = true,
                    Some(s) => seq.see(s - base),
                    None if p == b"hello" => return,
                    None => {}
                }
            }
            touch(p);
        })?;
        // A straggler of an earlier operation (a datagram path may deliver late) is not
        // part of this one.
        let n = n.filter(|_| !stale);
        match n {
            Some(n) => {
                bytes += n as u64;
                dgrams += dgram as u64;
                since_clock += 1;
                bytes_since_clock += n as u64;
                if since_clock >= 16 || bytes_since_clock >= 64 << 10 {
                    let now = mono_ns();
                    last = (now, bytes);
                    if now >= samples[samples.len() - 1].0 + 100_000 {
                        samples.push(last);
                    }
                    since_clock = 0;
                    bytes_since_clock = 0;
                }
            }
            None => {
                if since_clock > 0 {
                    // Went quiet with receptions not yet timed: time them now (at most 15
                    // small ones, so the error is a few hundred nanoseconds plus the poll).
                    last = (
                        mono_ns().saturating_sub(POLL.as_nanos() as u64).max(last.0),
                        bytes,
                    );
                    samples.push(last);
                    since_clock = 0;
                    bytes_since_clock = 0;
                }
                if stop.is_none() {
                    match rx.try_recv() {
                        Ok(c @ Command::Stop { .. }) => stop = Some((c, Instant::now())),
                        Ok(Command::Quit) | Err(mpsc::TryRecvError::Disconnected) => {
                            bail!("told to quit in the middle of an operation")
                        }
                        _ => {}
                    }
                }
            }
        }
        if let Some((
            Command::Stop {
                sent_bytes, lossy, ..
            },
            at,
        )) = &stop
        {
            if bytes >= *sent_bytes {
                break;
            }
            let quiet = if *lossy {
                Duration::from_millis(50)
            } else {
                Duration::from_secs(5)
            };
            if n.is_none() && at.elapsed() >= quiet {
                short = !*lossy;
                break;
            }
        }
    }
    if since_clock > 0 {
        last = (mono_ns(), bytes);
        samples.push(last);
    }
    let skip = match &stop {
        Some((Command::Stop { skip_bytes, .. }, _)) => *skip_bytes,
        _ => 0,
    };
    let start = samples
        .iter()
        .find(|(_, b)| *b >= skip)
        .copied()
        .unwrap_or(last);
    let (window_ns, window_bytes) = if last.0 > start.0 {
        (last.0 - start.0, last.1 - start.1)
    } else {
        // Everything arrived within one clock sample: fall back to the whole operation.
        (last.0.saturating_sub(t0).max(1), last.1)
    };
    Ok(PeerResult {
        bytes,
        dgrams,
        unique: seq.unique,
        duplicates: seq.duplicates,
        reordered: seq.reordered,
        echoed: 0,
        window_bytes,
        window_ns,
        cpu: cpu0.until(&Rusage::now(Who::Process)),
        cpu_wall_ns: last.0.saturating_sub(t0).max(1),
        short,
    })
}

/// The bench's handle on a running peer process.
pub struct PeerProc {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: io::BufReader<std::process::ChildStdout>,
    /// The address the peer reported in its `ready` line.
    pub addr: String,
    _guard: crate::teardown::Guard,
}

impl PeerProc {
    /// Starts `argv` (a `bench-peer` command line, possibly behind `ip netns exec`), hands it
    /// `cfg`, and waits for its `ready` line.
    pub fn spawn(argv: &[String], cfg: &PeerConfig) -> anyhow::Result<PeerProc> {
        let mut child = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start the bench peer ({})", argv[0]))?;
        let pid = child.id();
        let guard = crate::teardown::register(format!("bench peer {pid}"), move || {
            crate::teardown::kill_pid(pid)
        });
        let stdin = child.stdin.take().expect("piped");
        let stdout = io::BufReader::new(child.stdout.take().expect("piped"));
        let mut p = PeerProc {
            child,
            stdin,
            stdout,
            addr: String::new(),
            _guard: guard,
        };
        let mut line = serde_json::to_vec(cfg)?;
        line.push(b'\n');
        p.stdin
            .write_all(&line)
            .and_then(|()| p.stdin.flush())
            .context("the bench peer is gone")?;
        match p.reply()? {
            Reply::Ready { addr } => p.addr = addr,
            r => bail!("the bench peer said {r:?} instead of ready"),
        }
        Ok(p)
    }

    /// Sends a command.
    pub fn send(&mut self, c: &Command) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(c)?;
        line.push(b'\n');
        self.stdin
            .write_all(&line)
            .and_then(|()| self.stdin.flush())
            .context("the bench peer is gone")
    }

    /// Reads the next reply.
    pub fn reply(&mut self) -> anyhow::Result<Reply> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the bench peer exited unexpectedly");
        }
        match serde_json::from_str(&line).context("malformed reply from the bench peer")? {
            Reply::Error { message } => bail!("bench peer: {message}"),
            r => Ok(r),
        }
    }

    /// Starts an operation and waits until the peer runs it.
    pub fn start(&mut self, c: &Command) -> anyhow::Result<()> {
        self.send(c)?;
        match self.reply()? {
            Reply::Started => Ok(()),
            r => bail!("the bench peer said {r:?} instead of started"),
        }
    }

    /// Runs a client's `send` or `ping` and returns what it measured.
    pub fn run_client(&mut self, c: &Command) -> anyhow::Result<ClientRun> {
        self.send(c)?;
        match self.reply()? {
            Reply::Client(r) => Ok(r),
            r => bail!("the bench client said {r:?} instead of a result"),
        }
    }

    /// Stops the current operation and returns its result.
    pub fn stop(&mut self, c: &Command) -> anyhow::Result<PeerResult> {
        self.send(c)?;
        match self.reply()? {
            Reply::Done(r) => Ok(r),
            r => bail!("the bench peer said {r:?} instead of a result"),
        }
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.send(&Command::Quit);
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Client side of the handshake with a fabric peer: say hello until the peer is bound.
pub fn fabric_hello(ep: &mut backplane::dgram::Endpoint, peer: Addr) -> anyhow::Result<()> {
    fabric_hello_while(ep, peer, || true)
}

/// [`fabric_hello`], giving up as soon as `alive` says the peer's process is gone.
pub fn fabric_hello_while(
    ep: &mut backplane::dgram::Endpoint,
    peer: Addr,
    mut alive: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + HANDSHAKE;
    loop {
        match ep.send(peer, b"hello", Wait::Forever) {
            Ok(()) => break,
            Err(DgramError::Unreachable(_)) if Instant::now() < deadline && alive() => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(e).context("the bench peer did not come up"),
        }
    }
    let mut b = [0u8; 16];
    ep.recv(&mut b, Wait::For(HANDSHAKE))
        .context("the bench peer did not answer")?;
    Ok(())
}

/// Client side of the handshake with a UDP peer: hello until it answers (UDP may drop one).
pub fn udp_hello(s: &UdpSocket, peer: SocketAddr) -> anyhow::Result<()> {
    s.connect(peer)?;
    s.set_read_timeout(Some(Duration::from_millis(50)))?;
    let mut b = [0u8; 16];
    for _ in 0..200 {
        let _ = s.send(b"hello");
        if let Ok(2) = s.recv(&mut b) {
            if &b[..2] == b"ok" {
                return Ok(());
            }
        }
    }
    bail!("the UDP bench peer at {peer} never answered")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_tracker_counts_duplicates_and_reordering_but_not_loss() {
        let mut t = SeqTracker::default();
        for s in [0, 1, 2, 5, 3, 3, 4, 9, 9] {
            t.see(s);
        }
        assert_eq!(t.unique, 7); // 0 1 2 3 4 5 9 (6, 7, 8 lost)
        assert_eq!(t.duplicates, 2);
        assert_eq!(t.reordered, 2); // 3 and 4 came after 5
        t.see(u64::MAX);
        assert_eq!(t.unique, 7);
    }

    #[test]
    fn commands_and_replies_are_one_json_line_each() {
        let c = serde_json::to_string(&Command::Stop {
            sent_bytes: 10,
            sent_dgrams: 2,
            skip_bytes: 1,
            lossy: true,
        })
        .unwrap();
        assert!(c.starts_with(r#"{"op":"stop""#), "{c}");
        assert!(!c.contains('\n'));
        let r: Reply = serde_json::from_str(r#"{"ready":{"addr":"127.0.0.1:9"}}"#).unwrap();
        assert!(matches!(r, Reply::Ready { addr } if addr == "127.0.0.1:9"));
        assert_eq!(PeerKind::parse("unix"), Some(PeerKind::Unix));
        assert_eq!(PeerKind::parse("x"), None);
    }
}
