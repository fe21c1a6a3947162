//! The mapped copy: rendezvous from the sender's shared arena, copied from
//! its pages mapped into the receiver, and what a peer's claims about its
//! arena may not do.

use super::*;

/// `len` bytes of a pattern in a page-aligned buffer (in the shared arena
/// once a process device has turned it on).
fn shared_buffer(len: usize, seed: u32) -> Buffer {
    let mut b = Buffer::zeroed_page_aligned(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((i as u32).wrapping_mul(31).wrapping_add(seed) % 253) as u8;
    }
    b
}

/// Rank 1 sends `data` to rank 0 as it is; rank 0 receives it into
/// `into` (of the same length); returns the mapped copies and split copies
/// rank 0 made meanwhile, and the tails rank 1 wrote through its mapping of
/// rank 0's arena.
fn send_buffer(d0: &ProcessDevice, d1: &ProcessDevice, data: Buffer, into: Buffer) -> [u64; 3] {
    let counts = |d0: &ProcessDevice, d1: &ProcessDevice| {
        let (l0, l1) = (
            d0.engine.lock().m.mapped_copies,
            d1.engine.lock().m.mapped_writes,
        );
        [l0, d0.engine.lock().m.splits_done, l1]
    };
    let before = counts(d0, d1);
    let want = data.to_vec();
    assert_eq!(into.len(), want.len());
    let recv = d0.irecv(into, Source::Rank(1), TagSel::Tag(3), 4);
    let send = d1.isend(data, 0, 3, 4);
    std::thread::scope(|s| {
        s.spawn(|| assert!(send.wait().status.error.is_none()));
        let got = recv.wait();
        assert!(got.status.error.is_none(), "{:?}", got.status);
        assert!(got.buf[..] == want[..], "{} bytes: wrong bytes", want.len());
    });
    let after = counts(d0, d1);
    [0, 1, 2].map(|i| after[i] - before[i])
}

#[test]
fn a_rendezvous_from_the_shared_arena_is_copied_from_the_mapped_pages() {
    let (d0, d1) = pair(&[("cma", "on")]);
    assert!(d0.options().mapped);
    // A 256 KiB block, a 1 MiB block and a 3 MiB extent of rank 1's arena,
    // into heap buffers: split (rank 1 is free), the head copied from the
    // mapping, the tail written by CMA.
    for (len, seed) in [(256 << 10, 1), (1 << 20, 2), (3 << 20, 3)] {
        let b = shared_buffer(len, seed);
        assert!(xdev::devkit::shared_arena::span_of(&b).is_some());
        assert_eq!(
            send_buffer(&d0, &d1, b, Buffer::zeroed(len)),
            [1, 1, 0],
            "{len}"
        );
    }
    // Into a buffer of rank 0's arena: the tail goes through rank 1's
    // mapping of it too.
    for len in [256 << 10, 3 << 20] {
        let (b, into) = (shared_buffer(len, 4), Buffer::zeroed_page_aligned(len));
        assert_eq!(send_buffer(&d0, &d1, b, into), [1, 1, 1], "{len}");
    }
    // Part of a buffer (from an odd offset), by a blocking send.
    let b = shared_buffer(2 << 20, 9);
    let want = b[4097..4097 + (1 << 20)].to_vec();
    let recv = d0.irecv(Buffer::zeroed(1 << 20), Source::Rank(1), TagSel::Tag(4), 4);
    std::thread::scope(|s| {
        s.spawn(|| d1.send(&b[4097..4097 + (1 << 20)], 0, 4, 4).unwrap());
        assert!(recv.wait().buf[..] == want[..]);
    });
    assert_eq!(d0.engine.lock().m.mapped_copies, 6);
    // A heap buffer is copied by CMA (split with the sender).
    let heap = Buffer::from(vec![7u8; 1 << 20]);
    assert_eq!(
        send_buffer(&d0, &d1, heap, Buffer::zeroed(1 << 20)),
        [0, 1, 0]
    );
    // Not split: one copy from the mapping.
    let (d2, d3) = pair(&[("cma", "on"), ("cma_split_bytes", "0")]);
    let (b, into) = (
        shared_buffer(1 << 20, 5),
        Buffer::zeroed_page_aligned(1 << 20),
    );
    assert_eq!(send_buffer(&d2, &d3, b, into), [1, 0, 0]);
    // With `mapped=false` everything goes by CMA.
    let (d4, d5) = pair(&[("cma", "on"), ("mapped", "false")]);
    let (b, into) = (
        shared_buffer(1 << 20, 6),
        Buffer::zeroed_page_aligned(1 << 20),
    );
    assert_eq!(send_buffer(&d4, &d5, b, into), [0, 1, 0]);
}

