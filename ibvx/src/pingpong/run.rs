//! A run: resources, handshake, the measured loops and the output.

use std::io::Write;
use std::time::Duration;

use crate::verbs::{
    Access, CompletionChannel, CompletionQueue, Context, Gid, InitAttr, MemoryRegion, Mtu,
    PortAddress, ProtectionDomain, QpCaps, QueuePair, RemoteAddr, RemoteQp, SendFlags, SendOp,
    SendRequest, WcOpcode, WorkCompletion,
};

use super::clock::{cycles, Clock};
use super::error::PingpongError;
use super::net::Link;
use super::options::{Options, TestKind};
use super::perftest::{self, KeyMsg, PerftestBwReport};
use super::stats::{
    self, BwStats, LatencyStats, RecordContext, BW_HEADER, LAT_HEADER, RESULT_LINE,
};
use super::wire::{self, BwReport, Endpoint, Hello, Message, MAGIC};

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

/// The verbs objects of a run.
struct Resources {
    local: PortAddress,
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    send_mr: MemoryRegion<'static>,
    recv_mr: MemoryRegion<'static>,
    psn: u32,
    inline_max: u32,
    device: String,
}

impl Resources {
    /// Whether `size`-byte messages are sent inline.
    fn inline(&self, size: usize) -> bool {
        self.inline_max > 0 && size <= self.inline_max as usize
    }
}

fn setup(o: &Options) -> Result<Resources, PingpongError> {
    let ctx = Context::open(o.ib_dev.as_deref())?;
    let local = ctx.port_address(o.ib_port, o.gid_index)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let channels = if o.events {
        Some((CompletionChannel::new(&ctx)?, CompletionChannel::new(&ctx)?))
    } else {
        None
    };
    let max = o.max_size();
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let (send_len, recv_len, recv_access) = match (o.test, o.is_client()) {
        (TestKind::SendLat, _) => (max, max, Access::LOCAL_WRITE),
        (TestKind::WriteLat, _) => (max, max, rw),
        (TestKind::WriteBw, true) => (if o.check { max.max(CHECK_REGION) } else { max }, 4096, rw),
        (TestKind::WriteBw, false) => (
            4096,
            if o.check {
                max.max(CHECK_REGION)
            } else {
                max.max(8192)
            },
            rw,
        ),
    };
    let send_mr = MemoryRegion::alloc(&pd, send_len, Access::LOCAL_WRITE)?;
    let recv_mr = MemoryRegion::alloc(&pd, recv_len, recv_access)?;
    let max_wr = ctx.max_qp_wr().max(1);
    let send_wr = match o.test {
        TestKind::WriteBw => o.window() + 1,
        _ => 16,
    }
    .min(max_wr);
    let recv_wr = match o.test {
        TestKind::SendLat => o.rx_depth,
        _ => 16,
    }
    .min(max_wr);
    let send_cq = CompletionQueue::new(&ctx, send_wr + 1, channels.as_ref().map(|c| &c.0))?;
    let recv_cq = CompletionQueue::new(&ctx, recv_wr + 1, channels.as_ref().map(|c| &c.1))?;
    let caps = QpCaps {
        max_send_wr: send_wr,
        max_recv_wr: recv_wr,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: o.inline_size,
    };
    let qp = QueuePair::new_rc(&pd, &send_cq, &recv_cq, caps, false).map_err(|e| {
        if o.inline_size > 0 {
            PingpongError::Setup(format!(
                "{e} (with --inline-size {}; the device may allow less)",
                o.inline_size
            ))
        } else {
            e.into()
        }
    })?;
    qp.modify_to_init(&InitAttr {
        port: o.ib_port,
        pkey_index: 0,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    })?;
    let inline_max = o.inline_size.min(qp.caps().max_inline_data);
    if o.test == TestKind::SendLat {
        for _ in 0..recv_wr {
            // SAFETY: `recv_mr` is the tool's own region, moved into the
            // `Resources` with the QP and dropped after it (field order),
            // and only ever read through its raw-pointer accessors
            // (`verify`), never lent out. Like perftest, every receive
            // targets the whole region: the peer sends its next message only
            // after ours, so one receive at a time is written.
            unsafe { qp.post_recv(RECV_WR_ID, &[recv_mr.sge(0, recv_mr.len())])? };
        }
    }
    Ok(Resources {
        local,
        qp,
        send_cq,
        recv_cq,
        send_mr,
        recv_mr,
        psn: crate::verbs::random_psn(),
        inline_max,
        device: ctx.name().to_string(),
    })
}

