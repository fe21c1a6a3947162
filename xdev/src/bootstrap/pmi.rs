//! The PMI backend: the bootstrap over the PMI wire protocols a launcher
//! serves on the socket it names in `PMI_FD`.
//!
//! | launcher | protocol | how it is recognised |
//! |---|---|---|
//! | MPICH's Hydra (`mpirun.mpich`, `mpiexec.hydra`) | PMI-1: one text line per command, `cmd=NAME key=value ...` | `PMI_FD`, `PMI_RANK`, `PMI_SIZE` |
//! | Slurm's `srun --mpi=pmi2` | PMI-2: after a PMI-1 `cmd=init pmi_version=2` line, frames of a 6-character length, then `cmd=NAME;key=value;...` | `PMI_FD` and `PMI_JOBID` |
//!
//! (Slurm's pmi2 plugin also answers PMI-1, Hydra also answers PMI-2; the
//! table is what this backend speaks to each. `XDEV_PMI=1` or `XDEV_PMI=2`
//! forces one.)
//!
//! PMI keys and values are short (Hydra and Slurm allow 64-byte keys and
//! 1024-byte values) and must not contain the protocols' separators, so a key
//! is sent as `x` plus the key when it is made of `[A-Za-z0-9._-]` and short
//! enough, else as `h` plus 32 hex digits of its SHA-256; a value is sent as
//! hex digits, split over as many keys as it needs: the first holds
//! `CHUNKS:HEX`, the others (key `~I` appended) `HEX`.
//!
//! PMI has no way to report a departed process: [`Bootstrap::departed`]
//! reports only the ranks on this host whose processes this process saw
//! exit (the ranks watch each other's pids, published with the first
//! allgather); devices keep their own detection.
//!
//! [`Bootstrap::departed`]: super::Bootstrap::departed

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::SERVICE;
use crate::{Error, Rank, Result};

/// Environment variable: the launcher's PMI socket (Hydra, Slurm pmi2).
pub const PMI_FD: &str = "PMI_FD";
/// Environment variable: this process's PMI rank.
pub const PMI_RANK: &str = "PMI_RANK";
/// Environment variable: the number of PMI ranks.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// Environment variable: the job id Slurm's pmi2 plugin sets (PMI-2).
pub const PMI_JOBID: &str = "PMI_JOBID";
/// Environment variable: `1` or `2` forces the PMI wire protocol.
pub const XDEV_PMI: &str = "XDEV_PMI";

/// How long the handshake with the launcher may take before it is an error
/// (a stale `PMI_FD` must not hang a rank).
const INIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest line or frame accepted from the launcher.
const MAX_REPLY: usize = 64 * 1024;

/// The PMI wire protocol spoken on `PMI_FD`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// PMI-1 (MPICH Hydra).
    Pmi1,
    /// PMI-2 (Slurm `--mpi=pmi2`).
    Pmi2,
}

fn pmi_err(what: impl Into<String>) -> Error {
    Error::Protocol {
        rank: SERVICE,
        what: format!("PMI: {}", what.into()),
    }
}

fn io_err(what: &str, e: io::Error) -> Error {
    Error::transport(format!("PMI: {what}"), e)
}

// ---------------------------------------------------------------------------
// Codecs

/// A PMI-1 command line: `cmd=NAME k=v ...\n`. Values must not contain
/// spaces, `=` or newlines (the callers send encoded keys and hex values).
pub(crate) fn pmi1_command(cmd: &str, args: &[(&str, &str)]) -> String {
    let mut s = format!("cmd={cmd}");
    for (k, v) in args {
        s.push(' ');
        s.push_str(k);
        s.push('=');
        s.push_str(v);
    }
    s.push('\n');
    s
}

/// Parses a PMI-1 reply line into its `key=value` pairs, in order. A word
/// without `=` continues the previous value (Hydra's messages may hold
/// spaces).
pub(crate) fn pmi1_parse(line: &str) -> Result<Vec<(String, String)>> {
    let line = line.trim_end_matches(['\n', '\r']);
    let mut out: Vec<(String, String)> = Vec::new();
    for word in line.split(' ').filter(|w| !w.is_empty()) {
        match word.split_once('=') {
            Some((k, v)) if !k.is_empty() => out.push((k.to_string(), v.to_string())),
            _ => match out.last_mut() {
                Some((_, v)) => {
                    v.push(' ');
                    v.push_str(word);
                }
                None => return Err(pmi_err(format!("malformed PMI-1 reply {line:?}"))),
            },
        }
    }
    if out.first().map(|(k, _)| k.as_str()) != Some("cmd") {
        return Err(pmi_err(format!("PMI-1 reply without cmd: {line:?}")));
    }
    Ok(out)
}

