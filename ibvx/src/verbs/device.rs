//! Devices, device contexts, ports and GIDs.

use std::ffi::{c_int, CStr};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibvx_sys as sys;
use ibvx_sys::Verbs;

use super::error::{Error, Result};

/// One entry of the device list ([`device_list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel device name, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
}

/// The verbs devices of this host, in libibverbs' order.
///
/// Returns an empty list when libibverbs loads but there is no device (also
/// when the kernel has no RDMA support at all); fails only when libibverbs
/// itself is missing.
pub fn device_list() -> Result<Vec<DeviceInfo>> {
    let verbs = Verbs::load()?;
    Ok(RawDeviceList::get(verbs)
        .0
        .map(|l| l.infos())
        .unwrap_or_default())
}

/// An `ibv_get_device_list` result, freed on drop.
struct RawDeviceList {
    verbs: &'static Verbs,
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl RawDeviceList {
    /// The list, or why there is none (`ibv_get_device_list` returned NULL).
    fn get(verbs: &'static Verbs) -> (Option<RawDeviceList>, String) {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-parameter; the result is checked for NULL.
        let list = unsafe { (verbs.ibv_get_device_list)(&mut n) };
        match NonNull::new(list) {
            Some(list) => (
                Some(RawDeviceList {
                    verbs,
                    list,
                    len: usize::try_from(n).unwrap_or(0),
                }),
                String::new(),
            ),
            None => {
                let e = std::io::Error::last_os_error();
                let why = if e.raw_os_error() == Some(libc::ENOSYS) {
                    format!("ibv_get_device_list: {e}; the kernel has no RDMA support")
                } else {
                    format!("ibv_get_device_list: {e}")
                };
                (None, why)
            }
        }
    }

    fn device(&self, i: usize) -> *mut sys::ibv_device {
        assert!(i < self.len);
        // SAFETY: the list holds `len` valid device pointers (then NULL).
        unsafe { *self.list.as_ptr().add(i) }
    }

    fn name(&self, i: usize) -> String {
        // SAFETY: a device of the live list; the name is a NUL-terminated
        // string owned by the device.
        unsafe { CStr::from_ptr((self.verbs.ibv_get_device_name)(self.device(i))) }
            .to_string_lossy()
            .into_owned()
    }

    fn infos(&self) -> Vec<DeviceInfo> {
        (0..self.len)
            .map(|i| DeviceInfo {
                name: self.name(i),
                // SAFETY: a device of the live list.
                guid: u64::from_be(unsafe { (self.verbs.ibv_get_device_guid)(self.device(i)) }),
            })
            .collect()
    }
}

impl Drop for RawDeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once;
        // opened contexts stay valid after the list is freed.
        unsafe { (self.verbs.ibv_free_device_list)(self.list.as_ptr()) };
    }
}

/// An open device (`ibv_context`). Cheap to clone (reference counted); the
/// device is closed when the last clone and every object created from it
/// (protection domains, CQs, channels, which hold a clone) are gone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

