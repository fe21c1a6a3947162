# syscalls.sh - guest-side helpers (sourced by the guest scripts of
# ci/bench-vm.sh, ci/vm-suite.sh and ci/two-guest-suite.sh): system calls and
# `write`s per message of `xdev-bench --device ibv --test latency` (8 B)
# against perftest `ib_send_lat`, counted with `strace -f -c` around each
# side's processes (the launcher's own calls left out: xdev-run is not
# traced), divided by the messages both sides sent.
#
# Needs in the guest: strace, ib_send_lat, xdev-bench, xdev-run, $D (device
# options), $RXE_DEV, $RXE_GID_INDEX.

# strace_calls FILE... -> "calls writes" summed over strace -c summaries
strace_calls() {
  awk '$NF == "total" { c += $4 } $NF == "write" { w += $4 } END { printf "%d %d\n", c, w }' "$@"
}

# count_perftest ROUND N PORT PEER LOGPREFIX -> "calls writes messages" of
# one ib_send_lat pair (server here, client to PEER; PEER empty: this is the
# server side of a two-guest run, the client elsewhere).
count_perftest() {
  local r=$1 n=$2 port=$3 peer=$4 log=$5 spid
  strace -f -c -o "$log-pt-srv-$r.st" ib_send_lat $D -p "$port" -s 8 -n "$n" >"$log-pt-srv-$r.out" 2>&1 &
  spid=$!
  wait_listen "$port" || { kill $spid; return 1; }
  strace -f -c -o "$log-pt-cli-$r.st" ib_send_lat $D -p "$port" -s 8 -n "$n" "$peer" >"$log-pt-cli-$r.out" 2>&1
  wait $spid
  echo "$(strace_calls "$log-pt-srv-$r.st" "$log-pt-cli-$r.st") $((2 * n))"
}

# count_ibv ROUND N LOGPREFIX -> "calls writes messages" of one xdev-bench
# latency run at 8 B, N timed iterations (plus N/10 warm-up), one round.
count_ibv() {
  local r=$1 n=$2 log=$3
  xdev-run -n 2 --device ibv -- sh -c "exec strace -f -c -o $log-ibv-\$XDEV_RANK-$r.st xdev-bench --device ibv \
    --test latency --quick --min-size 8 --max-size 8 --iterations $n \
    --option ibv_device=$RXE_DEV --option ibv_gid_index=$RXE_GID_INDEX" >"$log-ibv-$r.out" 2>&1 || return 1
  echo "$(strace_calls "$log-ibv-0-$r.st" "$log-ibv-1-$r.st") $((2 * (n + n / 10)))"
}

wait_listen() { # port: wait up to 20 s for a listener (the one copy: every guest script sources this file)
  local i=0
  while ! netstat -ltn 2>/dev/null | grep -q ":$1 "; do
    i=$((i + 1)); [ $i -gt 200 ] && return 1; sleep 0.1
  done
}

# syscall_rounds ROUNDS N PORT LOGPREFIX PLACEMENT -> one JSON line per tool
# and round on stdout:
# {"vm_syscalls":TOOL,"placement":P,"round":R,"calls":C,"writes":W,"messages":M}
syscall_rounds() {
  local rounds=$1 n=$2 port=$3 log=$4 place=$5 r=1 order tool out
  while [ $r -le "$rounds" ]; do
    if [ $((r % 2)) = 1 ]; then order="perftest ibv"; else order="ibv perftest"; fi
    for tool in $order; do
      port=$((port + 1))
      if [ $tool = perftest ]; then out=$(count_perftest $r "$n" $port "$VM_PEER_IP" "$log")
      else out=$(count_ibv $r "$n" "$log"); fi
      set -- $out
      [ $# = 3 ] && printf '{"vm_syscalls":"%s","placement":"%s","round":%d,"calls":%d,"writes":%d,"messages":%d}\n' \
        "$tool" "$place" $r "$1" "$2" "$3"
    done
    r=$((r + 1))
  done
}

# syscall_summary FILE -> prints per message figures, best round per tool,
# and the targets (calls <= 1.2 x perftest's, writes <= perftest's + 0.1)
syscall_summary() {
  awk -F'[:,}]' '/"vm_syscalls"/ {
      delete f
      for (i = 1; i < NF; i++) { k = $i; gsub(/[{" ]/, "", k); v = $(i + 1); gsub(/[" ]/, "", v); f[k] = v }
      t = f["vm_syscalls"]; c = f["calls"] / f["messages"]; w = f["writes"] / f["messages"]
      if (!(t in bc) || c < bc[t]) bc[t] = c
      if (!(t in bw) || w < bw[t]) bw[t] = w
    }
    END {
      for (t in bc) printf "SYSCALLS %-9s calls/message %6.2f  writes/message %5.2f (best round)\n", t, bc[t], bw[t]
      if (("ibv" in bc) && ("perftest" in bc)) {
        printf "SYSCALLS ibv/perftest calls %.2fx (target <= 1.2: %s), writes %+.2f (target <= +0.1: %s)\n",
          bc["ibv"] / bc["perftest"], (bc["ibv"] <= 1.2 * bc["perftest"]) ? "met" : "NOT met",
          bw["ibv"] - bw["perftest"], (bw["ibv"] <= bw["perftest"] + 0.1) ? "met" : "NOT met"
      }
    }' "$1"
}