/// A PMI-2 frame: the body's length in 6 characters (left-aligned, padded
/// with spaces), then `cmd=NAME;k=v;...;`. A `;` inside a value is doubled.
pub(crate) fn pmi2_frame(cmd: &str, args: &[(&str, &str)]) -> Result<Vec<u8>> {
    let mut body = format!("cmd={cmd};");
    for (k, v) in args {
        body.push_str(k);
        body.push('=');
        body.push_str(&v.replace(';', ";;"));
        body.push(';');
    }
    if body.len() > 999_999 {
        return Err(Error::Config(format!(
            "PMI-2 command of {} bytes is too long",
            body.len()
        )));
    }
    let mut out = format!("{:<6}", body.len()).into_bytes();
    out.extend_from_slice(body.as_bytes());
    Ok(out)
}

/// Parses the length field of a PMI-2 frame.
pub(crate) fn pmi2_length(head: &[u8; 6]) -> Result<usize> {
    let text = std::str::from_utf8(head)
        .map_err(|_| pmi_err("PMI-2 length is not text"))?
        .trim();
    let len: usize = text
        .parse()
        .map_err(|_| pmi_err(format!("PMI-2 length {text:?} is not a number")))?;
    if len > MAX_REPLY {
        return Err(pmi_err(format!("PMI-2 frame of {len} bytes is too long")));
    }
    Ok(len)
}

/// Parses a PMI-2 frame body (`cmd=NAME;k=v;...`) into its pairs; `;;` is a
/// `;` inside a value.
pub(crate) fn pmi2_parse(body: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut chars = body.chars().peekable();
    let finish = |field: &mut String, out: &mut Vec<(String, String)>| -> Result<()> {
        if field.is_empty() {
            return Ok(());
        }
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| pmi_err(format!("malformed PMI-2 field {field:?}")))?;
        out.push((k.to_string(), v.to_string()));
        field.clear();
        Ok(())
    };
    while let Some(c) = chars.next() {
        if c == ';' {
            if chars.peek() == Some(&';') {
                chars.next();
                field.push(';');
            } else {
                finish(&mut field, &mut out)?;
            }
        } else {
            field.push(c);
        }
    }
    finish(&mut field, &mut out)?;
    if out.first().map(|(k, _)| k.as_str()) != Some("cmd") {
        return Err(pmi_err(format!("PMI-2 frame without cmd: {body:?}")));
    }
    Ok(out)
}

/// The value of `key` in parsed pairs.
pub(crate) fn field<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Room a key needs for the chunk suffix (`~` and up to 5 digits).
const SUFFIX_ROOM: usize = 6;

/// The PMI key for a bootstrap key, at most `keylen_max - SUFFIX_ROOM`
/// bytes of `[A-Za-z0-9._-~]`.
pub(crate) fn encode_key(key: &str, keylen_max: usize) -> String {
    let plain = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if plain && 1 + key.len() + SUFFIX_ROOM <= keylen_max {
        format!("x{key}")
    } else {
        let digest = Sha256::digest(key.as_bytes());
        format!("h{}", hex::encode(&digest[..16]))
    }
}

/// Lower-case hex digits of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// The bytes of hex digits `text`.
pub(crate) fn unhex(text: &str) -> Result<Vec<u8>> {
    hex::decode(text).map_err(|e| match e {
        hex::FromHexError::OddLength => pmi_err("odd number of hex digits in a value"),
        e => pmi_err(format!("value is not hex: {e}")),
    })
}

/// The hex digits per key for a launcher whose values are at most
/// `vallen_max` bytes: even, with room for the `CHUNKS:` header, and at
/// most 640 so a PMI-1 line stays under 1024 bytes.
pub(crate) fn chunk_digits(vallen_max: usize) -> usize {
    (vallen_max.saturating_sub(16).min(640) & !1).max(2)
}

