//! A run: the session and its driver, one size after another. Setup of the
//! verbs objects is in [`resources`], the exchange of endpoints in
//! [`handshake`], the measured loops in [`mod@send_lat`] and
//! [`mod@write`], waiting for completions in [`completion`], the data check
//! in [`check`] and the output in [`output`].

mod check;
mod completion;
mod handshake;
mod output;
mod resources;
mod send_lat;
#[cfg(test)]
mod tests;
mod write;

use std::io::Write;
use std::time::Duration;

use ibvx::verbs::{Mtu, RemoteAddr, RemoteQp};

use super::clock::Clock;
use super::error::PingpongError;
use super::net::Link;
use super::options::{Options, TestKind};
use super::perftest::{self, KeyMsg, PerftestBwReport};
use super::stats::{self, BwStats, LatencyStats, RecordContext, RESULT_LINE};
use super::wire::{Message, MAGIC};

pub use check::{check_slots, pattern};
use completion::Watch;
use handshake::{unexpected, Remote};
use resources::{setup, Resources};
use send_lat::send_lat;
use write::write_lat;

/// With `--check`, the bandwidth test spreads its writes over slots of a
/// region of this size (or of the message size, if larger).
pub const CHECK_REGION: usize = 16 << 20;

/// Pattern seeds of the two sides (`--check`).
const CLIENT_SEED: u8 = 0x5a;
const SERVER_SEED: u8 = 0xa5;

/// Work request id of receives.
const RECV_WR_ID: u64 = u64::MAX;

/// Which protocol the peer speaks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PeerKind {
    /// Another `ibvx-pingpong`.
    Ibvx,
    /// perftest, with the version it announced.
    Perftest {
        /// Its version number.
        version: f64,
    },
}

impl PeerKind {
    fn name(&self) -> String {
        match self {
            PeerKind::Ibvx => "ibvx-pingpong".into(),
            PeerKind::Perftest { version } => format!("perftest {version:.2}"),
        }
    }
}

/// One result row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowStats {
    /// A latency test's statistics.
    Latency(LatencyStats),
    /// A bandwidth test's statistics.
    Bandwidth(BwStats),
}

/// The result of one message size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// Message size.
    pub size: usize,
    /// Iterations.
    pub iters: u64,
    /// Statistics.
    pub stats: RowStats,
}

impl Row {
    /// A bandwidth row from the figures a peer reported (either handshake).
    fn bandwidth(size: u64, iters: u64, peak: f64, avg: f64, msg_rate: f64) -> Row {
        Row {
            size: size as usize,
            iters,
            stats: RowStats::Bandwidth(BwStats {
                peak,
                avg,
                msg_rate,
            }),
        }
    }
}

/// The running session.
struct Session<'a> {
    o: &'a Options,
    r: Resources,
    link: Link,
    peer: PeerKind,
    remote: Remote,
    path_mtu: Mtu,
    clock: Clock,
    out: &'a mut dyn Write,
    rec: RecordContext,
    rows: Vec<Row>,
    /// perftest: this side's key message, repeated at every handshake.
    key: KeyMsg,
    /// perftest write_bw client: the last size's report.
    last_bw: Option<PerftestBwReport>,
}

/// Runs the test `o` describes (client or server), writing perftest-style
/// tables (or JSON lines) to `out`; returns the rows.
pub fn run(o: &Options, out: &mut dyn Write) -> Result<Vec<Row>, PingpongError> {
    let clock = Clock::new();
    let r = setup(o)?;
    let mut link = match &o.host {
        Some(h) => Link::connect(h, o.port, o.connect_timeout, o.timeout)?,
        None => Link::accept(o.port, o.timeout)?,
    };
    let (peer, first) = if o.is_client() {
        (
            if o.perftest {
                PeerKind::Perftest { version: 0.0 }
            } else {
                PeerKind::Ibvx
            },
            None,
        )
    } else {
        // The client writes first; its first 16 bytes tell the protocol.
        let mut first = [0u8; 16];
        link.read(&mut first, "the client's greeting")?;
        if first == MAGIC {
            (PeerKind::Ibvx, Some(first))
        } else if let Some(v) = perftest::parse_version(&first) {
            (PeerKind::Perftest { version: v }, Some(first))
        } else {
            return Err(PingpongError::Protocol(format!(
                "the client is neither ibvx-pingpong nor perftest (greeting {:?})",
                String::from_utf8_lossy(&first)
            )));
        }
    };
    let rec = RecordContext {
        test: o.test.name().into(),
        role: if o.is_client() { "client" } else { "server" }.into(),
        peer: String::new(),
        device: r.device.clone(),
    };
    let mut s = Session {
        o,
        link,
        peer,
        remote: Remote {
            qp: RemoteQp {
                qpn: 0,
                psn: 0,
                lid: 0,
                gid: None,
            },
            region: RemoteAddr::default(),
            len: 0,
            window: o.window(),
        },
        path_mtu: r.local.active_mtu,
        r,
        clock,
        out,
        rec,
        rows: Vec::new(),
        key: KeyMsg::default(),
        last_bw: None,
    };
    match s.peer {
        PeerKind::Ibvx => s.native_handshake(first)?,
        PeerKind::Perftest { .. } => s.perftest_handshake(first)?,
    }
    s.rec.peer = s.peer.name();
    s.print_header()?;
    for (k, size) in o.sizes().into_iter().enumerate() {
        s.one_size(k, size)?;
    }
    s.finish()?;
    Ok(s.rows)
}