struct ContextInner {
    verbs: &'static Verbs,
    raw: NonNull<sys::ibv_context>,
    name: String,
    attr: sys::ibv_device_attr,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs locks
// internally); the inner fields are immutable after open.
unsafe impl Send for ContextInner {}
// SAFETY: as above; every method takes `&self` and calls thread-safe verbs.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device and closed once; every child
        // object holds a `Context` clone, so none is left.
        unsafe { (self.verbs.ibv_close_device)(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the device called `name`, or the first device when `name` is
    /// `None`.
    ///
    /// Errors: [`Error::Unavailable`] without libibverbs,
    /// [`Error::NoDevice`] when there is no device, [`Error::DeviceNotFound`]
    /// when no device has that name.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let verbs = Verbs::load()?;
        let (list, why) = RawDeviceList::get(verbs);
        let list = match list {
            Some(l) if l.len > 0 => l,
            _ => return Err(Error::NoDevice { reason: why }),
        };
        let index = match name {
            None => 0,
            Some(want) => {
                let names: Vec<String> = (0..list.len).map(|i| list.name(i)).collect();
                names
                    .iter()
                    .position(|n| n == want)
                    .ok_or_else(|| Error::DeviceNotFound {
                        name: want.to_owned(),
                        available: names.clone(),
                    })?
            }
        };
        let dev_name = list.name(index);
        // SAFETY: a device of the live list.
        let raw = unsafe { (verbs.ibv_open_device)(list.device(index)) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_open_device"))?;
        let mut attr = sys::ibv_device_attr::default();
        // SAFETY: live context, valid out-parameter.
        let rc = unsafe { (verbs.ibv_query_device)(raw.as_ptr(), &mut attr) };
        let inner = ContextInner {
            verbs,
            raw,
            name: dev_name,
            attr,
        };
        if rc != 0 {
            // `inner` closes the device on drop.
            drop(inner);
            return Err(Error::from_rc("ibv_query_device", rc));
        }
        Ok(Context {
            inner: Arc::new(inner),
        })
    }

    /// The device name, e.g. `rxe0`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The loaded libibverbs function table.
    pub fn verbs(&self) -> &'static Verbs {
        self.inner.verbs
    }

    /// The raw `ibv_context`, for calls this layer does not wrap. It stays
    /// valid as long as this `Context` (or a clone) lives.
    pub fn as_raw(&self) -> *mut sys::ibv_context {
        self.inner.raw.as_ptr()
    }

    /// Number of physical ports (numbered from 1).
    pub fn port_count(&self) -> u8 {
        self.inner.attr.phys_port_cnt
    }

    /// Largest number of outstanding work requests per queue.
    pub fn max_qp_wr(&self) -> u32 {
        u32::try_from(self.inner.attr.max_qp_wr).unwrap_or(0)
    }

    /// Largest number of entries of a completion queue.
    pub fn max_cqe(&self) -> u32 {
        u32::try_from(self.inner.attr.max_cqe).unwrap_or(0)
    }

    /// Largest number of scatter/gather entries per work request.
    pub fn max_sge(&self) -> u32 {
        u32::try_from(self.inner.attr.max_sge).unwrap_or(0)
    }

    /// Largest number of outstanding RDMA reads/atomics a QP may initiate.
    pub fn max_qp_init_rd_atom(&self) -> u8 {
        u8::try_from(self.inner.attr.max_qp_init_rd_atom).unwrap_or(u8::MAX)
    }

    /// Largest number of incoming RDMA reads/atomics a QP may serve.
    pub fn max_qp_rd_atom(&self) -> u8 {
        u8::try_from(self.inner.attr.max_qp_rd_atom).unwrap_or(u8::MAX)
    }

    fn bad_port(&self, port: u8, reason: String) -> Error {
        Error::BadPort {
            device: self.inner.name.clone(),
            port,
            reason,
        }
    }

    /// The attributes of `port` (1-based).
    ///
    /// Errors: [`Error::BadPort`] when the device has no such port or the
    /// query fails.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let count = self.port_count();
        if port == 0 || port > count {
            let s = if count == 1 { "" } else { "s" };
            return Err(self.bad_port(
                port,
                format!(
                    "no such port ({} has {count} port{s}, numbered from 1)",
                    self.name()
                ),
            ));
        }
        let mut attr = sys::ibv_port_attr::default();
        // SAFETY: live context, valid out-parameter of the full current size.
        let rc = unsafe { self.inner.verbs.query_port(self.as_raw(), port, &mut attr) };
        if rc != 0 {
            return Err(self.bad_port(
                port,
                format!("ibv_query_port failed: {}", super::error::errno_error(rc)),
            ));
        }
        Ok(PortAttr::from_raw(&attr))
    }

    fn bad_gid(&self, port: u8, index: u32, reason: String) -> Error {
        Error::BadGidIndex {
            device: self.inner.name.clone(),
            port,
            index,
            reason,
        }
    }

