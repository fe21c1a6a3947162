#!/usr/bin/env bash
# softroce-vm.sh - soft-RoCE (rdma_rxe) test bed in a qemu (TCG) guest.
#
# Boots a Debian 12 kernel with a busybox initramfs that carries rdma-core
# (libibverbs + rxe provider), iproute2 (ip, rdma), perftest and
# ibverbs-utils, creates an rxe device and runs a command in the guest.
# The host needs no RDMA support at all.  Run with --help for usage.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT_PATH=$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")
WORK=${SOFTROCE_WORK:-$SCRIPT_DIR/work}

# Debian packages the host needs (checked with dpkg-query, installed if missing).
HOST_PKGS=(qemu-system-x86 busybox-static cpio kmod rdma-core ibverbs-providers
           ibverbs-utils perftest iproute2 util-linux gzip dash bash)

# Kernel modules put in the initramfs (dependencies are added automatically).
MODULES=(rdma_rxe ib_uverbs ib_core ip6_udp_tunnel udp_tunnel crc32_generic
         rdma_ucm dummy 9p 9pnet 9pnet_virtio netfs fscache virtio_pci
         virtio_net net_failover failover)

# Programs put in the initramfs (with their shared libraries).
GUEST_BINS=(dash bash ip rdma ibv_devices ibv_devinfo ibv_rc_pingpong ibv_ud_pingpong
            ibv_srq_pingpong ibv_uc_pingpong ibv_asyncwatch
            ib_send_lat ib_send_bw ib_write_lat ib_write_bw ib_read_lat
            ib_read_bw ib_atomic_lat ib_atomic_bw)

SUBNET=10.77.0           # guest-internal addresses: $SUBNET.1, $SUBNET.2
RXE_DEV=rxe0
RXE_GID_INDEX=1          # IPv4-mapped GID of the netdev address
PEER_GRACE=${SOFTROCE_PEER_GRACE:-30}   # 2 hosts: kill the other guest this long after one failed

usage() {
  cat <<'EOF'
Usage:
  ci/softroce-vm.sh [OPTIONS] -- COMMAND [ARGS...]
  ci/softroce-vm.sh prepare        install packages, fetch kernel, build initramfs; no boot

Boots a qemu guest (TCG, no KVM needed) with soft-RoCE (rdma_rxe) set up and
runs COMMAND in it.  A single COMMAND argument is a shell string run with
`sh -c` (sh is dash; bash and the busybox applets are there too); several
arguments are run as one quoted command line.
The working directory is /share when --share is given, else /.  The script's
exit status is the command's (with --hosts 2: the first non-zero of guest 0,
guest 1); 124 on timeout; 125 when a guest did not report a status (boot or
setup failure, crash); 2 on usage or host-side setup errors.

Options:
  --hosts 1|2        1 (default): one guest, rxe0 over dummy0 (10.77.0.1/24).
                     2: two guests, each with a virtio NIC eth0 (10.77.0.1/24,
                     10.77.0.2/24) and rxe0 over it, wired together by qemu's
                     UDP socket netdev on 127.0.0.1 (random free ports);
                     COMMAND runs in both, started once each can ping the other.
  --timeout SECS     wall-clock limit for boot + command (default 900).
  --share DIR        export host DIR read-write over virtio-9p, mounted at /share
                     (both guests share the same DIR with --hosts 2).
  --extra-bin PATH   add a host program (and its shared libraries) to the guest,
                     in /usr/local/bin; repeatable.
  --env NAME=VALUE   export a variable to COMMAND; repeatable.
  --mem MB           guest memory (default 1024).
  --smp N            guest CPUs (default 2 with --hosts 1, 1 with --hosts 2).
  --verbose          show kernel messages and guest setup steps.
  -h, --help         this help.

Environment seen by COMMAND:
  VM_HOST=0|1  VM_HOSTS=1|2  VM_SELF_IP  VM_PEER_IP (= VM_SELF_IP with 1 host)
  VM_NETDEV (dummy0 or eth0)  RXE_DEV=rxe0  RXE_GID_INDEX=1
  VM_SHARE (/share or empty)  plus every --env.

