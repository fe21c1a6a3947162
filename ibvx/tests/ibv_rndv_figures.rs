//! Rendezvous latency and bandwidth of the `ibv` device between two
//! processes, 16 KiB to 4 MiB, from a reused user `Buffer`, from leased
//! memory (`Device::alloc_buffer`) and from a fresh `Buffer` per message;
//! then eager against rendezvous from 2 KiB to 64 KiB (for the choice of
//! `eager_limit`). A measurement, so `#[ignore]`: the VM suite runs it with
//! `--ignored --nocapture` over rxe. It re-executes this test binary as the
//! two ranks of a job (`XDEV_RANK` set); rank 0 prints the figures. Every
//! message's data is checked.
//!
//! With `IBVX_FIGURES=lat` a rank runs osu_latency's loop at 8 B (blocking
//! send and receive, `IBVX_FIGURES_ITERS` timed iterations after a tenth as
//! many for warm-up) and rank 0 prints `lat 8 US`: `ci/two-guest-suite.sh`
//! runs it with one rank per guest (`xdev-bench`'s ranks need shared memory
//! between them for their cache-line floor, so they cannot span guests).
#![cfg(feature = "ibv")]

use std::time::{Duration, Instant};

use ibvx::ibv::IbvDevice;
use xdev::bootstrap::{config_from_env, Bootstrap};
use xdev::devkit::launch::LocalJob;
use xdev::{Buffer, Device, Source, TagSel};

mod common;

/// Where a transfer's buffers come from.
#[derive(Clone, Copy, Debug)]
enum Memory {
    Reused,
    Leased,
    Fresh,
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed) as u8)
        .collect()
}

/// `old` again, or a new buffer (fresh mode, or none yet).
fn get(dev: &IbvDevice, mem: Memory, old: Option<Buffer>, len: usize) -> Buffer {
    match (mem, old) {
        (Memory::Reused | Memory::Leased, Some(b)) => b,
        (Memory::Leased, _) => dev.alloc_buffer(len).unwrap(),
        _ => Buffer::zeroed(len),
    }
}