    /// The GID at `index` of `port`'s GID table, refusing indices out of
    /// range and all-zero (unset) entries.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let attr = self.query_port(port)?;
        if index >= attr.gid_tbl_len {
            return Err(self.bad_gid(
                port,
                index,
                format!(
                    "out of range (the GID table has {} entries)",
                    attr.gid_tbl_len
                ),
            ));
        }
        let gid = self
            .raw_gid(port, index)
            .map_err(|e| self.bad_gid(port, index, format!("ibv_query_gid failed: {e}")))?;
        if gid.is_zero() {
            return Err(self.bad_gid(
                port,
                index,
                format!(
                    "the entry is all zeros (unset; see /sys/class/infiniband/{}/ports/{port}/gids/)",
                    self.name()
                ),
            ));
        }
        Ok(gid)
    }

    fn raw_gid(&self, port: u8, index: u32) -> std::io::Result<Gid> {
        let index =
            c_int::try_from(index).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut gid = sys::ibv_gid::default();
        // SAFETY: live context, valid out-parameter.
        let rc = unsafe { (self.inner.verbs.ibv_query_gid)(self.as_raw(), port, index, &mut gid) };
        if rc != 0 {
            return Err(super::error::errno_error(rc));
        }
        // SAFETY: every bit pattern is a valid `raw` GID.
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The type of the GID at `index` (IB, RoCE v1 or RoCE v2), if the
    /// library can tell.
    pub fn gid_type(&self, port: u8, index: u32) -> Option<GidType> {
        let mut entry = sys::ibv_gid_entry::default();
        // SAFETY: live context, valid out-parameter.
        let rc = unsafe {
            self.inner
                .verbs
                .query_gid_ex(self.as_raw(), u32::from(port), index, &mut entry, 0)
        };
        (rc == 0).then(|| GidType::from_raw(entry.gid_type))
    }

    /// The GID index to use by default on `port`: the first non-zero
    /// IPv4-mapped RoCE v2 entry, else the first non-zero RoCE v2 entry,
    /// else the first non-zero entry (as perftest prefers RoCE v2 and IPv4).
    pub fn default_gid_index(&self, port: u8) -> Result<Option<u32>> {
        let attr = self.query_port(port)?;
        let mut best: Option<(u32, u8)> = None;
        for i in 0..attr.gid_tbl_len.min(256) {
            let Ok(gid) = self.raw_gid(port, i) else {
                continue;
            };
            if gid.is_zero() {
                continue;
            }
            let v2 = self.gid_type(port, i) == Some(GidType::RoceV2);
            let rank = u8::from(v2) * 2 + u8::from(gid.is_ipv4_mapped());
            let better = match best {
                None => true,
                Some((_, r)) => rank > r,
            };
            if better {
                best = Some((i, rank));
                if rank == 3 {
                    break;
                }
            }
        }
        Ok(best.map(|(i, _)| i))
    }

    /// Everything a peer needs to know about `port` to connect to it, with
    /// the GID at `gid_index` (default: [`Context::default_gid_index`] when
    /// the port needs a GRH, i.e. on RoCE).
    pub fn port_address(&self, port: u8, gid_index: Option<u32>) -> Result<PortAddress> {
        let attr = self.query_port(port)?;
        if attr.state != PortState::Active {
            return Err(self.bad_port(port, format!("port state is {} (not active)", attr.state)));
        }
        let needs_grh = attr.link_layer == LinkLayer::Ethernet || attr.grh_required;
        let index = match gid_index {
            Some(i) => Some(i),
            None if needs_grh => Some(self.default_gid_index(port)?.ok_or_else(|| {
                self.bad_gid(port, 0, "the GID table has no usable entry".into())
            })?),
            None => None,
        };
        let gid = match index {
            Some(i) => Some((i, self.query_gid(port, i)?)),
            None => None,
        };
        Ok(PortAddress {
            port,
            lid: attr.lid,
            gid,
            link_layer: attr.link_layer,
            active_mtu: attr.active_mtu,
        })
    }
}

/// The local half of an address vector: what identifies `port` to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    /// Port number.
    pub port: u8,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// GID table index and GID, when a GRH is used (always on RoCE).
    pub gid: Option<(u32, Gid)>,
    /// Link layer of the port.
    pub link_layer: LinkLayer,
    /// Active MTU of the port.
    pub active_mtu: Mtu,
}

/// Port state (`ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Down.
    Down,
    /// Initializing.
    Init,
    /// Armed.
    Armed,
    /// Active: usable.
    Active,
    /// Active, deferred.
    ActiveDefer,
    /// Any other value.
    Other(u32),
}

