//! Open MPI over PSM2: the MPI peer of the psm device.
//!
//! Open MPI's `cm` PML over its `psm2` MTL drives the same libpsm2 as the
//! psm device, so it is the mature library the device is compared with, as
//! Open MPI's shared-memory path is for `shm`. Without Omni-Path hardware
//! PSM2 runs in its shm-only mode (`PSM2_DEVICES=self,shm`), but the MTL
//! opens only where it sees an hfi1 unit: a `/dev/hfi1_N` node and an
//! `ACTIVE` port under `/sys/class/infiniband` (Open MPI 4.1's
//! `ompi_mtl_psm2_component_open`). The launcher therefore runs in a mount
//! namespace of its own ([`command`]) whose `/dev` and `/sys/class` show
//! one; PSM2 itself never opens it in shm-only mode. Nothing outside the
//! namespace changes, and it ends with the launcher. It needs root and
//! util-linux's `unshare`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The shell script run inside the new mount namespace before it execs its
/// arguments: a tmpfs (on `/tmp/.xdev-fake-hfi`, an empty directory
/// outside the namespace), a copy of `/sys/class` with an `ACTIVE` hfi1 port
/// added and bound over it, and an overlay of `/dev` (with `/dev/shm` and
/// `/dev/pts` bound back) that holds an empty `/dev/hfi1_0`.
pub const FAKE_HFI_SCRIPT: &str = r#"set -e
d=/tmp/.xdev-fake-hfi
mkdir -p "$d"
mount -t tmpfs xdev-fake-hfi "$d"
mkdir -p "$d/class" "$d/up" "$d/work" "$d/shm" "$d/pts"
cp -a /sys/class/. "$d/class/" 2>/dev/null || true
mkdir -p "$d/class/infiniband/hfi1_0/ports/1"
echo "4: ACTIVE" > "$d/class/infiniband/hfi1_0/ports/1/state"
mount --bind "$d/class" /sys/class
mount --bind /dev/shm "$d/shm"
mount --bind /dev/pts "$d/pts"
mount -t overlay xdev-fake-hfi -o "lowerdir=/dev,upperdir=$d/up,workdir=$d/work" /dev
mount --bind "$d/shm" /dev/shm
mount --bind "$d/pts" /dev/pts
: > /dev/hfi1_0
exec "$@"
"#;

/// The launcher arguments of the peer: binding as Open MPI's other run,
/// PSM2's shm-only mode, and the `cm` PML over the `psm2` MTL.
pub const PSM2_RUN_ARGS: &[&str] = &[
    "--bind-to",
    "core",
    "--map-by",
    "core",
    "-x",
    "PSM2_DEVICES=self,shm",
    "--mca",
    "pml",
    "cm",
    "--mca",
    "mtl",
    "psm2",
];

/// How the peer was run, for its status in the report.
pub const PSM2_HOW: &str = "Open MPI's cm PML over its psm2 MTL on libpsm2 in its shm-only mode \
     (PSM2_DEVICES=self,shm), run in a mount namespace that shows the MTL the hfi1 unit it \
     looks for";

/// A command that runs `program` (and the arguments added to the command
/// afterwards) in a mount namespace that shows an hfi1 unit, or why it
/// cannot: it needs root, `unshare` and libpsm2.
pub fn command(program: &Path) -> Result<Command, String> {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let unshare = namespace_tool(euid, super::measure::which("unshare"))?;
    psm_sys::Psm2::load().map_err(|e| format!("libpsm2 is not usable: {e}"))?;
    let mut cmd = Command::new(unshare);
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        FAKE_HFI_SCRIPT,
        "sh",
    ])
    .arg(program);
    Ok(cmd)
}

/// The `unshare` to run the namespace with, for a process of effective
/// user `euid` that found `unshare` where it says, or why not.
fn namespace_tool(euid: u32, unshare: Option<PathBuf>) -> Result<PathBuf, String> {
    if euid != 0 {
        return Err(
            "needs root, for the mount namespace that shows Open MPI's psm2 MTL an hfi1 unit"
                .into(),
        );
    }
    unshare.ok_or_else(|| {
        "needs util-linux's unshare, for the mount namespace (apt-get install util-linux)".into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_root_or_unshare_the_peer_says_why_it_is_not_measured() {
        let path = PathBuf::from("/usr/bin/unshare");
        let e = namespace_tool(1000, Some(path.clone())).unwrap_err();
        assert!(e.contains("needs root"), "{e}");
        let e = namespace_tool(0, None).unwrap_err();
        assert!(
            e.contains("unshare") && e.contains("apt-get install"),
            "{e}"
        );
        assert_eq!(namespace_tool(0, Some(path.clone())), Ok(path));
    }

    /// The namespace shows an hfi1 unit to what runs in it, and nothing of
    /// it is left outside once that ends.
    #[test]
    fn the_namespace_shows_an_hfi1_unit_inside_and_leaves_nothing_outside() {
        let sh = std::path::PathBuf::from("/bin/sh");
        let mut cmd = match command(&sh) {
            Ok(c) => c,
            Err(why) => {
                println!("skipped: {why}");
                return;
            }
        };
        let out = cmd
            .args([
                "-c",
                "test -e /dev/hfi1_0 && cat /sys/class/infiniband/hfi1_0/ports/1/state \
                 && test -d /dev/shm && : > /dev/null && ls /sys/class | grep -c .",
            ])
            .output()
            .expect("unshare runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut lines = stdout.lines();
        assert_eq!(lines.next(), Some("4: ACTIVE"));
        // The rest of /sys/class is still there (copied, not hidden).
        let classes: usize = lines.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        assert!(classes > 1, "{stdout}");
        assert!(
            !Path::new("/dev/hfi1_0").exists(),
            "left /dev/hfi1_0 outside"
        );
        assert!(
            !Path::new("/sys/class/infiniband/hfi1_0").exists(),
            "left the hfi1 port outside"
        );
    }
}
