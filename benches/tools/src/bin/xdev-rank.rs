//! `xdev-rank`: one rank of a test job on any multi-process device of this
//! workspace, named by `XDEV_DEVICE` (`xdev-run --device NAME` sets it).
//!
//! ```text
//! xdev-rank conformance CASE [KEY=VALUE...]   run one xdev conformance case
//!                                             (`all`: every case, in order)
//! xdev-rank peer-exit [KEY=VALUE...]          rank 1 leaves; rank 0's operations
//!                                             involving it fail with PeerLost
//! xdev-rank peer-killed [KEY=VALUE...]       rank 1 writes its pid to the file named
//!                                             by XDEV_RANK_PIDFILE and waits to be
//!                                             killed; the others' receives from it
//!                                             fail with PeerLost
//! xdev-rank inflight-send [KEY=VALUE...]      rank 1 leaves with a rendezvous send
//!                                             to it in flight: the send fails, its
//!                                             data comes back
//! xdev-rank finish-posted [KEY=VALUE...]      receives still posted at finish, and
//!                                             operations after it, fail with Closed
//! xdev-rank posted-truncation [KEY=VALUE...]  a large message into a smaller
//!                                             receive posted before it was sent
//! xdev-rank bootstrap                         the launcher's bootstrap alone: prints
//!                                             `rank R of N in job J via LAUNCHER`,
//!                                             checks an allgather, a 20 KB value
//!                                             put by the previous rank and the
//!                                             timeout of a get nobody answers
//! xdev-rank impersonate [KEY=VALUE...]        3 ranks, shm: rank 2 republishes rank
//!                                             1's record with its own socket (a
//!                                             hostile rank); nobody but rank 1 may
//!                                             read what rank 0 sends to rank 1
//! xdev-rank cases                             list the conformance cases (no job)
//! ```
//! Exits 0 on success, 1 with a message on failure.

use std::process::ExitCode;

use xdev::devkit::conformance::{barrier, check, fill, run_all, run_case};
use xdev::{Config, Device};

fn config(options: &[String]) -> Result<Config, String> {
    xdev::bootstrap::config_from_env()
        .and_then(|c| c.with_assignments(options))
        .map_err(|e| e.to_string())
}

fn open(options: &[String]) -> Result<std::sync::Arc<dyn Device>, String> {
    let name = xdev::bootstrap::device_from_env()
        .ok_or("XDEV_DEVICE is not set (xdev-run --device NAME sets it)")?;
    let cfg = config(options)?;
    ibvx::registry()
        .open(&name, &cfg)
        .map_err(|e| format!("open {name}: {e}"))
}

const USAGE: &str = "usage: xdev-rank conformance CASE [K=V...] | posted-truncation [K=V...] \
     | peer-exit [K=V...] | peer-killed [K=V...] | bootstrap | inflight-send [K=V...] \
     | finish-posted [K=V...] | impersonate [K=V...] | cases";

