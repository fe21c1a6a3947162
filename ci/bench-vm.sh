#!/usr/bin/env bash
# bench-vm.sh - the soft-RoCE part of the comparison report: the `ibv` device
# and perftest, measured in one boot of the soft-RoCE guest, then the report.
#
# Builds xdev-bench and xdev-run (release) on the host, boots the guest of
# ci/softroce-vm.sh (qemu TCG, rdma_rxe over dummy0: both sides in one guest)
# and runs there, in ROUNDS rounds (the order of the tools alternating):
#   - perftest ib_send_lat, server and client in the guest (client connects to
#     $VM_PEER_IP, device $RXE_DEV, GID index $RXE_GID_INDEX), every power of
#     two from 1 B to MAX, 1000 iterations up to 8 KiB and 100 above: t_avg,
#   - xdev-bench --device ibv --test latency --quick (the same counts),
#   - perftest ib_write_bw -t 64 (a window of 64, as osu_bw), 640 writes up to
#     8 KiB and 128 above (xdev-bench --quick's message counts): BW average,
#     converted from perftest's MB (2^20 bytes) to OSU's (10^6 bytes),
#   - xdev-bench --device ibv --test bw --quick,
#   - xdev-bench --test floor --quick (the floors alone, between the rank
#     processes: more samples of the guest's floors, which TCG makes noisy),
# then, in 3 rounds of their own (alternating), the system calls and writes
# per message of the ibv latency test at 8 B against ib_send_lat, counted
# with strace -f -c (ci/lib/syscalls.sh: {"vm_syscalls":...} lines),
# writing every record into FILE (one JSON object per line: xdev-bench's
# records with the floors measured in the guest, perftest's as device
# "perftest", and {"vm_info":KEY,"value":VALUE} lines on the guest and the
# run, the host's load among them). Then, unless --vm-only, it runs
#   xdev-bench report --vm FILE [REPORT ARGS]
# on the host, which shows these figures in a section of their own (they come
# from an emulated guest: compare ibv with perftest, not with the host's).
#
# Usage: ci/bench-vm.sh [OPTIONS] [-- REPORT ARGS...]
#   --rounds N        rounds in the guest; each figure is its best round (default 2)
#   --max-size BYTES  largest message (default 4194304)
#   --timeout SECS    limit for the whole guest run (default 1500)
#   --out FILE        the results file (default target/release/bench-vm/vm-results.jsonl)
#   --vm-only         measure in the guest and write FILE; no report
# A perftest run that fails (perftest 6.06 gives up now and then when it cannot
# calibrate its clock on a busy TCG host) is tried up to 3 times; a size that
# still fails is recorded as a vm_info line, never filled in.
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ROUNDS=2 MAX=4194304 TIMEOUT=1500 OUT="" VM_ONLY=0
while (($#)); do
  case $1 in
    --rounds) ROUNDS=${2:?}; shift ;;
    --max-size) MAX=${2:?}; shift ;;
    --timeout) TIMEOUT=${2:?}; shift ;;
    --out) OUT=${2:?}; shift ;;
    --vm-only) VM_ONLY=1 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-vm: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench-vm: --rounds wants a positive number" >&2; exit 2; }
[[ $MAX =~ ^[1-9][0-9]*$ ]] || { echo "bench-vm: --max-size wants a byte count" >&2; exit 2; }