/// `value` as the PMI values of its keys: the first `CHUNKS:HEX`, the
/// others `HEX`, each at most `digits` hex digits (plus the header).
pub(crate) fn split_value(value: &[u8], digits: usize) -> Vec<String> {
    let all = hex(value);
    let mut parts: Vec<&str> = all
        .as_bytes()
        .chunks(digits)
        .map(|c| std::str::from_utf8(c).expect("hex is ASCII"))
        .collect();
    if parts.is_empty() {
        parts.push("");
    }
    let n = parts.len();
    parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            if i == 0 {
                format!("{n}:{p}")
            } else {
                p.to_string()
            }
        })
        .collect()
}

/// The key of chunk `i` (`i >= 1`) of the value under PMI key `key`.
pub(crate) fn chunk_key(key: &str, i: usize) -> String {
    format!("{key}~{i}")
}

/// Joins a value split by [`split_value`] with `digits` hex digits per
/// part: `first` is the value of bootstrap key `key`'s PMI key, `more(i)`
/// fetches part `i`.
///
/// The announced part count is checked against the most a value of
/// [`MAX_VALUE_LEN`](super::wire::MAX_VALUE_LEN) bytes needs before any part
/// is fetched, and every part against `digits`, so a hostile or corrupt
/// record costs a few round trips, not a million; a violation is an
/// [`Error::Protocol`] naming `key`.
pub(crate) fn join_value(
    key: &str,
    first: &str,
    digits: usize,
    mut more: impl FnMut(usize) -> Result<String>,
) -> Result<Vec<u8>> {
    let max_len = super::wire::MAX_VALUE_LEN;
    let bad = |what: String| pmi_err(format!("value of {key:?}: {what}"));
    let (n, head) = first
        .split_once(':')
        .ok_or_else(|| bad("no part count".into()))?;
    let n: usize = n
        .parse()
        .map_err(|_| bad(format!("part count {n:?} is not a number")))?;
    let max_parts = (2 * max_len).div_ceil(digits.max(2)).max(1);
    if n == 0 || n > max_parts {
        return Err(bad(format!(
            "{n} parts announced; a value of at most {max_len} bytes has 1..={max_parts}"
        )));
    }
    let mut out = Vec::new();
    for i in 0..n {
        let part = if i == 0 { head.to_string() } else { more(i)? };
        if part.len() > digits {
            return Err(bad(format!(
                "part {i} has {} hex digits, more than {digits}",
                part.len()
            )));
        }
        out.extend(unhex(&part)?);
        if out.len() > max_len {
            return Err(bad(format!("longer than {max_len} bytes")));
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The session

/// This process's connection to its PMI launcher (one per process: PMI
/// allows one `init`).
pub(crate) struct Session {
    wire: Wire,
    rank: Rank,
    size: usize,
    job: String,
    keylen_max: usize,
    vallen_max: usize,
    conn: Mutex<Conn>,
    finalized: Mutex<bool>,
}

struct Conn {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Conn {
    fn request(
        &mut self,
        wire: Wire,
        cmd: &str,
        args: &[(&str, &str)],
    ) -> Result<Vec<(String, String)>> {
        match wire {
            Wire::Pmi1 => {
                let line = pmi1_command(cmd, args);
                self.writer
                    .write_all(line.as_bytes())
                    .map_err(|e| io_err(&format!("sending {cmd}"), e))?;
                let mut reply = Vec::new();
                let n = (&mut self.reader)
                    .take(MAX_REPLY as u64)
                    .read_until(b'\n', &mut reply)
                    .map_err(|e| io_err(&format!("waiting for the reply to {cmd}"), e))?;
                if n == 0 {
                    return Err(io_err(
                        &format!("the launcher closed PMI_FD during {cmd}"),
                        io::ErrorKind::UnexpectedEof.into(),
                    ));
                }
                let text = String::from_utf8(reply)
                    .map_err(|_| pmi_err(format!("reply to {cmd} is not UTF-8")))?;
                pmi1_parse(&text)
            }
            Wire::Pmi2 => {
                let frame = pmi2_frame(cmd, args)?;
                self.writer
                    .write_all(&frame)
                    .map_err(|e| io_err(&format!("sending {cmd}"), e))?;
                let mut head = [0u8; 6];
                self.reader
                    .read_exact(&mut head)
                    .map_err(|e| io_err(&format!("waiting for the reply to {cmd}"), e))?;
                let len = pmi2_length(&head)?;
                let mut body = vec![0u8; len];
                self.reader
                    .read_exact(&mut body)
                    .map_err(|e| io_err(&format!("reading the reply to {cmd}"), e))?;
                let text = String::from_utf8(body)
                    .map_err(|_| pmi_err(format!("reply to {cmd} is not UTF-8")))?;
                pmi2_parse(&text)
            }
        }
    }
}

/// Checks a reply's command name and `rc`.
fn expect(reply: &[(String, String)], cmd: &str, what: &str) -> Result<()> {
    let got = field(reply, "cmd").unwrap_or("");
    if got != cmd {
        return Err(pmi_err(format!("{what}: expected {cmd}, got {got}")));
    }
    match field(reply, "rc") {
        None | Some("0") => Ok(()),
        Some(rc) => Err(pmi_err(format!(
            "{what} failed: rc={rc} {}",
            field(reply, "msg").or(field(reply, "errmsg")).unwrap_or("")
        ))),
    }
}

fn parse_number(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a non-negative integer")))
}

/// The process's PMI session, set up on first use.
pub(crate) fn session(wire: Wire) -> Result<Arc<Session>> {
    static SESSION: OnceLock<Result<Arc<Session>>> = OnceLock::new();
    let s = SESSION.get_or_init(|| {
        let s = Arc::new(Session::init(wire)?);
        AT_EXIT.get_or_init(|| s.clone());
        // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that never
        // unwinds (it catches nothing and panics on nothing: it only does
        // best-effort I/O), as atexit requires.
        unsafe { libc::atexit(finalize_at_exit) };
        Ok(s)
    });
    let s = s.clone()?;
    if s.wire != wire {
        return Err(Error::Config(format!(
            "PMI was set up as {:?} already, not {wire:?}",
            s.wire
        )));
    }
    Ok(s)
}

static AT_EXIT: OnceLock<Arc<Session>> = OnceLock::new();

extern "C" fn finalize_at_exit() {
    if let Some(s) = AT_EXIT.get() {
        s.finalize();
    }
}

/// What the launcher told this process at `init`: its place in the job and
/// the launcher's limits on keys and values.
struct Placement {
    rank: Rank,
    size: usize,
    job: String,
    keylen_max: usize,
    vallen_max: usize,
}

impl Placement {
    /// Checks that the rank is in the job, the job's name fits, and the
    /// launcher's limits leave room for this backend's keys and values.
    fn check(&self) -> Result<()> {
        let (rank, size, job) = (self.rank, self.size, &self.job);
        let (keylen_max, vallen_max) = (self.keylen_max, self.vallen_max);
        if size == 0 || rank >= size {
            return Err(Error::Config(format!(
                "PMI says rank {rank} of {size}: out of range"
            )));
        }
        if job.is_empty() || job.len() > super::wire::MAX_JOB_LEN {
            return Err(pmi_err(format!("job name {job:?} is empty or too long")));
        }
        if keylen_max < 16 + SUFFIX_ROOM + 2 || vallen_max < 32 {
            return Err(pmi_err(format!(
                "the launcher's limits (keys {keylen_max}, values {vallen_max} bytes) are too small"
            )));
        }
        Ok(())
    }
}

/// The environment variable `name`, if set (and Unicode).
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Takes over the launcher's socket named in [`PMI_FD`], once it is seen to
/// be an open socket, and keeps children from inheriting it.
fn take_pmi_fd() -> Result<UnixStream> {
    let fd_text = env_var(PMI_FD).ok_or_else(|| Error::Config(format!("{PMI_FD} is not set")))?;
    let fd: RawFd = fd_text
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("{PMI_FD}={fd_text:?} is not a file descriptor")))?;
    // SAFETY: `stat` is plain old data, for which all zeroes is a value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer; fstat on any
    // integer is sound (it fails for one that is not an open fd).
    if fd < 0 || unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::Config(format!(
            "{PMI_FD}={fd} is not an open file descriptor (started by a PMI launcher?)"
        )));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(Error::Config(format!(
            "{PMI_FD}={fd} is not a socket (started by a PMI launcher?)"
        )));
    }
    // SAFETY: the launcher gave this process the socket `fd` for PMI and
    // nothing else in the process uses it; this session takes it over
    // (one session per process, see `session`). Children must not
    // inherit it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: fcntl on the fd we now own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(stream)
}

