use super::*;

#[test]
fn work_completion_accessors() {
    let mut raw = sys::ibv_wc {
        wr_id: 7,
        status: sys::IBV_WC_SUCCESS,
        opcode: sys::IBV_WC_RECV_RDMA_WITH_IMM,
        byte_len: 64,
        wc_flags: sys::IBV_WC_WITH_IMM,
        qp_num: 0x11,
        ..Default::default()
    };
    raw.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
    let wc = WorkCompletion(raw);
    assert!(wc.is_success());
    assert!(wc.ok().is_ok());
    assert_eq!(wc.opcode(), WcOpcode::RecvRdmaWithImm);
    assert_eq!(wc.imm_data(), Some(0x1234_5678));
    assert_eq!((wc.wr_id(), wc.byte_len(), wc.qp_num()), (7, 64, 0x11));

    raw.wc_flags = 0;
    raw.status = sys::IBV_WC_RETRY_EXC_ERR;
    let wc = WorkCompletion(raw);
    assert_eq!(wc.imm_data(), None);
    let e = wc.ok().unwrap_err().to_string();
    assert!(e.starts_with("work completion error: "), "{e}");
    assert!(e.contains("status 12"), "{e}");
    if Verbs::load().is_ok() {
        assert!(e.contains("transport retry counter exceeded"), "{e}");
    }
}

#[test]
fn wait_readable_times_out() {
    let mut fds = [0; 2];
    // SAFETY: valid out-array of two fds.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    assert!(!wait_readable(fds[0], Some(Duration::from_millis(5))).unwrap());
    // SAFETY: writes one byte from a valid buffer to our pipe.
    assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
    assert!(wait_readable(fds[0], Some(Duration::from_millis(5))).unwrap());
    // SAFETY: closing our own fds once.
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
}
