//! The conformance case of the window calls (`isend_many`, `irecv_many`,
//! `Request::wait_all`).

use super::{checked, ctx, e, other, patterned, CaseResult, LARGE};
use crate::{Buffer, Device, Error, Request, Source, TagSel, ANY_SOURCE};

/// The window calls: `irecv_many` and `isend_many` keep the order of their
/// buffers (each receive gets the message of the same index, across eager
/// and rendezvous sizes, which a device may start by different paths), they
/// append to what `out` holds, `wait_all` gives the completions back in
/// order, and an invalid argument fails every request of the window, each
/// with its buffer.
pub(super) fn window_calls(dev: &dyn Device) -> CaseResult {
    const COUNT: usize = 24;
    // Mostly small, one message in the middle on the rendezvous path: a
    // device that batches eager sends must keep the rest behind it.
    let len = |i: usize| match i {
        9 => LARGE,
        _ => (i * 37) % 300,
    };
    let c = ctx(14, 0);
    let n = dev.size();
    let mut bufs: Vec<Buffer> = (0..3).map(|i| Buffer::from(vec![i as u8; 5])).collect();
    let mut out = Vec::new();
    dev.isend_many(&mut bufs, n, 0, c, &mut out);
    ensure!(
        bufs.is_empty() && out.len() == 3,
        "isend_many left {} buffers, made {} requests",
        bufs.len(),
        out.len()
    );
    let mut bufs: Vec<Buffer> = (0..2).map(|_| Buffer::zeroed(4)).collect();
    dev.irecv_many(&mut bufs, ANY_SOURCE, TagSel::Tag(-3), c, &mut out);
    let mut done = Vec::new();
    Request::wait_all(&mut out, &mut done);
    ensure!(
        out.is_empty() && done.len() == 5,
        "wait_all: {} left, {} done",
        out.len(),
        done.len()
    );
    for (i, d) in done.iter().enumerate() {
        let want_rank = i < 3;
        let ok = if want_rank {
            matches!(d.status.error.as_deref(), Some(Error::InvalidRank { .. }))
                && d.buf[..] == [i as u8; 5]
        } else {
            matches!(d.status.error.as_deref(), Some(Error::InvalidTag(-3))) && d.buf.len() == 4
        };
        ensure!(
            ok,
            "refused window request {i}: {:?}, {} bytes",
            d.status,
            d.buf.len()
        );
    }
    let me = dev.id();
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    if me > 1 {
        return Ok(());
    }
    // Both ranks of the pair post their receives, then their sends, as a
    // bidirectional window; `out` already holds a request, which stays first.
    let mut out = vec![dev.irecv(Buffer::zeroed(1), Source::Rank(peer), TagSel::Tag(9), c)];
    let mut rbufs: Vec<Buffer> = (0..COUNT).map(|i| Buffer::zeroed(len(i))).collect();
    dev.irecv_many(&mut rbufs, Source::Rank(peer), TagSel::Tag(7), c, &mut out);
    let mut sbufs: Vec<Buffer> = (0..COUNT)
        .map(|i| Buffer::from(patterned(len(i), (me * 1000 + i) as u64)))
        .collect();
    dev.isend_many(&mut sbufs, peer, 7, c, &mut out);
    ensure!(out.len() == 1 + 2 * COUNT, "{} requests", out.len());
    dev.send(&[me as u8], peer, 9, c).map_err(e("marker"))?;
    let mut done = Vec::with_capacity(out.len());
    Request::wait_all(&mut out, &mut done);
    let mut done = done.into_iter();
    let marker = done.next().expect("counted");
    ensure!(
        marker.status.error.is_none() && marker.buf[0] == peer as u8,
        "the request out held first: {:?}",
        marker.status
    );
    for (i, d) in done.by_ref().take(COUNT).enumerate() {
        let st = d.status;
        ensure!(st.error.is_none(), "window receive {i}: {:?}", st.error);
        ensure!(
            st.source == peer && st.tag == 7 && st.count == len(i),
            "window receive {i}: {st:?}"
        );
        checked(
            &d.buf,
            (peer * 1000 + i) as u64,
            &format!("window receive {i}"),
        )?;
    }
    for (i, d) in done.enumerate() {
        ensure!(
            d.status.error.is_none() && d.buf.len() == len(i),
            "window send {i}: {:?}",
            d.status
        );
    }
    Ok(())
}
