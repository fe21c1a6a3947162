#!/usr/bin/env bash
# lat-compare.sh - the ibv device's small-message latency against perftest
# ib_send_lat, in one boot of the soft-RoCE guest (issue 24's target: ibv at
# most 1.3 x ib_send_lat's t_avg at 8 B, best of 3 alternating rounds).
#
# Builds xdev-bench and xdev-run (release) on the host, boots the guest of
# ci/softroce-vm.sh (qemu TCG, 2 CPUs, rdma_rxe over dummy0: both sides in one
# guest) and alternates there, ROUNDS rounds (ci/lib/latency.sh):
#   - ib_send_lat -s SIZE -n N (server and client in the guest): t_avg,
#   - xdev-bench --device ibv --test latency --quick --iterations N at SIZE:
#     OSU's average of half round trips,
# then prints every round, each tool's best round and the line
#   LATENCY ibv/perftest X.XXx (target <= 1.3: met|NOT met)
# With --profile it then records, one run each, `perf record -e cpu-clock
# -F 999 -g -a` around the ibv run and around ib_send_lat (same size and
# count) and writes `perf report --no-children --sort comm,dso,sym` of each
# (symbols resolved in the guest) to WORK/perf-ibv.txt and WORK/perf-pt.txt,
# and on the host the bench's own samples by address and symbol+offset to
# WORK/perf-ibv-offsets.txt (the 60 hottest; read them against `objdump -d`
# of the binary), from WORK/perf-ibv.data.
# With --baseline BIN (another build of xdev-bench, e.g. the main branch's)
# every round also runs BIN's ibv latency (the tool "base", between the two
# others), and with --syscalls the system calls and writes per message of
# the ibv latency test against ib_send_lat are counted too (strace -f -c,
# ci/lib/syscalls.sh, ROUNDS alternating rounds of 2000 iterations), for
# BIN as well when given.
# The figures depend on the host's load: run it on a quiet host. The host's
# 1-minute load average is printed before and after.
#
# Usage: ci/lat-compare.sh [OPTIONS] [-- XDEV-BENCH ARGS...]
#   --rounds N      alternating rounds (default 3)
#   --size BYTES    message size (default 8)
#   --iterations N  iterations of each run (default 3000)
#   --profile       also profile one run of each tool with perf
#   --baseline BIN  also measure this xdev-bench build (see above)
#   --syscalls      also count system calls and writes per message
#   --timeout SECS  limit for the whole guest run (default 900)
# XDEV-BENCH ARGS go to every ibv run (e.g. --option inline=0).
# Work directory: $CARGO_TARGET_DIR/release/lat-compare (logs and profiles).
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ROUNDS=3 SIZE=8 ITERS=3000 PROFILE=0 TIMEOUT=900 BASELINE="" SYSCALLS=0
while (($#)); do
  case $1 in
    --rounds) ROUNDS=${2:?}; shift ;;
    --size) SIZE=${2:?}; shift ;;
    --iterations) ITERS=${2:?}; shift ;;
    --profile) PROFILE=1 ;;
    --baseline) BASELINE=${2:?}; shift ;;
    --syscalls) SYSCALLS=1 ;;
    --timeout) TIMEOUT=${2:?}; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "lat-compare: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -z $BASELINE || ( -f $BASELINE && -x $BASELINE ) ]] || { echo "lat-compare: --baseline $BASELINE is not an executable file" >&2; exit 2; }
for v in "$ROUNDS" "$SIZE" "$ITERS" "$TIMEOUT"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "lat-compare: --rounds, --size, --iterations and --timeout want positive numbers" >&2; exit 2; }
done

CARGO=${CARGO:-cargo}
say() { printf 'lat-compare: %s\n' "$*" >&2; }

say "building xdev-bench and xdev-run (release)"
"$CARGO" build --release --quiet -p xdev-bench --bin xdev-bench -p xdev-tools --bin xdev-run
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/release
WORK=$TARGET_DIR/lat-compare
rm -rf "$WORK"
mkdir -p "$WORK/logs"
cp "$ROOT/ci/lib/syscalls.sh" "$ROOT/ci/lib/latency.sh" "$WORK/"
{
  printf 'ROUNDS=%s\nSIZE=%s\nITERS=%s\nPROFILE=%s\nSYSCALLS=%s\n' "$ROUNDS" "$SIZE" "$ITERS" "$PROFILE" "$SYSCALLS"
  [[ -n $BASELINE ]] && printf 'BASELINE=1\n'
  printf 'BENCH_ARGS=(' ; for a in "$@"; do printf '%q ' "$a"; done; printf ')\n'
} >"$WORK/env.sh"

cat >"$WORK/run.sh" <<'GUEST'
# Runs inside the soft-RoCE guest (bash), from /share. See ci/lat-compare.sh.
# shellcheck disable=SC2086
set -u
. /share/env.sh
D="-d $RXE_DEV -x $RXE_GID_INDEX"
LOG=/share/logs
. /share/syscalls.sh # wait_listen
. /share/latency.sh
if [ "${BASELINE:-}" = 1 ]; then
  # the other build answers to the name xdev-bench in this directory
  export LAT_BASE_DIR=/tmp/lat-base
  mkdir -p $LAT_BASE_DIR && ln -sf /usr/local/bin/xdev-bench-base $LAT_BASE_DIR/xdev-bench
