//! The queue's second table: lent receives, whose handle keeps the buffer
//! and tests its own PSM2 request.
//!
//! A lent receive is posted, tested and freed once per message: its table
//! (the shape of the other, `table.rs`) holds plain-data payloads `L`, and
//! its test has PSM2 write the status where the caller reads it. Its key's
//! top bit says which table it is in, so a collecting round tells the two
//! apart from the status's context alone.

use psm_sys::ffi::{psm2_error, psm2_mq_status2_t};

use super::{MqStatus, MqTag, RequestKey, Selector, TrackedQueue};

/// Where [`TrackedQueue::test_lent`] has PSM2 write a completed receive's
/// status (zeroed until then).
pub struct StatusSlot(psm2_mq_status2_t);

impl StatusSlot {
    /// A zeroed slot.
    #[inline(always)]
    pub fn new() -> Self {
        // SAFETY: plain data (integers, a pointer, a union of integer
        // arrays), for which all zeroes is a valid value.
        StatusSlot(unsafe { std::mem::zeroed() })
    }

    /// The status last written to the slot (all zeroes if none was).
    #[inline(always)]
    pub fn status(&self) -> MqStatus {
        MqStatus::from_raw(&self.0)
    }

    /// The tag of the status in the slot, read in place (as are the two
    /// below: the message path reads these fields only, each a load of its
    /// own width).
    #[inline(always)]
    pub fn tag(&self) -> MqTag {
        // SAFETY: every bit pattern of the union is a valid [u32; 4].
        let t = unsafe { self.0.msg_tag.tag };
        MqTag([t[0], t[1], t[2]])
    }

    /// Bytes PSM2 delivered, per the status in the slot.
    #[inline(always)]
    pub fn nbytes(&self) -> u32 {
        self.0.nbytes
    }

    /// Whether the status in the slot says the request ended without error.
    #[inline(always)]
    pub fn is_ok(&self) -> bool {
        self.0.error_code == psm2_error::PSM2_OK
    }
}

impl Default for StatusSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// What testing a lent receive found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LentTest<R> {
    /// PSM2 completed it (and freed its request; its status is in the
    /// test's slot; its payload left the table): what the test picked
    /// from its payload.
    Done(R),
    /// Still outstanding.
    Pending,
    /// The key names no outstanding lent receive.
    Unknown,
}

impl<T, L> TrackedQueue<T, L> {
    /// Posts a receive of up to `len` bytes at `buf` for what `sel` matches
    /// (`psm2_mq_irecv2`) as a lent receive with `payload`, and returns its
    /// key (a lent one, [`RequestKey::is_lent`]), or the error with the
    /// payload if the post failed.
    ///
    /// # Safety
    /// As [`irecv`](TrackedQueue::irecv): `buf` must be valid for writes of
    /// `len` bytes and not be otherwise accessed until the request leaves
    /// the table: by [`test_lent`](Self::test_lent),
    /// [`take_completed_lent`](Self::take_completed_lent) or
    /// [`cancel_lent`](Self::cancel_lent), or the queue closed or dropped.
    #[inline(always)]
    pub unsafe fn irecv_lent(
        &mut self,
        sel: &Selector,
        (buf, len): (*mut u8, usize),
        payload: L,
    ) -> Result<RequestKey, (xdev::Error, L)> {
        let index = self.lent.claim();
        let key = self.lent.key(index);
        // SAFETY: the caller's contract covers the post's; the request is
        // entered in the table at once.
        match unsafe { self.mq.post_recv(sel, buf, len, key.0 as usize) } {
            Ok(req) => {
                self.lent.fill(index, req, true, payload);
                Ok(key)
            }
            Err(e) => {
                self.lent.unclaim(index);
                Err((e, payload))
            }
        }
    }

    /// Tests lent receive `key` (`psm2_mq_test2` on its handle, which frees
    /// it once it has completed), with PSM2 writing the status into
    /// `slot`. Does not poll. A completed one leaves the table, and what
    /// `pick` read from its payload comes back; its status is then in
    /// `slot`.
    ///
    /// The slot is the caller's, so the status stays where PSM2 wrote it
    /// and the caller reads the few fields it uses, each where it uses it;
    /// of the payload, only what `pick` takes is copied (a status or a
    /// payload returned whole went through the stack, field by field, two
    /// or three times).
    #[inline(always)]
    pub fn test_lent<R>(
        &mut self,
        key: RequestKey,
        slot: &mut StatusSlot,
        pick: impl FnOnce(&L) -> R,
    ) -> LentTest<R> {
        let Some(e) = self.lent.live(key) else {
            return LentTest::Unknown;
        };
        let mut req = e.req;
        let (_, psm) = self.mq.raw();
        // SAFETY: req is live (it is in the table); test2 frees it only
        // when it returns PSM2_OK, with the status written to the slot.
        if unsafe { (psm.psm2_mq_test2)(&mut req, &mut slot.0) } != psm2_error::PSM2_OK {
            return LentTest::Pending;
        }
        match self.lent.take_live(key.index(), pick) {
            Some(picked) => LentTest::Done(picked),
            // Live a moment ago, under `&mut self`.
            None => LentTest::Unknown,
        }
    }

    /// The key and payload of the lent receive a status of
    /// [`collect`](TrackedQueue::collect) reports, which leaves the table
    /// (PSM2 has freed its handle). `None` if the status is not of a lent
    /// receive of this table.
    #[inline]
    pub fn take_completed_lent(&mut self, st: &MqStatus) -> Option<(RequestKey, L)> {
        let key = RequestKey(st.context as u64);
        self.lent.remove(key).map(|p| (key, p))
    }

    /// Cancels lent receive `key` if PSM2 has not matched it yet: its
    /// payload; its memory is no longer PSM2's. `None` if it had matched
    /// (it completes as usual) or `key` names no outstanding lent receive.
    pub fn cancel_lent(&mut self, key: RequestKey) -> Option<L> {
        let req = self.lent.live(key)?.req;
        // SAFETY: req is a live receive request of this queue (in the table).
        if unsafe { self.cancel_live(req) } {
            self.lent.remove(key)
        } else {
            None
        }
    }

    /// The payload of outstanding lent receive `key`.
    #[inline]
    pub fn lent(&self, key: RequestKey) -> Option<&L> {
        self.lent.live(key)?.payload.as_ref()
    }

    /// The payload of outstanding lent receive `key`, to change.
    #[inline]
    pub fn lent_mut(&mut self, key: RequestKey) -> Option<&mut L> {
        self.lent.payload_mut(key)
    }

    /// Every outstanding lent receive's key and payload.
    pub fn lent_iter(&self) -> impl Iterator<Item = (RequestKey, &L)> {
        self.lent.iter()
    }
}