/// Sets both timeouts of the launcher's socket (`None`: none).
fn set_timeouts(stream: &UnixStream, t: Option<Duration>) -> Result<()> {
    stream
        .set_read_timeout(t)
        .and_then(|()| stream.set_write_timeout(t))
        .map_err(|e| io_err("setting PMI_FD's timeouts", e))
}

impl Conn {
    /// PMI-1's `init`, `get_maxes` and `get_my_kvsname`; the rank and size
    /// come from [`PMI_RANK`] and [`PMI_SIZE`].
    fn init_pmi1(&mut self) -> Result<Placement> {
        let wire = Wire::Pmi1;
        let r = self.request(
            wire,
            "init",
            &[("pmi_version", "1"), ("pmi_subversion", "1")],
        )?;
        expect(&r, "response_to_init", "PMI-1 init")?;
        let r = self.request(wire, "get_maxes", &[])?;
        expect(&r, "maxes", "PMI-1 get_maxes")?;
        let keylen_max = parse_number("keylen_max", field(&r, "keylen_max").unwrap_or("64"))?;
        let vallen_max = parse_number("vallen_max", field(&r, "vallen_max").unwrap_or("1024"))?;
        let r = self.request(wire, "get_my_kvsname", &[])?;
        expect(&r, "my_kvsname", "PMI-1 get_my_kvsname")?;
        let job = field(&r, "kvsname")
            .ok_or_else(|| pmi_err("my_kvsname without kvsname"))?
            .to_string();
        let size = parse_number(
            PMI_SIZE,
            &env_var(PMI_SIZE).ok_or_else(|| Error::Config(format!("{PMI_SIZE} is not set")))?,
        )?;
        let rank = parse_number(
            PMI_RANK,
            &env_var(PMI_RANK).ok_or_else(|| Error::Config(format!("{PMI_RANK} is not set")))?,
        )?;
        Ok(Placement {
            rank,
            size,
            job,
            keylen_max,
            vallen_max,
        })
    }

