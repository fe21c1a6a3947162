#!/usr/bin/env bash
# vm-suite.sh - the soft-RoCE VM suite: everything that needs an RDMA device.
#
# Builds the test binaries and ibvx-pingpong on the host (release), then in
# ONE boot of the soft-RoCE guest (ci/softroce-vm.sh) runs:
#   0. the shm test that needs Yama (ptrace_scope 1), absent on the host,
#   1. the ibvx-sys tests (lib, load, device_loopback --nocapture; regen is a
#      host-only freshness check and is not run),
#   2. the ibvx tests (lib, verbs_loopback --nocapture), then the ibv device
#      with IBVX_REQUIRE_RDMA=1 (a skip fails): registration cache (regcache_rxe),
#      the ibv:: device tests, the ibv scenarios, conformance with 2 and 4 processes,
#      and the hybrid device's conformance on 2 simulated hosts with ibv between,
#   3. ibvx-pingpong against itself for send_lat, write_lat and write_bw with
#      the data check (-c): every size 2..8 MiB, plus events (-e) and inline,
#   4. ibvx-pingpong against perftest (ib_send_lat, ib_write_lat, ib_write_bw)
#      in both directions (ibvx client / perftest server and the reverse),
#   5. the failure modes: mismatched options, a bad GID index, a bad port, an
#      unknown device, an unreachable peer, a peer killed mid-run (both
#      directions), a perftest server met without --perftest,
#   6. a comparison run, same sizes and iterations, of ibvx-pingpong against
#      ib_send_lat / ib_write_lat (8 B) and ib_write_bw (1 MiB and 4 MiB), alternating
#      the tools over several rounds; prints both tables and the ratios,
#   7. system calls and writes per message of the ibv device's latency test
#      (xdev-bench, 8 B) against ib_send_lat, counted with strace -f -c
#      (ci/lib/syscalls.sh), best of 3 alternating rounds; the 8 B latency
#      of the same test against ib_send_lat's t_avg, best of 3 alternating
#      rounds (ci/lib/latency.sh), printed as "LATENCY ibv/perftest X.XXx
#      (target <= 1.3: met|NOT met)" (a figure, not a gate); and the rendezvous
#      figures of the user-buffer registration cache (reused user buffer,
#      leased memory, a fresh buffer each time; eager against rendezvous).
# Exits non-zero if anything fails, and prints "VM suite passed" at the end.
# The comparison is reported, not enforced (timings on a shared TCG guest
# are noisy); --strict-perf makes a ratio outside 10% a failure.
#
# Usage: ci/vm-suite.sh [--rounds N] [--strict-perf] [--timeout SECS] [--keep]
#   --rounds N      comparison rounds per test (default 9)
#   --strict-perf   fail when ibvx-pingpong is not within 10% of perftest
#   --timeout SECS  limit for the whole guest run (default 2700)
#   --keep          keep the work directory (logs of every step)
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ROUNDS=9 STRICT=0 TIMEOUT=2700 KEEP=0
while (($#)); do
  case $1 in
    --rounds) ROUNDS=${2:?}; shift ;;
    --strict-perf) STRICT=1 ;;
    --timeout) TIMEOUT=${2:?}; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "vm-suite: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "vm-suite: --rounds wants a positive number" >&2; exit 2; }

CARGO=${CARGO:-cargo}
T0=$SECONDS
say() { printf 'vm-suite: %s\n' "$*"; }

# ------------------------------------------------------------------ build
say "building ibvx-pingpong and the test binaries (release)"
"$CARGO" build --release --quiet -p xdev-tools --bin ibvx-pingpong --bin xdev-rank --bin xdev-run
"$CARGO" build --release --quiet -p xdev-bench --bin xdev-bench
BUILD_JSON=$(mktemp)
trap 'rm -f "$BUILD_JSON"' EXIT
"$CARGO" test --release --quiet -p ibvx-sys -p ibvx -p shm-ipc --no-run --message-format=json >"$BUILD_JSON"

