//! Command-line options of `ibvx-pingpong`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use ibvx::verbs::Mtu;

/// The default TCP port of the out-of-band exchange (perftest's).
pub const DEFAULT_PORT: u16 = 18515;

/// Largest message of `--all` (2^23 bytes, as perftest).
pub const ALL_MAX_SIZE: usize = 1 << 23;

/// Largest message size accepted (1 GiB).
pub const MAX_SIZE: usize = 1 << 30;

/// The three tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TestKind {
    /// Send/receive latency, pingpong (perftest's `ib_send_lat`).
    SendLat,
    /// RDMA-write latency, pingpong polling the last byte (`ib_write_lat`).
    WriteLat,
    /// RDMA-write bandwidth with a window of outstanding writes (`ib_write_bw`).
    WriteBw,
}

impl TestKind {
    /// All tests.
    pub const ALL: [TestKind; 3] = [TestKind::SendLat, TestKind::WriteLat, TestKind::WriteBw];

    /// The option value: `send_lat`, `write_lat` or `write_bw`.
    pub fn name(self) -> &'static str {
        match self {
            TestKind::SendLat => "send_lat",
            TestKind::WriteLat => "write_lat",
            TestKind::WriteBw => "write_bw",
        }
    }

    /// The perftest program that runs the same test.
    pub fn perftest_program(self) -> &'static str {
        match self {
            TestKind::SendLat => "ib_send_lat",
            TestKind::WriteLat => "ib_write_lat",
            TestKind::WriteBw => "ib_write_bw",
        }
    }

    /// Whether the test measures latency (else bandwidth).
    pub fn is_latency(self) -> bool {
        !matches!(self, TestKind::WriteBw)
    }

    /// The title perftest prints above its table.
    pub fn title(self) -> &'static str {
        match self {
            TestKind::SendLat => "Send Latency Test",
            TestKind::WriteLat => "RDMA_Write Latency Test",
            TestKind::WriteBw => "RDMA_Write BW Test",
        }
    }

    /// Wire code of the native handshake.
    pub fn code(self) -> u8 {
        match self {
            TestKind::SendLat => 1,
            TestKind::WriteLat => 2,
            TestKind::WriteBw => 3,
        }
    }

    /// From the wire code.
    pub fn from_code(c: u8) -> Option<TestKind> {
        TestKind::ALL.into_iter().find(|t| t.code() == c)
    }
}

impl fmt::Display for TestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TestKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        TestKind::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown test {s:?} (send_lat, write_lat or write_bw)"))
    }
}

/// Everything `ibvx-pingpong` was asked to do, with defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Which test.
    pub test: TestKind,
    /// The server to connect to (client mode); `None` = server mode.
    pub host: Option<String>,
    /// TCP port of the out-of-band exchange.
    pub port: u16,
    /// Device name (`None` = first device).
    pub ib_dev: Option<String>,
    /// Device port (1-based).
    pub ib_port: u8,
    /// GID index (`None` = automatic on RoCE, none on InfiniBand).
    pub gid_index: Option<u32>,
    /// Message size (ignored with `all`).
    pub size: usize,
    /// Every power of two from 2 to 8 MiB.
    pub all: bool,
    /// Iterations per size.
    pub iters: u64,
    /// Requested path MTU (`None` = the port's active MTU).
    pub mtu: Option<Mtu>,
    /// Messages up to this size are sent inline.
    pub inline_size: u32,
    /// Outstanding writes of the bandwidth test.
    pub tx_depth: u32,
    /// Posted receives of the send latency test.
    pub rx_depth: u32,
    /// Wait for completions on the completion channel instead of polling.
    pub events: bool,
    /// Fill messages with a pattern and verify them on arrival.
    pub check: bool,
    /// One JSON record per size instead of tables.
    pub json: bool,
    /// Speak perftest's out-of-band protocol (peer is `ib_*_lat`/`ib_write_bw`).
    pub perftest: bool,
    /// Limit for each phase: waiting for the peer, the handshake, each size's run.
    pub timeout: Duration,
    /// How long a client retries a refused connection.
    pub connect_timeout: Duration,
}

