#!/usr/bin/env bash
# two-guest-suite.sh - the xdev conformance suite across two soft-RoCE guests.
#
# Boots two qemu guests (ci/softroce-vm.sh --hosts 2: 10.77.0.1 and 10.77.0.2,
# rxe0 over a virtio NIC each, wired by qemu) and runs every conformance case
# as a job whose ranks are split between them:
#   1. ibv: 2 ranks, one per guest (verbs over the wire between guests);
#   2. hybrid: 4 ranks, two per guest (shared memory inside a guest, ibv
#      between guests);
#   3. compare: the ibv device's 8 B latency (osu_latency's loop, one rank
#      per guest: the lat mode of ibvx's ibv_rndv_figures test binary, since
#      xdev-bench's ranks share memory for their floor and cannot span
#      guests) against ib_send_lat across the wire, 3 rounds alternating the
#      tools: latency (un-traced runs) and system calls and writes per
#      message (strace -f -c on each side, ci/lib/syscalls.sh). The records
#      go to FILE with --compare-out FILE (appended: the VM results file of
#      ci/bench-vm.sh, so that `xdev-bench report --vm FILE` shows them).
# Guest 0 serves each job's bootstrap (xdev-run --serve --bind 10.77.0.1:PORT)
# and leaves the lines to export in the shared directory; each guest then
# starts its own ranks by hand, as a batch scheduler would.
# Exits non-zero if any case fails on either guest; prints
# "two-guest suite passed" at the end otherwise.
#
# Usage: ci/two-guest-suite.sh [--timeout SECS] [--only ibv|hybrid|compare]
#                               [--compare-out FILE] [--keep]
#   --timeout SECS  limit for the whole run, boot included (default 2400)
#   --only NAME     run one of the three parts
#   --compare-out FILE  append the comparison's records to FILE
#   --keep          keep the work directory (every rank's log)
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/.."

TIMEOUT=2400 ONLY="" KEEP=0 COMPARE_OUT=""
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=${2:?}; shift ;;
    --only) ONLY=${2:?}; shift ;;
    --compare-out) COMPARE_OUT=${2:?}; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "two-guest-suite: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -z $ONLY || $ONLY == ibv || $ONLY == hybrid || $ONLY == compare ]] ||
  { echo "two-guest-suite: --only wants ibv, hybrid or compare" >&2; exit 2; }

CARGO=${CARGO:-cargo}
say() { printf 'two-guest-suite: %s\n' "$*"; }

say "building xdev-rank and xdev-run (release)"
"$CARGO" build --release --quiet -p xdev-tools --bin xdev-rank --bin xdev-run
FIGS=$("$CARGO" test --release --quiet -p ibvx --test ibv_rndv_figures --no-run --message-format=json |
  sed -n 's/.*"executable":"\([^"]*ibv_rndv_figures[^"]*\)".*/\1/p' | tail -n 1)
[[ -x $FIGS ]] || { say "error: the ibv_rndv_figures test binary was not built"; exit 1; }
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}/release
WORK=$TARGET_DIR/two-guest-suite
rm -rf "$WORK"
mkdir -p "$WORK/jobs" "$WORK/logs" "$WORK/sync"
cp ci/lib/syscalls.sh "$WORK/syscalls.sh"
echo "FIGS=$(basename "$FIGS")" >>"$WORK/env.sh"
[[ $WORK != *,* ]] || { say "error: the work directory path contains a comma: $WORK"; exit 1; }
echo "ONLY=$ONLY" >>"$WORK/env.sh"

