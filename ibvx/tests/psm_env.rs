//! `PSM2_DEVICES` is set before `main` (from the ELF initializers), never
//! by `set_var` once threads exist, and a user's value is kept.
#![cfg(feature = "psm")]

use std::process::Command;

fn hfi_present() -> bool {
    std::fs::read_dir("/dev")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("hfi1_"))
        })
        .unwrap_or(false)
}

/// What a fresh process of this binary finds in its environment at the
/// start of a test, with `PSM2_DEVICES` as given (`None`: unset).
fn child_sees(given: Option<&str>) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_prints_psm2_devices", "--nocapture"])
        .env("XDEV_PSM_ENV_CHILD", "1");
    match given {
        Some(v) => cmd.env("PSM2_DEVICES", v),
        None => cmd.env_remove("PSM2_DEVICES"),
    };
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("PSM2_DEVICES=").map(str::to_string))
        .expect("the child printed its PSM2_DEVICES")
}

#[test]
fn child_prints_psm2_devices() {
    if std::env::var_os("XDEV_PSM_ENV_CHILD").is_none() {
        return; // only meaningful as the child of the test below
    }
    // Links the crate, and with it its initializer.
    let _ = ibvx::registry();
    println!(
        "PSM2_DEVICES={}",
        std::env::var("PSM2_DEVICES").unwrap_or_else(|_| "<unset>".into())
    );
}

#[test]
fn psm2_devices_is_set_before_main_and_a_users_value_is_kept() {
    if hfi_present() {
        println!("skipped: this host has an Omni-Path hfi unit, so nothing is set");
        return;
    }
    assert_eq!(child_sees(None), "self,shm");
    assert_eq!(child_sees(Some("shm")), "shm");
}
