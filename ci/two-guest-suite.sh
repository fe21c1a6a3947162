#!/usr/bin/env bash
# two-guest-suite.sh - the xdev conformance suite across two soft-RoCE guests.
#
# Boots two qemu guests (ci/softroce-vm.sh --hosts 2: 10.77.0.1 and 10.77.0.2,
# rxe0 over a virtio NIC each, wired by qemu) and runs every conformance case
# as a job whose ranks are split between them:
#   1. ibv: 2 ranks, one per guest (verbs over the wire between guests);
#   2. hybrid: 4 ranks, two per guest (shared memory inside a guest, ibv
#      between guests).
# Guest 0 serves each job's bootstrap (xdev-run --serve --bind 10.77.0.1:PORT)
# and leaves the lines to export in the shared directory; each guest then
# starts its own ranks by hand, as a batch scheduler would.
# Exits non-zero if any case fails on either guest; prints
# "two-guest suite passed" at the end otherwise.
#
# Usage: ci/two-guest-suite.sh [--timeout SECS] [--only ibv|hybrid] [--keep]
#   --timeout SECS  limit for the whole run, boot included (default 2400)
#   --only NAME     run one of the two configurations
#   --keep          keep the work directory (every rank's log)
# Environment: CARGO (default cargo), CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/.."

TIMEOUT=2400 ONLY="" KEEP=0
while (($#)); do
  case $1 in
    --timeout) TIMEOUT=${2:?}; shift ;;
    --only) ONLY=${2:?}; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "two-guest-suite: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -z $ONLY || $ONLY == ibv || $ONLY == hybrid ]] || { echo "two-guest-suite: --only wants ibv or hybrid" >&2; exit 2; }

CARGO=${CARGO:-cargo}
say() { printf 'two-guest-suite: %s\n' "$*"; }

say "building xdev-rank and xdev-run (release)"
"$CARGO" build --release --quiet -p ibvx --bin xdev-rank
"$CARGO" build --release --quiet -p xdev --bin xdev-run
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}/release
WORK=$TARGET_DIR/two-guest-suite
rm -rf "$WORK"
mkdir -p "$WORK/jobs" "$WORK/logs"
[[ $WORK != *,* ]] || { say "error: the work directory path contains a comma: $WORK"; exit 1; }
echo "ONLY=$ONLY" >"$WORK/env.sh"

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

echo "guest $H: $(uname -r), $(nproc) CPU, $VM_SELF_IP, peer $VM_PEER_IP, device $RXE_DEV"
[ -z "$ONLY" ] || [ "$ONLY" = ibv ] && job ibv ibv 1
[ -z "$ONLY" ] || [ "$ONLY" = hybrid ] && job hybrid hybrid 2 remote=ibv
echo "guest $H: $FAILS failed"
[ $FAILS = 0 ]
GUEST

say "booting two guests (qemu TCG; this takes a while)"
rc=0
ci/softroce-vm.sh --hosts 2 --mem 2048 --timeout "$TIMEOUT" --share "$WORK" \
  --extra-bin "$TARGET_DIR/xdev-rank" --extra-bin "$TARGET_DIR/xdev-run" \
  -- 'bash /share/guest.sh' || rc=$?
if [[ $rc == 0 ]]; then
  say "two-guest suite passed"
  ((KEEP)) || rm -rf "$WORK"
else
  say "FAILED (exit $rc); logs in $WORK/logs"
fi
exit $rc