impl PortState {
    fn from_raw(v: u32) -> Self {
        match v {
            sys::IBV_PORT_DOWN => PortState::Down,
            sys::IBV_PORT_INIT => PortState::Init,
            sys::IBV_PORT_ARMED => PortState::Armed,
            sys::IBV_PORT_ACTIVE => PortState::Active,
            sys::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
            v => PortState::Other(v),
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortState::Down => f.write_str("DOWN"),
            PortState::Init => f.write_str("INIT"),
            PortState::Armed => f.write_str("ARMED"),
            PortState::Active => f.write_str("ACTIVE"),
            PortState::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            PortState::Other(v) => write!(f, "state {v}"),
        }
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand (LID routing; a GRH only across subnets).
    InfiniBand,
    /// Ethernet: RoCE, every packet carries a GRH built from a GID.
    Ethernet,
    /// Not reported.
    Unspecified,
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "IB",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Unspecified => "unspecified",
        })
    }
}

/// GID type of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand or RoCE v1.
    IbOrRoceV1,
    /// RoCE v2 (UDP/IP encapsulation).
    RoceV2,
    /// Any other value.
    Other(u32),
}

impl GidType {
    fn from_raw(v: u32) -> Self {
        match v {
            sys::IBV_GID_TYPE_IB | sys::IBV_GID_TYPE_ROCE_V1 => GidType::IbOrRoceV1,
            sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            v => GidType::Other(v),
        }
    }
}

/// Path MTU (`ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// All values, smallest first.
    pub const ALL: [Mtu; 5] = [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ];

    /// From the `ibv_mtu` enum value (1 = 256 ... 5 = 4096).
    pub fn from_raw(v: u32) -> Option<Mtu> {
        Mtu::ALL
            .get(usize::try_from(v).ok()?.checked_sub(1)?)
            .copied()
    }

    /// From a size in bytes (256, 512, 1024, 2048 or 4096).
    pub fn from_bytes(bytes: usize) -> Option<Mtu> {
        Mtu::ALL.into_iter().find(|m| m.bytes() == bytes)
    }

    /// The `ibv_mtu` enum value.
    pub fn raw(self) -> u32 {
        self as u32
    }

    /// Size in bytes.
    pub fn bytes(self) -> usize {
        128 << (self as u32)
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// Port attributes (the parts of `ibv_port_attr` a connection needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// Port state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU in use (on RoCE: derived from the netdev MTU).
    pub active_mtu: Mtu,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Number of entries of the GID table.
    pub gid_tbl_len: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// The port requires a GRH in every address vector (`IBV_QPF_GRH_REQUIRED`).
    pub grh_required: bool,
    /// Largest message size.
    pub max_msg_sz: u32,
}

impl PortAttr {
    fn from_raw(a: &sys::ibv_port_attr) -> Self {
        PortAttr {
            state: PortState::from_raw(a.state),
            max_mtu: Mtu::from_raw(a.max_mtu).unwrap_or(Mtu::Mtu256),
            active_mtu: Mtu::from_raw(a.active_mtu).unwrap_or(Mtu::Mtu256),
            lid: a.lid,
            gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
            link_layer: match u32::from(a.link_layer) {
                sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
            grh_required: a.flags & sys::IBV_QPF_GRH_REQUIRED != 0,
            max_msg_sz: a.max_msg_sz,
        }
    }
}

/// A 128-bit global identifier, in network byte order (as on the wire).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zeros: an unset GID table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `::ffff:a.b.c.d`, the GID of an IPv4 address on RoCE v2.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10] == 0xff && self.0[11] == 0xff
    }

    /// The GID as an IPv6 address.
    pub fn to_ipv6(&self) -> std::net::Ipv6Addr {
        std::net::Ipv6Addr::from(self.0)
    }

    pub(crate) fn to_raw(self) -> sys::ibv_gid {
        sys::ibv_gid { raw: self.0 }
    }
}

/// Displays as the kernel does in sysfs: eight groups of four hex digits.
impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

#[cfg(test)]
mod tests;
