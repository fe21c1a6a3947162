//! Examples of the xdev API, one program each, all started as the ranks of
//! a job by a launcher (`xdev-run`, `srun`, `mpirun`) that names the device
//! in `XDEV_DEVICE`:
//!
//! - `hello`: open a device from the environment and exchange messages.
//! - `ring`: a token around a ring of all ranks, on any device and under
//!   any launcher.
//! - `nonblocking`: `isend`/`irecv` with owned buffers, many in flight.
//! - `peer_lost`: a rank leaves; the others' operations with it fail with
//!   `Error::PeerLost` and the job goes on without it.
//!
//! ```text
//! cargo build --release -p xdev-tools -p xdev-examples --examples
//! target/release/xdev-run -n 4 --device shm -- target/release/examples/ring
//! ```
//!
//! This library holds no code; it is there because a package needs a target
//! besides its examples.