/// The command line (without the program name), read with `lexopt`: a
/// command and its positional arguments; `-h`/`--help` gives the usage, any
/// other option is an error.
fn arguments(args: impl IntoIterator<Item = std::ffi::OsString>) -> Result<Vec<String>, String> {
    use lexopt::Arg;
    let mut p = lexopt::Parser::from_args(args);
    let mut out = Vec::new();
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Arg::Value(v) => out.push(
                v.into_string()
                    .map_err(|v| format!("argument {v:?} is not UTF-8"))?,
            ),
            Arg::Short('h') | Arg::Long("help") => return Err(USAGE.into()),
            Arg::Short(c) => return Err(format!("unknown option \"-{c}\"\n{USAGE}")),
            Arg::Long(l) => return Err(format!("unknown option \"--{l}\"\n{USAGE}")),
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    xdev_tools::init_tracing("xdev-rank");
    let args = match arguments(std::env::args_os().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("xdev-rank: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = match args.first().map(String::as_str) {
        Some("conformance") if args.len() >= 2 => conformance(&args[1], &args[2..]),
        Some("cases") => {
            for (name, _) in xdev::devkit::conformance::CASES {
                println!("{name}");
            }
            Ok(())
        }
        Some("posted-truncation") => posted_truncation(&args[1..]),
        Some("peer-exit") => peer_exit(&args[1..]),
        Some("inflight-send") => inflight_send(&args[1..]),
        Some("peer-killed") => peer_killed(&args[1..]),
        Some("bootstrap") => bootstrap_check(),
        Some("finish-posted") => finish_posted(&args[1..]),
        Some("impersonate") => impersonate(&args[1..]),
        _ => Err(USAGE.into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xdev-rank: {e}");
            ExitCode::FAILURE
        }
    }
}

fn conformance(case: &str, options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    if case == "all" {
        run_all(&*dev).map_err(|f| f.to_string())?;
    } else {
        run_case(&*dev, case).map_err(|f| f.to_string())?;
    }
    // Everyone is done with the case before anyone closes its endpoint.
    barrier(&*dev).map_err(|e| format!("final barrier: {e}"))?;
    dev.finish().map_err(|e| format!("finish: {e}"))?;
    if dev.id() == 0 {
        println!(
            "conformance {case}: passed on {} with {} ranks",
            dev.name(),
            dev.size()
        );
    }
    Ok(())
}

/// Rank 0 posts a 1000-byte receive, then rank 1 sends 1 MiB to it (a
/// rendezvous on every device): the receive must report the truncation with
/// the sender's length, and the bytes that fit must be intact.
fn posted_truncation(options: &[String]) -> Result<(), String> {
    const LEN: usize = 1 << 20;
    let dev = open(options)?;
    let ctx = 0x5452_554e;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    match dev.id() {
        0 => {
            let r = dev.irecv(
                xdev::Buffer::zeroed(1000),
                xdev::Source::Rank(1),
                xdev::TagSel::Tag(1),
                ctx,
            );
            barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
            let done = r.wait();
            match done.status.error.as_deref() {
                Some(xdev::Error::Truncated {
                    message_len,
                    capacity,
                    ..
                }) if *message_len == LEN && *capacity == 1000 => {}
                other => {
                    return Err(format!(
                        "posted receive of 1 MiB into 1000 bytes: {other:?}"
                    ))
                }
            }
            if done.buf[..] != data[..1000] {
                return Err("the bytes that fit differ".into());
            }
        }
        1 => {
            barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
            dev.send(&data, 0, 1, ctx)
                .map_err(|e| format!("send: {e}"))?;
        }
        _ => barrier(&*dev).map_err(|e| format!("barrier: {e}"))?,
    }
    barrier(&*dev).map_err(|e| format!("final barrier: {e}"))?;
    dev.finish().map_err(|e| format!("finish: {e}"))
}

/// Rank 1 exits right after a barrier, without finishing. Rank 0's receive
/// from it, a new send to it and a probe naming it fail with PeerLost, and
/// rank 0 still finishes.
fn peer_exit(options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    let ctx = 0x4558_4954;
    barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
    if dev.id() == 1 {
        std::process::exit(0);
    }
    if dev.id() != 0 {
        return dev.finish().map_err(|e| format!("finish: {e}"));
    }
    let lost = |what: &str, r: Option<&xdev::Error>| match r {
        Some(xdev::Error::PeerLost { rank: 1, .. }) => Ok(()),
        other => Err(format!(
            "{what}: expected PeerLost from rank 1, got {other:?}"
        )),
    };
    let done = dev
        .irecv(
            xdev::Buffer::zeroed(8),
            xdev::Source::Rank(1),
            xdev::TagSel::Any,
            ctx,
        )
        .wait();
    lost("irecv", done.status.error.as_deref())?;
    lost("send", dev.send(b"x", 1, 0, ctx).err().as_ref())?;
    lost(
        "probe",
        dev.probe(xdev::Source::Rank(1), xdev::TagSel::Any, ctx)
            .err()
            .as_ref(),
    )?;
    dev.finish().map_err(|e| format!("finish: {e}"))
}

/// The bootstrap of whichever launcher started this process: identity,
/// an allgather of the ranks, and a value larger than a PMI value (split
/// over several keys) put by each rank and read by the next after a barrier.
fn bootstrap_check() -> Result<(), String> {
    let boot = xdev::bootstrap::Bootstrap::from_env().map_err(|e| e.to_string())?;
    let (rank, size) = (boot.rank(), boot.size());
    println!(
        "rank {rank} of {size} in job {} via {:?}",
        boot.job(),
        boot.launcher()
    );
    let all = boot
        .allgather(&(rank as u32).to_le_bytes())
        .map_err(|e| format!("allgather: {e}"))?;
    let want: Vec<Vec<u8>> = (0..size as u32).map(|r| r.to_le_bytes().to_vec()).collect();
    if all != want {
        return Err(format!("allgather returned {all:?}"));
    }
    let value = |r: usize| -> Vec<u8> { (0..20_000).map(|i| (i * 13 + r * 7) as u8).collect() };
    boot.put(&format!("check.{rank}"), &value(rank))
        .map_err(|e| format!("put: {e}"))?;
    boot.barrier().map_err(|e| format!("barrier: {e}"))?;
    let prev = (rank + size - 1) % size;
    let got = boot
        .get(&format!("check.{prev}"), std::time::Duration::from_secs(30))
        .map_err(|e| format!("get: {e}"))?;
    if got != value(prev) {
        return Err(format!("rank {prev}'s value came back different"));
    }
    // A key nobody put: a timeout, neither a hang nor a protocol error.
    let t = std::time::Instant::now();
    match boot.get("never.put", std::time::Duration::from_millis(300)) {
        Err(xdev::Error::Transport { source, .. })
            if source
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut) => {}
        other => return Err(format!("get of a key nobody put: {other:?}")),
    }
    if t.elapsed() > std::time::Duration::from_secs(5) {
        return Err(format!("get of a key nobody put took {:?}", t.elapsed()));
    }
    boot.barrier().map_err(|e| format!("barrier: {e}"))
}

