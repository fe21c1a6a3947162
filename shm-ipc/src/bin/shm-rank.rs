//! `shm-rank`: one rank of a test job on the `shm` process device, started by
//! `xdev-run` (or by the shm-ipc tests, which serve the bootstrap
//! themselves).
//!
//! ```text
//! shm-rank conformance CASE [KEY=VALUE...]   run one xdev conformance case
//! shm-rank no-ptrace CASE [KEY=VALUE...]     the same in a process that others
//!                                            may not ptrace (so CMA is refused)
//! shm-rank victim [KEY=VALUE...]             dead-peer test (see tests/process_faults.rs)
//! shm-rank stream-victim sender|receiver [KEY=VALUE...]
//!                                             a peer dies in the middle of a pipelined transfer
//! ```
//! Exits 0 on success, 1 with a message on failure.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use shm_ipc::ProcessDevice;
use xdev::devkit::conformance::{barrier, run_case};
use xdev::{Buffer, Config, Device, Error, Source, TagSel};

fn config(options: &[String]) -> Result<Config, String> {
    xdev::bootstrap::config_from_env()
        .and_then(|c| c.with_assignments(options))
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("conformance") if args.len() >= 2 => conformance(&args[1], &args[2..]),
        Some("no-ptrace") if args.len() >= 2 => {
            forbid_ptrace().and_then(|()| conformance(&args[1], &args[2..]))
        }
        Some("victim") => victim(&args[1..]),
        Some("stream-victim") if args.len() >= 2 => stream_victim(&args[1], &args[2..]),
        _ => Err(
            "usage: shm-rank conformance CASE [K=V...] | victim [K=V...] \
             | stream-victim sender|receiver [K=V...]"
                .into(),
        ),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shm-rank: {e}");
            ExitCode::FAILURE
        }
    }
}

fn open(options: &[String]) -> Result<ProcessDevice, String> {
    let cfg = config(options)?;
    ProcessDevice::open(&cfg).map_err(|e| format!("open: {e}"))
}

fn conformance(case: &str, options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    if dev.id() == 0 {
        println!("rendezvous path: {:?}", dev.rendezvous());
    }
    run_case(&dev, case).map_err(|f| f.to_string())?;
    dev.finish().map_err(|e| format!("finish: {e}"))
}

/// Makes this process non-dumpable and drops `CAP_SYS_PTRACE`, so that
/// neither it nor its peers (which do the same) may `process_vm_readv` each
/// other: the kernel's real refusal, as under Yama or in a container.
fn forbid_ptrace() -> Result<(), String> {
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let mut caps = capabilities(None).map_err(|e| format!("capget: {e}"))?;
    caps.effective.remove(CapabilitySet::SYS_PTRACE);
    caps.permitted.remove(CapabilitySet::SYS_PTRACE);
    set_capabilities(None, caps).map_err(|e| format!("capset: {e}"))?;
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(|e| format!("prctl: {e}"))
}

/// Rank 1 is the victim: after a barrier it prints `ready` and waits to be
/// killed. The others have a receive from it, an unmatched rendezvous send
/// to it and a synchronous send to it in flight; each must fail with
/// PeerLost, new operations to it must fail at once, and the survivors must
/// still talk to each other and finish.
fn victim(options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    let ctx = 0x5151;
    barrier(&dev).map_err(|e| format!("barrier: {e}"))?;
    if dev.id() == 1 {
        println!("ready");
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    let recv = dev.irecv(Buffer::zeroed(64), Source::Rank(1), TagSel::Any, ctx);
    let big = dev.isend(Buffer::from(vec![7u8; 1 << 20]), 1, 1, ctx);
    let sync = dev.issend(Buffer::from(vec![1u8; 8]), 1, 2, ctx);
    let start = Instant::now();
    for (what, req) in [("irecv", recv), ("rendezvous isend", big), ("issend", sync)] {
        let done = req.wait();
        match done.status.error.as_deref() {
            Some(Error::PeerLost { rank: 1, .. }) => {}
            other => {
                return Err(format!(
                    "{what}: expected PeerLost from rank 1, got {other:?}"
                ))
            }
        }
    }
    let noticed = start.elapsed();
    let t = Instant::now();
    match dev.send(b"x", 1, 3, ctx) {
        Err(Error::PeerLost { rank: 1, .. }) => {}
        other => return Err(format!("send to the dead rank: {other:?}")),
    }
    if t.elapsed() > Duration::from_millis(100) {
        return Err(format!("send to the dead rank took {:?}", t.elapsed()));
    }
    // Survivors 0 and 2 still talk.
    let peer = 2 - dev.id();
    let mut got = [0u8; 4];
    dev.send(&(dev.id() as u32).to_le_bytes(), peer, 9, ctx)
        .map_err(|e| format!("survivor send: {e}"))?;
    dev.recv(&mut got, Source::Rank(peer), TagSel::Tag(9), ctx)
        .map_err(|e| format!("survivor recv: {e}"))?;
    if u32::from_le_bytes(got) as usize != peer {
        return Err("survivor message corrupted".into());
    }
    dev.finish().map_err(|e| format!("finish: {e}"))?;
    println!("noticed after {} ms", noticed.as_millis());
    Ok(())
}

/// Two ranks, a 64 MiB message by the pipelined copy (`cma=off`, small
/// rings). Rank 1 is the victim, as the `sender` or the `receiver`: it
/// takes part in the transfer until some fragments have moved, prints
/// `ready` and stops (the test kills it). Rank 0's side of the transfer must
/// fail with PeerLost, not hang and not report success, and rank 0 must then
/// finish.
fn stream_victim(role: &str, options: &[String]) -> Result<(), String> {
    const LEN: usize = 64 << 20;
    let dev = open(options)?;
    if dev.rendezvous() == &shm_ipc::RendezvousPath::Cma {
        return Err("stream-victim needs the pipelined path (cma=off)".into());
    }
    let ctx = 0x5152;
    barrier(&dev).map_err(|e| format!("barrier: {e}"))?;
    let victim_sends = match role {
        "sender" => true,
        "receiver" => false,
        other => return Err(format!("stream-victim: unknown role {other:?}")),
    };
    if dev.id() == 1 {
        let req = if victim_sends {
            dev.isend(Buffer::from(vec![3u8; LEN]), 0, 1, ctx)
        } else {
            dev.irecv(Buffer::zeroed(LEN), Source::Rank(0), TagSel::Tag(1), ctx)
        };
        // Drive the transfer for a while: it cannot end in this time
        // (a fragment per ring quarter), so it is in the middle of it.
        let t = Instant::now();
        let mut req = Some(req);
        while t.elapsed() < Duration::from_millis(20) {
            match req.take().expect("pending").test() {
                Ok(_) => return Err("the transfer ended before the kill".into()),
                Err(r) => req = Some(r),
            }
        }
        println!("ready");
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    let req = if victim_sends {
        dev.irecv(Buffer::zeroed(LEN), Source::Rank(1), TagSel::Tag(1), ctx)
    } else {
        dev.isend(Buffer::from(vec![4u8; LEN]), 1, 1, ctx)
    };
    let done = req.wait();
    let start = Instant::now();
    match done.status.error.as_deref() {
        Some(Error::PeerLost { rank: 1, .. }) => {}
        other => {
            return Err(format!(
                "the {} side: expected PeerLost from rank 1, got {other:?}",
                if victim_sends { "receiving" } else { "sending" }
            ))
        }
    }
    dev.finish().map_err(|e| format!("finish: {e}"))?;
    println!("noticed; finished {} ms later", start.elapsed().as_millis());
    Ok(())
}