Host environment: SOFTROCE_WORK (cache dir, default ci/work),
SOFTROCE_PEER_GRACE (with --hosts 2, seconds the other guest may run on
after one failed; default 30), SOFTROCE_QEMU_CPU (qemu -cpu model, default max).
EOF
}

log() { printf 'softroce-vm: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# POSIX single-quote a string for the guest's sh.
shquote() { local s=${1//\'/\'\\\'\'}; printf "'%s'" "$s"; }

# ---------------------------------------------------------------- host setup

APT_UPDATED=0
apt_update_once() {
  (( APT_UPDATED )) && return 0
  local i
  for i in 1 2 3 4 5 6; do
    if apt-get update -qq >"$WORK/apt-update.log" 2>&1; then APT_UPDATED=1; return 0; fi
    log "apt-get update failed (try $i), retrying in 10 s"; sleep 10
  done
  cat "$WORK/apt-update.log" >&2; die "apt-get update failed"
}

ensure_host_packages() {
  local p st missing=()
  for p in "${HOST_PKGS[@]}"; do
    st=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) || true
    [[ $st == ii* ]] || missing+=("$p")
  done
  (( ${#missing[@]} )) || return 0
  [[ $(id -u) == 0 ]] || die "need root to install: ${missing[*]}"
  log "installing ${missing[*]}"
  apt_update_once
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=600 "${missing[@]}" >"$WORK/apt-install.log" 2>&1 \
    || { cat "$WORK/apt-install.log" >&2; die "apt-get install failed"; }
}

# Name of the versioned kernel package linux-image-amd64 depends on.
kernel_pkg_name() {
  apt-cache show --no-all-versions linux-image-amd64 2>/dev/null \
    | sed -n 's/^Depends:.*\(linux-image-[0-9][^ ,]*-amd64\).*/\1/p' | head -n1 || true
}

# Sets KDIR (extracted kernel package root), KVER, VMLINUZ.
ensure_kernel() {
  local kroot=$WORK/kernel pkg=
  mkdir -p "$kroot"
  [[ -f $kroot/current ]] && pkg=$(<"$kroot/current")
  if [[ -z $pkg || ! -f $kroot/$pkg/.complete ]]; then
    # fresh package lists, so that the named package is still in the archive
    apt_update_once
    pkg=$(kernel_pkg_name)
    [[ -n $pkg ]] || die "cannot find the kernel package linux-image-amd64 depends on"
    if [[ ! -f $kroot/$pkg/.complete ]]; then
      log "downloading and extracting $pkg"
      local dl=$kroot/dl debs kv
      rm -rf "$dl" "${kroot:?}/$pkg"; mkdir -p "$dl"
      (cd "$dl" && apt-get download -qq -o APT::Sandbox::User=root "$pkg") \
        || die "apt-get download $pkg failed"
      debs=("$dl"/"$pkg"_*.deb)
      [[ -f ${debs[0]} ]] || die "apt-get download $pkg left no .deb"
      dpkg-deb -x "${debs[0]}" "$kroot/$pkg"
      rm -rf "$dl"
      kv=$(basename "$(ls -d "$kroot/$pkg"/lib/modules/*/)")
      depmod -b "$kroot/$pkg" "$kv"
      touch "$kroot/$pkg/.complete"
    fi
    printf '%s\n' "$pkg" >"$kroot/current"
  fi
  KDIR=$kroot/$pkg
  KVER=$(basename "$(ls -d "$KDIR"/lib/modules/*/)")
  VMLINUZ=$KDIR/boot/vmlinuz-$KVER
  [[ -f $VMLINUZ ]] || die "no $VMLINUZ"
}

# ------------------------------------------------------------ initramfs

# Copy one file into the staging root at the same path (following links).
stage_file() {
  local root=$1 src=$2 dst=${3:-$2}
  [[ -e $root$dst ]] && return 0
  mkdir -p "$root$(dirname "$dst")"
  cp -L "$src" "$root$dst"
}

# Copy the shared libraries (and the dynamic loader) a binary needs.
stage_libs() {
  local root=$1 bin=$2 lib
  while read -r lib; do
    [[ -n $lib ]] && stage_file "$root" "$lib"
  done < <(ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3; next}
                                         $1 ~ /^\// {print $1}')
}

# Make a root skeleton with merged-/usr library links.
stage_skeleton() {
  local root=$1
  mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,usr/local/bin,bin,sbin,etc}
  ln -sfn usr/lib "$root/lib"
  ln -sfn usr/lib64 "$root/lib64"
}

write_guest_init() {
  cat >"$1" <<'EOF'
#!/bin/sh
# /init of the softroce-vm guest (generated by ci/softroce-vm.sh).
export PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin
export HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /tmp /run /share /root
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
. /etc/softroce/env
say() { [ "$SOFTROCE_VERBOSE" = 1 ] && echo "softroce-guest: $*"; return 0; }
finish() {
  echo
  echo "$SOFTROCE_MARKER=$1"
  sync
  [ -n "$VM_SHARE" ] && umount /share 2>/dev/null
  poweroff -f
  sleep 10
  echo o >/proc/sysrq-trigger
}
fail() {
  echo "softroce-guest: setup failed: $*"
  dmesg | tail -n 40
  finish 125
}
[ "$SOFTROCE_VERBOSE" = 1 ] || echo 1 >/proc/sys/kernel/printk
echo "softroce-guest: kernel $(uname -r) up after $(cut -d' ' -f1 /proc/uptime) s"
ip link set lo up
modprobe virtio_pci || fail "modprobe virtio_pci"
if [ -n "$VM_SHARE" ]; then
  modprobe 9pnet_virtio && modprobe 9p || fail "modprobe 9p"
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,access=any share "$VM_SHARE" \
    || fail "mount 9p share"
  say "host folder mounted at $VM_SHARE"
fi
modprobe crc32_generic || fail "modprobe crc32_generic"
modprobe rdma_rxe || fail "modprobe rdma_rxe"
modprobe rdma_ucm || say "modprobe rdma_ucm failed (rdma_cm unavailable)"
if [ "$VM_HOSTS" = 1 ]; then
  modprobe dummy || fail "modprobe dummy"
  ip link show "$VM_NETDEV" >/dev/null 2>&1 || ip link add "$VM_NETDEV" type dummy \
    || fail "ip link add $VM_NETDEV"
else
  modprobe virtio_net || fail "modprobe virtio_net"
  i=0
  while ! ip link show "$VM_NETDEV" >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -gt 100 ] && fail "no $VM_NETDEV"; sleep 0.1
  done
fi
ip link set "$VM_NETDEV" up || fail "ip link set $VM_NETDEV up"
rdma link add "$RXE_DEV" type rxe netdev "$VM_NETDEV" || fail "rdma link add $RXE_DEV"
# The address goes on after the rxe device exists, so that a peer that can
# ping us also finds our rxe device ready.
ip addr add "$VM_SELF_IP/24" dev "$VM_NETDEV" || fail "ip addr add"
port=/sys/class/infiniband/$RXE_DEV/ports/1
i=0
while :; do
  state=$(cat "$port/state" 2>/dev/null)
  gid=$(cat "$port/gids/$RXE_GID_INDEX" 2>/dev/null)
  case "$state" in *ACTIVE*)
    case "$gid" in ""|0000:0000:0000:0000:0000:0000:0000:0000) ;; *) break ;; esac ;;
  esac
  i=$((i + 1)); [ $i -gt 300 ] && fail "$RXE_DEV port not ACTIVE with a GID $RXE_GID_INDEX (state '$state', gid '$gid')"
  sleep 0.1
done
[ -e /dev/infiniband/uverbs0 ] || fail "/dev/infiniband/uverbs0 missing"
say "$RXE_DEV over $VM_NETDEV $VM_SELF_IP: $state, gid[$RXE_GID_INDEX] $gid"
if [ "$VM_HOSTS" != 1 ]; then
  i=0
  until ping -c 1 -W 1 "$VM_PEER_IP" >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -gt 200 ] && fail "peer $VM_PEER_IP unreachable"
    sleep 0.5
  done
  say "peer $VM_PEER_IP reachable"
