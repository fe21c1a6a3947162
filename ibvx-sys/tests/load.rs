//! Loading libibverbs at run time: the error when it is absent, agreement of
//! the default load with what is installed, and calls that work without an
//! RDMA device.

use std::ffi::{c_int, CStr};
use std::path::{Path, PathBuf};

use ibvx_sys::*;

const PREFIX: &str = "verbs not available: ";

#[test]
fn missing_library_path_gives_verbs_not_available_with_loader_message() {
    let path = "/nonexistent/ibvx-sys-test/libibverbs.so.1";
    let err = Verbs::load_from(path).unwrap_err();
    assert!(matches!(err, LoadError::Library { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with(PREFIX), "{msg}");
    // What follows the prefix is glibc's dlerror() text.
    let loader = &msg[PREFIX.len()..];
    assert_eq!(
        loader,
        format!("{path}: cannot open shared object file: No such file or directory")
    );
}

#[test]
fn missing_soname_gives_verbs_not_available() {
    let err = Verbs::load_from("libibvx-sys-test-absent.so.1").unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with(PREFIX), "{msg}");
    assert!(msg.contains("libibvx-sys-test-absent.so.1"), "{msg}");
}

#[test]
fn library_without_verbs_symbols_gives_verbs_not_available() {
    // libc is always loadable and has no ibv_* symbols.
    let err = Verbs::load_from("libc.so.6").unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with(PREFIX), "{msg}");
    match err {
        LoadError::Symbol {
            symbol, version, ..
        } => assert_eq!((symbol, version), Verbs::SYMBOLS[0]),
        other => panic!("expected a missing-symbol error, got {other:?}"),
    }
}

/// Finds libibverbs.so.1 the way the dynamic loader would look for it
/// (LD_LIBRARY_PATH, the ld.so cache, the default directories), without
/// dlopen, so it can be compared with what `Verbs::load` does.
fn find_libibverbs() -> Option<PathBuf> {
    const SONAME: &str = "libibverbs.so.1";
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dirs) = std::env::var_os("LD_LIBRARY_PATH") {
        candidates.extend(std::env::split_paths(&dirs).map(|d| d.join(SONAME)));
    }
    for ldconfig in ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"] {
        if let Ok(out) = std::process::Command::new(ldconfig).arg("-p").output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let line = line.trim();
                if line.starts_with(&format!("{SONAME} ")) && line.contains("x86-64") {
                    if let Some((_, path)) = line.split_once(" => ") {
                        candidates.push(PathBuf::from(path));
                    }
                }
            }
            break;
        }
    }
    for dir in [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib64",
        "/usr/lib64",
        "/lib",
        "/usr/lib",
    ] {
        candidates.push(Path::new(dir).join(SONAME));
    }
    // `exists` follows symlinks: a dangling soname link does not count.
    candidates.into_iter().find(|p| p.exists())
}

#[test]
fn default_load_matches_installation_and_is_cached() {
    let installed = find_libibverbs();
    let first = Verbs::load();
    match (&installed, &first) {
        (Some(path), Ok(_)) => println!("libibverbs installed at {}: loaded", path.display()),
        (None, Err(e)) => {
            let msg = e.to_string();
            assert!(msg.starts_with(PREFIX), "{msg}");
            assert!(msg.contains(LIBIBVERBS), "{msg}");
            println!("libibverbs not installed: {msg}");
        }
        (Some(path), Err(e)) => panic!("{} is installed but loading failed: {e}", path.display()),
        (None, Ok(_)) => panic!("loaded {LIBIBVERBS} although no copy was found"),
    }
    // Once per process: the same table, or the same (cached) error.
    match (first, Verbs::load()) {
        (Ok(a), Ok(b)) => assert!(std::ptr::eq(a, b)),
        (Err(a), Err(b)) => assert_eq!(a, b),
        (a, b) => panic!("second load differs: {a:?} vs {b:?}"),
    }
}

/// Number of uverbs devices the kernel exposes (0 without kernel support).
fn kernel_uverbs_devices() -> usize {
    std::fs::read_dir("/sys/class/infiniband_verbs")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("uverbs"))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn device_list_is_empty_without_rdma_devices() {
    let verbs = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let kernel_devices = kernel_uverbs_devices();
    let mut n: c_int = -1;
    // SAFETY: `n` is a valid out-parameter.
    let list = unsafe { (verbs.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        // No kernel verbs support at all (this host: errno ENOSYS).
        let err = std::io::Error::last_os_error();
        assert_eq!(kernel_devices, 0, "ibv_get_device_list failed: {err}");
        assert!(n <= 0, "NULL list but num_devices = {n}");
        println!("ibv_get_device_list: NULL ({err}), 0 devices");
        return;
    }
    let mut names = Vec::new();
    for i in 0.. {
        // SAFETY: the list is NULL-terminated; entries are read up to the NULL.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a device of the live list; the name is a C string.
        let name = unsafe { CStr::from_ptr((verbs.ibv_get_device_name)(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (verbs.ibv_free_device_list)(list) };
    println!("ibv_get_device_list: {n} devices {names:?} (kernel: {kernel_devices})");
    assert_eq!(n as usize, names.len());
    if kernel_devices == 0 {
        assert_eq!(n, 0, "devices {names:?} without kernel uverbs devices");
    } else {
        assert!(names.len() <= kernel_devices);
    }
}

#[test]
fn string_functions_work_without_a_device() {
    let verbs = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let s = |p: *const std::ffi::c_char| {
        assert!(!p.is_null());
        // SAFETY: these functions return static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    };
    // SAFETY: all five are pure lookups of static strings by enum value.
    unsafe {
        assert_eq!(s((verbs.ibv_wc_status_str)(IBV_WC_SUCCESS)), "success");
        assert_eq!(
            s((verbs.ibv_wc_status_str)(IBV_WC_RETRY_EXC_ERR)),
            "transport retry counter exceeded"
        );
        assert_eq!(s((verbs.ibv_port_state_str)(IBV_PORT_ACTIVE)), "active");
        assert_eq!(
            s((verbs.ibv_node_type_str)(IBV_NODE_CA)),
            "InfiniBand channel adapter"
        );
        assert_eq!(
            s((verbs.ibv_event_type_str)(IBV_EVENT_PORT_ACTIVE)),
            "port active"
        );
    }
}
