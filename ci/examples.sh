#!/usr/bin/env bash
# Runs every program of examples/ (package xdev-examples) under xdev-run on
# each multi-process device that runs here, 3 ranks, and checks what it
# prints. ci/launchers.sh runs the ring under srun and mpirun as well.
# Usage: bash ci/examples.sh [DEVICE...]   (default: shm psm hybrid)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "examples: FAILED: $*" >&2; exit 1; }
cargo build --release --quiet -p xdev-tools --bin xdev-run -p xdev-examples --examples
T=${CARGO_TARGET_DIR:-target}/release
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() { # DEVICE EXAMPLE -> output in $log
  local rc=0
  timeout 120 "$T/xdev-run" -n 3 --device "$1" -- "$T/examples/$2" >"$log" 2>&1 || rc=$?
  ((rc == 0)) || { cat "$log" >&2; fail "$2 on $1 exited with status $rc"; }
}
expect() { # DEVICE EXAMPLE PATTERN (grep -E, a whole line)
  grep -Eqx "$3" "$log" || { cat "$log" >&2; fail "$2 on $1: no line matching '$3'"; }
}

devices=("$@")
((${#devices[@]})) || devices=(shm psm hybrid)
for d in "${devices[@]}"; do
  run "$d" hello
  for r in 1 2; do expect "$d" hello "rank 0 got from rank $r: hello from rank $r of 3"; done
  expect "$d" hello "hello: 3 ranks on $d"

  run "$d" ring
  expect "$d" ring "ring: 3 ranks on $d, 10 rounds, token 30"

  run "$d" nonblocking
  for r in 0 1 2; do
    expect "$d" nonblocking "nonblocking: rank $r of 3 on $d: 16 messages, 4194304 bytes in, all checked"
  done

  run "$d" peer_lost
  for r in 0 1; do
    expect "$d" peer_lost "rank $r: PeerLost from rank 2 \(.*\)"
    expect "$d" peer_lost "rank $r: survivors still exchange messages"
  done
  echo "ok: examples hello, ring, nonblocking, peer_lost on $d (xdev-run, 3 ranks)"
done