/// What this side knows about the peer after the handshake.
#[derive(Debug, Clone, Copy)]
struct Remote {
    qp: RemoteQp,
    /// The region this side RDMA-writes into.
    region: RemoteAddr,
    /// Its length (perftest does not say: assumed large enough).
    len: u64,
    /// The peer's bandwidth window (native only; slots of `--check`).
    window: u32,
}

/// Deadline and peer watch of one measured phase.
struct Watch {
    deadline: u64,
    next_peek: u64,
    peek_every: u64,
    timeout: Duration,
}

impl Watch {
    fn new(cycles_per_us: f64, timeout: Duration) -> Watch {
        let now = cycles();
        let peek_every = (cycles_per_us * 50_000.0) as u64; // 50 ms
        Watch {
            deadline: now.saturating_add((timeout.as_secs_f64() * 1e6 * cycles_per_us) as u64),
            next_peek: now + peek_every,
            peek_every,
            timeout,
        }
    }

    /// Fails when the phase has run out of time or the peer has gone.
    #[cold]
    fn check(&mut self, link: &Link, what: &dyn Fn() -> String) -> Result<(), PingpongError> {
        let now = cycles();
        if now >= self.deadline {
            return Err(PingpongError::Timeout {
                what: what(),
                secs: self.timeout.as_secs_f64(),
            });
        }
        if now >= self.next_peek {
            self.next_peek = now + self.peek_every;
            if let Some(why) = link.peer_gone() {
                return Err(PingpongError::PeerGone {
                    detail: format!("{why} ({})", what()),
                });
            }
        }
        Ok(())
    }
}

/// A failed verbs call during a run; reported as the peer's departure when
/// the control connection shows it has gone.
fn run_error(link: &Link, context: String, e: crate::verbs::Error) -> PingpongError {
    match link.peer_gone() {
        Some(why) => PingpongError::PeerGone {
            detail: format!("{why} ({context}: {e})"),
        },
        None => PingpongError::Run { context, source: e },
    }
}

