#!/usr/bin/env bash
# The project's test command (README): installs what the tests need, then runs
# formatting, lints, docs, the unit tests and the conformance suite of every
# device that runs on this machine, and the soft-RoCE VM suite when present.
#
# Usage: bash ci/test.sh [--no-vm]
set -euo pipefail
cd "$(dirname "$0")/.."

no_vm=0
for a in "$@"; do
  case "$a" in
    --no-vm) no_vm=1 ;;
    *) echo "usage: ci/test.sh [--no-vm]" >&2; exit 2 ;;
  esac
done

step() { printf '\n=== %s\n' "$*"; }

# Debian packages the tests use at run time (the build itself needs none):
# libibverbs (verbs loader tests: the library without any RDMA device),
# libpsm2 (the PSM2 loopback test in shm-only mode) and ucx-utils
# (ucx_perftest, the report's UCX peer: its run-and-parse test).
# shellcheck source=ci/lib/packages.sh
. ci/lib/packages.sh
install_missing libibverbs1 libpsm2-2 ucx-utils

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

step "features: ibvx with --no-default-features and with each feature alone (clippy, all targets)"
# A user of shm alone (no default features) builds no verbs or PSM2 code.
for f in "" ibv psm hybrid; do
  cargo clippy -p ibvx --all-targets --quiet --no-default-features ${f:+--features "$f"} -- -D warnings
done
if cargo tree -p ibvx --no-default-features -e normal --prefix none | grep -Eq '^(ibvx-sys|psm-sys) '; then
  echo "ibvx without default features still depends on ibvx-sys or psm-sys" >&2; exit 1
fi

step "aarch64: cargo clippy --target aarch64-unknown-linux-gnu (every crate and target; ibvx-sys checks its aarch64 pthread layouts against libc's at compile time)"
# Needs rustup's std for that target; where it cannot be installed (no
# network to rustup's server), say so and go on.
if rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu ||
  timeout 300 rustup target add aarch64-unknown-linux-gnu >/dev/null 2>&1; then
  # Compiled, not run: nothing here can execute aarch64 code.
  cargo clippy --quiet --target aarch64-unknown-linux-gnu --workspace --all-targets -- -D warnings
else
  echo "skipped: the Rust standard library for aarch64-unknown-linux-gnu is not installed and rustup could not download it"
fi

step "packaging: cargo publish --dry-run of every library crate (packaged, then built from the tarballs), licenses, rust-version"
# Packaging needs neither libibverbs nor libpsm2 (loaded at run time). The
# verification builds land under target/package with their own hashes, so the
# main cache stays valid. xdev-bench is publish = false (a tool, see its
# Cargo.toml), and so are xdev-tools and xdev-examples. The package in xdev/
# is `ibvx-xdev` (`xdev` is taken on crates.io; its library is still `xdev`).
dirs=(ibvx-sys psm-sys xdev shm-ipc ibvx)
libs=(ibvx-sys psm-sys ibvx-xdev shm-ipc ibvx)
for c in "${dirs[@]}" benches; do
  cmp -s LICENSE-MIT "$c/LICENSE-MIT" && cmp -s LICENSE-APACHE "$c/LICENSE-APACHE" ||
    { echo "$c: LICENSE-MIT/LICENSE-APACHE differ from the root's copies" >&2; exit 1; }
done
# The dry run verifies each package from a temporary local registry, which
# cargo extracts under $CARGO_HOME/registry/src/-HASH/NAME-VERSION and reuses
# when that directory exists: a second run on this machine would build the
# sources a previous run packaged. Remove our own packages' copies (only
# there: crates.io's sources live under index.crates.io-*).
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
for l in "${libs[@]}"; do
  rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$l-$version"
done
# And the verification builds go to a target directory of their own, made
# afresh: cargo takes a registry package as immutable, so a build of an
# earlier run's `ibvx-xdev 0.1.0` left in the main target directory would be
# reused for this run's (it was, once `Tracker::completed` changed).
rm -rf target/publish-verify
CARGO_TARGET_DIR=target/publish-verify \
  timeout 900 cargo publish --dry-run --allow-dirty --quiet --workspace --exclude xdev-bench --exclude xdev-tools --exclude xdev-examples
