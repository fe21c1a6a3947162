//! Where the tests find `xdev-rank`, the rank program of their jobs. It is a
//! binary of the `xdev-tools` package (benches/tools), not of this crate, so
//! cargo does not hand its path to these tests: `XDEV_RANK_BIN` (the VM
//! suite copies it into the guest) or the one built into the same target
//! directory (`cargo test --workspace` builds it before running any test).

use std::path::PathBuf;

/// The `xdev-rank` program, or `None` after printing `skipped: why`.
pub fn program() -> Option<String> {
    if let Ok(p) = std::env::var("XDEV_RANK_BIN") {
        return Some(p);
    }
    // This test runs as target/PROFILE/deps/NAME-HASH; the binaries are in
    // target/PROFILE.
    let exe = std::env::current_exe().ok();
    let dir = exe
        .as_deref()
        .and_then(|e| e.parent())
        .and_then(|d| d.parent())
        .map(PathBuf::from);
    match dir.map(|d| d.join("xdev-rank")) {
        Some(p) if p.is_file() => Some(p.to_string_lossy().into_owned()),
        p => {
            println!(
                "skipped: xdev-rank is not built next to this test ({}): \
                 cargo build -p xdev-tools --bin xdev-rank in this profile, \
                 or cargo test --workspace",
                p.map(|p| p.display().to_string()).unwrap_or_default()
            );
            None
        }
    }
}