    /// PMI-2's announcement (a PMI-1 `init` line asking for version 2), then
    /// `fullinit` and `job-getid`.
    fn init_pmi2(&mut self) -> Result<Placement> {
        let wire = Wire::Pmi2;
        let jobid = env_var(PMI_JOBID).unwrap_or_default();
        let rank_env = env_var(PMI_RANK).unwrap_or_else(|| "0".into());
        // A PMI-2 client announces itself with a PMI-1 line, then
        // speaks PMI-2 frames.
        let r = self.request(
            Wire::Pmi1,
            "init",
            &[("pmi_version", "2"), ("pmi_subversion", "0")],
        )?;
        expect(&r, "response_to_init", "PMI-2 init")?;
        if field(&r, "pmi_version") != Some("2") {
            return Err(pmi_err(format!(
                "the launcher does not speak PMI-2 (it answered pmi_version={})",
                field(&r, "pmi_version").unwrap_or("?")
            )));
        }
        let r = self.request(
            wire,
            "fullinit",
            &[
                ("pmijobid", &jobid),
                ("pmirank", &rank_env),
                ("threaded", "FALSE"),
            ],
        )?;
        expect(&r, "fullinit-response", "PMI-2 fullinit")?;
        let rank = parse_number("rank", field(&r, "rank").unwrap_or(&rank_env))?;
        let size = parse_number(
            "size",
            field(&r, "size")
                .map(str::to_string)
                .or_else(|| env_var(PMI_SIZE))
                .as_deref()
                .unwrap_or(""),
        )?;
        let r = self.request(wire, "job-getid", &[])?;
        expect(&r, "job-getid-response", "PMI-2 job-getid")?;
        let job = field(&r, "jobid")
            .map(str::to_string)
            .filter(|j| !j.is_empty())
            .unwrap_or(jobid);
        // Slurm's and MPICH's PMI-2 limits (PMI2_MAX_KEYLEN/VALLEN).
        Ok(Placement {
            rank,
            size,
            job,
            keylen_max: 64,
            vallen_max: 1024,
        })
    }
}