/// Half the round trip of non-blocking `len`-byte messages in
/// microseconds (rank 0; rank 1 answers), the first round a warm-up.
fn latency(dev: &IbvDevice, mem: Memory, len: usize, iters: usize) -> f64 {
    let (me, peer) = (dev.id(), 1 - dev.id());
    let mut buf = None;
    let mut t = Instant::now();
    for i in 0..=iters {
        if i == 1 {
            t = Instant::now();
        }
        if me == 0 {
            let c = dev.isend(get(dev, mem, buf.take(), len), peer, 1, 0).wait();
            assert!(c.status.error.is_none(), "{:?}", c.status);
            buf = Some(c.buf);
        }
        let r = get(dev, mem, buf.take(), len);
        let c = dev.irecv(r, Source::Rank(peer), TagSel::Tag(1), 0).wait();
        assert_eq!(c.status.count, len, "{:?}", c.status);
        buf = Some(c.buf);
        if me == 1 {
            let c = dev.isend(get(dev, mem, buf.take(), len), peer, 1, 0).wait();
            buf = Some(c.buf);
        }
    }
    t.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

/// MB/s (10^6 bytes) of windows of 4 messages answered by a zero-byte
/// message (rank 0 sends, rank 1 checks every message), the first window a
/// warm-up.
fn bandwidth(dev: &IbvDevice, mem: Memory, len: usize, reps: usize) -> f64 {
    const WINDOW: usize = 4;
    let check = pattern(len, len);
    let mut bufs: Vec<Option<Buffer>> = (0..WINDOW).map(|_| None).collect();
    let mut t = Instant::now();
    for i in 0..=reps {
        if i == 1 {
            t = Instant::now();
        }
        let reqs: Vec<_> = bufs
            .iter_mut()
            .map(|o| {
                let mut b = get(dev, mem, o.take(), len);
                if dev.id() == 0 {
                    b.copy_from_slice(&check);
                    dev.isend(b, 1, 3, 0)
                } else {
                    dev.irecv(b, Source::Rank(0), TagSel::Tag(3), 0)
                }
            })
            .collect();
        for (o, r) in bufs.iter_mut().zip(reqs) {
            let c = r.wait();
            assert!(c.status.error.is_none(), "{:?}", c.status);
            if dev.id() == 1 {
                assert!(c.buf[..] == check[..], "{mem:?} {len}: corrupt data");
            }
            *o = Some(c.buf);
        }
        if dev.id() == 0 {
            dev.recv(&mut [], Source::Rank(1), TagSel::Tag(4), 0)
                .unwrap();
        } else {
            dev.send(&[], 0, 4, 0).unwrap();
        }
    }
    (reps * WINDOW * len) as f64 / t.elapsed().as_secs_f64() / 1e6
}

/// osu_latency at 8 B: half the round trip in microseconds, from rank 0.
fn blocking_latency(dev: &IbvDevice, iters: usize) -> f64 {
    let (me, peer) = (dev.id(), 1 - dev.id());
    let mut buf = [0xA5u8; 8];
    let mut t = Instant::now();
    for i in 0..iters + iters / 10 {
        if i == iters / 10 {
            t = Instant::now();
        }
        if me == 0 {
            dev.send(&buf, peer, 1, 0).unwrap();
            dev.recv(&mut buf, Source::Rank(peer), TagSel::Tag(1), 0)
                .unwrap();
        } else {
            dev.recv(&mut buf, Source::Rank(peer), TagSel::Tag(1), 0)
                .unwrap();
            dev.send(&buf, peer, 1, 0).unwrap();
        }
    }
    t.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

/// The rank's part: the table of `IBVX_FIGURES` (`rndv`, `cross` or `lat`).
fn rank() {
    let mut cfg = config_from_env().unwrap();
    for kv in std::env::var("IBVX_FIGURES_OPTIONS")
        .unwrap_or_default()
        .split(',')
    {
        if let Some((k, v)) = kv.split_once('=') {
            cfg = cfg.with(k, v);
        }
    }
    let dev = IbvDevice::with_bootstrap(&cfg, Bootstrap::from_env().unwrap()).unwrap();
    if std::env::var("IBVX_FIGURES").as_deref() == Ok("lat") {
        let iters = std::env::var("IBVX_FIGURES_ITERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1000);
        let us = blocking_latency(&dev, iters);
        if dev.id() == 0 {
            println!("lat 8 {us:.2}");
        }
        dev.finish().unwrap();
        return;
    }
    let cross = std::env::var("IBVX_FIGURES").as_deref() == Ok("cross");
    let (mut len, last) = if cross {
        (2048, 65536)
    } else {
        (16384, 4 << 20)
    };
    while len <= last {
        let (iters, reps) = if len <= 256 * 1024 { (20, 6) } else { (6, 2) };
        let mut row = format!("{} {len:>8}", if cross { "cross" } else { "rndv" });
        let modes: &[Memory] = if cross {
            &[Memory::Reused]
        } else {
            &[Memory::Reused, Memory::Leased, Memory::Fresh]
        };
        let mut bw = String::new();
        for &m in modes {
            row += &format!(" {:>9.1}", latency(&dev, m, len, iters));
            bw += &format!(" {:>9.1}", bandwidth(&dev, m, len, reps));
        }
        if dev.id() == 0 {
            println!("{row}   {bw}");
        }
        len *= 2;
    }
    if dev.id() == 0 {
        println!("cache {:?}", dev.cache().stats());
    }
    dev.finish().unwrap();
}

fn job(what: &str, options: &str) -> String {
    let me = std::env::current_exe().unwrap();
    let args = ["--exact", "rendezvous_figures", "--ignored", "--nocapture"];
    let env = [("IBVX_FIGURES", what), ("IBVX_FIGURES_OPTIONS", options)];
    let job = LocalJob::start(2, &me, &args, &env).expect("start job");
    let exits = job.wait(Duration::from_secs(900)).expect("job ends");
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
    exits[0]
        .stdout
        .lines()
        .filter(|l| l.starts_with(what) || l.starts_with("cache"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
#[ignore = "a measurement: the VM suite runs it"]
fn rendezvous_figures() {
    if std::env::var_os("XDEV_RANK").is_some() {
        return rank();
    }
    if common::open().is_none() {
        return;
    }
    println!("rndv     size  lat_us: reused   leased    fresh   MB/s: reused    leased     fresh");
    println!("{}", job("rndv", ""));
    println!("cross    size  lat_us: eager (eager_limit 64 KiB)   MB/s");
    println!("{}", job("cross", "eager_limit=65536,eager_window=4194304"));
    println!("cross    size  lat_us: rendezvous (eager_limit 1 KiB)   MB/s");
    println!("{}", job("cross", "eager_limit=1024"));
}