/// Rank 1 writes its pid to the file `XDEV_RANK_PIDFILE` names and sleeps
/// until it is killed (by the test that runs this, with SIGKILL); every
/// other rank waits for a message from it, which must fail with PeerLost
/// (not hang), says so on stdout and finishes.
fn peer_killed(options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    let ctx = 0x4b49_4c4c;
    barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
    if dev.id() == 1 {
        let path = std::env::var("XDEV_RANK_PIDFILE")
            .map_err(|_| "XDEV_RANK_PIDFILE is not set".to_string())?;
        std::fs::write(&path, format!("{}\n", std::process::id()))
            .map_err(|e| format!("writing {path}: {e}"))?;
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
    let done = dev
        .irecv(
            xdev::Buffer::zeroed(8),
            xdev::Source::Rank(1),
            xdev::TagSel::Any,
            ctx,
        )
        .wait();
    match done.status.error.as_deref() {
        Some(xdev::Error::PeerLost { rank: 1, .. }) => {
            println!("rank {}: PeerLost from rank 1", dev.id());
        }
        other => return Err(format!("expected PeerLost from rank 1, got {other:?}")),
    }
    dev.finish().map_err(|e| format!("finish: {e}"))
}

/// Rank 0 starts a 1 MiB send to rank 1 (a rendezvous on every device),
/// which rank 1 never receives: it exits right after a barrier, without
/// finishing. Waiting for the send fails with PeerLost (it does not wait
/// for `finish`), and rank 0 still finishes.
fn inflight_send(options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    let ctx = 0x464c_5954;
    let seed = 0x5EED;
    let mut buf = xdev::Buffer::zeroed(1 << 20);
    fill(&mut buf, seed);
    let at = buf.as_ptr() as usize;
    let send = (dev.id() == 0).then(|| dev.isend(buf, 1, 0, ctx));
    barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
    if dev.id() == 1 {
        std::process::exit(0);
    }
    if let Some(send) = send {
        let c = send.wait();
        match c.status.error.as_deref() {
            Some(xdev::Error::PeerLost { rank: 1, .. }) => {}
            other => {
                return Err(format!(
                    "isend: expected PeerLost from rank 1, got {other:?}"
                ))
            }
        }
        // Nothing is lost: the data comes back. PSM2 cannot cancel a send
        // it has taken, so psm hands back a copy and keeps the memory PSM2
        // may still read.
        if let Err(at) = check(&c.buf, seed) {
            return Err(format!(
                "isend: the buffer came back with other data at {at}"
            ));
        }
        if dev.name() == "psm" && c.buf.as_ptr() as usize == at {
            return Err("isend: psm handed back the memory PSM2 may still read".into());
        }
    }
    dev.finish().map_err(|e| format!("finish: {e}"))
}

/// Every rank posts receives that nothing matches (from itself, so that a
/// peer finishing first cannot fail it, and from any source), then all
/// finish: the receives end with Closed, as do a send and a receive started
/// afterwards.
fn finish_posted(options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    let ctx = 0x434c_5344;
    let me = dev.id();
    let posted = [xdev::Source::Rank(me), xdev::Source::Any]
        .map(|s| dev.irecv(xdev::Buffer::zeroed(8), s, xdev::TagSel::Any, ctx));
    barrier(&*dev).map_err(|e| format!("barrier: {e}"))?;
    dev.finish().map_err(|e| format!("finish: {e}"))?;
    let closed = |what: &str, r: Option<&xdev::Error>| match r {
        Some(xdev::Error::Closed) => Ok(()),
        other => Err(format!("{what}: expected Closed, got {other:?}")),
    };
    for (i, r) in posted.into_iter().enumerate() {
        closed(
            &format!("posted receive {i}"),
            r.wait().status.error.as_deref(),
        )?;
    }
    closed(
        "send after finish",
        dev.send(b"x", me, 0, ctx).err().as_ref(),
    )?;
    let late = dev.irecv(
        xdev::Buffer::zeroed(8),
        xdev::Source::Any,
        xdev::TagSel::Any,
        ctx,
    );
    closed("receive after finish", late.wait().status.error.as_deref())
}

/// A hostile rank (issue 21): with 3 ranks on shm, rank 2 republishes rank
/// 1's device record (rank 1's pid, learnt from a first allgather, and an
/// abstract socket rank 2 listens on) under the key rank 1's record has
/// under PMI (`ag.1.1`: the second allgather, rank 1), two seconds after
/// the others put theirs, then opens the device like everyone. Under a
/// launcher whose key store keeps the last put (Slurm's pmi2) the ranks
/// must refuse the record instead of sending rank 1's traffic to rank 2;
/// under one that ties keys to their putter (PMIx) the forged put changes
/// nothing. With `XDEV_IMPERSONATE=own` the forged record names rank 2's
/// own pid. Rank 0 sends one message to rank 1; rank 2 reports any message
/// it can see. Prints one line per rank saying what happened.
fn impersonate(options: &[String]) -> Result<(), String> {
    use std::os::linux::net::SocketAddrExt;
    let cfg = config(options)?;
    let boot = xdev::bootstrap::Bootstrap::from_env().map_err(|e| e.to_string())?;
    let rank = boot.rank();
    if boot.size() != 3 {
        return Err("impersonate needs 3 ranks".into());
    }
    let pids = boot
        .allgather(&std::process::id().to_le_bytes())
        .map_err(|e| format!("allgather: {e}"))?;
    let mut _listener = None;
    if rank == 2 {
        let opts = shm_ipc::ProcessOptions::from_config(&cfg).map_err(|e| e.to_string())?;
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("xdev-fd-{:032x}", nonce ^ u128::from(std::process::id()));
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| e.to_string())?;
        _listener =
            Some(std::os::unix::net::UnixListener::bind_addr(&addr).map_err(|e| e.to_string())?);
        let forged = shm_ipc::process::PeerInfo {
            // XDEV_IMPERSONATE=own: the forged record names rank 2's own
            // process (which does serve the socket) instead of rank 1's.
            pid: if std::env::var("XDEV_IMPERSONATE").as_deref() == Ok("own") {
                std::process::id()
            } else {
                u32::from_le_bytes(pids[1][..4].try_into().map_err(|_| "short pid")?)
            },
            nslots: opts.nslots() as u32,
            credit_bytes: opts.credit_bytes as u64,
            probe_addr: 0,
            probe_value: 0,
            segment: name,
        };
        std::thread::sleep(std::time::Duration::from_secs(2));
        boot.put("ag.1.1", &forged.encode())
            .map_err(|e| format!("put: {e}"))?;
        println!("rank 2: republished rank 1's record with its own socket");
    }
    let dev = shm_ipc::ProcessDevice::with_bootstrap(&cfg, boot)
        .map_err(|e| format!("rank {rank}: opening shm refused: {e}"))?;
    let ctx = 0x494d_5053;
    match rank {
        0 => {
            dev.send(b"for rank 1 only", 1, 7, ctx)
                .map_err(|e| format!("send: {e}"))?;
            println!("rank 0: sent the message for rank 1");
        }
        1 => {
            let mut buf = [0u8; 64];
            let st = dev
                .recv(&mut buf, xdev::Source::Rank(0), xdev::TagSel::Tag(7), ctx)
                .map_err(|e| format!("recv: {e}"))?;
            if &buf[..st.count] != b"for rank 1 only" {
                return Err("rank 1 received something else".into());
            }
            println!("rank 1: received the message meant for it");
        }
        _ => {
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_secs(2) {
                let seen = dev
                    .iprobe(xdev::Source::Any, xdev::TagSel::Any, ctx)
                    .map_err(|e| format!("iprobe: {e}"))?;
                if let Some(st) = seen {
                    println!("rank 2: READ A MESSAGE MEANT FOR ANOTHER RANK ({st:?})");
                    return Err("rank 2 saw a message".into());
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            println!("rank 2: saw no message");
        }
    }
    barrier(&dev).map_err(|e| format!("final barrier: {e}"))?;
    dev.finish().map_err(|e| format!("finish: {e}"))
}