cat >"$WORK/guest.sh" <<'GUEST'
# Runs in both guests (bash), from /share. See ci/two-guest-suite.sh.
. /share/env.sh
H=$VM_HOST
FAILS=0
PORT=21000
now() { cut -d' ' -f1 /proc/uptime; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
CASES=$(xdev-rank cases)

# job LABEL DEVICE RANKS_PER_GUEST [OPTIONS...]: every case as one job.
job() {
  local label=$1 dev=$2 per=$3 n case envf serve spid t0 k r rc pids
  shift 3
  n=$((per * 2))
  echo "== $label: $n ranks, $per per guest ($dev $*)"
  for case in $CASES; do
    PORT=$((PORT + 1))
    envf=/share/jobs/$label-$case.env
    serve=/share/jobs/$label-$case.serve
    t0=$(now)
    if [ "$H" = 0 ]; then
      xdev-run --serve -n "$n" --device "$dev" --bind "$VM_SELF_IP:$PORT" --timeout 900 >"$serve" 2>&1 &
      spid=$!
      k=0
      until grep -q '^export' "$serve" 2>/dev/null; do
        k=$((k + 1)); [ $k -gt 300 ] && break; sleep 0.1
      done
      grep '^export' "$serve" >"$envf.tmp" && mv "$envf.tmp" "$envf"
    else
      k=0
      until [ -f "$envf" ]; do
        k=$((k + 1)); [ $k -gt 9000 ] && break; sleep 0.1
      done
    fi
    if [ ! -f "$envf" ]; then
      echo "FAIL  $label $case: no bootstrap service (see $(basename "$serve"))"; FAILS=$((FAILS + 1))
      [ "$H" = 0 ] && { kill "$spid" 2>/dev/null; wait "$spid"; }
      continue
    fi
    pids=""
    for k in $(seq 0 $((per - 1))); do
      r=$((H * per + k))
      ( . "$envf"; export XDEV_RANK=$r XDEV_DEVICE=$dev
        exec timeout 900 xdev-rank conformance "$case" "$@" ) >"/share/logs/$label-$case-rank$r.txt" 2>&1 &
      pids="$pids $!"
    done
    rc=0
    for p in $pids; do wait "$p" || rc=$?; done
    if [ "$H" = 0 ]; then wait "$spid" || [ $rc != 0 ] || rc=99; fi
    if [ $rc = 0 ]; then
      printf 'PASS  %-40s %6s s\n' "$label $case" "$(secs "$t0")"
    else
      printf 'FAIL  %-40s %6s s (exit %s)\n' "$label $case" "$(secs "$t0")" "$rc"; FAILS=$((FAILS + 1))
      for f in /share/logs/$label-$case-rank*.txt; do
        [ -s "$f" ] && { echo "----- $(basename "$f")"; tail -n 20 "$f"; }
      done
      [ "$H" = 0 ] && { echo "----- bootstrap service"; tail -n 20 "$serve"; }
    fi
  done
}

mark() { : >"/share/sync/$1"; }
await() { # name: wait up to 300 s for the other guest's mark
  local k=0
  until [ -f "/share/sync/$1" ]; do k=$((k + 1)); [ $k -gt 3000 ] && return 1; sleep 0.1; done
}

# pt_pair ROUND N TRACE(0|1): one ib_send_lat pair, server in guest 0.
pt_pair() {
  local r=$1 n=$2 st=$3 tag=pt-$1-$3 pre=""
  PORT=$((PORT + 1))
  [ "$st" = 1 ] && pre="strace -f -c -o /share/logs/$tag-h$H.st"
  if [ "$H" = 0 ]; then
    $pre ib_send_lat $D -p $PORT -s 8 -n "$n" >"/share/logs/$tag-h0.out" 2>&1 &
    wait_listen $PORT; mark "$tag-listen"; wait $!
  else
    await "$tag-listen" && $pre ib_send_lat $D -p $PORT -s 8 -n "$n" "$VM_PEER_IP" >"/share/logs/$tag-h1.out" 2>&1
  fi
  mark "$tag-done-h$H"; await "$tag-done-h$((1 - H))"
}

# ibv_pair ROUND N TRACE(0|1): osu_latency's loop on ibv, rank H in guest H.
ibv_pair() {
  local r=$1 n=$2 st=$3 tag=ibv-$1-$3 pre="" envf
  PORT=$((PORT + 1)); envf=/share/jobs/$tag.env
  [ "$st" = 1 ] && pre="strace -f -c -o /share/logs/$tag-h$H.st"
  if [ "$H" = 0 ]; then
    xdev-run --serve -n 2 --device ibv --bind "$VM_SELF_IP:$PORT" --timeout 600 >"/share/jobs/$tag.serve" 2>&1 &
    until grep -q '^export' "/share/jobs/$tag.serve" 2>/dev/null; do sleep 0.1; done
    grep '^export' "/share/jobs/$tag.serve" >"$envf.tmp" && mv "$envf.tmp" "$envf"
  fi
  until [ -f "$envf" ]; do sleep 0.1; done
  ( . "$envf"; export XDEV_RANK=$H XDEV_DEVICE=ibv IBVX_FIGURES=lat IBVX_FIGURES_ITERS=$n \
      IBVX_FIGURES_OPTIONS="ibv_device=$RXE_DEV,ibv_gid_index=$RXE_GID_INDEX"
    exec timeout 300 $pre "$FIGS" rendezvous_figures --exact --ignored --nocapture ) \
    >"/share/logs/$tag-h$H.out" 2>&1
  [ "$H" = 0 ] && wait
  mark "$tag-done-h$H"; await "$tag-done-h$((1 - H))"
}

# compare: 3 rounds, tools alternating, each once un-traced (latency) and
# once traced (system calls); guest 0 writes /share/compare.jsonl.
compare() {
  local r=1 n=1000 tool lat
  D="-d $RXE_DEV -x $RXE_GID_INDEX"
  . /share/syscalls.sh
  echo "== compare: ibv against ib_send_lat across the wire, 8 B, 3 rounds"
  while [ $r -le 3 ]; do
    for tool in $([ $((r % 2)) = 1 ] && echo "pt ibv" || echo "ibv pt"); do
      ${tool}_pair $r $n 0; ${tool}_pair $r $n 1
    done
    r=$((r + 1))
  done
  [ "$H" = 0 ] || return 0
  : >/share/compare.jsonl
  for r in 1 2 3; do
    set -- $(strace_calls /share/logs/pt-$r-1-h0.st /share/logs/pt-$r-1-h1.st)
    [ $# = 2 ] && printf '{"vm_syscalls":"perftest","placement":"two guests","round":%d,"calls":%d,"writes":%d,"messages":%d}\n' $r "$1" "$2" $((2 * n)) >>/share/compare.jsonl
    set -- $(strace_calls /share/logs/ibv-$r-1-h0.st /share/logs/ibv-$r-1-h1.st)
    [ $# = 2 ] && printf '{"vm_syscalls":"ibv","placement":"two guests","round":%d,"calls":%d,"writes":%d,"messages":%d}\n' $r "$1" "$2" $((2 * (n + n / 10))) >>/share/compare.jsonl
  done
  pt=$(for r in 1 2 3; do awk '/#bytes/ { if (getline > 0 && $6 ~ /^[0-9.]+$/) print $6; exit }' /share/logs/pt-$r-0-h1.out; done | sort -g | head -1)
  # the test harness prints "test rendezvous_figures ... " before the figure, on its line
  ib=$(for r in 1 2 3; do grep -o 'lat 8 [0-9.]*' /share/logs/ibv-$r-0-h0.out | awk '{ print $3 }'; done | sort -g | head -1)
  lat="ibv ${ib:-none} us, ib_send_lat t_avg ${pt:-none} us"
  [ -n "$pt" ] && [ -n "$ib" ] && lat="$lat: ibv / perftest $(awk -v a="$ib" -v b="$pt" 'BEGIN { printf "%.2f", a / b }')"
  printf '{"vm_info":"two guests (ci/two-guest-suite.sh --only compare): 8 B latency, best of 3 rounds","value":"%s"}\n' "$lat" >>/share/compare.jsonl
  echo "compare: $lat"
  syscall_summary /share/compare.jsonl
}

echo "guest $H: $(uname -r), $(nproc) CPU, $VM_SELF_IP, peer $VM_PEER_IP, device $RXE_DEV"
[ -z "$ONLY" ] || [ "$ONLY" = ibv ] && job ibv ibv 1
[ -z "$ONLY" ] || [ "$ONLY" = hybrid ] && job hybrid hybrid 2 remote=ibv
[ -z "$ONLY" ] || [ "$ONLY" = compare ] && compare
echo "guest $H: $FAILS failed"
[ $FAILS = 0 ]
GUEST

say "booting two guests (qemu TCG; this takes a while)"
rc=0
ci/softroce-vm.sh --hosts 2 --mem 2048 --timeout "$TIMEOUT" --share "$WORK" \
  --extra-bin "$TARGET_DIR/xdev-rank" --extra-bin "$TARGET_DIR/xdev-run" \
  --extra-bin "$FIGS" --extra-bin "$(command -v strace)" \
  -- 'bash /share/guest.sh' || rc=$?
if [[ -n $COMPARE_OUT && -s $WORK/compare.jsonl ]]; then
  cat "$WORK/compare.jsonl" >>"$COMPARE_OUT"
  say "comparison records appended to $COMPARE_OUT"
fi
if [[ $rc == 0 ]]; then
  say "two-guest suite passed"
  ((KEEP)) || rm -rf "$WORK"
else
  say "FAILED (exit $rc); logs in $WORK/logs"
fi
exit $rc