fi
echo "guest: $(uname -r), $(nproc) CPUs, perftest $(ib_send_lat --version 2>&1 | sed 's/Version: //')"
lat_rounds "$ROUNDS" "$SIZE" "$ITERS" 20000 "$LOG/lat" "${BENCH_ARGS[@]}" | tee /share/latency.jsonl
lat_summary /share/latency.jsonl
if [ "$SYSCALLS" = 1 ]; then
  syscall_rounds "$ROUNDS" 2000 22000 "$LOG/st" "one guest" >/share/syscalls.jsonl
  echo "system calls, this build:"; syscall_summary /share/syscalls.jsonl
  if [ -n "${LAT_BASE_DIR:-}" ]; then
    PATH=$LAT_BASE_DIR:$PATH syscall_rounds "$ROUNDS" 2000 23000 "$LOG/st-base" "one guest" >/share/syscalls-base.jsonl
    echo "system calls, the baseline build (its figures under the name ibv):"; syscall_summary /share/syscalls-base.jsonl
  fi
fi
if [ "$PROFILE" = 1 ]; then
  PERF="perf record -q -e cpu-clock -F 999 -g -a"
  REPORT="perf report --stdio --no-children --sort comm,dso,sym --percent-limit 0.5"
  $PERF -o /tmp/ibv.data -- xdev-bench --device ibv --test latency --quick --min-size "$SIZE" --max-size "$SIZE" \
    --iterations "$ITERS" --option ibv_device="$RXE_DEV" --option ibv_gid_index="$RXE_GID_INDEX" "${BENCH_ARGS[@]}" \
    >"$LOG/perf-ibv.out" 2>&1
  { perf report --stdio --no-children --sort comm,dso -g none -i /tmp/ibv.data; $REPORT -i /tmp/ibv.data; } \
    >/share/perf-ibv.txt 2>"$LOG/perf-ibv-report.err"
  cp /tmp/ibv.data /share/perf-ibv.data # for the offsets, on the host
  ib_send_lat $D -p 21000 -s "$SIZE" -n "$ITERS" >"$LOG/perf-pt.server" 2>&1 &
  wait_listen 21000
  $PERF -o /tmp/pt.data -- ib_send_lat $D -p 21000 -s "$SIZE" -n "$ITERS" "$VM_PEER_IP" >"$LOG/perf-pt.client" 2>&1
  wait
  { perf report --stdio --no-children --sort comm,dso -g none -i /tmp/pt.data; $REPORT -i /tmp/pt.data; } \
    >/share/perf-pt.txt 2>"$LOG/perf-pt-report.err"
  echo "guest: profiles in perf-ibv.txt and perf-pt.txt"
fi
GUEST

extra=()
((PROFILE)) && extra+=(--extra-bin "$(command -v perf)")
((SYSCALLS)) && extra+=(--extra-bin "$(command -v strace)")
if [[ -n $BASELINE ]]; then
  cp "$BASELINE" "$WORK/xdev-bench-base"
  extra+=(--extra-bin "$WORK/xdev-bench-base")
fi
say "booting the soft-RoCE guest (host load average $(cut -d' ' -f1-3 /proc/loadavg))"
status=0
"$ROOT/ci/softroce-vm.sh" --timeout "$TIMEOUT" --mem 2048 --share "$WORK" \
  --extra-bin "$TARGET_DIR/xdev-bench" --extra-bin "$TARGET_DIR/xdev-run" "${extra[@]}" \
  -- 'bash /share/run.sh' || status=$?
say "host load average after: $(cut -d' ' -f1-3 /proc/loadavg); logs in $WORK"
if ((PROFILE)) && [[ -f $WORK/perf-ibv.data ]]; then
  # The samples in the bench's own code (every rank) by symbol+offset, hot
  # first, to read against `objdump -d` of the same binary: under qemu TCG
  # they land on the boundaries of calls, returns and atomics.
  perf script -i "$WORK/perf-ibv.data" --show-mmap-events -F pid,ip,dso --hide-call-graph 2>/dev/null \
    | python3 -c '
import bisect, collections, re, subprocess, sys
binary = sys.argv[1]
maps, hits = {}, collections.Counter()
for line in sys.stdin:
    m = re.search(r"MMAP2? (\d+)/\d+: \[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+) .*r-xp .*/xdev-bench$", line)
    if m:
        maps[int(m[1])] = (int(m[2], 16), int(m[4], 16))
        continue
    f = line.split()
    if len(f) == 3 and f[2].endswith("xdev-bench)") and int(f[0]) in maps:
        base, off = maps[int(f[0])]
        hits[int(f[1], 16) - base + off] += 1
# file offsets to addresses: the executable segment of the binary
seg = [l.split() for l in subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True).stdout.splitlines() if "LOAD" in l and "R E" in l][0]
delta = int(seg[2], 16) - int(seg[1], 16)
syms = sorted((int(a, 16), n) for a, t, n in (l.split(" ", 2) for l in subprocess.run(["nm", "-C", "--defined-only", binary], capture_output=True, text=True).stdout.splitlines() if l.count(" ") >= 2) if t in "tT")
keys = [a for a, _ in syms]
total = sum(hits.values()) or 1
for off, n in hits.most_common(60):
    a = off + delta
    i = bisect.bisect_right(keys, a) - 1
    print(f"{n:6d} {100 * n / total:5.1f}% {a:#x} {syms[i][1]}+{a - syms[i][0]:#x}")
' "$TARGET_DIR/xdev-bench" >"$WORK/perf-ibv-offsets.txt" || say "no offsets (perf, python3, readelf and nm on the host)"
fi
exit "$status"
