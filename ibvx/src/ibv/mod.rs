//! IBVX, the message layer over verbs (RC queue pairs, eager messages plus
//! RDMA-write rendezvous). Today this module holds one building block of it:
//! [`regcache`], the pin-down registration cache that leases out registered
//! memory the library owns and registers foreign memory for one operation
//! only, so that a cached registration can never name stale pages.

pub mod regcache;