# "name executable" for every test executable cargo reported.
executables() {
  grep '"reason":"compiler-artifact"' "$BUILD_JSON" | grep '"executable":"' | while read -r line; do
    name=$(sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p' <<<"$line")
    exe=$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$line")
    kind=$(sed -n 's/.*"target":{"kind":\["\([^"]*\)".*/\1/p' <<<"$line")
    printf '%s %s %s\n' "$kind" "$name" "$exe"
  done
}
pick() { # kind name -> executable
  executables | awk -v k="$1" -v n="$2" '$1 == k && $2 == n { print $3; exit }'
}
SYS_LIB=$(pick lib ibvx_sys)
SYS_LOAD=$(pick test load)
SYS_DEV=$(pick test device_loopback)
IBVX_LIB=$(pick lib ibvx)
IBVX_VERBS=$(pick test verbs_loopback)
IBV_CONF=$(pick test ibv_conformance)
HYBRID_CONF=$(pick test hybrid_conformance)
IBV_SCEN=$(pick test device_scenarios)
REGCACHE=$(pick test regcache_rxe)
RNDV_FIG=$(pick test ibv_rndv_figures)
SHM_LIB=$(pick lib shm_ipc)
TARGET_DIR=$(dirname "$(dirname "$SYS_DEV")")   # .../release/deps -> .../release
PINGPONG=$TARGET_DIR/ibvx-pingpong
RANK_BIN=$TARGET_DIR/xdev-rank
# MPICH's Hydra launcher, for the ibv device under a cluster launcher.
# shellcheck source=ci/lib/packages.sh
. "$ROOT/ci/lib/packages.sh"
install_missing mpich
HYDRA=$(command -v mpiexec.hydra)
HYDRA_PROXY=$(command -v hydra_pmi_proxy)
XDEV_RUN=$TARGET_DIR/xdev-run
XDEV_BENCH=$TARGET_DIR/xdev-bench
for f in "$SHM_LIB" "$SYS_LIB" "$SYS_LOAD" "$SYS_DEV" "$IBVX_LIB" "$IBVX_VERBS" "$IBV_CONF" "$HYBRID_CONF" "$IBV_SCEN" "$REGCACHE" "$RNDV_FIG" \
         "$PINGPONG" "$RANK_BIN" "$XDEV_RUN" "$XDEV_BENCH"; do
  [[ -n $f && -x $f ]] || { say "error: test executable not found (${f:-?}); cargo output in $BUILD_JSON"; trap - EXIT; exit 1; }
done

# ------------------------------------------------------------------ guest script
WORK=$TARGET_DIR/vm-suite
rm -rf "$WORK"
mkdir -p "$WORK/logs"
[[ $WORK != *,* ]] || { say "error: the work directory path contains a comma: $WORK"; exit 1; }

cp "$ROOT/ci/lib/syscalls.sh" "$ROOT/ci/lib/latency.sh" "$WORK/"
cat >"$WORK/env.sh" <<EOF
SYS_LIB=$(basename "$SYS_LIB")
SYS_LOAD=$(basename "$SYS_LOAD")
SYS_DEV=$(basename "$SYS_DEV")
IBVX_LIB=$(basename "$IBVX_LIB")
IBVX_VERBS=$(basename "$IBVX_VERBS")
IBV_CONF=$(basename "$IBV_CONF")
HYBRID_CONF=$(basename "$HYBRID_CONF")
IBV_SCEN=$(basename "$IBV_SCEN")
REGCACHE=$(basename "$REGCACHE")
RNDV_FIG=$(basename "$RNDV_FIG")
SHM_LIB=$(basename "$SHM_LIB")
ROUNDS=$ROUNDS
STRICT=$STRICT
EOF

cat >"$WORK/guest.sh" <<'GUEST'
# Runs inside the soft-RoCE guest (bash), from /share. See ci/vm-suite.sh.
# $D (device options) and $HOST are split on purpose.
# shellcheck disable=SC2086
. /share/env.sh
LOG=/share/logs
D="-d $RXE_DEV -x $RXE_GID_INDEX"
HOST=$VM_PEER_IP
P=ibvx-pingpong
FAILS=0
PORT=20000
now() { cut -d' ' -f1 /proc/uptime; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
pass() { printf 'PASS  %-58s %6s s\n' "$1" "$2"; }
fail() {
  printf 'FAIL  %-58s %6s s\n' "$1" "$2"; FAILS=$((FAILS + 1))
  shift 2
  for f in "$@"; do [ -f "$f" ] && { echo "----- $(basename "$f")"; tail -n 40 "$f"; }; done
  echo "-----"
}
section() { printf '\n== %s\n' "$*"; }
next_port() { PORT=$((PORT + 1)); }
. /share/syscalls.sh # wait_listen, and the system-call counts of section 7
. /share/latency.sh # the 8 B latency comparison of section 7
# first / last table row after perftest's header line
row() { awk '/#bytes/ { if (getline > 0) print; exit }' "$1"; }
last_row() { awk '/#bytes/ { on = 1; next } on && /^ [0-9]/ { r = $0 } END { print r }' "$1"; }

# unit: name, log, command...
unit() {
  local name=$1 log=$LOG/$2 t0
  shift 2
  t0=$(now)
  if timeout 300 "$@" >"$log" 2>&1; then pass "$name" "$(secs "$t0")"; else fail "$name" "$(secs "$t0")" "$log"; fi
}

# pair: name, log prefix, "server command", "client command"
# Both must exit 0; the server starts first, the client once it listens.
# perftest 6.06 gives up ("Can't produce a report") when its CPU-frequency
# sampling is too noisy, which happens now and then on a busy TCG host: such
# a run is repeated (up to 3 attempts), it says nothing about the other side.
pair() {
  local name=$1 l=$LOG/$2 srv=$3 cli=$4 t0 spid crc src attempt=1 note=""
  t0=$(now)
  while :; do
    timeout 300 sh -c "$srv" >"$l.server" 2>&1 &
    spid=$!
    if ! wait_listen "$PORT"; then
      kill "$spid" 2>/dev/null; wait "$spid"
      fail "$name (server never listened)" "$(secs "$t0")" "$l.server"; return
    fi
    timeout 300 sh -c "$cli" >"$l.client" 2>&1; crc=$?
    wait "$spid"; src=$?
    if [ $crc = 0 ] && [ $src = 0 ]; then
      pass "$name$note" "$(secs "$t0")"; return
    fi
    if [ $attempt -lt 3 ] && grep -q "Can't produce a report" "$l.server" "$l.client"; then
      attempt=$((attempt + 1)); note=" (attempt $attempt: perftest could not calibrate its clock)"
      next_port; srv=$(echo "$srv" | sed "s/-p [0-9]*/-p $PORT/"); cli=$(echo "$cli" | sed "s/-p [0-9]*/-p $PORT/")
      continue
    fi
    fail "$name (client $crc, server $src)" "$(secs "$t0")" "$l.server" "$l.client"; return
  done
}

# expect_error: name, log, expected exit code, text the one-line error must contain, command...
expect_error() {
  local name=$1 log=$LOG/$2 want=$3 text=$4 t0 rc
  shift 4
  t0=$(now)
  timeout 60 "$@" >"$log" 2>&1; rc=$?
  if [ $rc = "$want" ] && grep -q -- "$text" "$log" && [ "$(grep -c 'error:' "$log")" -le 1 ]; then
    pass "$name" "$(secs "$t0")"; sed 's/^/      /' "$log" | grep 'error:'
  else
    fail "$name (exit $rc, wanted $want and \"$text\")" "$(secs "$t0")" "$log"
  fi
}

echo "guest: $(uname -r), $(nproc) CPUs, device $RXE_DEV, GID index $RXE_GID_INDEX, perftest $(ib_send_lat --version | sed 's/Version: //')"
echo "guest: cpu MHz in /proc/cpuinfo (perftest's clock): $(awk '/cpu MHz/ { print $4; exit }' /proc/cpuinfo)"

# --------------------------------------------------------------- 1-2 tests
section "ibvx-sys tests"
unit "ibvx-sys lib unit tests" sys-lib.txt "$SYS_LIB"
unit "ibvx-sys load tests" sys-load.txt "$SYS_LOAD" --nocapture
unit "ibvx-sys device_loopback" sys-device.txt "$SYS_DEV" --nocapture
grep -E 'device |delivered' "$LOG/sys-device.txt" | sed 's/^/      /'
echo "      (regen: host-only check of the checked-in bindings, not run here)"

section "ibvx tests"
# One at a time: some device tests count this process's descriptors.
unit "ibvx lib unit tests" ibvx-lib.txt "$IBVX_LIB" --test-threads 1
unit "ibvx verbs_loopback (safe verbs layer)" ibvx-verbs.txt "$IBVX_VERBS" --nocapture --test-threads 1
if grep -q '^skipped' "$LOG/ibvx-verbs.txt" "$LOG/sys-device.txt"; then
  fail "device tests skipped inside the VM" 0 "$LOG/ibvx-verbs.txt"
fi

# --------------------------------------------------------------- 2a shm
section "shm device: what needs Yama (absent on the host kernel)"
if [ -f /proc/sys/kernel/yama/ptrace_scope ]; then
  old_scope=$(cat /proc/sys/kernel/yama/ptrace_scope)
  echo 1 >/proc/sys/kernel/yama/ptrace_scope
  unit "PR_SET_PTRACER only while CMA is used (ptrace_scope 1)" shm-ptrace.txt \
    "$SHM_LIB" process::tests::ptrace_is_allowed_only_while_cma_is_used --exact --nocapture
  echo "$old_scope" >/proc/sys/kernel/yama/ptrace_scope
  grep -q '^skipped' "$LOG/shm-ptrace.txt" && fail "shm ptrace test skipped inside the VM" 0 "$LOG/shm-ptrace.txt"
else
  fail "the guest kernel has no Yama: the ptrace test cannot run" 0
fi

# --------------------------------------------------------------- 2b IBVX
section "IBVX: the ibv xdev device over rxe"
# Every test below must really run here: a skip is a failure.
export IBVX_REQUIRE_RDMA=1 XDEV_RANK_BIN=/usr/local/bin/xdev-rank IBVX_JOB_TIMEOUT=300
unit "registration cache over rxe (public face: zeroed leases, idle reuse, budget)" regcache.txt "$REGCACHE" --nocapture --test-threads 1
unit "ibv device and cache tests (init/finish loop, QP error, registration failure, free/realloc/resend, cache keys, stale-registration stress)" \
  ibv-device.txt "$IBVX_LIB" ibv:: --test-threads 1
unit "ibv scenarios (posted truncation, peer exit)" ibv-scen.txt "$IBV_SCEN" ibv_ --test-threads 1
unit "ibv conformance, 2 processes" ibv-conf-2.txt "$IBV_CONF" two_processes:: --test-threads 1
unit "ibv conformance, 4 processes" ibv-conf-4.txt "$IBV_CONF" four_processes:: --test-threads 1
unit "ibv conformance, 2 processes, tiny budgets (4 slots, 256 B window)" ibv-conf-tiny.txt \
  "$IBV_CONF" tiny_budgets:: --test-threads 1
unit "hybrid conformance, 4 processes on 2 simulated hosts, ibv between them" hybrid-conf.txt \
  "$HYBRID_CONF" two_hosts_over_ibv:: --test-threads 1
for f in regcache ibv-device ibv-scen ibv-conf-2 ibv-conf-4 ibv-conf-tiny hybrid-conf; do
  grep -q '^skipped' "$LOG/$f.txt" && fail "$f: a test skipped inside the VM" 0 "$LOG/$f.txt"
  grep -h 'test result' "$LOG/$f.txt" | sed 's/^/      /'
done
unset IBVX_REQUIRE_RDMA XDEV_RANK_BIN IBVX_JOB_TIMEOUT
# The ibv device under a cluster launcher: MPICH's Hydra (PMI-1 over PMI_FD),
# as ci/launchers.sh runs shm and psm on the host.
unit "ibv conformance under mpiexec.hydra (PMI-1 bootstrap), 2 ranks" ibv-hydra.txt \
  mpiexec.hydra -launcher fork -np 2 -genv XDEV_DEVICE ibv /usr/local/bin/xdev-rank conformance all
grep -q 'conformance all: passed on ibv with 2 ranks' "$LOG/ibv-hydra.txt" ||
  fail "ibv under mpiexec.hydra: no pass line" 0 "$LOG/ibv-hydra.txt"

# --------------------------------------------------------------- 3 self
section "ibvx-pingpong against itself, data check on"
for t in send_lat write_lat write_bw; do
  next_port
  pair "$t -a -n 10 -c (2 B .. 8 MiB)" "self-$t-all" \
    "$P $D -p $PORT --test $t -a -n 10 -c" \
    "$P $D -p $PORT --test $t -a -n 10 -c $HOST"
  echo "      8 MiB: $(last_row "$LOG/self-$t-all.client" | tr -s ' \t' ' ')"
done
for t in send_lat write_lat write_bw; do
  next_port
  pair "$t -e -c -I 64 -s 60 -n 500 (events, inline)" "self-$t-events" \
    "$P $D -p $PORT --test $t -e -c -I 64 -s 60 -n 500 --json" \
    "$P $D -p $PORT --test $t -e -c -I 64 -s 60 -n 500 --json $HOST"
  sed 's/^/      /' "$LOG/self-$t-events.client"
done
next_port
pair "send_lat -m 512 -s 5000 -n 200 -c (multi-packet messages)" "self-mtu" \
  "$P $D -p $PORT --test send_lat -m 512 -s 5000 -n 200 -c" \
  "$P $D -p $PORT --test send_lat -m 512 -s 5000 -n 200 -c $HOST"
grep -q 'Mtu            : 512' "$LOG/self-mtu.client" || fail "path MTU 512 not used" 0 "$LOG/self-mtu.client"
next_port
pair "write_bw -s 1M -n 50 -c -t 16 (slots)" "self-bw-1m" \
  "$P $D -p $PORT --test write_bw -s 1M -n 50 -c -t 16" \
  "$P $D -p $PORT --test write_bw -s 1M -n 50 -c -t 16 $HOST"

# --------------------------------------------------------------- 4 interop
section "interoperation with perftest"
for t in send_lat write_lat write_bw; do
  pt=ib_$t
  next_port
  pair "ibvx-pingpong client -> $pt server (-s 64 -n 200)" "interop-$t-ibvx-client" \
    "$pt $D -p $PORT -s 64 -n 200" \
    "$P $D -p $PORT --perftest --test $t -s 64 -n 200 $HOST"
  next_port
  pair "$pt client -> ibvx-pingpong server (-s 64 -n 200)" "interop-$t-pt-client" \
    "$P $D -p $PORT --test $t -s 64 -n 200" \
    "$pt $D -p $PORT -s 64 -n 200 $HOST"
  next_port
  pair "$pt client -> ibvx-pingpong server (-a -n 5)" "interop-$t-all" \
    "$P $D -p $PORT --test $t -a -n 5" \
    "$pt $D -p $PORT -a -n 5 $HOST"
  echo "      8 MiB, $pt client: $(last_row "$LOG/interop-$t-all.client" | tr -s ' \t' ' ')"
  echo "      8 MiB, ibvx-pingpong server: $(last_row "$LOG/interop-$t-all.server" | tr -s ' \t' ' ')"
done
next_port
pair "ibvx-pingpong client -> ib_send_lat server (-e -a -n 5)" "interop-send-events" \
  "ib_send_lat $D -p $PORT -e -a -n 5" \
  "$P $D -p $PORT --perftest --test send_lat -e -a -n 5 $HOST"

# --------------------------------------------------------------- 5 failures
section "failure modes (one-line error, non-zero exit, no hang)"
next_port
expect_error "unknown device" err-device.txt 1 'RDMA device "nosuch" not found (available: ' \
  $P -d nosuch -p $PORT
expect_error "bad port" err-port.txt 1 "bad port 2 on $RXE_DEV" $P -d "$RXE_DEV" -i 2 -p $PORT
expect_error "bad GID index (unset entry)" err-gid.txt 1 "bad GID index 9 on $RXE_DEV port 1" \
  $P -d "$RXE_DEV" -x 9 -p $PORT
expect_error "bad GID index (255)" err-gid2.txt 1 "bad GID index 255 on $RXE_DEV port 1" \
  $P -d "$RXE_DEV" -x 255 -p $PORT
expect_error "unreachable peer (connection refused)" err-refused.txt 1 \
  "cannot connect to $HOST:$PORT: Connection refused" $P $D -p $PORT --connect-timeout 1 $HOST
expect_error "bad arguments" err-args.txt 2 "--mtu must be" $P -m 1500

next_port
t=$(now)
$P $D -p $PORT --test send_lat -s 64 >"$LOG/err-mismatch.server" 2>&1 &
spid=$!
wait_listen $PORT
timeout 60 $P $D -p $PORT --test send_lat -s 128 -n 10 $HOST >"$LOG/err-mismatch.client" 2>&1; crc=$?
wait $spid; src=$?
if [ $crc = 1 ] && [ $src = 1 ] \
   && grep -q "the server refused the run: options differ between server and client: size: server 64, client 128; iterations: server 1000, client 10" "$LOG/err-mismatch.client" \
   && grep -q "error: options differ between server and client: size: server 64, client 128" "$LOG/err-mismatch.server"; then
  pass "mismatched options refused at the handshake" "$(secs "$t")"
  sed 's/^/      /' "$LOG/err-mismatch.client"
else
  fail "mismatched options (client $crc, server $src)" "$(secs "$t")" "$LOG/err-mismatch.server" "$LOG/err-mismatch.client"
fi

next_port
t=$(now)
$P $D -p $PORT --test write_lat -s 64 -m 1024 >"$LOG/err-testtype.server" 2>&1 &
spid=$!
wait_listen $PORT
timeout 60 $P $D -p $PORT --test write_bw -s 64 -m 512 $HOST >"$LOG/err-testtype.client" 2>&1; crc=$?
wait $spid; src=$?
if [ $crc = 1 ] && [ $src = 1 ] && grep -q "test: server write_lat, client write_bw" "$LOG/err-testtype.client" \
   && grep -q "mtu: server 1024, client 512" "$LOG/err-testtype.server"; then
  pass "mismatched test types and MTUs refused" "$(secs "$t")"
  sed 's/^/      /' "$LOG/err-testtype.server"
else
  fail "mismatched test types (client $crc, server $src)" "$(secs "$t")" "$LOG/err-testtype.server" "$LOG/err-testtype.client"
fi

# A peer killed mid-run: the survivor must fail within seconds, not hang.
killed() { # name, test, which side is killed (client|server)
  local name=$1 test=$2 victim=$3 l=$LOG/err-kill-$2-$3 t spid cpid survivor log k guard rc took
  next_port
  t=$(now)
  $P $D -p $PORT --test "$test" -s 64 -n 50000000 --timeout 120 >"$l.server" 2>&1 &
  spid=$!
  wait_listen $PORT
  $P $D -p $PORT --test "$test" -s 64 -n 50000000 --timeout 120 $HOST >"$l.client" 2>&1 &
  cpid=$!
  sleep 2
  if [ "$victim" = client ]; then
    kill -9 $cpid; { wait $cpid; } 2>/dev/null; survivor=$spid; log=$l.server
  else
    kill -9 $spid; { wait $spid; } 2>/dev/null; survivor=$cpid; log=$l.client
  fi
  k=$(now)
  ( sleep 30; kill -9 $survivor 2>/dev/null ) &
  guard=$!
  wait $survivor; rc=$?
  kill $guard 2>/dev/null
  { wait; } 2>/dev/null
  took=$(secs "$k")
  if [ $rc = 1 ] && grep -q "error: peer disconnected" "$log" && awk -v s="$took" 'BEGIN { exit !(s < 10) }'; then
    pass "$name (noticed after ${took} s)" "$(secs "$t")"; grep error: "$log" | sed 's/^/      /'
  else
    fail "$name (exit $rc after ${took} s)" "$(secs "$t")" "$log"
  fi
}
killed "client killed during send_lat: server notices" send_lat client
killed "server killed during write_lat: client notices" write_lat server
killed "client killed during write_bw: server notices" write_bw client

next_port
t=$(now)
timeout 60 ib_send_lat $D -p $PORT >"$LOG/err-perftest.server" 2>&1 &
spid=$!
wait_listen $PORT
timeout 60 $P $D -p $PORT --test send_lat $HOST >"$LOG/err-perftest.client" 2>&1; crc=$?
wait $spid
if [ $crc = 1 ] && grep -q "use --perftest" "$LOG/err-perftest.client"; then
  pass "perftest server met without --perftest: clear error" "$(secs "$t")"
  grep error: "$LOG/err-perftest.client" | sed 's/^/      /'
else
  fail "perftest server met without --perftest (exit $crc)" "$(secs "$t")" "$LOG/err-perftest.client"
fi

# --------------------------------------------------------------- 6 comparison
section "comparison: ibvx-pingpong vs perftest (same sizes and iterations, $ROUNDS rounds, alternating)"
# compare: test, perftest program, size, iterations, field (5 = t_typical, 4 =
# BW average)[, name (of its logs and RATIO line; default the test's)]
compare() {
  local test=$1 pt=$2 size=$3 n=$4 field=$5 name=${6:-$1} r tool order srv cli hdr
  : >"$LOG/cmp-$name.pt" ; : >"$LOG/cmp-$name.ibvx"
  r=1
  while [ $r -le "$ROUNDS" ]; do
    # alternate which tool goes first
    if [ $((r % 2)) = 1 ]; then order="pt ibvx"; else order="ibvx pt"; fi
    for tool in $order; do
      next_port
      if [ $tool = pt ]; then
        srv="$pt $D -p $PORT -s $size -n $n"; cli="$pt $D -p $PORT -s $size -n $n $HOST"
      else
        srv="$P $D -p $PORT --test $test -s $size -n $n"; cli="$P $D -p $PORT --test $test -s $size -n $n $HOST"
      fi
      pair "$name $tool round $r" "cmp-$name-$tool-$r" "$srv" "$cli" >"$LOG/cmp-$name-$tool-$r.status"
      grep -q '^PASS' "$LOG/cmp-$name-$tool-$r.status" || cat "$LOG/cmp-$name-$tool-$r.status"
      row "$LOG/cmp-$name-$tool-$r.client" >>"$LOG/cmp-$name.$tool"
    done
    r=$((r + 1))
  done
  case $field in 5) hdr=" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";;
                  *) hdr=" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";; esac
  echo "--- $pt (perftest), client side, one row per round"
  echo "$hdr"; cat "$LOG/cmp-$name.pt"
  echo "--- ibvx-pingpong --test $test, client side, one row per round"
  echo "$hdr"; cat "$LOG/cmp-$name.ibvx"
  awk -v f="$field" -v name="$name" -v strict="$STRICT" '
    function median(a, n,   i, j, t) {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    # perftest prints inf when its clock calibration failed: such rows are left out
    $f !~ /^[0-9]+([.][0-9]+)?$/ || $f + 0 <= 0 { bad[FILENAME]++; next }
    FILENAME ~ /[.]pt$/ { pt[++np] = $f; next }
    { ib[++ni] = $f }
    END {
      if (np == 0 || ni == 0) { print "RATIO " name ": no data"; exit 1 }
      mp = median(pt, np); mi = median(ib, ni); ratio = mi / mp
      what = (f == 5) ? "t_typical (usec)" : "BW average (MB/sec)"
      within = (ratio >= 0.9 && ratio <= 1.1) ? "yes" : "NO"
      printf "RATIO %-9s %-20s perftest %10.2f  ibvx-pingpong %10.2f  ibvx/perftest %.3f  within 10%%: %s", name, what, mp, mi, ratio, within
      for (k in bad) { n = k; sub(".*/cmp-", "", n); printf "  (%d unusable %s row(s) left out)", bad[k], n }
      printf "\n"
      exit (strict && within == "NO") ? 1 : 0
    }' "$LOG/cmp-$name.pt" "$LOG/cmp-$name.ibvx" | tee -a "$LOG/ratios.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || FAILS=$((FAILS + 1))
}
# warm the device and caches up before measuring
next_port
pair "warm-up" warmup "$P $D -p $PORT -s 8 -n 3000" "$P $D -p $PORT -s 8 -n 3000 $HOST" >/dev/null
: >"$LOG/ratios.txt"
compare send_lat ib_send_lat 8 2000 5
compare write_lat ib_write_lat 8 2000 5
compare write_bw ib_write_bw 1048576 120 4
# the size issue 24 names (the ratio at 4 MiB at least 0.9)
compare write_bw ib_write_bw 4194304 60 4 write_bw_4M
printf '\n== comparison summary (median over %s rounds)\n' "$ROUNDS"
cat "$LOG/ratios.txt"

# --------------------------------------------------------------- 7 ibv costs
section "ibv against ib_send_lat: system calls and writes per message (strace -f -c, 8 B, 3 rounds)"
t=$(now)
syscall_rounds 3 2000 $((PORT + 100)) "$LOG/st" "one guest" >"$LOG/syscalls.jsonl"
PORT=$((PORT + 110))
if [ "$(grep -c vm_syscalls "$LOG/syscalls.jsonl")" = 6 ]; then
  pass "strace counts, 3 rounds each" "$(secs "$t")"
  syscall_summary "$LOG/syscalls.jsonl" | sed 's/^/      /'
else
  fail "strace counts: $(grep -c vm_syscalls "$LOG/syscalls.jsonl") of 6 runs counted" "$(secs "$t")" "$LOG/syscalls.jsonl"
fi
section "ibv against ib_send_lat: 8 B latency (t_avg; best of 3 alternating rounds)"
# A figure, not a gate: the host's load decides it (ci/lib/latency.sh).
t=$(now)
lat_rounds 3 8 3000 $((PORT + 10)) "$LOG/lat" >"$LOG/latency.jsonl"
PORT=$((PORT + 40))
# An ibv run without a figure is a failure; perftest's own calibration
# failures (3 attempts each) only leave its round out.
if [ "$(grep '"ibv"' "$LOG/latency.jsonl" | grep -c '"us"')" = 3 ]; then
  pass "latency, 3 rounds each" "$(secs "$t")"
else
  fail "latency: an ibv run gave no figure" "$(secs "$t")" "$LOG/latency.jsonl" "$LOG"/lat-ibv-*.err
fi
lat_summary "$LOG/latency.jsonl" | sed 's/^/      /'
section "rendezvous from a reused user buffer, leased memory and fresh buffers"
export IBVX_REQUIRE_RDMA=1
t=$(now)
if timeout 1200 "$RNDV_FIG" rendezvous_figures --exact --ignored --nocapture >"$LOG/rndv.txt" 2>&1; then
  pass "rendezvous figures, 2 processes (16 KiB .. 4 MiB; eager against rendezvous 2 .. 64 KiB)" "$(secs "$t")"
else
  fail "rendezvous figures" "$(secs "$t")" "$LOG/rndv.txt"
fi
grep -E '^(rndv|cross|cache)' "$LOG/rndv.txt" | sed 's/^/      /'
unset IBVX_REQUIRE_RDMA

printf '\n'
if [ $FAILS -eq 0 ]; then echo "guest: all steps passed"; exit 0; fi
echo "guest: $FAILS step(s) failed"; exit 1
GUEST

# ------------------------------------------------------------------ run
say "booting the soft-RoCE guest (one boot for the whole suite)"
status=0
"$ROOT/ci/softroce-vm.sh" --timeout "$TIMEOUT" --mem 2048 --share "$WORK" \
  --extra-bin "$PINGPONG" \
  --extra-bin "$SYS_LIB" --extra-bin "$SYS_LOAD" --extra-bin "$SYS_DEV" \
  --extra-bin "$IBVX_LIB" --extra-bin "$IBVX_VERBS" --extra-bin "$SHM_LIB" \
  --extra-bin "$IBV_CONF" --extra-bin "$HYBRID_CONF" --extra-bin "$IBV_SCEN" --extra-bin "$REGCACHE" --extra-bin "$RNDV_FIG" \
  --extra-bin "$RANK_BIN" --extra-bin "$XDEV_RUN" --extra-bin "$XDEV_BENCH" \
  --extra-bin "$HYDRA" --extra-bin "$HYDRA_PROXY" --extra-bin "$(command -v strace)" \
  -- 'bash /share/guest.sh' || status=$?

if ((KEEP)); then say "logs kept in $WORK/logs"; fi
if ((status == 0)); then
  ((KEEP)) || rm -rf "$WORK"
  say "took $((SECONDS - T0)) s"
  echo "VM suite passed"
else
  say "logs of every step: $WORK/logs"
  say "took $((SECONDS - T0)) s"
  echo "VM suite FAILED (status $status)"
  exit "$status"
fi
