//! Non-blocking exchange with owned buffers: every rank posts `WINDOW`
//! receives and `WINDOW` sends to its neighbours at once, then waits for
//! them. A request owns its buffer while it is in flight and gives it back
//! on completion (`wait_ok`), so nothing is borrowed across the wait and a
//! dropped request cannot leave the device writing into freed memory.
//! Buffers come from `alloc_buffer`, which lets a device hand out memory it
//! has registered already (verbs); `Buffer::from(Vec)` works everywhere.
//!
//! ```text
//! xdev-run -n 2 --device shm -- target/release/examples/nonblocking
//! ```

use xdev::bootstrap::{config_from_env, device_from_env};
use xdev::{Buffer, Source, TagSel};

const WINDOW: usize = 16;
/// Larger than every device's eager limit: these go by rendezvous.
const LEN: usize = 256 << 10;
const CONTEXT: xdev::Context = 3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = config_from_env()?;
    let name = device_from_env().ok_or("XDEV_DEVICE is not set")?;
    let dev = ibvx::registry().open(&name, &config)?;
    let (rank, size) = (dev.id(), dev.size());
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);

    // Receives first (any order works; posted first, they avoid copies of
    // unexpected messages).
    let recvs: Vec<_> = (0..WINDOW)
        .map(|i| {
            let buf = dev.alloc_buffer(LEN)?;
            Ok(dev.irecv(
                buf,
                Source::Rank(prev),
                TagSel::Tag(i as xdev::Tag),
                CONTEXT,
            ))
        })
        .collect::<Result<_, xdev::Error>>()?;
    let sends: Vec<_> = (0..WINDOW)
        .map(|i| {
            let data = vec![(rank * WINDOW + i) as u8; LEN];
            dev.isend(Buffer::from(data), next, i as xdev::Tag, CONTEXT)
        })
        .collect();

    let mut bytes = 0;
    for (i, r) in recvs.into_iter().enumerate() {
        // The buffer comes back with the data, or with the error.
        let (buf, st) = r.wait_ok().map_err(|f| f.error.clone())?;
        let want = (prev * WINDOW + i) as u8;
        if st.count != LEN || buf.iter().any(|&b| b != want) {
            return Err(format!("rank {rank}: message {i} from {prev} is wrong").into());
        }
        bytes += st.count;
    }
    for s in sends {
        let (buf, _) = s.wait_ok().map_err(|f| f.error.clone())?;
        // The send buffer is ours again: reuse it, or turn it back into a Vec.
        let _: Vec<u8> = buf.into_vec();
    }
    println!("nonblocking: rank {rank} of {size} on {name}: {WINDOW} messages, {bytes} bytes in, all checked");
    dev.finish()?;
    Ok(())
}