CARGO=${CARGO:-cargo}
say() { printf 'bench-vm: %s\n' "$*" >&2; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

say "building xdev-bench and xdev-run (release)"
"$CARGO" build --release --quiet -p xdev-bench --bin xdev-bench -p xdev-tools --bin xdev-run
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/release
WORK=$TARGET_DIR/bench-vm
OUT=${OUT:-$WORK/vm-results.jsonl}
rm -rf "$WORK/share"
mkdir -p "$WORK/share/logs" "$(dirname "$OUT")"

cat >"$WORK/share/run.sh" <<'GUEST'
# Runs inside the soft-RoCE guest (bash), from /share. See ci/bench-vm.sh.
# $D (device options) is split on purpose.
# shellcheck disable=SC2086
set -u
. /share/env.sh # MAX, ROUNDS
OUT=/share/vm-results.jsonl
LOG=/share/logs
D="-d $RXE_DEV -x $RXE_GID_INDEX"
PORT=20000
# perftest registers buffers of 4 KiB pages: xdev-bench's alike (its large
# buffers would otherwise be backed by huge pages, and the 1 GiB guest
# keeps no arena of them).
export XDEV_HUGE_PAGES=0
: >"$OUT"
escape() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  '; }
info() { printf '{"vm_info":"%s","value":"%s"}\n' "$(escape "$1")" "$(escape "$2")" >>"$OUT"; }
say() { printf 'guest: %s\n' "$*"; }
now() { cut -d' ' -f1 /proc/uptime; }
. /share/syscalls.sh # wait_listen, syscall_rounds

# perftest: program size iterations field scale extra-options -> one record
perftest() {
  local prog=$1 size=$2 n=$3 field=$4 scale=$5 extra=$6 test value attempt spid crc=- src=- log
  case $prog in *_lat) test=latency ;; *) test=bw ;; esac
  for attempt in 1 2 3; do
    PORT=$((PORT + 1)); log=$LOG/$prog-$size-r$ROUND-a$attempt
    timeout 300 $prog $D -p $PORT -s $size -n $n $extra >"$log.server" 2>&1 &
    spid=$!
    if ! wait_listen $PORT; then kill $spid 2>/dev/null; wait $spid; continue; fi
    timeout 300 $prog $D -p $PORT -s $size -n $n $extra $VM_PEER_IP >"$log.client" 2>&1; crc=$?
    wait $spid; src=$?
    # the table row after perftest's header line; perftest prints inf when
    # its clock calibration failed: no figure then
    value=$(awk -v f="$field" -v s="$scale" '/#bytes/ { if (getline > 0 && $f ~ /^[0-9]+([.][0-9]+)?$/ && $f > 0) printf "%.4f", $f * s; exit }' "$log.client")
    if [ $crc = 0 ] && [ $src = 0 ] && [ -n "$value" ]; then
      printf '{"device":"perftest","test":"%s","size":%s,"value":%s,"unit":"%s","floor":0}\n' \
        "$test" "$size" "$value" "$([ $test = latency ] && echo us || echo MB/s)" >>"$OUT"
      return 0
    fi
  done
  say "$prog -s $size failed 3 times (client $crc, server $src): $log.client"
  info "perftest failed" "$prog -s $size in round $ROUND: client exit $crc, server exit $src, no figure in 3 attempts"
}
sizes() { local s=1; while [ $s -le "$MAX" ]; do echo $s; s=$((s * 2)); done; }
perftest_latency() {
  for s in $(sizes); do
    if [ $s -le 8192 ]; then n=1000; else n=100; fi
    perftest ib_send_lat $s $n 6 1 ""
  done
}
perftest_bw() {
  for s in $(sizes); do
    if [ $s -le 8192 ]; then n=640; else n=128; fi
    perftest ib_write_bw $s $n 4 1.048576 "-t 64"
  done
}
floors() { # the floors alone; the threads' are not used here
  timeout 600 xdev-bench --test floor --quick --json --max-size "$MAX" \
    >"$LOG/floor-r$ROUND.out" 2>"$LOG/floor-r$ROUND.err" || say "xdev-bench --test floor failed"
  grep '"floor":"processes"' "$LOG/floor-r$ROUND.out" >>"$OUT"
}
ibv() { # test
  local rc
  timeout 900 xdev-bench --device ibv --test $1 --quick --json --max-size "$MAX" \
    --option ibv_device=$RXE_DEV --option ibv_gid_index=$RXE_GID_INDEX \
    >"$LOG/ibv-$1-r$ROUND.out" 2>"$LOG/ibv-$1-r$ROUND.err"
  rc=$?
  grep '^{' "$LOG/ibv-$1-r$ROUND.out" >>"$OUT"
  [ $rc = 0 ] || { say "xdev-bench --device ibv --test $1 exited with $rc"; tail -n 5 "$LOG/ibv-$1-r$ROUND.err"; }
}
step() { # name command...
  local t0; t0=$(now); "${@:2}"
  say "round $ROUND: $1 took $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }') s"
}

