//! Open the device the launcher names and exchange messages: every rank
//! greets rank 0, and rank 0 answers each greeting.
//!
//! ```text
//! xdev-run -n 3 --device shm -- target/release/examples/hello
//! ```

use xdev::bootstrap::{config_from_env, device_from_env};
use xdev::{Source, TagSel, ANY_SOURCE};

const CONTEXT: xdev::Context = 7;
const GREETING: xdev::Tag = 1;
const ANSWER: xdev::Tag = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Rank, size and job come from the launcher's environment; the device
    // name from XDEV_DEVICE (`xdev-run --device NAME` sets it).
    let config = config_from_env()?;
    let name = device_from_env().ok_or("XDEV_DEVICE is not set")?;
    let dev = ibvx::registry().open(&name, &config)?;
    let (rank, size) = (dev.id(), dev.size());

    if rank == 0 {
        for _ in 1..size {
            let mut buf = [0u8; 64];
            let st = dev.recv(&mut buf, ANY_SOURCE, TagSel::Tag(GREETING), CONTEXT)?;
            let text = std::str::from_utf8(&buf[..st.count])?;
            println!("rank 0 got from rank {}: {text}", st.source);
            dev.send(b"welcome", st.source, ANSWER, CONTEXT)?;
        }
        println!("hello: {size} ranks on {name}");
    } else {
        let hi = format!("hello from rank {rank} of {size}");
        dev.send(hi.as_bytes(), 0, GREETING, CONTEXT)?;
        let mut buf = [0u8; 7];
        dev.recv(&mut buf, Source::Rank(0), TagSel::Tag(ANSWER), CONTEXT)?;
        assert_eq!(&buf, b"welcome");
    }
    // Every rank finishes: its peers may still be talking to it until then.
    dev.finish()?;
    Ok(())
}
