//! One side of a data path under test, behind one trait so every measurement runs the same
//! code over fabric datagrams, UDP, TCP and Unix stream sockets.
//!
//! Datagram links carry messages larger than one datagram as consecutive datagrams; each
//! datagram starts with an 8-byte little-endian sequence number (the stamp) so the receiver
//! can count loss, duplicates and reordering. Stream links carry bytes.

use std::io::{self, Read, Write};
use std::net::UdpSocket;
use std::time::Duration;

use backplane::dgram::{Addr, DgramError, Endpoint, Wait};
use backplane::wire::MAX_DGRAM;

/// The largest UDP payload over IPv4.
pub const MAX_UDP: usize = 65_507;

/// Bytes of the sequence stamp at the start of every datagram.
pub const STAMP: usize = 8;

/// One side of a connected data path.
pub trait Link {
    /// Largest datagram, or `None` for a byte stream.
    fn max_dgram(&self) -> Option<usize>;
    /// Sends one datagram (at most `max_dgram` bytes) or, on a stream, all of `data`, waiting
    /// for room.
    fn send(&mut self, data: &[u8]) -> io::Result<()>;
    /// Sends one datagram without waiting: `Ok(false)` when the path did not accept it
    /// (full ring or socket buffer). Streams behave like `send`.
    fn try_send(&mut self, data: &[u8]) -> io::Result<bool> {
        self.send(data).map(|()| true)
    }
    /// Waits until everything sent so far has left (paths whose transport only moves when
    /// called, like the verbs engine, need this before the sender goes quiet).
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// Receives one datagram, or up to `max` bytes of a stream, and hands the bytes to `f`
    /// (in place where the path allows). `Ok(None)` if nothing arrived within `timeout`.
    fn recv(
        &mut self,
        timeout: Duration,
        max: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> io::Result<Option<usize>>;
}

/// Reads every cache line of a payload (one word per line), as a consumer would; returns a
/// checksum so the reads cannot be optimised away.
pub fn touch(p: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut i = 0;
    while i + 8 <= p.len() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&p[i..i + 8]);
        s = s.wrapping_add(u64::from_le_bytes(w));
        i += 64;
    }
    s.wrapping_add(p.len() as u64)
}

/// The datagram lengths a message of `size` bytes travels as over a path whose datagrams
/// hold at most `max` bytes: full datagrams, and a last one that is never shorter than a
/// stamp (when the message is at least that long), so every datagram carries one.
pub fn chunk_lens(size: usize, max: usize) -> impl Iterator<Item = usize> {
    assert!(max > 2 * STAMP);
    let full = size / max;
    let rest = size % max;
    let (full, tail) = if rest > 0 && rest < STAMP && full > 0 {
        // Borrow a stamp's worth from the last full datagram.
        (full - 1, Some([max - STAMP, rest + STAMP]))
    } else {
        (full, None)
    };
    let last = (rest > 0 && tail.is_none()) || size == 0;
    std::iter::repeat_n(max, full)
        .chain(tail.into_iter().flatten())
        .chain(last.then_some(rest))
}