info "guest" "qemu TCG (software emulation), $(nproc) CPUs ($(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)), $(awk '/MemTotal/ { printf "%d MiB", $2 / 1024 }' /proc/meminfo)"
info "guest kernel" "$(uname -r)"
info "RDMA device" "$RXE_DEV: rdma_rxe (soft-RoCE) over $VM_NETDEV, GID index $RXE_GID_INDEX, both sides in this guest"
info "perftest" "$(ib_send_lat --version 2>&1 | sed 's/Version: //'): ib_send_lat (t_avg) and ib_write_bw -t 64 (BW average)"
info "rounds" "$ROUNDS, the order of the tools alternating; each figure is its best round"
ROUND=1
while [ $ROUND -le "$ROUNDS" ]; do
  if [ $((ROUND % 2)) = 1 ]; then
    step "ib_send_lat" perftest_latency; step "ibv latency" ibv latency
    step "ib_write_bw" perftest_bw; step "ibv bw" ibv bw
  else
    step "ibv latency" ibv latency; step "ib_send_lat" perftest_latency
    step "ibv bw" ibv bw; step "ib_write_bw" perftest_bw
  fi
  step "floors" floors
  ROUND=$((ROUND + 1))
done
t0=$(now)
syscall_rounds 3 2000 30000 "$LOG/st" "one guest" >>"$OUT"
say "system calls counted ($(grep -c vm_syscalls "$OUT") runs) in $(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }') s"
say "$(grep -c '"value"' "$OUT") records in $OUT"
GUEST
cp "$ROOT/ci/lib/syscalls.sh" "$WORK/share/syscalls.sh"
printf 'MAX=%s\nROUNDS=%s\n' "$MAX" "$ROUNDS" >"$WORK/share/env.sh"

LOAD_BEFORE=$(load) T0=$SECONDS
say "booting the soft-RoCE guest (host load average $LOAD_BEFORE)"
# What else the host runs meanwhile: every 10 s the 1-minute load average and
# the number of qemu processes (this guest is one of them).
(while :; do echo "$(cut -d' ' -f1 /proc/loadavg) $(pgrep -c qemu-system || true)"; sleep 10; done) \
  >"$WORK/host-samples.txt" &
SAMPLER=$!
status=0
"$ROOT/ci/softroce-vm.sh" --timeout "$TIMEOUT" --mem 2048 --share "$WORK/share" \
  --extra-bin "$TARGET_DIR/xdev-bench" --extra-bin "$TARGET_DIR/xdev-run" --extra-bin "$(command -v strace)" \
  -- 'bash /share/run.sh' || status=$?
kill "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" 2>/dev/null || true
if ((status != 0)); then
  say "the guest run failed (status $status); logs in $WORK/share/logs"
  exit "$status"
fi
{
  cat "$WORK/share/vm-results.jsonl"
  printf '{"vm_info":"host load average (1, 5, 15 min)","value":"%s before the guest run, %s after"}\n' \
    "$LOAD_BEFORE" "$(load)"
  awk '{ n++; l = $1 + 0; if (n == 1 || l < lo) lo = l; if (l > hi) hi = l; if ($2 > 1) busy++ }
    END { if (n) printf "{\"vm_info\":\"host during the guest run\",\"value\":\"1-minute load average %.2f to %.2f (the guest itself keeps about 2 busy); other qemu guests running in %d of %d samples (every 10 s)\"}\n", lo, hi, busy, n }' \
    "$WORK/host-samples.txt"
  printf '{"vm_info":"guest run","value":"ci/bench-vm.sh --rounds %s --max-size %s on %s, %s UTC, %d s from boot to power-off"}\n' \
    "$ROUNDS" "$MAX" "$(hostname)" "$(date -u '+%Y-%m-%d %H:%M')" $((SECONDS - T0))
} >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
say "wrote $OUT"

if ((VM_ONLY)); then exit 0; fi
OUT=${OUT#"$ROOT"/} # the report names the file: relative to the work tree when in it
say "the report: xdev-bench report --vm $OUT $*"
exec "$TARGET_DIR/xdev-bench" report --vm "$OUT" "$@"
