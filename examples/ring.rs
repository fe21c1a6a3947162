//! A token around a ring of all ranks, `ROUNDS` times: rank 0 starts it,
//! every rank adds its rank number and passes it on. Rank 0 checks the sum.
//! Runs on any multi-process device and under any launcher:
//!
//! ```text
//! xdev-run -n 4 --device shm -- target/release/examples/ring
//! XDEV_DEVICE=shm srun --mpi=pmix -n 4 target/release/examples/ring
//! mpirun -np 4 -x XDEV_DEVICE=shm target/release/examples/ring
//! ```

use xdev::bootstrap::{config_from_env, device_from_env};
use xdev::{Source, TagSel};

const ROUNDS: u64 = 10;
const CONTEXT: xdev::Context = 1;
const TOKEN: xdev::Tag = 0;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = config_from_env()?;
    let name = device_from_env().ok_or("XDEV_DEVICE is not set")?;
    let dev = ibvx::registry().open(&name, &config)?;
    let (rank, size) = (dev.id(), dev.size());
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);

    let mut token = [0u8; 8];
    for round in 0..ROUNDS {
        if rank == 0 {
            let start = if round == 0 {
                0
            } else {
                u64::from_le_bytes(token)
            };
            dev.send(&start.to_le_bytes(), next, TOKEN, CONTEXT)?;
            dev.recv(&mut token, Source::Rank(prev), TagSel::Tag(TOKEN), CONTEXT)?;
        } else {
            dev.recv(&mut token, Source::Rank(prev), TagSel::Tag(TOKEN), CONTEXT)?;
            let v = u64::from_le_bytes(token) + rank as u64;
            dev.send(&v.to_le_bytes(), next, TOKEN, CONTEXT)?;
        }
    }
    if rank == 0 {
        let got = u64::from_le_bytes(token);
        let want = ROUNDS * (size as u64 * (size as u64 - 1) / 2);
        if got != want {
            return Err(format!("ring: token {got}, expected {want}").into());
        }
        println!("ring: {size} ranks on {name}, {ROUNDS} rounds, token {got}");
    }
    dev.finish()?;
    Ok(())
}