fi
ulimit -l unlimited 2>/dev/null
cd "${VM_SHARE:-/}" || fail "cd"
echo "softroce-guest: host $VM_HOST ready after $(cut -d' ' -f1 /proc/uptime) s; running command"
sh -c "$(cat /etc/softroce/cmd)" </dev/null
finish $?
EOF
  chmod 755 "$1"
}

# Fingerprint of everything the base initramfs is made from.
initramfs_key() {
  {
    sha256sum "$SCRIPT_PATH"
    printf '%s\n' "$KVER" "$KDIR"
    dpkg-query -W -f='${Package} ${Version}\n'
  } | sha256sum | cut -c1-16
}

# Sets BASE_INITRD.
ensure_initramfs() {
  local key out
  key=$(initramfs_key)
  out=$WORK/initramfs-$KVER-$key.cpio.gz
  BASE_INITRD=$out
  [[ -f $out ]] && return 0
  log "building initramfs for $KVER"
  local root
  root=$(mktemp -d "$WORK/stage.XXXXXX")
  stage_skeleton "$root"

  # busybox and its applets (real programs in /usr/bin win in PATH)
  mkdir -p "$root"/{proc,sys,dev,tmp,run,share,root}
  cp /bin/busybox "$root/bin/busybox"
  local a
  for a in $(/bin/busybox --list); do
    [[ -e $root/bin/$a ]] || ln -s busybox "$root/bin/$a"
  done
  ln -sf ../bin/busybox "$root/sbin/modprobe"   # kernel's module helper path

  # programs
  local b p
  for b in "${GUEST_BINS[@]}"; do
    p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$b") || die "host program $b not found"
    p=$(readlink -f "$p")
    stage_file "$root" "$p"
    stage_libs "$root" "$p"
  done

  # /bin/sh is dash, not busybox ash: ash would run its own applets (ip, xz,
  # ...) in preference to the real programs found in PATH
  ln -sfn /usr/bin/dash "$root/bin/sh"
  ln -sfn /usr/bin/bash "$root/bin/bash"

  # libibverbs rxe provider (dlopen'ed) and its driver file
  local prov provs
  provs=(/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so)
  prov=${provs[0]}
  [[ -f $prov ]] || die "librxe provider not found (ibverbs-providers)"
  stage_file "$root" "$prov"
  stage_libs "$root" "$prov"
  stage_file "$root" /etc/libibverbs.d/rxe.driver

  # kernel modules with their dependencies, and modules.dep from depmod -b
  local m f
  for m in "${MODULES[@]}"; do
    while read -r f; do
      stage_file "$root" "$f" "${f#"$KDIR"}"
    done < <(modprobe -d "$KDIR" -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" {print $2}')
  done
  for f in modules.order modules.builtin modules.builtin.modinfo; do
    [[ -f $KDIR/lib/modules/$KVER/$f ]] && stage_file "$root" "$KDIR/lib/modules/$KVER/$f" "/lib/modules/$KVER/$f"
  done
  depmod -b "$root" "$KVER"

  # minimal /etc
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
  printf 'root:x:0:\n' >"$root/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files\n' >"$root/etc/nsswitch.conf"
  printf '127.0.0.1 localhost\n%s.1 vm0\n%s.2 vm1\n' "$SUBNET" "$SUBNET" >"$root/etc/hosts"
  write_guest_init "$root/init"

  (cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -1 >"$out.tmp"
  mv "$out.tmp" "$out"
  rm -rf "$root"
  # drop stale images
  find "$WORK" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "$(basename "$out")" -delete
  log "initramfs $(du -h "$out" | cut -f1) $out"
}

prepare() {
  mkdir -p "$WORK"
  exec 9>"$WORK/.lock"
  flock 9
  ensure_host_packages
  ensure_kernel
  ensure_initramfs
  flock -u 9
}

# ------------------------------------------------------------ run

# Per-run overlay archive: env, command, extra programs. $1=host index, $2=out
make_overlay() {
  local idx=$1 out=$2 root self peer netdev b p kv
  root=$(mktemp -d "$RUN/ov.XXXXXX")
  stage_skeleton "$root"
  mkdir -p "$root/etc/softroce"
  for b in "${EXTRA_BINS[@]}"; do
    p=$(readlink -f "$b")
    stage_file "$root" "$p" "/usr/local/bin/$(basename "$b")"
    stage_libs "$root" "$p"
  done
  self=$SUBNET.$((idx + 1))
  if (( HOSTS == 1 )); then peer=$self netdev=dummy0; else peer=$SUBNET.$((2 - idx)) netdev=eth0; fi
  {
    printf 'SOFTROCE_MARKER=%s\n' "$(shquote "$MARKER")"
    printf 'SOFTROCE_VERBOSE=%s\n' "$VERBOSE"
    printf 'export VM_HOST=%s VM_HOSTS=%s\n' "$idx" "$HOSTS"
    printf 'export VM_SELF_IP=%s VM_PEER_IP=%s VM_NETDEV=%s\n' "$self" "$peer" "$netdev"
    printf 'export RXE_DEV=%s RXE_GID_INDEX=%s\n' "$RXE_DEV" "$RXE_GID_INDEX"
    if [[ -n $SHARE ]]; then printf 'export VM_SHARE=/share\n'; else printf 'export VM_SHARE=\n'; fi
    for kv in "${EXTRA_ENV[@]}"; do
      printf 'export %s=%s\n' "${kv%%=*}" "$(shquote "${kv#*=}")"
    done
  } >"$root/etc/softroce/env"
  printf '%s\n' "$GUEST_CMD" >"$root/etc/softroce/cmd"
  # the skeleton's lib links are already in the base archive
  rm -f "$root/lib" "$root/lib64"
  if [[ -d $root/usr/lib64 ]] && [[ -z $(ls -A "$root/usr/lib64") ]]; then rmdir "$root/usr/lib64"; fi
  (cd "$root" && find . ! -name . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) | gzip -1 >"$out.ov"
  cat "$BASE_INITRD" "$out.ov" >"$out"
  rm -rf "$root" "$out.ov"
}

udp_port_in_use() { [[ -n $(ss -Huan "( sport = :$1 )" 2>/dev/null) ]]; }

# A random free UDP port on the host, different from $1.
pick_port() {
  local i p
  for i in $(seq 100); do
    p=$(( 20000 + (RANDOM * 32768 + RANDOM) % 40000 ))
    [[ $p != "${1:-}" ]] && ! udp_port_in_use "$p" && { echo "$p"; return 0; }
  done
  die "no free UDP port found"
}

# True once qemu $1 has bound UDP port $2.
vm_bound() {
  local out
  out=$(ss -Huanp "( sport = :$2 )" 2>/dev/null) || true
  [[ $out == *"pid=${QPID[$1]},"* ]]
}

# start_vm IDX NETSPEC  -> sets QPID[IDX], TPID[IDX]
start_vm() {
  local idx=$1 netspec=$2 smp append
  local -a args
  smp=${SMP:-$(( HOSTS == 1 ? 2 : 1 ))}
  append="console=ttyS0,115200 panic=-1 mitigations=off random.trust_cpu=on"
  (( VERBOSE )) || append+=" quiet loglevel=1"
  args=(-accel tcg -cpu "${SOFTROCE_QEMU_CPU:-max}" -smp "$smp" -m "$MEM" -nodefaults -no-user-config
        -display none -no-reboot -monitor none
        -serial "file:$RUN/vm$idx.log"
        -kernel "$VMLINUZ" -initrd "$RUN/initrd$idx.img" -append "$append")
  if [[ -n $netspec ]]; then
    args+=(-netdev "socket,id=n0,$netspec"
           -device "virtio-net-pci,netdev=n0,romfile=,mac=52:54:00:77:00:0$((idx + 1))")
  fi
  if [[ -n $SHARE ]]; then
    args+=(-fsdev "local,id=fs0,path=$SHARE,security_model=none"
           -device "virtio-9p-pci,fsdev=fs0,mount_tag=share")
  fi
  : >"$RUN/vm$idx.log"
  qemu-system-x86_64 "${args[@]}" </dev/null &
  QPID[idx]=$!
  local prefix=""
  (( HOSTS == 1 )) || prefix="[vm$idx] "
  tail -n +1 -f --pid="${QPID[idx]}" "$RUN/vm$idx.log" \
    | sed -u -e 's/\r$//' -e "s/^/$prefix/" &
  TPID[idx]=$!
}

vm_alive() { [[ -n ${QPID[$1]:-} ]] && kill -0 "${QPID[$1]}" 2>/dev/null; }

kill_vm() {
  local pid=${QPID[$1]:-}
  [[ -n $pid ]] || return 0
  kill "$pid" 2>/dev/null || true
  local i
  for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

# Guest exit status from its console log, or "none".
vm_status() {
  local s
  s=$(tr -d '\r' <"$RUN/vm$1.log" | grep -ao "$MARKER=[0-9]*" | tail -n1 | cut -d= -f2) || true
  echo "${s:-none}"
}

# shellcheck disable=SC2317  # called from the EXIT trap
cleanup() {
  local i
  for i in 0 1; do vm_alive "$i" && kill_vm "$i"; done
  [[ -n ${RUN:-} && -d $RUN ]] && rm -rf "$RUN"
  return 0
}

run() {
  [[ -n $GUEST_CMD ]] || die "no command given (see --help)"
  prepare
  RUN=$(mktemp -d "$WORK/run.XXXXXX")
  QPID=() TPID=()
  trap cleanup EXIT
  trap 'log "interrupted"; exit 130' INT TERM
  MARKER=SOFTROCE-VM-EXIT-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
  local i
  for (( i = 0; i < HOSTS; i++ )); do make_overlay "$i" "$RUN/initrd$i.img"; done

  local t0=$SECONDS
  if (( HOSTS == 1 )); then
    start_vm 0 ""
  else
    # The "wire": qemu's UDP socket netdev, one loopback port per guest,
    # each guest sending to the other's port.  (The TCP listen/connect form
    # stalls ~40 ms per packet on the listening side: Nagle + delayed ACK.)
    local p0 p1 try ok=0 n
    for try in 1 2 3 4 5; do
      p0=$(pick_port) p1=$(pick_port "$p0")
      start_vm 0 "udp=127.0.0.1:$p1,localaddr=127.0.0.1:$p0"
      start_vm 1 "udp=127.0.0.1:$p0,localaddr=127.0.0.1:$p1"
      for (( n = 0; n < 100; n++ )); do
        { vm_alive 0 && vm_alive 1; } || break
        if vm_bound 0 "$p0" && vm_bound 1 "$p1"; then ok=1; break; fi
        sleep 0.1
      done
      (( ok )) && break
      for i in 0 1; do kill_vm "$i"; wait "${TPID[i]}" 2>/dev/null || true; done
      log "UDP ports $p0/$p1 not usable (try $try), retrying with others"
    done
    (( ok )) || die "could not start the two guests"
  fi

  local timed_out=0 fail_at=-1 alive st stopped_peer=0
  while :; do
    alive=0
    for (( i = 0; i < HOSTS; i++ )); do
      if vm_alive "$i"; then alive=1
      elif (( fail_at < 0 )) && [[ $(vm_status "$i") != 0 ]]; then fail_at=$SECONDS
      fi
    done
    (( alive )) || break
    if (( SECONDS - t0 >= TIMEOUT )); then timed_out=1; break; fi
    if (( HOSTS > 1 && fail_at >= 0 && SECONDS - fail_at >= PEER_GRACE )); then
      log "one guest failed; stopping the other after ${PEER_GRACE} s grace"
      stopped_peer=1
      break
    fi
    sleep 1
  done
  for (( i = 0; i < HOSTS; i++ )); do vm_alive "$i" && kill_vm "$i"; done
  for (( i = 0; i < HOSTS; i++ )); do
    wait "${QPID[i]}" 2>/dev/null || true
    wait "${TPID[i]}" 2>/dev/null || true
  done
  local elapsed=$(( SECONDS - t0 ))
  if (( timed_out )); then
    log "TIMEOUT: the guest command did not finish within ${TIMEOUT} s; qemu killed"
    exit 124
  fi
  # exit status: the first non-zero status a guest reported, else 125 when a
  # guest reported none (killed, crashed, did not boot), else 0
  local rc=0 nostatus=0 summary=""
  for (( i = 0; i < HOSTS; i++ )); do
    st=$(vm_status "$i")
    summary+=" vm$i=$st"
    if [[ $st == none ]]; then
      if (( stopped_peer )); then
        log "vm$i: stopped after the other guest failed"
      else
        log "vm$i: no exit status from the guest (boot failure or crash; see output above)"
      fi
      nostatus=1
      continue
    fi
    [[ $st == 125 ]] && log "vm$i: guest setup failed or command exited 125 (see output above)"
    (( rc == 0 )) && rc=$st
  done
  (( rc == 0 && nostatus )) && rc=125
  log "done in ${elapsed} s, exit status:$summary"
  exit "$rc"
}

# ------------------------------------------------------------ main

HOSTS=1 TIMEOUT=900 SHARE="" MEM=1024 SMP="" VERBOSE=0
EXTRA_BINS=() EXTRA_ENV=()
MODE=run
if [[ ${1:-} == prepare ]]; then MODE=prepare; shift; fi
while (( $# )); do
  case $1 in
    --hosts)     HOSTS=${2:?}; shift ;;
    --hosts=*)   HOSTS=${1#*=} ;;
    --timeout)   TIMEOUT=${2:?}; shift ;;
    --timeout=*) TIMEOUT=${1#*=} ;;
    --share)     SHARE=${2:?}; shift ;;
    --share=*)   SHARE=${1#*=} ;;
    --extra-bin) EXTRA_BINS+=("${2:?}"); shift ;;
    --extra-bin=*) EXTRA_BINS+=("${1#*=}") ;;
    --env)       EXTRA_ENV+=("${2:?}"); shift ;;
    --env=*)     EXTRA_ENV+=("${1#*=}") ;;
    --mem)       MEM=${2:?}; shift ;;
    --mem=*)     MEM=${1#*=} ;;
    --smp)       SMP=${2:?}; shift ;;
    --smp=*)     SMP=${1#*=} ;;
    --verbose|-v) VERBOSE=1 ;;
    -h|--help)   usage; exit 0 ;;
    --)          shift; break ;;
    *)           die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done