impl Options {
    /// Defaults of `test` (perftest's): 2 bytes and 1000 iterations for the
    /// latency tests, 64 KiB and 5000 iterations for bandwidth.
    pub fn new(test: TestKind) -> Options {
        Options {
            test,
            host: None,
            port: DEFAULT_PORT,
            ib_dev: None,
            ib_port: 1,
            gid_index: None,
            size: if test.is_latency() { 2 } else { 65536 },
            all: false,
            iters: if test.is_latency() { 1000 } else { 5000 },
            mtu: None,
            inline_size: 0,
            tx_depth: 128,
            rx_depth: 512,
            events: false,
            check: false,
            json: false,
            perftest: false,
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Client (connects to `host`) or server.
    pub fn is_client(&self) -> bool {
        self.host.is_some()
    }

    /// The message sizes to run, in order.
    pub fn sizes(&self) -> Vec<usize> {
        if self.all {
            all_sizes()
        } else {
            vec![self.size]
        }
    }

    /// The largest message size.
    pub fn max_size(&self) -> usize {
        if self.all {
            ALL_MAX_SIZE
        } else {
            self.size
        }
    }

    /// The window of the bandwidth test: `tx_depth`, at most `iters`.
    pub fn window(&self) -> u32 {
        u32::try_from(self.iters.min(u64::from(self.tx_depth))).unwrap_or(self.tx_depth)
    }
}

/// 2, 4, ... 8 MiB: the sizes of `--all` (perftest's `-a`).
pub fn all_sizes() -> Vec<usize> {
    (1..=23).map(|i| 1usize << i).collect()
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Run a test.
    Run(Box<Options>),
    /// Print the help text.
    Help,
    /// Print the version.
    Version,
}

/// The help text.
pub const HELP: &str = "\
ibvx-pingpong: verbs latency and bandwidth between two processes (perftest layout)

USAGE:
  ibvx-pingpong [OPTIONS]          server: wait for a client
  ibvx-pingpong [OPTIONS] HOST     client: connect to the server on HOST

TESTS (--test, the same on both sides):
  send_lat    send/receive latency, pingpong            (perftest: ib_send_lat)
  write_lat   RDMA-write latency, polling the last byte (perftest: ib_write_lat)
  write_bw    RDMA-write bandwidth, tx-depth window     (perftest: ib_write_bw)

OPTIONS:
      --test TEST          send_lat (default), write_lat or write_bw
  -p, --port PORT          TCP port of the out-of-band exchange (default 18515)
  -d, --ib-dev DEV         RDMA device (default: the first one)
  -i, --ib-port PORT       device port (default 1)
  -x, --gid-index N        GID index (default: RoCE v2 IPv4 entry on RoCE, none on IB)
  -s, --size BYTES         message size (default 2; 65536 for write_bw; K/M/G suffixes)
  -a, --all                every power of two from 2 to 8 MiB
  -n, --iters N            iterations per size (default 1000; 5000 for write_bw)
  -m, --mtu BYTES          path MTU 256..4096 (default: the port's active MTU)
  -I, --inline-size BYTES  send messages up to this size inline (default 0)
  -t, --tx-depth N         outstanding writes of write_bw (default 128)
  -r, --rx-depth N         posted receives of send_lat (default 512)
  -e, --events             wait on the completion channel instead of polling
  -c, --check              fill messages with a pattern and verify it (ibvx peers)
      --json               one JSON record per size instead of the table
      --perftest           talk to perftest (ib_send_lat, ib_write_lat, ib_write_bw)
                           instead of ibvx-pingpong; a server also detects it itself
      --timeout SECS       limit for waiting for the peer, the handshake and each
                           size's run (default 300)
      --connect-timeout S  how long a client retries a refused connection (default 5)
  -h, --help               this text
  -V, --version            version

Both sides must use the same test, sizes, iterations and MTU: an ibvx-pingpong
peer refuses a mismatch at the handshake; perftest cannot tell (see --perftest).
Latency is half the round trip (t_typical is the median), bandwidth is in MiB/s,
as perftest reports them.";

/// Parses a byte count with an optional K, M or G (binary) suffix.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let (digits, mult) = match s.as_bytes().last() {
        Some(b'k' | b'K') => (&s[..s.len() - 1], 1usize << 10),
        Some(b'm' | b'M') => (&s[..s.len() - 1], 1 << 20),
        Some(b'g' | b'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a byte count"))
}

fn parse_num<T: FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{name} takes a number, not {v:?}"))
}

/// Parses the arguments (without the program name) with `lexopt`: long
/// options as `--name VALUE` or `--name=VALUE`, short ones as `-s VALUE` or
/// `-sVALUE`, and at most one HOST.
pub fn parse<I, S>(args: I) -> Result<Command, String>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    use lexopt::Arg;

    let mut test = TestKind::SendLat;
    let mut host: Option<String> = None;
    let mut size: Option<usize> = None;
    let mut iters: Option<u64> = None;
    let mut o = Options::new(TestKind::SendLat);
    let mut p = lexopt::Parser::from_args(
        args.into_iter()
            .map(|a| std::ffi::OsString::from(a.into()))
            .collect::<Vec<_>>(),
    );
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        let name = match arg {
            Arg::Short(c) => format!("-{c}"),
            Arg::Long(l) => format!("--{l}"),
            Arg::Value(v) => {
                let v = v
                    .into_string()
                    .map_err(|v| format!("HOST {v:?} is not UTF-8"))?;
                if let Some(h) = &host {
                    return Err(format!("more than one HOST given ({h:?} and {v:?})"));
                }
                host = Some(v);
                continue;
            }
        };
        let mut value = |what: &str| -> Result<String, String> {
            p.value()
                .ok()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| format!("{what} needs a value"))
        };
        match name.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "-V" | "--version" => return Ok(Command::Version),
            "--test" => test = value("--test")?.parse()?,
            "-s" | "--size" => size = Some(parse_bytes(&value("--size")?)?),
            "-n" | "--iters" => iters = Some(parse_num("--iters", &value("--iters")?)?),
            n if set_option(&mut o, n, &mut value)? => {}
            a => return Err(format!("unknown option {a:?} (see --help)")),
        }
    }
    let defaults = Options::new(test);
    o.test = test;
    o.host = host;
    o.size = size.unwrap_or(defaults.size);
    o.iters = iters.unwrap_or(defaults.iters);
    check_options(&o, size.is_some())?;
    Ok(Command::Run(Box::new(o)))
}