# rust-version is checked three ways: clippy's incompatible_msrv (std APIs,
# above), the libraries' dependencies (normal and build, Linux) below, and a
# build of the libraries with that toolchain itself (rustup, minimal profile;
# where rustup cannot download it, the step says so and the other two stand).
mkdir -p target
cargo metadata --format-version 1 --locked >target/metadata.json
cargo tree --locked -e normal,build --target x86_64-unknown-linux-gnu --prefix none -f '{p}' \
  $(printf -- '-p %s ' "${libs[@]}") | python3 -c '
import json, sys
meta = json.load(open("target/metadata.json"))
v = lambda s: tuple(int(x) for x in s.split("."))
rv = {(p["name"], p["version"]): p.get("rust_version") for p in meta["packages"]}
ours = v(next(p["rust_version"] for p in meta["packages"] if p["name"] == "ibvx-xdev"))
bad = set()
for line in filter(str.strip, sys.stdin):
    name, ver = line.split()[:2]
    r = rv.get((name, ver.lstrip("v")))
    if r and v(r) > ours:
        bad.add(f"{name} {ver} needs {r}")
if bad:
    sys.exit("dependencies need a newer Rust than rust-version: " + ", ".join(sorted(bad)))
print("rust-version", ".".join(map(str, ours)), "covers the dependencies of the libraries")'
msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
if rustup run "$msrv" rustc --version >/dev/null 2>&1 ||
  timeout 600 rustup toolchain install "$msrv" --profile minimal >/dev/null 2>&1; then
  # Its own target directory: another compiler's artifacts would evict ours.
  CARGO_TARGET_DIR=target/msrv cargo "+$msrv" build --quiet --locked $(printf -- '-p %s ' "${libs[@]}")
  echo "the libraries build with Rust $msrv (rust-version)"
else
  echo "skipped: building with Rust $msrv: rustup could not install that toolchain"
fi

step "cargo test (unit tests, property tests, conformance suites)"
mkdir -p target
# A hung test must fail the run, not stall it (each conformance case also has its own watchdog).
timeout 2400 cargo test --workspace --release -- --show-output 2>&1 | tee target/test-output.txt
# Tests that could not run say "skipped: why"; list them so nobody reads a skip as a pass.
if grep -h '^skipped:' target/test-output.txt >/dev/null; then
  step "tests that reported a skip (they run for real in the VM suite or where the component exists)"
  grep -h '^skipped:' target/test-output.txt | sort | uniq -c
fi

step "shm-ipc ring hostile-peer property tests, debug build (integer overflow is a panic there)"
timeout 900 cargo test -p shm-ipc --test ring_hostile

step "shm-ipc biased lock unit tests, debug build (a thread that locks a lock it holds panics there)"
timeout 900 cargo test -p shm-ipc --lib biased

step "loom models of the shm-ipc ring, the biased engine lock and the request core (shm-ipc/tests/{ring,biased}_loom.rs, xdev/tests/request_loom.rs)"
# --cfg loom changes every crate's build: its own target dir keeps the main
# cache valid. The models themselves run in a few seconds; the bound is for
# the cold build.
CARGO_TARGET_DIR=target/loom RUSTFLAGS="${RUSTFLAGS:-} --cfg loom" \
  timeout 900 cargo test -p shm-ipc --release --test ring_loom --test biased_loom
CARGO_TARGET_DIR=target/loom RUSTFLAGS="${RUSTFLAGS:-} --cfg loom" \
  timeout 900 cargo test -p ibvx-xdev --release --test request_loom

step "examples/: each example under xdev-run on shm, psm and hybrid, output checked"; bash ci/examples.sh

step "launchers: conformance and the ring example under mpirun.openmpi, mpirun.mpich, srun --mpi=pmix and --mpi=pmi2"; bash ci/launchers.sh

if ((no_vm == 0)) && [ -x ci/vm-suite.sh ]; then
  step "soft-RoCE VM suite"
  bash ci/vm-suite.sh
  step "two-guest suite (conformance with ranks split between two soft-RoCE guests: ibv, and hybrid)"
  bash ci/two-guest-suite.sh
fi
step "all tests passed"
