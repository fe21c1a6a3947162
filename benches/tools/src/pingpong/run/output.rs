//! The output: the header of a run and its rows (tables or JSON lines).

use ibvx::verbs::Gid;

use super::{Row, RowStats, Session};
use crate::pingpong::error::PingpongError;
use crate::pingpong::options::TestKind;
use crate::pingpong::stats::{self, BW_HEADER, LAT_HEADER, RESULT_LINE};

impl Session<'_> {
    pub(super) fn print_header(&mut self) -> Result<(), PingpongError> {
        if self.o.json {
            return Ok(());
        }
        let o = self.o;
        let mut h = self.header_params();
        h += &self.header_addresses();
        h += &format!("{RESULT_LINE}\n");
        h += if o.test.is_latency() {
            LAT_HEADER
        } else {
            BW_HEADER
        };
        h.push('\n');
        self.emit(&h)
    }

    /// The header's first part: the tool, the device, the port and the
    /// parameters of the run.
    fn header_params(&self) -> String {
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
        h
    }

    /// The header's second part: both sides' addresses.
    fn header_addresses(&self) -> String {
        let o = self.o;
        let l = &self.r.local;
        let mut h = String::new();
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
        h
    }

    pub(super) fn emit(&mut self, s: &str) -> Result<(), PingpongError> {
        self.out
            .write_all(s.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(|e| PingpongError::Io {
                what: "writing the results".into(),
                source: e,
            })
    }

    pub(super) fn emit_row(&mut self, row: Row) -> Result<(), PingpongError> {
        let line = match (&row.stats, self.o.json) {
            (RowStats::Latency(s), false) => stats::latency_row(row.size, row.iters, s),
            (RowStats::Latency(s), true) => self.rec.latency_json(row.size, row.iters, s),
            (RowStats::Bandwidth(s), false) => stats::bw_row(row.size as u64, row.iters, s),
            (RowStats::Bandwidth(s), true) => self.rec.bw_json(row.size as u64, row.iters, s),
        };
        self.rows.push(row);
        self.emit(&format!("{line}\n"))
    }
}
