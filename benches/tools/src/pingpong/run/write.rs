//! The RDMA-write tests: `write_lat` and the client's loop of `write_bw`.

use std::time::Duration;

use ibvx::verbs::{RemoteAddr, SendFlags, SendOp, SendRequest, WcOpcode, WorkCompletion};

use super::check::{check_slots, fill, verify};
use super::completion::{poll_armed, run_error, wait_armed, wait_wc, wait_wc_idle, Watch};
use super::handshake::unexpected;
use super::resources::Resources;
use super::{Row, RowStats, Session, CLIENT_SEED};
use crate::pingpong::clock::cycles;
use crate::pingpong::error::PingpongError;
use crate::pingpong::net::Link;
use crate::pingpong::options::Options;
use crate::pingpong::perftest::PerftestBwReport;
use crate::pingpong::stats;
use crate::pingpong::wire::{BwReport, Message};

/// perftest's `run_iter_lat_write`: each side RDMA-writes `size` bytes whose
/// last byte is the iteration count, and polls the last byte of its own
/// region for the peer's; the client writes first.
pub(super) fn write_lat(
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
pub(super) type BwTimes = (Vec<u64>, Vec<(usize, u64)>);

/// The bandwidth client's window (how many writes may be outstanding) and
/// CQ moderation (every how many writes one is signaled).
fn bw_window(r: &Resources, o: &Options, size: usize, slots: usize) -> (usize, usize) {
    let window = if o.check { slots } else { o.window() as usize }
        .min(r.qp.caps().max_send_wr as usize)
        .max(1);
    // perftest: CQ moderation of 100 (at most the window), none above 8 KiB.
    let cq_mod = if o.events || size > 8192 {
        1
    } else {
        window.min(100)
    };
    (window, cq_mod)
}

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
    let (window, cq_mod) = bw_window(r, o, size, slots);
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
        record_completions(&wcs[..n], &mut completed, link, &what)?;
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

/// Records the completions `wcs`, all taken now, as completion points of a
/// bandwidth run; fails at the first failed one.
#[inline]
fn record_completions(
    wcs: &[WorkCompletion],
    completed: &mut Vec<(usize, u64)>,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<(), PingpongError> {
    let now = cycles();
    for wc in wcs {
        if let Err(e) = wc.ok() {
            return Err(run_error(link, what(), e));
        }
        let j = wc.wr_id() as usize;
        completed.push((j, now));
    }
    Ok(())
}

impl Session<'_> {
    /// The bandwidth client's measured loop for `size`-byte messages in
    /// `slots` slots, its row, and its report to the server.
    pub(super) fn one_size_bw_client(
        &mut self,
        size: usize,
        native: bool,
        slots: usize,
        w: &mut Watch,
    ) -> Result<(), PingpongError> {
        let (posted, completed) = write_bw_client(
            &mut self.r,
            &self.link,
            w,
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

    /// The bandwidth server's part of size `size`: waits for the client's
    /// last write, checks the data, and prints the client's report.
    pub(super) fn one_size_bw_server(
        &mut self,
        size: usize,
        native: bool,
        w: &mut Watch,
    ) -> Result<(), PingpongError> {
        if !native {
            // perftest's client runs every size, then reports once.
            return Ok(());
        }
        // Like perftest's server, do not spin while the client measures.
        let what = || format!("write_bw {size} B: waiting for the client's last write");
        let idle = Some(Duration::from_micros(500));
        let wc = wait_wc_idle(&self.r.recv_cq, self.o.events, idle, w, &self.link, &what)?;
        if wc.opcode() != WcOpcode::RecvRdmaWithImm || wc.imm_data() != Some(self.o.iters as u32) {
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
