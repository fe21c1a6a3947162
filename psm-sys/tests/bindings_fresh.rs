//! The committed `src/bindings.rs` is exactly what `regen.sh` produces from the
//! installed headers, when the pinned bindgen, libclang and the headers are
//! all present; otherwise the test prints `skipped: <why>` and passes.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const HEADERS: [&str; 2] = ["/usr/include/psm2.h", "/usr/include/psm2_mq.h"];

/// The `BINDGEN_VERSION=` pin in regen.sh.
fn pinned_bindgen_version(regen: &Path) -> String {
    let script = fs::read_to_string(regen).expect("read regen.sh");
    script
        .lines()
        .find_map(|l| l.strip_prefix("BINDGEN_VERSION="))
        .expect("regen.sh pins BINDGEN_VERSION")
        .trim()
        .to_owned()
}

/// Directories searched for the `bindgen` binary: PATH, then cargo's bin dir.
fn bindgen_search_path() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(cargo_home) = env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(cargo_home).join("bin"));
    }
    if let Some(home) = env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs
}

fn find_bindgen(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join("bindgen")).find(|p| p.is_file())
}

/// Whether a libclang shared library is where clang-sys (bindgen) looks.
fn libclang_present() -> bool {
    let mut dirs: Vec<PathBuf> = env::var_os("LIBCLANG_PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/lib", "/usr/lib64", "/usr/local/lib"].map(PathBuf::from));
    for parent in ["/usr/lib"] {
        if let Ok(entries) = fs::read_dir(parent) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("llvm-") {
                    dirs.push(entry.path().join("lib"));
                } else if name.ends_with("-linux-gnu") {
                    dirs.push(entry.path());
                }
            }
        }
    }
    dirs.iter().any(|dir| {
        fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("libclang")
                    && !name.starts_with("libclang-cpp")
                    && !name.starts_with("libclang_rt")
                    && name.contains(".so")
            })
        })
    })
}

#[test]
fn committed_bindings_match_regenerated() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let regen = crate_dir.join("regen.sh");
    let pinned = pinned_bindgen_version(&regen);

    if let Some(missing) = HEADERS.iter().find(|h| !Path::new(h).is_file()) {
        println!("skipped: {missing} not found (Debian package libpsm2-dev)");
        return;
    }
    let dirs = bindgen_search_path();
    let Some(bindgen) = find_bindgen(&dirs) else {
        println!(
            "skipped: bindgen not found (cargo install --locked bindgen-cli --version {pinned})"
        );
        return;
    };
    let version = Command::new(&bindgen)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    if version != format!("bindgen {pinned}") {
        println!(
            "skipped: {} is {version:?}, bindings are pinned to bindgen {pinned}",
            bindgen.display()
        );
        return;
    }
    if !libclang_present() {
        println!("skipped: libclang not found (Debian package libclang-dev)");
        return;
    }

    let fresh = env::temp_dir().join(format!("psm-sys-bindings-{}.rs", std::process::id()));
    let path: OsString = env::join_paths(&dirs).expect("PATH");
    let out = Command::new("bash")
        .arg(&regen)
        .arg("--no-install")
        .arg(&fresh)
        .env("PATH", path)
        .output()
        .expect("run regen.sh");
    let generated = fs::read_to_string(&fresh);
    let _ = fs::remove_file(&fresh);
    assert!(
        out.status.success(),
        "regen.sh failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = generated.expect("read regenerated bindings");
    let committed =
        fs::read_to_string(crate_dir.join("src/bindings.rs")).expect("read src/bindings.rs");
    if generated != committed {
        let line = generated
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(committed.lines().count()));
        panic!(
            "src/bindings.rs is stale; run psm-sys/regen.sh. First difference at line {}:\n\
             regenerated: {:?}\ncommitted:   {:?}",
            line + 1,
            generated.lines().nth(line),
            committed.lines().nth(line)
        );
    }
    println!("bindings.rs matches bindgen {pinned} output");
}