/// Rank 1 claims a rendezvous of `src` (which it keeps alive) from its
/// arena at `fd` and `offset`; rank 0 receives it.
fn claim(d0: &ProcessDevice, d1: &ProcessDevice, src: &[u8], fd: u64, offset: u64) -> Vec<u8> {
    let h = Header {
        kind: KIND_RNDV,
        flags: FLAG_MAPPED | FLAG_EXPECTING,
        tag: 7,
        context: 1,
        cookie: 1,
        aux: src.len() as u64,
        ..Header::default()
    };
    let mut start = Vec::new();
    start.extend_from_slice(&(src.as_ptr() as u64).to_le_bytes());
    start.extend_from_slice(&fd.to_le_bytes());
    start.extend_from_slice(&offset.to_le_bytes());
    assert!(raw_push(d1, 0, h, &start));
    let mut buf = vec![0u8; src.len()];
    d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(7), 1)
        .unwrap();
    buf
}

#[test]
fn a_peer_arena_that_is_not_a_sealed_shmem_file_or_too_short_is_read_by_cma() {
    // Past the end of the (real) arena: the bytes come by CMA instead, and
    // this peer's later rendezvous too.
    let (d0, d1) = pair(&[("cma", "on")]);
    let src = shared_buffer(512 << 10, 3);
    let span = xdev::devkit::shared_arena::span_of(&src).unwrap();
    let got = claim(&d0, &d1, &src, span.fd as u64, 1 << 50);
    assert!(got[..] == src[..], "the receive still gets the bytes");
    let l = d0.engine.lock();
    assert_eq!((l.m.mapped_copies, l.m.mapped[1]), (0, false));
    drop(l);
    // A file that is not a sealed memfd (a pipe, stdin, a descriptor that
    // does not exist), or a number no descriptor can have: never mapped.
    use std::os::fd::AsRawFd;
    let (r, _w) = std::io::pipe().unwrap();
    for fd in [r.as_raw_fd() as u64, 0, 1 << 20, u64::MAX] {
        let (d0, d1) = pair(&[("cma", "on")]);
        let got = claim(&d0, &d1, &src, fd, span.offset);
        assert!(got[..] == src[..], "fd {fd}");
        let l = d0.engine.lock();
        assert_eq!(l.m.mapped_copies, 0, "fd {fd}");
        assert!(l.m.arenas[1].is_none(), "fd {fd}");
    }
    // The real arena and span: mapped.
    let (d0, d1) = pair(&[("cma", "on")]);
    let got = claim(&d0, &d1, &src, span.fd as u64, span.offset);
    assert!(got[..] == src[..]);
    assert_eq!(d0.engine.lock().m.mapped_copies, 1);
}

#[test]
fn a_mapped_start_of_the_wrong_length_is_a_violation() {
    let (d0, d1) = pair(&[]);
    let h = Header {
        kind: KIND_RNDV,
        flags: FLAG_MAPPED,
        aux: 1 << 20,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &[0u8; 8]));
    assert_violation(&d0, "rendezvous start of 8 bytes");
}

#[test]
fn a_tail_is_written_into_a_peer_arena_only_inside_it_and_only_if_sealed() {
    // What a receiver's `WRITE` with `FLAG_MAPPED` makes its sender do:
    // write into the receiver's arena where it names, or answer that it
    // could not (the receiver then reads the tail itself).
    let (_d0, d1) = pair(&[("cma", "on")]);
    let mut into = Buffer::zeroed_page_aligned(512 << 10);
    let span = xdev::devkit::shared_arena::span_of(&into).unwrap();
    let tail: Vec<u8> = (0..4096u32).map(|i| (i % 199) as u8 + 1).collect();
    let write = |at: (i32, u64)| {
        let mut l = d1.engine.lock();
        ProcessMedium::mapped_write(&d1.engine, &mut l, 0, at, &tail)
    };
    // Inside the arena: written, at the offset named.
    assert!(write((span.fd, span.offset + 8192)));
    assert!(into[8192..8192 + 4096] == tail[..]);
    assert!(into[..8192].iter().all(|&b| b == 0));
    assert_eq!(d1.engine.lock().m.mapped_writes, 1);
    into[8192..8192 + 4096].fill(0);
    // Past its end: nothing written, and this peer is not mapped again.
    assert!(!write((span.fd, u64::MAX - 100)));
    assert!(!d1.engine.lock().m.mapped[0]);
    assert!(!write((span.fd, span.offset)));
    assert!(into.iter().all(|&b| b == 0));
    // A file that is not a sealed shmem file (a pipe) is never mapped.
    use std::os::fd::AsRawFd;
    let (r, _w) = std::io::pipe().unwrap();
    let (d2, d3) = pair(&[("cma", "on")]);
    let mut l = d3.engine.lock();
    assert!(!ProcessMedium::mapped_write(
        &d3.engine,
        &mut l,
        0,
        (r.as_raw_fd(), 0),
        &tail
    ));
    assert!(l.m.arenas[0].is_none() && !l.m.mapped[0]);
    drop(l);
    drop(d2);
}

