//! The checked-in src/bindings/{x86_64,aarch64}.rs must be what regen.sh
//! produces from the installed headers. Runs only where the pinned bindgen, libclang and the
//! rdma-core headers are installed; elsewhere it prints "skipped: <why>".

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn temp_path(name: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("ibvx-sys-{}-{nanos}-{name}", std::process::id()))
}

/// Formats `file` in place with rustfmt if it is available, so that a
/// rustfmt version difference does not count as a difference in bindings.
fn rustfmt(file: &Path) -> bool {
    Command::new("rustfmt")
        .args(["--edition", "2021"])
        .arg(file)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn regen_matches_checked_in_x86_64() {
    regen_matches_checked_in("x86_64");
}

#[test]
fn regen_matches_checked_in_aarch64() {
    regen_matches_checked_in("aarch64");
}

fn regen_matches_checked_in(arch: &str) {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let checked_in = crate_dir.join(format!("src/bindings/{arch}.rs"));
    let fresh = temp_path(&format!("bindings-{arch}.rs"));
    let copy = temp_path(&format!("checked-in-{arch}.rs"));

    let out = match Command::new("bash")
        .arg(crate_dir.join("regen.sh"))
        .args(["--no-install", "--arch", arch, "--out"])
        .arg(&fresh)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!("skipped: cannot run bash: {e}");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        // regen.sh --no-install exits 3 when a prerequisite is missing.
        Some(3) => {
            println!(
                "skipped: {}",
                stderr.trim().trim_start_matches("regen.sh: ")
            );
            return;
        }
        _ => panic!("regen.sh failed ({}):\n{stderr}", out.status),
    }

    std::fs::copy(&checked_in, &copy).unwrap();
    let formatted = rustfmt(&fresh) && rustfmt(&copy);
    let want = std::fs::read_to_string(&fresh).unwrap();
    let have = std::fs::read_to_string(&copy).unwrap();
    let _ = std::fs::remove_file(&fresh);
    let _ = std::fs::remove_file(&copy);

    if want != have {
        let (want_lines, have_lines): (Vec<&str>, Vec<&str>) =
            (want.lines().collect(), have.lines().collect());
        let line = (0..want_lines.len().max(have_lines.len()))
            .find(|&i| want_lines.get(i) != have_lines.get(i))
            .unwrap_or(0);
        let w = want_lines.get(line).copied().unwrap_or("<end of file>");
        let h = have_lines.get(line).copied().unwrap_or("<end of file>");
        panic!(
            "src/bindings/{arch}.rs is stale (compared {}): first difference at line {}:\n  \
             regenerated: {w}\n  checked in:  {h}\n\
             run ibvx-sys/regen.sh and commit src/bindings/{arch}.rs",
            if formatted {
                "after rustfmt"
            } else {
                "unformatted"
            },
            line + 1,
        );
    }
    println!(
        "regenerated bindings match src/bindings/{arch}.rs ({} lines)",
        want.lines().count()
    );
}