/// The stamp at the start of a datagram, if it is long enough to carry one.
pub fn stamp_of(p: &[u8]) -> Option<u64> {
    p.get(..STAMP)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// Writes `seq` at the start of a datagram.
pub fn put_stamp(p: &mut [u8], seq: u64) {
    if p.len() >= STAMP {
        p[..STAMP].copy_from_slice(&seq.to_le_bytes());
    }
}

fn dgram_io(e: DgramError) -> io::Error {
    let kind = match e {
        DgramError::WouldBlock => io::ErrorKind::WouldBlock,
        DgramError::TimedOut => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

/// Sends one message of `data.len()` bytes over fabric datagrams (consecutive datagrams of at
/// most 64 KiB; an empty message is one empty datagram).
pub fn fabric_send_msg(
    ep: &mut Endpoint,
    to: Addr,
    data: &[u8],
    wait: Wait,
) -> Result<(), DgramError> {
    if data.len() <= MAX_DGRAM {
        return ep.send(to, data, wait);
    }
    // As one call: to a receiver on another host its datagrams go a few to a message.
    let chunks: Vec<&[u8]> = data.chunks(MAX_DGRAM).collect();
    ep.send_many(to, &chunks, wait)
}

/// Receives one message of `size` bytes over fabric datagrams, reading every byte in place
/// (zero-copy receive); returns a checksum of what it read.
pub fn fabric_recv_msg(ep: &mut Endpoint, size: u64, wait: Wait) -> Result<u64, DgramError> {
    let mut got = 0u64;
    let mut sum = 0u64;
    loop {
        let (n, s) = ep.recv_with(wait, |_, p| Ok((p.len() as u64, touch(p))))?;
        sum = sum.wrapping_add(s);
        got += n.max(1);
        if got >= size {
            return Ok(sum);
        }
    }
}

/// Receives a stream of `count` messages of `size` bytes sent by [`fabric_send_msg`] (each
/// one datagram, or `MAX_DGRAM`-byte ones and the rest), reading every byte in place, as many
/// datagrams a call as are there ([`Endpoint::recv_many_with`]: from another host every
/// datagram of a look, a batch's too, read where UCX received it); returns a checksum of
/// what it read.
pub fn fabric_recv_stream(
    ep: &mut Endpoint,
    size: u64,
    count: u64,
    wait: Wait,
) -> Result<u64, DgramError> {
    let mut left = size.div_ceil(MAX_DGRAM as u64).max(1) * count;
    let mut sum = 0u64;
    while left > 0 {
        let max = usize::try_from(left).unwrap_or(usize::MAX);
        let got = ep.recv_many_with(wait, max, |_, p| {
            sum = sum.wrapping_add(touch(p));
            Ok(())
        })?;
        left -= got as u64;
    }
    Ok(sum)
}

/// Fabric datagram endpoint connected to one peer address.
pub struct FabricLink {
    ep: Endpoint,
    peer: Addr,
}

impl FabricLink {
    /// A link from `ep` to `peer`.
    pub fn new(ep: Endpoint, peer: Addr) -> Self {
        FabricLink { ep, peer }
    }
}

impl Link for FabricLink {
    fn max_dgram(&self) -> Option<usize> {
        Some(MAX_DGRAM)
    }
    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        self.ep
            .send(self.peer, data, Wait::Forever)
            .map_err(dgram_io)
    }
    fn try_send(&mut self, data: &[u8]) -> io::Result<bool> {
        match self.ep.send(self.peer, data, Wait::Never) {
            Ok(()) => Ok(true),
            Err(DgramError::WouldBlock) => Ok(false),
            Err(e) => Err(dgram_io(e)),
        }
    }
    fn recv(
        &mut self,
        timeout: Duration,
        _max: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> io::Result<Option<usize>> {
        match self.ep.recv_with(Wait::For(timeout), |_, p| {
            f(p);
            Ok(p.len())
        }) {
            Ok(n) => Ok(Some(n)),
            Err(DgramError::TimedOut) | Err(DgramError::WouldBlock) => Ok(None),
            Err(e) => Err(dgram_io(e)),
        }
    }
}

/// A connected UDP socket.
pub struct UdpLink {
    sock: UdpSocket,
    buf: Vec<u8>,
    timeout: Option<Duration>,
    nonblocking: bool,
}

impl UdpLink {
    /// A link over `sock`, which must be connected to the peer.
    pub fn new(sock: UdpSocket) -> Self {
        UdpLink {
            sock,
            buf: vec![0u8; MAX_UDP + 1],
            timeout: None,
            nonblocking: false,
        }
    }

    fn blocking(&mut self, on: bool) -> io::Result<()> {
        if self.nonblocking == on {
            self.sock.set_nonblocking(!on)?;
            self.nonblocking = !on;
        }
        Ok(())
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl Link for UdpLink {
    fn max_dgram(&self) -> Option<usize> {
        Some(MAX_UDP)
    }
    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        self.blocking(true)?;
        loop {
            match self.sock.send(data) {
                Ok(_) => return Ok(()),
                // A full socket buffer on a blocking socket (ENOBUFS) or a peer not yet
                // listening (ECONNREFUSED from a previous ICMP): try again, as iperf does.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => std::thread::yield_now(),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    fn try_send(&mut self, data: &[u8]) -> io::Result<bool> {
        self.blocking(false)?;
        match self.sock.send(data) {
            Ok(_) => Ok(true),
            Err(e) if would_block(&e) || e.raw_os_error() == Some(libc::ENOBUFS) => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(false),
            Err(e) => Err(e),
        }
    }
    fn recv(
        &mut self,
        timeout: Duration,
        _max: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> io::Result<Option<usize>> {
        self.blocking(true)?;
        if self.timeout != Some(timeout) {
            self.sock
                .set_read_timeout(Some(timeout.max(Duration::from_micros(1))))?;
            self.timeout = Some(timeout);
        }
        match self.sock.recv(&mut self.buf) {
            Ok(n) => {
                f(&self.buf[..n]);
                Ok(Some(n))
            }
            Err(e) if would_block(&e) || e.kind() == io::ErrorKind::ConnectionRefused => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A byte stream (TCP or Unix domain) whose read timeout can be set.
pub trait Stream: Read + Write + Send {
    /// Sets the read timeout.
    fn set_timeout(&self, t: Duration) -> io::Result<()>;
}

impl Stream for std::net::TcpStream {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))
    }
}

impl Stream for std::os::unix::net::UnixStream {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))
    }
}

/// A connected byte stream.
pub struct StreamLink<S: Stream> {
    s: S,
    buf: Vec<u8>,
    timeout: Option<Duration>,
}

impl<S: Stream> StreamLink<S> {
    /// A link over a connected stream.
    pub fn new(s: S) -> Self {
        StreamLink {
            s,
            buf: vec![0u8; 256 << 10],
            timeout: None,
        }
    }
}

impl<S: Stream> Link for StreamLink<S> {
    fn max_dgram(&self) -> Option<usize> {
        None
    }
    fn send(&mut self, data: &[u8]) -> io::Result<()> {
        self.s.write_all(data)
    }
    fn recv(
        &mut self,
        timeout: Duration,
        max: usize,
        f: &mut dyn FnMut(&[u8]),
    ) -> io::Result<Option<usize>> {
        // A ping-pong asks for a slightly shorter timeout every round (the time left to its
        // deadline): the socket's is changed only when it is 10 % off, not with a system call
        // per message.
        let off = self
            .timeout
            .is_none_or(|t| timeout > t || timeout < t.mul_f64(0.9));
        if off {
            self.s.set_timeout(timeout.max(Duration::from_micros(1)))?;
            self.timeout = Some(timeout);
        }
        let max = max.clamp(1, self.buf.len());
        match self.s.read(&mut self.buf[..max]) {
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection",
            )),
            Ok(n) => {
                f(&self.buf[..n]);
                Ok(Some(n))
            }
            Err(e) if would_block(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_round_trip_and_short_datagrams_carry_none() {
        let mut d = [0u8; 16];
        put_stamp(&mut d, 0x0102_0304_0506_0708);
        assert_eq!(stamp_of(&d), Some(0x0102_0304_0506_0708));
        let mut short = [0u8; 4];
        put_stamp(&mut short, 9);
        assert_eq!(short, [0; 4]);
        assert_eq!(stamp_of(&short), None);
    }

    #[test]
    fn messages_split_into_datagrams_that_each_hold_a_stamp() {
        let v = |s, m| chunk_lens(s, m).collect::<Vec<_>>();
        assert_eq!(v(100, 64), [64, 36]);
        assert_eq!(v(128, 64), [64, 64]);
        assert_eq!(v(131, 64), [64, 56, 11]);
        assert_eq!(v(40, 64), [40]);
        assert_eq!(v(0, 64), [0]);
        assert_eq!(v(1 << 20, MAX_UDP).iter().sum::<usize>(), 1 << 20);
        assert!(v(1 << 20, MAX_UDP)
            .iter()
            .all(|&l| (STAMP..=MAX_UDP).contains(&l)));
    }

    #[test]
    fn touch_reads_one_word_per_cache_line() {
        let mut p = vec![0u8; 256];
        for line in 0..4 {
            p[line * 64] = 1;
            p[line * 64 + 8] = 100; // not read: not the first word of a line
        }
        assert_eq!(touch(&p), 4 + 256);
    }

    #[test]
    fn udp_and_stream_links_carry_bytes_between_two_sockets() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        a.connect(b.local_addr().unwrap()).unwrap();
        b.connect(a.local_addr().unwrap()).unwrap();
        let (mut a, mut b) = (UdpLink::new(a), UdpLink::new(b));
        let mut d = vec![7u8; 1000];
        put_stamp(&mut d, 42);
        a.send(&d).unwrap();
        let mut seen = None;
        let n = b
            .recv(Duration::from_secs(5), usize::MAX, &mut |p| {
                seen = stamp_of(p)
            })
            .unwrap();
        assert_eq!((n, seen), (Some(1000), Some(42)));
        assert_eq!(
            b.recv(Duration::from_millis(1), 1, &mut |_| ()).unwrap(),
            None
        );

        let (x, y) = std::os::unix::net::UnixStream::pair().unwrap();
        let (mut x, mut y) = (StreamLink::new(x), StreamLink::new(y));
        x.send(&[1u8; 5000]).unwrap();
        let mut got = 0;
        while got < 5000 {
            got += y
                .recv(Duration::from_secs(5), 5000 - got, &mut |_| ())
                .unwrap()
                .unwrap_or(0);
        }
        assert_eq!(got, 5000);
        drop(x);
        assert!(y.recv(Duration::from_secs(5), 10, &mut |_| ()).is_err());
    }
}
