//! Handling `PeerLost`: the last rank leaves the job without finishing its
//! device (as a crashed process would); the others' operations with it fail
//! with `Error::PeerLost`, and they go on among themselves.
//!
//! ```text
//! xdev-run -n 3 --device shm -- target/release/examples/peer_lost
//! ```

use std::process::exit;

use xdev::bootstrap::{config_from_env, device_from_env};
use xdev::{Error, Source, TagSel};

const CONTEXT: xdev::Context = 9;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = config_from_env()?;
    let name = device_from_env().ok_or("XDEV_DEVICE is not set")?;
    let dev = ibvx::registry().open(&name, &config)?;
    let (rank, size) = (dev.id(), dev.size());
    if size < 3 {
        return Err("peer_lost needs at least 3 ranks".into());
    }
    let leaver = size - 1;

    if rank == leaver {
        // Leave without `finish`, without a word: exit status 0, so the
        // launcher does not stop the job.
        exit(0);
    }
    // Wait for a message the leaver will never send.
    let mut buf = [0u8; 8];
    match dev.recv(&mut buf, Source::Rank(leaver), TagSel::Tag(1), CONTEXT) {
        Err(Error::PeerLost { rank: r, reason }) => {
            println!("rank {rank}: PeerLost from rank {r} ({reason})");
        }
        other => return Err(format!("rank {rank}: expected PeerLost, got {other:?}").into()),
    }
    // Sends to it fail the same way, at once.
    match dev.send(b"anyone?", leaver, 1, CONTEXT) {
        Err(Error::PeerLost { .. }) => {}
        other => return Err(format!("rank {rank}: send to a lost rank: {other:?}").into()),
    }
    // The survivors still talk: a ring among ranks 0..leaver.
    let (next, prev) = ((rank + 1) % leaver, (rank + leaver - 1) % leaver);
    dev.send(&(rank as u64).to_le_bytes(), next, 2, CONTEXT)?;
    dev.recv(&mut buf, Source::Rank(prev), TagSel::Tag(2), CONTEXT)?;
    if u64::from_le_bytes(buf) != prev as u64 {
        return Err(format!("rank {rank}: wrong message from rank {prev}").into());
    }
    println!("rank {rank}: survivors still exchange messages");
    dev.finish()?;
    Ok(())
}