[[ $HOSTS == 1 || $HOSTS == 2 ]] || die "--hosts must be 1 or 2"
[[ $TIMEOUT =~ ^[0-9]+$ && $TIMEOUT -gt 0 ]] || die "--timeout must be a positive number of seconds"
[[ $MEM =~ ^[0-9]+$ ]] || die "--mem must be a number of MiB"
[[ -z $SMP || $SMP =~ ^[1-9][0-9]*$ ]] || die "--smp must be a positive number"
if [[ -n $SHARE ]]; then
  [[ -d $SHARE ]] || die "--share $SHARE is not a directory"
  SHARE=$(cd "$SHARE" && pwd)
  [[ $SHARE != *,* ]] || die "--share path must not contain a comma"
fi
for b in "${EXTRA_BINS[@]}"; do [[ -f $b && -x $b ]] || die "--extra-bin $b is not an executable file"; done
for kv in "${EXTRA_ENV[@]}"; do
  [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env wants NAME=VALUE, got '$kv'"
done

if (( $# == 1 )); then
  GUEST_CMD=$1
else
  GUEST_CMD=""
  for a in "$@"; do GUEST_CMD+="${GUEST_CMD:+ }$(shquote "$a")"; done
fi

mkdir -p "$WORK"
if [[ $MODE == prepare ]]; then
  (( $# == 0 )) || die "prepare takes no command"
  prepare
  log "ready: kernel $KVER, initramfs $BASE_INITRD"
  exit 0
fi
run
