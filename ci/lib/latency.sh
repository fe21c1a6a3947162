# latency.sh - guest-side helpers (sourced by the guest scripts of
# ci/lat-compare.sh and ci/vm-suite.sh, after ci/lib/syscalls.sh, whose
# wait_listen they use): the latency of the ibv device at one size
# (`xdev-bench --device ibv --test latency`, OSU's average of half round
# trips) against perftest `ib_send_lat`'s t_avg (the average of half round
# trips too), in rounds that alternate which tool goes first. The figure of
# each tool is its best round; the target is ibv <= 1.3 x ib_send_lat.
#
# Needs in the guest: ib_send_lat, xdev-bench, $D (device options),
# $RXE_DEV, $RXE_GID_INDEX, $VM_PEER_IP. With $LAT_BASE_DIR set (a directory
# whose xdev-bench is another build, e.g. the main branch's), the rounds
# also run that build as the tool "base", and the summary compares ibv with
# it.

# lat_perftest SIZE N PORT LOG -> ib_send_lat's t_avg in us (nothing if it
# failed 3 times: perftest 6.06 gives up now and then when it cannot
# calibrate its clock on a busy TCG host). Uses ports PORT..PORT+2.
lat_perftest() {
  local size=$1 n=$2 port=$3 log=$4 attempt spid crc src value
  for attempt in 1 2 3; do
    timeout 300 ib_send_lat $D -p "$port" -s "$size" -n "$n" >"$log-a$attempt.server" 2>&1 &
    spid=$!
    if wait_listen "$port"; then
      timeout 300 ib_send_lat $D -p "$port" -s "$size" -n "$n" "$VM_PEER_IP" >"$log-a$attempt.client" 2>&1; crc=$?
      wait $spid; src=$?
      # t_avg is the 6th column of the row after the header
      value=$(awk '/#bytes/ { if (getline > 0 && $6 ~ /^[0-9]+([.][0-9]+)?$/ && $6 > 0) print $6; exit }' "$log-a$attempt.client")
      if [ "$crc" = 0 ] && [ "$src" = 0 ] && [ -n "$value" ]; then echo "$value"; return 0; fi
    else
      kill $spid 2>/dev/null; wait $spid
    fi
    port=$((port + 1))
  done
  return 1
}

# lat_ibv SIZE N LOG [XDEV-BENCH ARGS...] -> the ibv device's latency in us
# (xdev-bench --test latency --quick: one round, N timed iterations and N/10
# warm-up, after its own floor measurement).
lat_ibv() {
  local size=$1 n=$2 log=$3
  shift 3
  timeout 600 xdev-bench --device ibv --test latency --quick --json --min-size "$size" --max-size "$size" \
    --iterations "$n" --option ibv_device="$RXE_DEV" --option ibv_gid_index="$RXE_GID_INDEX" "$@" \
    >"$log.out" 2>"$log.err" || return 1
  sed -n 's/.*"device":"ibv","test":"latency".*"value":\([0-9.e+-]*\).*/\1/p' "$log.out" | head -n 1 | grep .
}

# lat_rounds ROUNDS SIZE N PORT LOGPREFIX [XDEV-BENCH ARGS...] -> one JSON line per tool and
# round on stdout: {"vm_latency":TOOL,"round":R,"size":S,"us":X}; a run
# that gave no figure prints {"vm_latency":TOOL,"round":R,"size":S,"failed":true}.
# Odd rounds run perftest first (then base, then ibv), even rounds the
# reverse order.
lat_rounds() {
  local rounds=$1 size=$2 n=$3 port=$4 log=$5 r=1 order tool v base=""
  shift 5
  [ -n "${LAT_BASE_DIR:-}" ] && base=base
  while [ $r -le "$rounds" ]; do
    if [ $((r % 2)) = 1 ]; then order="perftest $base ibv"; else order="ibv $base perftest"; fi
    for tool in $order; do
      port=$((port + 3))
      case $tool in
        perftest) v=$(lat_perftest "$size" "$n" $port "$log-pt-$r") ;;
        base) v=$(PATH=$LAT_BASE_DIR:$PATH lat_ibv "$size" "$n" "$log-base-$r" "$@") ;;
        *) v=$(lat_ibv "$size" "$n" "$log-ibv-$r" "$@") ;;
      esac
      if [ -n "$v" ]; then
        printf '{"vm_latency":"%s","round":%d,"size":%d,"us":%s}\n' "$tool" $r "$size" "$v"
      else
        printf '{"vm_latency":"%s","round":%d,"size":%d,"failed":true}\n' "$tool" $r "$size"
      fi
    done
    r=$((r + 1))
  done
}

# lat_summary FILE -> every round, the best round of each tool and the line
# LATENCY ibv/perftest X.XXx (target <= 1.3: met|NOT met)
# (a figure, not a gate: the host's load decides it).
lat_summary() {
  awk -F'[:,}]' '/"vm_latency"/ {
      delete f
      for (i = 1; i < NF; i++) { k = $i; gsub(/[{" ]/, "", k); v = $(i + 1); gsub(/[" ]/, "", v); f[k] = v }
      t = f["vm_latency"]; size = f["size"]
      if (f["failed"] == "true") { printf "LATENCY round %d %-8s %d B: no figure\n", f["round"], t, size; next }
      printf "LATENCY round %d %-8s %d B: %8.2f us\n", f["round"], t, size, f["us"]
      if (!(t in best) || f["us"] + 0 < best[t]) best[t] = f["us"] + 0
    }
    END {
      for (t in best) printf "LATENCY %-8s %d B: %8.2f us (best round)\n", t, size, best[t]
      if (("ibv" in best) && ("perftest" in best)) {
        r = best["ibv"] / best["perftest"]
        printf "LATENCY ibv/perftest %.2fx (target <= 1.3: %s)\n", r, (r <= 1.3) ? "met" : "NOT met"
      } else print "LATENCY ibv/perftest: no figure (a tool gave none in every round)"
      if (("base" in best) && ("ibv" in best)) printf "LATENCY ibv/base %.2fx\n", best["ibv"] / best["base"]
      if (("base" in best) && ("perftest" in best)) printf "LATENCY base/perftest %.2fx\n", best["base"] / best["perftest"]
    }' "$1"
}
