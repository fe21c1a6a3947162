//! The hybrid engine's state (a module of its own so that the type is
//! public, as `xdev::devkit::Face` needs, without a path users could name).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use xdev::devkit::Tracker;
use xdev::{Device, Rank};

use super::held::Held;
use super::route::{RankMap, Route};

/// The hybrid device's engine: the two devices it routes between, the
/// receives it holds, and its tracker.
pub struct HybridEngine {
    pub(super) rank: Rank,
    pub(super) size: usize,
    pub(super) routes: Vec<Route>,
    pub(super) local: Arc<dyn Device>,
    pub(super) local_map: RankMap,
    /// The network device's ranks are the job's.
    pub(super) remote_map: RankMap,
    pub(super) remote: Option<Arc<dyn Device>>,
    pub(super) tracker: Arc<Tracker>,
    /// Held receives. Every receive is posted to a device under this lock.
    pub(super) held: Mutex<Held>,
    pub(super) closed: AtomicBool,
}
