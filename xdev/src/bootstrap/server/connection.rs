//! One connection's thread: its handshake, then serving the authenticated
//! rank's requests until the connection closes.

use std::io::BufReader;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::handshake::handshake;
use super::{lock, send_all, CollKind, Conn, Shared, Slot};
use crate::bootstrap::wire::{self, Message, MAX_FRAME_LEN};
use crate::Rank;

pub(super) fn run_connection(shared: &Arc<Shared>, id: u64, stream: TcpStream, heard: &AtomicBool) {
    let accepted = handshake(shared, &stream, heard);
    lock(&shared.pending).remove(&id);
    shared.handshakes.fetch_sub(1, Ordering::SeqCst);
    if let Some((rank, conn)) = accepted {
        serve(shared, rank, &conn, &stream);
    }
    let _ = stream.shutdown(Shutdown::Both);
    lock(&shared.conns).sockets.remove(&id);
}

/// Serves an authenticated rank until its connection closes or misbehaves,
/// then records its departure and tells the others.
fn serve(shared: &Shared, rank: Rank, conn: &Arc<Conn>, stream: &TcpStream) {
    let limit = shared.opts.max_store_bytes;
    let mut reader = BufReader::new(stream);
    loop {
        let msg = match wire::read_message(&mut reader, MAX_FRAME_LEN, rank) {
            Ok(Some(m)) => m,
            // End of stream, I/O failure or a malformed frame: the
            // connection is closed either way.
            Ok(None) | Err(_) => break,
        };
        let out = {
            let mut st = lock(&shared.state);
            match msg {
                Message::Put { id, key, value } => st.put(limit, rank, id, key, value),
                Message::Get { id, key } => st.get(shared.opts.max_waiting_gets, rank, id, key),
                Message::Cancel { id } => {
                    st.cancel(rank, id);
                    Vec::new()
                }
                Message::Barrier { id } => {
                    st.arrive(limit, rank, id, CollKind::Barrier, Vec::new())
                }
                Message::Allgather { id, value } => {
                    st.arrive(limit, rank, id, CollKind::Allgather, value)
                }
                Message::Goodbye => {
                    st.slots[rank] = Slot::Live {
                        conn: conn.clone(),
                        goodbye: true,
                    };
                    Vec::new()
                }
                // A service-to-client message from a client: a protocol
                // violation, which closes the connection.
                _ => break,
            }
        };
        send_all(out);
    }
    let _ = stream.shutdown(Shutdown::Both);
    let out = {
        let mut st = lock(&shared.state);
        st.depart(rank).1
    };
    shared.changed.notify_all();
    send_all(out);
}