/// Applies option `name` if it only sets a field of `o`, taking its value
/// from `value` when it has one; `Ok(false)` if `name` is no such option.
fn set_option(
    o: &mut Options,
    name: &str,
    value: &mut dyn FnMut(&str) -> Result<String, String>,
) -> Result<bool, String> {
    match name {
        "-p" | "--port" => {
            o.port = parse_num("--port", &value("--port")?)?;
            if o.port == 0 {
                return Err("--port must be 1..65535".into());
            }
        }
        "-d" | "--ib-dev" => o.ib_dev = Some(value("--ib-dev")?),
        "-i" | "--ib-port" => {
            o.ib_port = parse_num("--ib-port", &value("--ib-port")?)?;
            if o.ib_port == 0 {
                return Err("--ib-port counts from 1".into());
            }
        }
        "-x" | "--gid-index" => {
            let v: u32 = parse_num("--gid-index", &value("--gid-index")?)?;
            if v > 255 {
                return Err("--gid-index must be 0..255".into());
            }
            o.gid_index = Some(v);
        }
        "-a" | "--all" => o.all = true,
        "-m" | "--mtu" => {
            let v = parse_bytes(&value("--mtu")?)?;
            o.mtu =
                Some(Mtu::from_bytes(v).ok_or_else(|| {
                    format!("--mtu must be 256, 512, 1024, 2048 or 4096, not {v}")
                })?);
        }
        "-I" | "--inline-size" => {
            o.inline_size = u32::try_from(parse_bytes(&value("--inline-size")?)?)
                .map_err(|_| "--inline-size is too large".to_string())?;
        }
        "-t" | "--tx-depth" => o.tx_depth = parse_num("--tx-depth", &value("--tx-depth")?)?,
        "-r" | "--rx-depth" => o.rx_depth = parse_num("--rx-depth", &value("--rx-depth")?)?,
        "-e" | "--events" => o.events = true,
        "-c" | "--check" => o.check = true,
        "--json" => o.json = true,
        "--perftest" => o.perftest = true,
        "--timeout" => {
            let s: f64 = parse_num("--timeout", &value("--timeout")?)?;
            if !(s > 0.0 && s < 1e9) {
                return Err("--timeout must be a positive number of seconds".into());
            }
            o.timeout = Duration::from_secs_f64(s);
        }
        "--connect-timeout" => {
            let s: f64 = parse_num("--connect-timeout", &value("--connect-timeout")?)?;
            if !(0.0..1e9).contains(&s) {
                return Err("--connect-timeout must be a number of seconds".into());
            }
            o.connect_timeout = Duration::from_secs_f64(s);
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// The checks made once every option is read: ranges, and options that
/// exclude each other (`size_given`: whether `--size` was given).
fn check_options(o: &Options, size_given: bool) -> Result<(), String> {
    if o.all && size_given {
        return Err("--all and --size exclude each other".into());
    }
    if o.size == 0 || o.size > MAX_SIZE {
        return Err(format!("--size must be 1..{MAX_SIZE}"));
    }
    if !(5..=100_000_000).contains(&o.iters) {
        return Err("--iters must be 5..100000000".into());
    }
    if !(1..=15000).contains(&o.tx_depth) {
        return Err("--tx-depth must be 1..15000".into());
    }
    if !(1..=16384).contains(&o.rx_depth) {
        return Err("--rx-depth must be 1..16384".into());
    }
    if o.check && o.perftest {
        return Err(
            "--check needs ibvx-pingpong on both sides (perftest does not fill or verify data)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
