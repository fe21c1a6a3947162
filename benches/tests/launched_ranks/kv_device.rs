//! A test device between processes over the bootstrap's key-value store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use xdev::bootstrap::Bootstrap;
use xdev::devkit::Tracker;
use xdev::registry::{Entry, Placement};
use xdev::{
    Buffer, Config, Context, Device, Envelope, Error, Peeked, Rank, Request, Source, Status, Tag,
    TagSel,
};

/// Only for these tests: a device between processes whose messages are
/// keys of the bootstrap's store (one round trip to the service each).
/// Slow, but like a real process device it holds its rank's bootstrap
/// connection, so the benchmark must coordinate through the device.
struct KvDevice {
    boot: Bootstrap,
    tracker: Tracker,
    sent: Mutex<HashMap<(Rank, Tag, Context), u64>>,
    taken: Mutex<HashMap<(Rank, Tag, Context), u64>>,
}

/// The registry entry of the KV test device.
pub fn kv_entry() -> Entry {
    Entry {
        name: "kv",
        description: "test device over the bootstrap key-value store",
        placement: Placement::Processes,
        options: &[],
        open: |cfg| Ok(Arc::new(KvDevice::open(cfg)?) as Arc<dyn Device>),
    }
}

fn next(counters: &Mutex<HashMap<(Rank, Tag, Context), u64>>, k: (Rank, Tag, Context)) -> u64 {
    let mut m = counters.lock().unwrap();
    let n = m.entry(k).or_insert(0);
    *n += 1;
    *n - 1
}

impl KvDevice {
    fn open(cfg: &Config) -> xdev::Result<KvDevice> {
        let boot = Bootstrap::from_env()?;
        assert_eq!((boot.rank(), boot.size()), (cfg.rank, cfg.size));
        Ok(KvDevice {
            boot,
            tracker: Tracker::new(),
            sent: Mutex::default(),
            taken: Mutex::default(),
        })
    }

    fn key(src: Rank, dst: Rank, tag: Tag, ctx: Context, seq: u64) -> String {
        format!("kv/{ctx}/{src}/{dst}/{tag}/{seq}")
    }

    fn exact(source: Source, tag: TagSel) -> xdev::Result<(Rank, Tag)> {
        match (source, tag) {
            (Source::Rank(r), TagSel::Tag(t)) => Ok((r, t)),
            _ => Err(Error::Config("kv test device: no wildcards".into())),
        }
    }

    /// The next message from `src`; consumes it when `take`.
    fn message(&self, src: Rank, tag: Tag, ctx: Context, take: bool) -> xdev::Result<Vec<u8>> {
        let k = (src, tag, ctx);
        let seq = if take {
            next(&self.taken, k)
        } else {
            self.taken.lock().unwrap().get(&k).copied().unwrap_or(0)
        };
        let key = Self::key(src, self.boot.rank(), tag, ctx, seq);
        self.boot.get(&key, Duration::from_secs(30))
    }
}

impl Device for KvDevice {
    fn name(&self) -> &'static str {
        "kv"
    }
    fn id(&self) -> Rank {
        self.boot.rank()
    }
    fn size(&self) -> usize {
        self.boot.size()
    }
    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> xdev::Result<()> {
        xdev::devkit::check_send(dest, tag, self.size())?;
        let seq = next(&self.sent, (dest, tag, context));
        self.boot
            .put(&Self::key(self.id(), dest, tag, context, seq), buf)
    }
    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> xdev::Result<()> {
        self.send(buf, dest, tag, context)
    }
    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> xdev::Result<Status> {
        let (src, tag) = Self::exact(source, tag)?;
        let m = self.message(src, tag, context, true)?;
        let n = m.len().min(buf.len());
        buf[..n].copy_from_slice(&m[..n]);
        let env = Envelope {
            source: src,
            tag,
            context,
        };
        Status::received(env, m.len(), buf.len()).into_result()
    }
    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        let st = match self.send(&buf, dest, tag, context) {
            Ok(()) => Status::ok(env, buf.len()),
            Err(e) => Status::failed(env, e),
        };
        self.tracker.completed(buf, st)
    }
    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.isend(buf, dest, tag, context)
    }
    fn irecv(&self, mut buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        let st = self
            .recv(&mut buf, source, tag, context)
            .unwrap_or_else(|e| {
                let env = Envelope {
                    source: 0,
                    tag: 0,
                    context,
                };
                Status::failed(env, e)
            });
        self.tracker.completed(buf, st)
    }
    fn probe(&self, source: Source, tag: TagSel, context: Context) -> xdev::Result<Status> {
        let (src, tag) = Self::exact(source, tag)?;
        let m = self.message(src, tag, context, false)?;
        let env = Envelope {
            source: src,
            tag,
            context,
        };
        Ok(Status::ok(env, m.len()))
    }
    fn iprobe(&self, _: Source, _: TagSel, _: Context) -> xdev::Result<Option<Status>> {
        Err(Error::Config("kv test device: no iprobe".into()))
    }
    fn peek(&self) -> xdev::Result<Option<Peeked>> {
        Ok(self.tracker.pop_completed())
    }
    fn finish(&self) -> xdev::Result<()> {
        Ok(())
    }
}