/// Waits for one completion on `cq` (polling, or sleeping on its channel
/// with `events`), checking the watch, and checks its status.
fn wait_wc(
    cq: &CompletionQueue,
    events: bool,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<WorkCompletion, PingpongError> {
    wait_wc_idle(cq, events, None, w, link, what)
}

/// [`wait_wc`], sleeping `idle` between empty polls when given (for waits
/// that are not measured: a spinning process would take a CPU from the
/// kernel's soft-RoCE work on a small machine).
fn wait_wc_idle(
    cq: &CompletionQueue,
    events: bool,
    idle: Option<Duration>,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<WorkCompletion, PingpongError> {
    let mut wc = [WorkCompletion::default()];
    let mut spins = 0u32;
    loop {
        if poll_armed(cq, &mut wc, events, link, what)? == 1 {
            wc[0].ok().map_err(|e| run_error(link, what(), e))?;
            return Ok(wc[0]);
        }
        if events {
            wait_armed(cq, w, link, what)?;
        } else if let Some(pause) = idle {
            std::thread::sleep(pause);
            w.check(link, what)?;
        } else {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                w.check(link, what)?;
            }
        }
    }
}

/// Polls `cq` into `wcs` and returns how many completions it took. With
/// `events`, an empty poll arms the queue and polls once more: a completion
/// that arrived before the arming raises no event, so only after a second
/// empty poll may the caller sleep ([`wait_armed`]).
#[inline]
fn poll_armed(
    cq: &CompletionQueue,
    wcs: &mut [WorkCompletion],
    events: bool,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<usize, PingpongError> {
    let n = cq.poll(wcs).map_err(|e| run_error(link, what(), e))?;
    if n > 0 || !events {
        return Ok(n);
    }
    cq.req_notify(false)
        .map_err(|e| run_error(link, what(), e))?;
    cq.poll(wcs).map_err(|e| run_error(link, what(), e))
}

/// Sleeps on the channel of `cq` (armed by [`poll_armed`]) for up to 50 ms,
/// checking the watch when no event came.
fn wait_armed(
    cq: &CompletionQueue,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<(), PingpongError> {
    let woke = cq
        .wait_event(Some(Duration::from_millis(50)))
        .map_err(|e| run_error(link, what(), e))?;
    if !woke {
        w.check(link, what)?;
    }
    Ok(())
}

/// Byte `j` of message `iter` from the side with `seed` (`--check`).
#[inline]
pub fn pattern(seed: u8, iter: u64, j: usize) -> u8 {
    (iter as u8).wrapping_mul(31).wrapping_add(seed)
        ^ (j as u8).wrapping_mul(7)
        ^ ((j >> 8) as u8).wrapping_mul(13)
}

fn fill(mr: &mut MemoryRegion<'_>, offset: usize, len: usize, seed: u8, iter: u64) {
    mr.fill(offset, len, |j| pattern(seed, iter, j));
}

/// Checks that `len` bytes at `offset` hold message `iter` of the side with
/// `seed`. Runs once per message with `--check`: it allocates nothing, and
/// `what` (the context of the error) is only formatted on a mismatch.
fn verify(
    mr: &MemoryRegion<'_>,
    offset: usize,
    len: usize,
    seed: u8,
    iter: u64,
    what: impl Fn() -> String,
) -> Result<(), PingpongError> {
    check_pattern(|at, out| mr.read(offset + at, out), len, seed, iter, what)
}

/// [`verify`] over any source of bytes: `read(at, out)` fills `out` with
/// the bytes at `at`; they are compared in chunks of a stack buffer.
fn check_pattern(
    mut read: impl FnMut(usize, &mut [u8]),
    len: usize,
    seed: u8,
    iter: u64,
    what: impl Fn() -> String,
) -> Result<(), PingpongError> {
    let mut buf = [0u8; 4096];
    let mut done = 0;
    while done < len {
        let n = buf.len().min(len - done);
        read(done, &mut buf[..n]);
        if let Some(k) = (0..n).find(|&k| buf[k] != pattern(seed, iter, done + k)) {
            let j = done + k;
            return Err(PingpongError::DataCheck(format!(
                "{}: byte {j} of message {iter} is {:#04x}, expected {:#04x}",
                what(),
                buf[k],
                pattern(seed, iter, j)
            )));
        }
        done += n;
    }
    Ok(())
}

/// Slots of the `--check` bandwidth test for `size`-byte messages and a
/// window of `window` writes.
pub fn check_slots(window: u32, size: usize) -> usize {
    (window as usize).clamp(1, (CHECK_REGION / size.max(1)).max(1))
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

    fn hello(&self) -> Hello {
        let o = self.o;
        let local = &self.r.local;
        Hello {
            test: o.test,
            all: o.all,
            check: o.check,
            size: if o.all { 0 } else { o.size as u64 },
            iters: o.iters,
            mtu_requested: o.mtu.map_or(0, |m| m.bytes() as u16),
            mtu_active: local.active_mtu.bytes() as u16,
            window: o.window(),
            endpoint: Endpoint {
                lid: local.lid,
                qpn: self.r.qp.qp_num(),
                psn: self.r.psn,
                gid: local.gid.map_or([0; 16], |(_, g)| g.0),
                rkey: self.r.recv_mr.rkey(),
                addr: self.r.recv_mr.addr(),
                len: self.r.recv_mr.len() as u64,
            },
        }
    }

    /// The path MTU: the requested one (or the port's), at most what both
    /// ports have active.
    fn path_mtu(&self, peer_active: Option<Mtu>) -> Mtu {
        let mine = self
            .o
            .mtu
            .unwrap_or(self.r.local.active_mtu)
            .min(self.r.local.active_mtu);
        peer_active.map_or(mine, |p| mine.min(p))
    }

    fn native_handshake(&mut self, first: Option<[u8; 16]>) -> Result<(), PingpongError> {
        let mine = self.hello();
        let theirs = if self.client() {
            self.link
                .write(&greeting(&Message::Hello(mine)), "the greeting")?;
            let mut magic = [0u8; 16];
            self.link.read(&mut magic, "the server's greeting").map_err(|e| match e {
                PingpongError::PeerGone { .. } => PingpongError::Protocol(
                    "the server closed the connection at the greeting (a perftest server? use --perftest)".into(),
                ),
                e => e,
            })?;
            if magic != MAGIC {
                return Err(PingpongError::Protocol(
                    match perftest::parse_version(&magic) {
                        Some(v) => format!("the server is perftest {v} (use --perftest)"),
                        None => format!(
                            "the server is not ibvx-pingpong (greeting {:?})",
                            String::from_utf8_lossy(&magic)
                        ),
                    },
                ));
            }
            match self.link.recv("the server's parameters")? {
                Message::Hello(h) => {
                    if let Some(m) = wire::mismatch(&h, &mine) {
                        return Err(PingpongError::Mismatch(m));
                    }
                    h
                }
                Message::Reject(why) => return Err(PingpongError::Rejected(why)),
                m => return Err(unexpected("Hello", &m)),
            }
        } else {
            debug_assert_eq!(first, Some(MAGIC));
            let h = match self.link.recv("the client's parameters")? {
                Message::Hello(h) => h,
                m => return Err(unexpected("Hello", &m)),
            };
            if let Some(m) = wire::mismatch(&mine, &h) {
                // Best effort: the error is this side's result either way.
                let _ = self
                    .link
                    .write(&greeting(&Message::Reject(m.clone())), "the refusal");
                return Err(PingpongError::Mismatch(m));
            }
            self.link
                .write(&greeting(&Message::Hello(mine)), "the greeting")?;
            h
        };
        let e = theirs.endpoint;
        self.remote = Remote {
            qp: RemoteQp {
                qpn: e.qpn,
                psn: e.psn,
                lid: e.lid,
                gid: (e.gid != [0; 16]).then_some(Gid(e.gid)),
            },
            region: RemoteAddr {
                addr: e.addr,
                rkey: e.rkey,
            },
            len: e.len,
            window: theirs.window,
        };
        self.path_mtu = self.path_mtu(Mtu::from_bytes(usize::from(theirs.mtu_active)));
        self.connect_qp()
    }

    fn connect_qp(&mut self) -> Result<(), PingpongError> {
        if self.r.local.gid.is_some() && self.remote.qp.gid.is_none() {
            return Err(PingpongError::Setup(
                "the local port needs a GRH (RoCE) but the peer sent no GID".into(),
            ));
        }
        self.r
            .qp
            .connect(&self.r.local, &self.remote.qp, self.path_mtu, self.r.psn)?;
        Ok(())
    }

    fn key_xchg(&mut self, what: &str) -> Result<KeyMsg, PingpongError> {
        let with_gid = self.key.gid.is_some();
        let mut theirs = vec![0u8; KeyMsg::len(with_gid)];
        let mine = self.key.encode();
        self.link.xchg(&mine, &mut theirs, what)?;
        KeyMsg::decode(&theirs, with_gid)
            .map_err(|e| PingpongError::Protocol(format!("{e} ({what})")))
    }

    fn perftest_handshake(&mut self, first: Option<[u8; 16]>) -> Result<(), PingpongError> {
        // 1. versions
        let mut theirs = [0u8; perftest::VERSION_LEN];
        match first {
            Some(f) => {
                theirs = f;
                self.link
                    .write(&perftest::version_msg(), "the version exchange")?;
            }
            None => self.link.xchg(
                &perftest::version_msg(),
                &mut theirs,
                "the version exchange",
            )?,
        }
        let version = perftest::parse_version(&theirs).ok_or_else(|| {
            PingpongError::Protocol(if theirs == MAGIC {
                "the server is ibvx-pingpong in native mode (run the client without --perftest)"
                    .into()
            } else {
                format!(
                    "the peer is not perftest (version {:?})",
                    String::from_utf8_lossy(&theirs)
                )
            })
        })?;
        if version < perftest::MIN_PEER_VERSION {
            return Err(PingpongError::Protocol(format!(
                "perftest {version} is too old: this side speaks the protocol of perftest {} and newer",
                perftest::MIN_PEER_VERSION
            )));
        }
        self.peer = PeerKind::Perftest { version };
        // 2. cycle buffer and cache line size
        let mut four = [0u8; 4];
        self.link.xchg(
            &4096u32.to_be_bytes(),
            &mut four,
            "the cycle buffer exchange",
        )?;
        self.link
            .xchg(&64u32.to_be_bytes(), &mut four, "the cache line exchange")?;
        // 3. MTU
        let mine = self.path_mtu(None);
        let mut two = [0u8; 2];
        self.link
            .xchg(&perftest::mtu_msg(mine), &mut two, "the MTU exchange")?;
        self.path_mtu = mine.min(perftest::parse_mtu(&two).unwrap_or(mine));
        // 4. keys
        let l = &self.r.local;
        self.key = KeyMsg {
            lid: u32::from(l.lid),
            out_reads: 1,
            qpn: self.r.qp.qp_num(),
            psn: self.r.psn,
            rkey: self.r.recv_mr.rkey(),
            vaddr: self.r.recv_mr.addr(),
            gid: l.gid.map(|(_, g)| g.0),
            srqn: 0,
        };
        let k = self.key_xchg("the QP exchange")?;
        self.remote = Remote {
            qp: RemoteQp {
                qpn: k.qpn,
                psn: k.psn,
                lid: k.lid as u16,
                gid: k.gid.filter(|g| *g != [0; 16]).map(Gid),
            },
            region: RemoteAddr {
                addr: k.vaddr,
                rkey: k.rkey,
            },
            len: u64::MAX,
            window: self.o.window(),
        };
        if let (Some((_, mine)), Some(theirs)) = (self.r.local.gid, self.remote.qp.gid) {
            if mine.is_ipv4_mapped() != theirs.is_ipv4_mapped() {
                return Err(PingpongError::Setup(
                    "GID types differ (IPv4-mapped on one side only): choose matching --gid-index values".into(),
                ));
            }
        }
        self.connect_qp()?;
        for _ in 1..perftest::handshakes_before_run(self.o.test) {
            self.key_xchg("a synchronization")?;
        }
        Ok(())
    }

    fn print_header(&mut self) -> Result<(), PingpongError> {
        if self.o.json {
            return Ok(());
        }
        let o = self.o;
        let l = &self.r.local;
        let mut h = String::new();
        let role = if self.client() { "client" } else { "server" };
        h += &format!("{RESULT_LINE}\n                    {}\n", o.test.title());
        h += &format!(
            " Tool           : ibvx-pingpong {} ({role}), peer: {}\n",
            env!("CARGO_PKG_VERSION"),
            self.peer.name()
        );
        h += &format!(
            " Device         : {}\t\tPort           : {}\n",
            self.r.device, l.port
        );
        h += &format!(
            " Link type      : {}\tGID index      : {}\n",
            l.link_layer,
            l.gid.map_or("none".to_string(), |(i, _)| i.to_string())
        );
        h += &format!(
            " Mtu            : {}[B]\tMax inline data: {}[B]\n",
            self.path_mtu.bytes(),
            self.r.inline_max
        );
        h += &format!(
            " Completions    : {}\tData check     : {}\n",
            if o.events { "events" } else { "polling" },
            if o.check { "on" } else { "off" }
        );
        if o.test == TestKind::WriteBw && self.client() {
            h += &format!(" TX depth       : {}\n", o.window());
        }
        h += &format!(
            " Clock          : cycle counter, {:.2} MHz (measured against CLOCK_MONOTONIC)\n",
            self.clock.cycles_per_us()
        );
        h += &format!("{RESULT_LINE}\n");
        let rdma = o.test != TestKind::SendLat;
        let addr =
            |side: &str, lid: u16, qpn: u32, psn: u32, rkey: u32, vaddr: u64, gid: Option<Gid>| {
                let mut s =
                    format!(" {side} address: LID {lid:#06x} QPN {qpn:#08x} PSN {psn:#08x}");
                if rdma {
                    s += &format!(" RKey {rkey:#010x} VAddr {vaddr:#018x}");
                }
                s.push('\n');
                if let Some(g) = gid {
                    let b: Vec<String> = g.0.iter().map(|x| format!("{x:02}")).collect();
                    s += &format!(" GID: {}\n", b.join(":"));
                }
                s
            };
        h += &addr(
            "local",
            l.lid,
            self.r.qp.qp_num(),
            self.r.psn,
            self.r.recv_mr.rkey(),
            self.r.recv_mr.addr(),
            l.gid.map(|(_, g)| g),
        );
        let rq = self.remote.qp;
        h += &addr(
            "remote",
            rq.lid,
            rq.qpn,
            rq.psn,
            self.remote.region.rkey,
            self.remote.region.addr,
            rq.gid,
        );
        h += &format!("{RESULT_LINE}\n");
        h += if o.test.is_latency() {
            LAT_HEADER
        } else {
            BW_HEADER
        };
        h.push('\n');
        self.emit(&h)
    }

    fn emit(&mut self, s: &str) -> Result<(), PingpongError> {
        self.out
            .write_all(s.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(|e| PingpongError::Io {
                what: "writing the results".into(),
                source: e,
            })
    }

    fn emit_row(&mut self, row: Row) -> Result<(), PingpongError> {
        let line = match (&row.stats, self.o.json) {
            (RowStats::Latency(s), false) => stats::latency_row(row.size, row.iters, s),
            (RowStats::Latency(s), true) => self.rec.latency_json(row.size, row.iters, s),
            (RowStats::Bandwidth(s), false) => stats::bw_row(row.size as u64, row.iters, s),
            (RowStats::Bandwidth(s), true) => self.rec.bw_json(row.size as u64, row.iters, s),
        };
        self.rows.push(row);
        self.emit(&format!("{line}\n"))
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
            TestKind::SendLat | TestKind::WriteLat => {
                let seeds = self.seeds();
                let stamps = if self.o.test == TestKind::SendLat {
                    send_lat(&mut self.r, &self.link, &mut w, self.o, size, seeds)?
                } else {
                    write_lat(
                        &mut self.r,
                        &self.link,
                        &mut w,
                        self.o,
                        size,
                        seeds,
                        self.remote.region,
                    )?
                };
                let rate = self.clock.cycles_per_us();
                let s = stats::latency_stats(&stamps, rate).ok_or_else(|| {
                    PingpongError::Setup("too few iterations for statistics".into())
                })?;
                self.emit_row(Row {
                    size,
                    iters: self.o.iters,
                    stats: RowStats::Latency(s),
                })
            }
            TestKind::WriteBw if self.client() => {
                let (posted, completed) = write_bw_client(
                    &mut self.r,
                    &self.link,
                    &mut w,
                    self.o,
                    size,
                    native,
                    self.remote.region,
                    slots,
                )?;
                let rate = self.clock.cycles_per_us();
                let s = stats::bw_stats(size, &posted, &completed, rate)
                    .ok_or_else(|| PingpongError::Setup("no completion timestamps".into()))?;
                self.emit_row(Row {
                    size,
                    iters: self.o.iters,
                    stats: RowStats::Bandwidth(s),
                })?;
                if native {
                    self.link.send(&Message::BwReport(BwReport {
                        size: size as u64,
                        iters: self.o.iters,
                        peak: s.peak,
                        avg: s.avg,
                        msg_rate: s.msg_rate,
                    }))?;
                } else {
                    self.last_bw = Some(PerftestBwReport {
                        size: size as u64,
                        iters: self.o.iters,
                        bw_peak: s.peak,
                        bw_avg: s.avg,
                        msg_rate: s.msg_rate,
                    });
                }
                Ok(())
            }
            TestKind::WriteBw => {
                if !native {
                    // perftest's client runs every size, then reports once.
                    return Ok(());
                }
                // Like perftest's server, do not spin while the client measures.
                let what = || format!("write_bw {size} B: waiting for the client's last write");
                let idle = Some(Duration::from_micros(500));
                let wc = wait_wc_idle(
                    &self.r.recv_cq,
                    self.o.events,
                    idle,
                    &mut w,
                    &self.link,
                    &what,
                )?;
                if wc.opcode() != WcOpcode::RecvRdmaWithImm
                    || wc.imm_data() != Some(self.o.iters as u32)
                {
                    return Err(PingpongError::Protocol(format!(
                        "expected the final write with immediate {}, got {:?}",
                        self.o.iters as u32, wc
                    )));
                }
                if self.o.check {
                    let slots = check_slots(self.remote.window, size);
                    let iters = self.o.iters;
                    let (_, peer_seed) = self.seeds();
                    for slot in 0..slots.min(iters as usize) {
                        // the last iteration that wrote this slot
                        let it = (iters - 1) - ((iters - 1 - slot as u64) % slots as u64);
                        verify(&self.r.recv_mr, slot * size, size, peer_seed, it, || {
                            format!("write_bw {size} B slot {slot}")
                        })?;
                    }
                }
                let rep = match self.link.recv("the client's bandwidth report")? {
                    Message::BwReport(r) => r,
                    m => return Err(unexpected("BwReport", &m)),
                };
                self.emit_row(Row::bandwidth(
                    rep.size,
                    rep.iters,
                    rep.peak,
                    rep.avg,
                    rep.msg_rate,
                ))
            }
        }
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

/// perftest's `run_iter_lat_send`: the server waits for a message and
/// answers, the client sends first; every send is signaled and awaited.
/// Returns the post timestamps.
fn send_lat(
    r: &mut Resources,
    link: &Link,
    w: &mut Watch,
    o: &Options,
    size: usize,
    (my_seed, peer_seed): (u8, u8),
) -> Result<Vec<u64>, PingpongError> {
    let iters = o.iters;
    let client = o.is_client();
    let mut stamps = Vec::with_capacity(iters as usize);
    let flags = SendFlags::SIGNALED.with(SendFlags::INLINE, r.inline(size));
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(client && scnt == 0) {
            let what = || format!("send_lat {size} B: waiting for message {rcnt} of {iters}");
            let wc = wait_wc(&r.recv_cq, o.events, w, link, &what)?;
            if wc.byte_len() as usize != size {
                return Err(PingpongError::Protocol(format!(
                    "send_lat: received {} bytes, expected {size} (do both sides use the same --size?)",
                    wc.byte_len()
                )));
            }
            if o.check {
                verify(&r.recv_mr, 0, size, peer_seed, rcnt, || {
                    format!("send_lat {size} B")
                })?;
            }
            rcnt += 1;
            // SAFETY: as in `setup`: the region is ours, outlives the QP and
            // is only read through raw pointers after a completion.
            unsafe {
                r.qp.post_recv(RECV_WR_ID, &[r.recv_mr.sge(0, r.recv_mr.len())])
            }
            .map_err(|e| run_error(link, "send_lat: reposting a receive".into(), e))?;
        }
        if scnt < iters {
            if o.check {
                fill(&mut r.send_mr, 0, size, my_seed, scnt);
            }
            stamps.push(cycles());
            let sge = [r.send_mr.sge(0, size)];
            // SAFETY: `send_mr` is the tool's own region, dropped after the
            // QP, and not written again before this send's completion is
            // awaited just below.
            unsafe {
                r.qp.post_send(&SendRequest {
                    wr_id: scnt,
                    op: SendOp::Send,
                    sges: &sge,
                    flags,
                })
            }
            .map_err(|e| run_error(link, format!("send_lat {size} B: post {scnt}"), e))?;
            scnt += 1;
            let what = || format!("send_lat {size} B: completion of send {scnt} of {iters}");
            wait_wc(&r.send_cq, o.events, w, link, &what)?;
        }
    }
    Ok(stamps)
}

/// perftest's `run_iter_lat_write`: each side RDMA-writes `size` bytes whose
/// last byte is the iteration count, and polls the last byte of its own
/// region for the peer's; the client writes first.
fn write_lat(
    r: &mut Resources,
    link: &Link,
    w: &mut Watch,
    o: &Options,
    size: usize,
    (my_seed, peer_seed): (u8, u8),
    remote: RemoteAddr,
) -> Result<Vec<u64>, PingpongError> {
    let iters = o.iters;
    let server = !o.is_client();
    let mut stamps = Vec::with_capacity(iters as usize);
    let flags = SendFlags::SIGNALED.with(SendFlags::INLINE, r.inline(size));
    let last = size - 1;
    let (mut scnt, mut rcnt, mut ccnt) = (0u64, 0u64, 0u64);
    while scnt < iters || ccnt < iters || rcnt < iters {
        if rcnt < iters && !(scnt < 1 && server) {
            rcnt += 1;
            let want = rcnt as u8;
            let mut spins = 0u32;
            while r.recv_mr.load_u8(last) != want {
                spins = spins.wrapping_add(1);
                if spins % 4096 == 0 {
                    w.check(link, &|| {
                        format!("write_lat {size} B: waiting for write {rcnt} of {iters}")
                    })?;
                }
            }
            if o.check {
                verify(&r.recv_mr, 0, last, peer_seed, rcnt - 1, || {
                    format!("write_lat {size} B")
                })?;
            }
        }
        if scnt < iters {
            if o.check {
                fill(&mut r.send_mr, 0, last, my_seed, scnt);
            }
            stamps.push(cycles());
            scnt += 1;
            r.send_mr.store_u8(last, scnt as u8);
            let sge = [r.send_mr.sge(0, size)];
            // SAFETY: `send_mr` is the tool's own region, dropped after the
            // QP; the next iteration rewrites it only through raw-pointer
            // accessors (`fill`, `store_u8`), which at worst changes what an
            // unfinished write sends, as in perftest. `remote` is the region
            // the peer registered for our writes and sent in the handshake;
            // its device refuses anything outside it.
            unsafe {
                r.qp.post_send(&SendRequest {
                    wr_id: scnt,
                    op: SendOp::RdmaWrite(remote),
                    sges: &sge,
                    flags,
                })
            }
            .map_err(|e| run_error(link, format!("write_lat {size} B: post {scnt}"), e))?;
        }
        if ccnt < iters {
            let what = || {
                format!(
                    "write_lat {size} B: completion of write {} of {iters}",
                    ccnt + 1
                )
            };
            wait_wc(&r.send_cq, o.events, w, link, &what)?;
            ccnt += 1;
        }
    }
    Ok(stamps)
}

/// Post timestamps and completion points `(last message, time)` of a
/// bandwidth run.
type BwTimes = (Vec<u64>, Vec<(usize, u64)>);

/// perftest's `run_iter_bw` for RDMA write: keeps up to a window of writes
/// outstanding, signaling every `cq_mod`-th. Returns the post timestamps
/// and the completion points. With a native peer the last write carries the
/// iteration count as immediate data (the server's end-of-size signal);
/// with `--check` writes cycle through `slots` slots of both regions.
#[allow(clippy::too_many_arguments)]
fn write_bw_client(
    r: &mut Resources,
    link: &Link,
    w: &mut Watch,
    o: &Options,
    size: usize,
    native: bool,
    remote: RemoteAddr,
    slots: usize,
) -> Result<BwTimes, PingpongError> {
    let iters = o.iters as usize;
    let window = if o.check { slots } else { o.window() as usize }
        .min(r.qp.caps().max_send_wr as usize)
        .max(1);
    // perftest: CQ moderation of 100 (at most the window), none above 8 KiB.
    let cq_mod = if o.events || size > 8192 {
        1
    } else {
        window.min(100)
    };
    let inline = r.inline(size);
    let mut posted = Vec::with_capacity(iters);
    let mut completed = Vec::with_capacity(iters / cq_mod + 1);
    let (mut scnt, mut ccnt) = (0usize, 0usize);
    let mut wcs = [WorkCompletion::default(); 16];
    let mut spins = 0u32;
    while ccnt < iters {
        while scnt < iters && scnt - ccnt < window {
            let slot = if o.check { scnt % slots } else { 0 };
            if o.check {
                fill(&mut r.send_mr, slot * size, size, CLIENT_SEED, scnt as u64);
            }
            let last = scnt + 1 == iters;
            let signaled = last || (scnt + 1) % cq_mod == 0;
            let dst = remote.offset((slot * size) as u64);
            let op = if native && last {
                SendOp::RdmaWriteWithImm(dst, iters as u32)
            } else {
                SendOp::RdmaWrite(dst)
            };
            let sge = [r.send_mr.sge(slot * size, size)];
            posted.push(cycles());
            // SAFETY: `send_mr` is the tool's own region, dropped after the
            // QP, written only through its raw-pointer accessors; with
            // `--check` a slot is refilled only after the write that last
            // used it completed (at most `slots` writes are outstanding).
            // The destination is inside the region the peer registered for
            // our writes (`slots * size` was checked against its length).
            unsafe {
                r.qp.post_send(&SendRequest {
                    wr_id: scnt as u64,
                    op,
                    sges: &sge,
                    flags: SendFlags::NONE
                        .with(SendFlags::SIGNALED, signaled)
                        .with(SendFlags::INLINE, inline),
                })
            }
            .map_err(|e| run_error(link, format!("write_bw {size} B: post {scnt}"), e))?;
            scnt += 1;
        }
        let done = ccnt;
        let what = move || format!("write_bw {size} B: {done} of {iters} writes complete");
        let n = poll_armed(&r.send_cq, &mut wcs, o.events, link, &what)?;
        if n == 0 && o.events {
            wait_armed(&r.send_cq, w, link, &what)?;
            continue;
        }
        let now = cycles();
        for wc in &wcs[..n] {
            if let Err(e) = wc.ok() {
                return Err(run_error(link, what(), e));
            }
            let j = wc.wr_id() as usize;
            completed.push((j, now));
        }
        if let Some(&(j, _)) = completed.last() {
            ccnt = j + 1;
        }
        if n == 0 {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                w.check(link, &what)?;
            }
        }
    }
    Ok((posted, completed))
}

/// What each side sends first in the native protocol: the magic and `m`,
/// in one write.
fn greeting(m: &Message) -> Vec<u8> {
    let mut g = MAGIC.to_vec();
    m.encode_into(&mut g);
    g
}

/// The error for a message of the wrong kind where `want` was due.
fn unexpected(want: &str, got: &Message) -> PingpongError {
    PingpongError::Protocol(format!("expected {want}, got {}", got.name()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_between_sides_iterations_and_offsets() {
        assert_ne!(pattern(CLIENT_SEED, 0, 0), pattern(SERVER_SEED, 0, 0));
        assert_ne!(pattern(CLIENT_SEED, 0, 0), pattern(CLIENT_SEED, 1, 0));
        let row: Vec<u8> = (0..512).map(|j| pattern(CLIENT_SEED, 3, j)).collect();
        assert!(row.windows(2).any(|w| w[0] != w[1]));
        // bytes 256 apart differ too
        assert_ne!(pattern(CLIENT_SEED, 3, 1), pattern(CLIENT_SEED, 3, 257));
    }

    #[test]
    fn the_data_check_finds_the_first_wrong_byte() {
        let len = 10_000; // more than one chunk
        let mut msg: Vec<u8> = (0..len).map(|j| pattern(CLIENT_SEED, 7, j)).collect();
        fn read(m: &[u8]) -> impl FnMut(usize, &mut [u8]) + '_ {
            move |at, out| out.copy_from_slice(&m[at..at + out.len()])
        }
        let what = || "send_lat 10000 B".to_string();
        check_pattern(read(&msg), len, CLIENT_SEED, 7, what).unwrap();
        let e = check_pattern(read(&msg), len, CLIENT_SEED, 8, what).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("data check failed: send_lat 10000 B: byte 0 of message 8 is "),
            "{e}"
        );
        msg[9000] ^= 1;
        let e = check_pattern(read(&msg), len, CLIENT_SEED, 7, what).unwrap_err();
        assert!(matches!(e, PingpongError::DataCheck(_)), "{e}");
        assert!(e.to_string().contains("byte 9000 of message 7"), "{e}");
        // Only the first `len` bytes count.
        check_pattern(read(&msg), 9000, CLIENT_SEED, 7, what).unwrap();
    }

    #[test]
    fn check_slots_fit_the_region() {
        assert_eq!(check_slots(128, 2), 128);
        assert_eq!(check_slots(128, 1 << 20), 16);
        assert_eq!(check_slots(128, 8 << 20), 2);
        assert_eq!(check_slots(128, 64 << 20), 1);
        assert_eq!(check_slots(0, 64), 1);
        for size in [1usize, 4096, 1 << 20, 1 << 23] {
            assert!(check_slots(128, size) * size <= CHECK_REGION.max(size));
        }
    }
}