impl Session<'_> {
    fn client(&self) -> bool {
        self.o.is_client()
    }

    fn seeds(&self) -> (u8, u8) {
        if self.client() {
            (CLIENT_SEED, SERVER_SEED)
        } else {
            (SERVER_SEED, CLIENT_SEED)
        }
    }

    /// The synchronization before size number `k`.
    fn sync_before(&mut self, k: usize) -> Result<(), PingpongError> {
        match self.peer {
            PeerKind::Ibvx => {
                let tag = k as u32 + 1;
                let what = format!("synchronizing before size #{}", k + 1);
                let got = if self.client() {
                    self.link.send(&Message::Sync(tag))?;
                    self.link.recv(&what)?
                } else {
                    let got = self.link.recv(&what)?;
                    self.link.send(&Message::Sync(tag))?;
                    got
                };
                match got {
                    Message::Sync(t) if t == tag => Ok(()),
                    m => Err(PingpongError::Protocol(format!(
                        "expected Sync({tag}), got {m:?}"
                    ))),
                }
            }
            PeerKind::Perftest { .. } if self.o.test == TestKind::SendLat => {
                self.key_xchg("the per-size synchronization").map(|_| ())
            }
            PeerKind::Perftest { .. } => Ok(()),
        }
    }

    fn watch(&self) -> Watch {
        Watch::new(self.clock.cycles_per_us(), self.o.timeout)
    }

    fn one_size(&mut self, k: usize, size: usize) -> Result<(), PingpongError> {
        let native = self.peer == PeerKind::Ibvx;
        let bw_server = self.o.test == TestKind::WriteBw && !self.client();
        if bw_server && native {
            // The client's last write of the size carries an immediate.
            // SAFETY: no scatter/gather entry: the receive names no memory.
            unsafe { self.r.qp.post_recv(RECV_WR_ID, &[])? };
        }
        // The bandwidth client's write slots (several only with --check).
        let slots = if self.o.check {
            check_slots(self.o.window(), size)
        } else {
            1
        };
        if self.o.test == TestKind::WriteBw
            && self.client()
            && (slots * size) as u64 > self.remote.len
        {
            return Err(PingpongError::Setup(format!(
                "the server's region of {} bytes cannot hold {slots} x {size} bytes",
                self.remote.len
            )));
        }
        self.sync_before(k)?;
        let mut w = self.watch();
        match self.o.test {
            TestKind::SendLat | TestKind::WriteLat => self.one_size_latency(size, &mut w),
            TestKind::WriteBw if self.client() => {
                self.one_size_bw_client(size, native, slots, &mut w)
            }
            TestKind::WriteBw => self.one_size_bw_server(size, native, &mut w),
        }
    }

    /// The measured loop of a latency test for `size`-byte messages, and its
    /// row.
    fn one_size_latency(&mut self, size: usize, w: &mut Watch) -> Result<(), PingpongError> {
        let seeds = self.seeds();
        let stamps = if self.o.test == TestKind::SendLat {
            send_lat(&mut self.r, &self.link, w, self.o, size, seeds)?
        } else {
            write_lat(
                &mut self.r,
                &self.link,
                w,
                self.o,
                size,
                seeds,
                self.remote.region,
            )?
        };
        let rate = self.clock.cycles_per_us();
        let s = stats::latency_stats(&stamps, rate)
            .ok_or_else(|| PingpongError::Setup("too few iterations for statistics".into()))?;
        self.emit_row(Row {
            size,
            iters: self.o.iters,
            stats: RowStats::Latency(s),
        })
    }

    fn finish(&mut self) -> Result<(), PingpongError> {
        match self.peer {
            PeerKind::Ibvx => {
                if self.client() {
                    self.link.send(&Message::Bye)?;
                    self.expect_bye()?;
                } else {
                    self.expect_bye()?;
                    self.link.send(&Message::Bye)?;
                }
            }
            PeerKind::Perftest { .. } => match self.o.test {
                TestKind::SendLat => {
                    self.key_xchg("the closing handshake")?;
                    self.perftest_done();
                }
                TestKind::WriteLat => {}
                TestKind::WriteBw => {
                    if !self.client() {
                        // Waits while perftest's client runs every size.
                        let sizes = self.o.sizes().len() as u32;
                        self.link.set_timeout(self.o.timeout * sizes)?;
                    }
                    self.key_xchg("the end-of-test handshake")?;
                    let mine = self.last_bw.unwrap_or(PerftestBwReport {
                        size: 0,
                        iters: 0,
                        bw_peak: 0.0,
                        bw_avg: 0.0,
                        msg_rate: 0.0,
                    });
                    let mut theirs = [[0u8; 8]; 5];
                    for (m, t) in mine.fields().iter().zip(theirs.iter_mut()) {
                        self.link.xchg(m, t, "the bandwidth report exchange")?;
                    }
                    if !self.client() {
                        let r = PerftestBwReport::from_fields(&theirs);
                        self.emit_row(Row::bandwidth(
                            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate,
                        ))?;
                    }
                    self.key_xchg("the closing handshake")?;
                    self.perftest_done();
                }
            },
        }
        if !self.o.json {
            self.emit(&format!("{RESULT_LINE}\n"))?;
        }
        Ok(())
    }

    fn expect_bye(&mut self) -> Result<(), PingpongError> {
        match self.link.recv("the end of the run")? {
            Message::Bye => Ok(()),
            m => Err(unexpected("Bye", &m)),
        }
    }

    /// perftest's close: each side writes "done" and closes.
    fn perftest_done(&mut self) {
        let _ = self.link.write(perftest::DONE, "done");
        self.link
            .drain(perftest::DONE.len(), Duration::from_millis(200));
    }
}