#[test]
fn a_tail_the_sender_could_not_write_is_read_by_the_receiver_from_its_mapping() {
    // Rank 0 asks rank 1 to write the tail through its mapping of rank 0's
    // arena; rank 1 does not map rank 0 (as after a failure), answers that
    // it could not, and rank 0 copies the tail from rank 1's arena itself.
    let (d0, d1) = pair(&[("cma", "on")]);
    d1.engine.lock().m.mapped[0] = false;
    let len = 1 << 20;
    let (b, into) = (shared_buffer(len, 8), Buffer::zeroed_page_aligned(len));
    // The head and the tail from the mapping, one split, no tail written.
    assert_eq!(send_buffer(&d0, &d1, b, into), [2, 1, 0]);
}

/// Rank 1 claims a rendezvous of `len` bytes from `addr`, in its arena at
/// `fd` and `offset`, that rank 0 may split; rank 0 asks for the tail, and
/// rank 1 answers that it could not write it. Rank 0's receive, and how
/// many copies it made from the mapping.
fn split_claim(
    d0: &ProcessDevice,
    d1: &ProcessDevice,
    len: usize,
    at: [u64; 3],
) -> (xdev::devkit::Completion, u64) {
    // Rank 1 says it is idle, so that rank 0 splits the copy.
    d1.progress();
    let recv = d0.irecv(Buffer::zeroed(len), Source::Rank(1), TagSel::Tag(8), 1);
    let h = Header {
        kind: KIND_RNDV,
        flags: FLAG_MAPPED,
        tag: 8,
        context: 1,
        cookie: 1,
        aux: len as u64,
        ..Header::default()
    };
    let start: Vec<u8> = at.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert!(raw_push(d1, 0, h, &start));
    d0.progress();
    assert!(d0.engine.lock().m.splits.contains_key(&(1, 1)), "split");
    let wrote = Header {
        kind: KIND_WROTE,
        flags: FLAG_FAILED,
        cookie: 1,
        ..Header::default()
    };
    assert!(raw_push(d1, 0, wrote, &[]));
    let got = recv.wait();
    (got, d0.engine.lock().m.mapped_copies)
}

#[test]
fn a_split_tail_at_an_offset_or_address_past_the_end_of_memory_is_an_error_not_a_crash() {
    // (A device opened first turns the shared arena on.)
    let (d0, d1) = pair(&[("cma", "on")]);
    let len = 1 << 20;
    let src = shared_buffer(len, 11);
    let span = xdev::devkit::shared_arena::span_of(&src).unwrap();
    let (fd, addr) = (span.fd as u64, src.as_ptr() as u64);
    // An offset whose tail lies past the end of the address space: the
    // head and the tail come by CMA from the address.
    let (got, mapped) = split_claim(&d0, &d1, len, [addr, fd, u64::MAX - 100]);
    assert!(got.status.error.is_none(), "{:?}", got.status);
    assert!(got.buf[..] == src[..]);
    assert_eq!(mapped, 0);
    // An address whose tail lies past the end: the head and the tail come
    // from the mapping (a real span), the address is never read.
    let (d0, d1) = pair(&[("cma", "on")]);
    let (got, mapped) = split_claim(&d0, &d1, len, [u64::MAX - 100, fd, span.offset]);
    assert!(got.status.error.is_none(), "{:?}", got.status);
    assert!(got.buf[..] == src[..]);
    assert_eq!(mapped, 2);
}

#[test]
fn a_split_tail_readable_neither_from_the_mapping_nor_at_its_address_fails_that_receive() {
    let (d0, d1) = pair(&[("cma", "on")]);
    let len = 1 << 20;
    let src = shared_buffer(len, 13);
    let fd = xdev::devkit::shared_arena::span_of(&src).unwrap().fd;
    // SAFETY: the shared arena's descriptor stays open for the life of the
    // process; it is only borrowed for this call.
    let file = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let size = rustix::fs::fstat(file).unwrap().st_size as u64;
    // The head (the first half, as the receiver splits 1 MiB) ends at the
    // arena's end, so it comes from the mapping; the tail lies past it, and
    // the address it falls back to wraps around to unmapped memory.
    let half = (len / 2) as u64;
    let (got, mapped) = split_claim(&d0, &d1, len, [u64::MAX - 100, fd as u64, size - half]);
    assert_eq!(mapped, 1, "the head from the mapping");
    match got.status.error.as_deref() {
        Some(xdev::Error::Protocol { rank: 1, what }) => {
            assert!(what.contains("unreadable"), "{what}")
        }
        other => panic!("expected the tail's read to fail the receive: {other:?}"),
    }
    // Mapping with that peer stops; the device goes on.
    assert!(!d0.engine.lock().m.mapped[1]);
}
