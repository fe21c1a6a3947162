//! The TCP connection of the out-of-band exchange, with timeouts everywhere.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::thread;
use std::time::{Duration, Instant};

use super::error::PingpongError;
use super::wire::{Message, HEADER_LEN, MAX_PAYLOAD};

/// The control connection to the peer.
#[derive(Debug)]
pub struct Link {
    stream: TcpStream,
    timeout: Duration,
    peer: String,
    client: bool,
}

impl Link {
    /// Connects to `host:port`, retrying refused connections for up to
    /// `retry_for` (a server may still be starting). Reads then time out
    /// after `timeout`.
    pub fn connect(
        host: &str,
        port: u16,
        retry_for: Duration,
        timeout: Duration,
    ) -> Result<Link, PingpongError> {
        let target = format!("{host}:{port}");
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| PingpongError::Connect {
                addr: target.clone(),
                detail: format!("cannot resolve: {e}"),
            })?
            .collect();
        let start = Instant::now();
        let per_try = timeout
            .min(Duration::from_secs(5))
            .max(Duration::from_millis(100));
        loop {
            let mut last: Option<io::Error> = None;
            for a in &addrs {
                match TcpStream::connect_timeout(a, per_try) {
                    Ok(stream) => return Link::new(stream, timeout, target, true),
                    Err(e) => last = Some(e),
                }
            }
            let e = last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"));
            let retry = matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::TimedOut
                    | io::ErrorKind::WouldBlock
            );
            if !retry || start.elapsed() >= retry_for {
                let waited = start.elapsed();
                let detail = if waited >= Duration::from_millis(500) {
                    format!(
                        "{e} (tried for {:.1} s; is the server running?)",
                        waited.as_secs_f64()
                    )
                } else {
                    format!("{e} (is the server running?)")
                };
                return Err(PingpongError::Connect {
                    addr: target,
                    detail,
                });
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Listens on `port` (all addresses) and accepts one client within `timeout`.
    pub fn accept(port: u16, timeout: Duration) -> Result<Link, PingpongError> {
        let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| PingpongError::Io {
            what: format!("cannot listen on TCP port {port}"),
            source: e,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| PingpongError::Io {
                what: "listen".into(),
                source: e,
            })?;
        let deadline = Instant::now() + timeout;
        loop {
            match listener.accept() {
                Ok((stream, addr)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| PingpongError::Io {
                            what: "accept".into(),
                            source: e,
                        })?;
                    return Link::new(stream, timeout, addr.to_string(), false);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(PingpongError::Timeout {
                            what: format!("waiting for a client on TCP port {port}"),
                            secs: timeout.as_secs_f64(),
                        });
                    }
                    let mut pfd = libc::pollfd {
                        fd: listener.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    let ms = left.as_millis().clamp(1, 1000) as i32;
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut pfd, 1, ms) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(PingpongError::Io {
                        what: "accept".into(),
                        source: e,
                    })
                }
            }
        }
    }

    fn new(
        stream: TcpStream,
        timeout: Duration,
        peer: String,
        client: bool,
    ) -> Result<Link, PingpongError> {
        let io = |e| PingpongError::Io {
            what: "configuring the TCP connection".into(),
            source: e,
        };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
        Ok(Link {
            stream,
            timeout,
            peer,
            client,
        })
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether this side connected (the client).
    pub fn is_client(&self) -> bool {
        self.client
    }

    /// Sets how long reads wait.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), PingpongError> {
        self.timeout = timeout;
        self.stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| PingpongError::Io {
                what: "setting the read timeout".into(),
                source: e,
            })
    }

    fn io_error(&self, e: io::Error, what: &str) -> PingpongError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => PingpongError::Timeout {
                what: format!("waiting for the peer ({what})"),
                secs: self.timeout.as_secs_f64(),
            },
            io::ErrorKind::UnexpectedEof => PingpongError::PeerGone {
                detail: format!("the peer closed the connection ({what})"),
            },
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted => PingpongError::PeerGone {
                detail: format!("connection lost ({what}): {e}"),
            },
            _ => PingpongError::Io {
                what: what.to_string(),
                source: e,
            },
        }
    }

    /// Writes `bytes` in one call (perftest reads each message with a
    /// single `read`).
    pub fn write(&mut self, bytes: &[u8], what: &str) -> Result<(), PingpongError> {
        self.stream
            .write_all(bytes)
            .map_err(|e| self.io_error(e, what))
    }

    /// Reads exactly `buf.len()` bytes.
    pub fn read(&mut self, buf: &mut [u8], what: &str) -> Result<(), PingpongError> {
        self.stream
            .read_exact(buf)
            .map_err(|e| self.io_error(e, what))
    }

    /// perftest's exchange of equal-sized messages: the client writes first,
    /// the server reads first.
    pub fn xchg(
        &mut self,
        mine: &[u8],
        theirs: &mut [u8],
        what: &str,
    ) -> Result<(), PingpongError> {
        if self.client {
            self.write(mine, what)?;
            self.read(theirs, what)
        } else {
            self.read(theirs, what)?;
            self.write(mine, what)
        }
    }

    /// Sends a native frame.
    pub fn send(&mut self, m: &Message) -> Result<(), PingpongError> {
        self.write(&m.encode(), m.name())
    }

    /// Receives a native frame.
    pub fn recv(&mut self, what: &str) -> Result<Message, PingpongError> {
        let mut h = [0u8; HEADER_LEN];
        self.read(&mut h, what)?;
        let (kind, len) = Message::decode_header(&h)
            .map_err(|e| PingpongError::Protocol(format!("{e} ({what})")))?;
        debug_assert!(len <= MAX_PAYLOAD);
        let mut p = vec![0u8; len as usize];
        self.read(&mut p, what)?;
        Message::decode_payload(kind, &p)
            .map_err(|e| PingpongError::Protocol(format!("{e} ({what})")))
    }

    /// Whether the peer has closed the connection or it failed, without
    /// blocking and without consuming data: `Some(why)` if so.
    pub fn peer_gone(&self) -> Option<String> {
        let mut b = [0u8; 1];
        // SAFETY: a valid 1-byte buffer and our own socket.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => Some("the peer closed the TCP connection".into()),
            n if n > 0 => None,
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => None,
                    _ => Some(format!("TCP connection lost: {e}")),
                }
            }
        }
    }

    /// Reads whatever the peer still sends (up to `max` bytes, for at most
    /// `wait`) and ignores it: the tail of perftest's close.
    pub fn drain(&mut self, max: usize, wait: Duration) {
        let _ = self.stream.set_read_timeout(Some(wait));
        let mut buf = vec![0u8; max];
        let _ = self.stream.read(&mut buf);
    }
}

#[cfg(test)]
mod tests;