impl Session {
    fn init(wire: Wire) -> Result<Session> {
        let stream = take_pmi_fd()?;
        let writer = stream
            .try_clone()
            .map_err(|e| io_err("duplicating PMI_FD", e))?;
        set_timeouts(&stream, Some(INIT_TIMEOUT))?;
        let mut conn = Conn {
            reader: BufReader::new(
                stream
                    .try_clone()
                    .map_err(|e| io_err("duplicating PMI_FD", e))?,
            ),
            writer,
        };
        let placement = match wire {
            Wire::Pmi1 => conn.init_pmi1()?,
            Wire::Pmi2 => conn.init_pmi2()?,
        };
        placement.check()?;
        let Placement {
            rank,
            size,
            job,
            keylen_max,
            vallen_max,
        } = placement;
        // Collectives may legitimately wait for slow peers.
        set_timeouts(&stream, None)?;
        Ok(Session {
            wire,
            rank,
            size,
            job,
            keylen_max,
            vallen_max,
            conn: Mutex::new(conn),
            finalized: Mutex::new(false),
        })
    }

    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn job(&self) -> &str {
        &self.job
    }

    pub(crate) fn wire(&self) -> Wire {
        self.wire
    }

    fn request(&self, cmd: &str, args: &[(&str, &str)]) -> Result<Vec<(String, String)>> {
        lock(&self.conn).request(self.wire, cmd, args)
    }

    fn put_raw(&self, key: &str, value: &str) -> Result<()> {
        match self.wire {
            Wire::Pmi1 => {
                let r = self.request(
                    "put",
                    &[("kvsname", &self.job), ("key", key), ("value", value)],
                )?;
                expect(&r, "put_result", "PMI-1 put")
            }
            Wire::Pmi2 => {
                let r = self.request("kvs-put", &[("key", key), ("value", value)])?;
                expect(&r, "kvs-put-response", "PMI-2 kvs-put")
            }
        }
    }

    /// The value of `key` if the launcher has it.
    fn get_raw(&self, key: &str) -> Result<Option<String>> {
        match self.wire {
            Wire::Pmi1 => {
                let r = self.request("get", &[("kvsname", &self.job), ("key", key)])?;
                if field(&r, "cmd") != Some("get_result") {
                    return Err(pmi_err("PMI-1 get: unexpected reply"));
                }
                match field(&r, "rc") {
                    Some("0") => Ok(field(&r, "value").map(str::to_string)),
                    _ => Ok(None),
                }
            }
            Wire::Pmi2 => {
                let r = self.request(
                    "kvs-get",
                    &[("jobid", &self.job), ("srcid", "-1"), ("key", key)],
                )?;
                expect(&r, "kvs-get-response", "PMI-2 kvs-get")?;
                if field(&r, "found") == Some("TRUE") {
                    Ok(field(&r, "value").map(str::to_string))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// Publishes `value` under bootstrap key `key` (visible to the other
    /// ranks after the next fence).
    pub(crate) fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = encode_key(key, self.keylen_max);
        for (i, part) in split_value(value, chunk_digits(self.vallen_max))
            .iter()
            .enumerate()
        {
            if i == 0 {
                self.put_raw(&k, part)?;
            } else {
                self.put_raw(&chunk_key(&k, i), part)?;
            }
        }
        Ok(())
    }

    /// The value of bootstrap key `key`, if published.
    pub(crate) fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let k = encode_key(key, self.keylen_max);
        let Some(first) = self.get_raw(&k)? else {
            return Ok(None);
        };
        join_value(key, &first, chunk_digits(self.vallen_max), |i| {
            self.get_raw(&chunk_key(&k, i))?
                .ok_or_else(|| pmi_err(format!("chunk {i} of {key:?} is missing")))
        })
        .map(Some)
    }

    /// The launcher's barrier, which also publishes what was put.
    pub(crate) fn fence(&self) -> Result<()> {
        match self.wire {
            Wire::Pmi1 => {
                let r = self.request("barrier_in", &[])?;
                expect(&r, "barrier_out", "PMI-1 barrier")
            }
            Wire::Pmi2 => {
                let r = self.request("kvs-fence", &[])?;
                expect(&r, "kvs-fence-response", "PMI-2 kvs-fence")
            }
        }
    }

    /// Tells the launcher this process is done with PMI (once; at exit).
    fn finalize(&self) {
        let mut done = lock(&self.finalized);
        if *done {
            return;
        }
        *done = true;
        // A thread blocked in a fence holds the connection: don't wait.
        let Ok(mut conn) = self.conn.try_lock() else {
            return;
        };
        let _ = conn.writer.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = conn
            .reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)));
        let _ = conn.request(self.wire, "finalize", &[]);
    }
}

#[cfg(test)]
mod tests;
