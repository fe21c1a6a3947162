#!/usr/bin/env bash
# Launcher suite (issue 17): the conformance suite (and examples/ring) with 3
# ranks, on shm and on psm, started the way clusters start jobs instead of by
# xdev-run:
#   mpirun.openmpi -np 3 -x XDEV_DEVICE   (Open MPI's PMIx server)
#   mpirun.mpich -np 3 -genv XDEV_DEVICE  (MPICH Hydra: PMI-1 over PMI_FD)
#   srun --mpi=pmix -n 3                  (Slurm's PMIx plugin)
#   srun --mpi=pmi2 -n 3                  (Slurm's PMI-2 server over PMI_FD)
# First the bootstrap alone under each (`xdev-rank bootstrap`: 3 ranks of one
# job through the expected backend), then conformance (and hybrid under the
# PMI launchers), then, under srun, a rank killed with SIGKILL on shm and on
# psm (the others report PeerLost, srun the failed job), and last a rank
# started with no launcher (the three-way error, no hang). About 40 s once
# built.
#
# Installs openmpi-bin, mpich, slurm-wlm, munge, libpmix2 and libpmix-dev when missing and
# starts a one-node Slurm (as root, state under $XDEV_SLURM_DIR, default
# /tmp/xdev-slurm) unless one answers already. Idempotent; meant to run as
# root, as ci/test.sh does. Usage: bash ci/launchers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n--- %s\n' "$*"; }
fail() { echo "launchers: FAILED: $*" >&2; exit 1; }

# shellcheck source=ci/lib/packages.sh
. ci/lib/packages.sh
# libpmix-dev: Slurm's mpi/pmix plugin loads the unversioned libpmix.so.
install_missing openmpi-bin mpich slurm-wlm munge libpmix2 libpmix-dev

# --- a one-node Slurm ------------------------------------------------------
SD=${XDEV_SLURM_DIR:-/tmp/xdev-slurm}
export SLURM_CONF=$SD/slurm.conf
slurm_up() { timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
if ! slurm_up; then
  step "starting a one-node Slurm under $SD"
  mkdir -p "$SD"/{state,spool,log,run}
  host=$(hostname)
  cat >"$SD/slurm.conf" <<CONF
ClusterName=xdev
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
StateSaveLocation=$SD/state
SlurmdSpoolDir=$SD/spool
SlurmctldPidFile=$SD/run/slurmctld.pid
SlurmdPidFile=$SD/run/slurmd.pid
SlurmctldLogFile=$SD/log/slurmctld.log
SlurmdLogFile=$SD/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$SD/cgroup.conf"
  [ -s /etc/munge/munge.key ] || mungekey -c
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    munged -f
  fi
  [ -f "$SD/run/slurmctld.pid" ] && kill "$(cat "$SD/run/slurmctld.pid")" 2>/dev/null || true
  [ -f "$SD/run/slurmd.pid" ] && kill "$(cat "$SD/run/slurmd.pid")" 2>/dev/null || true
  sleep 1
  slurmctld -c
  slurmd -c
  for _ in $(seq 60); do slurm_up && break; sleep 1; done
  slurm_up || { tail -20 "$SD"/log/*.log; fail "Slurm did not come up"; }
fi
srun --mpi=list 2>&1 | grep -q pmix || fail "srun --mpi=list has no pmix"
srun --mpi=list 2>&1 | grep -q pmi2 || fail "srun --mpi=list has no pmi2"

# --- the rank program ------------------------------------------------------
step "building xdev-rank, xdev-run and the examples (release)"
cargo build --release --quiet -p xdev-tools --bin xdev-rank --bin xdev-run -p xdev-examples --examples
rank=${CARGO_TARGET_DIR:-$PWD/target}/release/xdev-rank
ring=${CARGO_TARGET_DIR:-$PWD/target}/release/examples/ring

log=$(mktemp)
trap 'rm -f "$log"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Two cores, three ranks: each launcher is told it may place more ranks than cores.
run_under() { # NAME DEVICE -- command...
  local name=$1 dev=$2 t0=$SECONDS
  shift 3
  if ! XDEV_DEVICE=$dev timeout 300 "$@" >"$log" 2>&1; then
    cat "$log" >&2
    fail "conformance on $dev under $name"
  fi
  echo "ok: conformance all, 3 ranks, $dev under $name ($((SECONDS - t0)) s)"
}
step "the bootstrap alone under each launcher: 3 ranks of one job, allgather, 20 KB values"
check_bootstrap() { # NAME WANT -- command...
  local name=$1 want=$2
  shift 3
  timeout 120 "$@" "$rank" bootstrap >"$log" 2>&1 || { cat "$log" >&2; fail "bootstrap under $name"; }
  for r in 0 1 2; do
    grep -q "^rank $r of 3 in job .* via $want\$" "$log" || { cat "$log" >&2; fail "rank $r of 3 via $want missing under $name"; }
  done
  [ "$(grep -c ' of 3 in job ' "$log")" = 3 ] || { cat "$log" >&2; fail "not 3 ranks of one job under $name"; }
  [ "$(sed -n 's/.* in job \(.*\) via .*/\1/p' "$log" | sort -u | wc -l)" = 1 ] ||
    { cat "$log" >&2; fail "the ranks disagree on the job under $name"; }
  echo "ok: 3 ranks of one job via $want under $name"
}
check_bootstrap mpirun.openmpi Pmix -- mpirun.openmpi --oversubscribe -np 3
check_bootstrap mpirun.mpich Pmi1 -- mpirun.mpich -np 3
check_bootstrap "srun --mpi=pmix" Pmix -- srun --overcommit --mpi=pmix -n 3
check_bootstrap "srun --mpi=pmi2" Pmi2 -- srun --overcommit --mpi=pmi2 -n 3
check_bootstrap "srun --mpi=pmi2 with XDEV_PMI=1" Pmi1 -- env XDEV_PMI=1 srun --overcommit --mpi=pmi2 -n 3
check_bootstrap xdev-run XdevRun -- "$(dirname "$rank")/xdev-run" -n 3 --

step "examples/ring (a token around 3 ranks) under each launcher, on shm and psm"
ring_under() { # NAME DEVICE -- command...
  local name=$1 dev=$2
  shift 3
  XDEV_DEVICE=$dev timeout 120 "$@" "$ring" >"$log" 2>&1 || { cat "$log" >&2; fail "ring on $dev under $name"; }
  grep -qx "ring: 3 ranks on $dev, 10 rounds, token 30" "$log" || { cat "$log" >&2; fail "ring on $dev under $name: wrong output"; }
  echo "ok: ring, 3 ranks, $dev under $name"
}
for dev in shm psm; do
  ring_under mpirun.openmpi "$dev" -- mpirun.openmpi --oversubscribe -np 3 -x XDEV_DEVICE
  ring_under mpirun.mpich "$dev" -- mpirun.mpich -np 3 -genv XDEV_DEVICE "$dev"
  ring_under "srun --mpi=pmix" "$dev" -- srun --overcommit --mpi=pmix -n 3
  ring_under "srun --mpi=pmi2" "$dev" -- srun --overcommit --mpi=pmi2 -n 3
done

for dev in shm psm; do
  step "conformance suite on $dev, 3 ranks, under each launcher"
  run_under "mpirun.openmpi (PMIx)" "$dev" -- \
    mpirun.openmpi --oversubscribe -np 3 -x XDEV_DEVICE "$rank" conformance all
  run_under "mpirun.mpich (Hydra, PMI-1)" "$dev" -- \
    mpirun.mpich -np 3 -genv XDEV_DEVICE "$dev" "$rank" conformance all
  run_under "srun --mpi=pmix" "$dev" -- srun --overcommit --mpi=pmix -n 3 "$rank" conformance all
  run_under "srun --mpi=pmi2" "$dev" -- srun --overcommit --mpi=pmi2 -n 3 "$rank" conformance all
done
step "hybrid (one host: its shm group) under mpirun.mpich and srun --mpi=pmi2"
run_under "mpirun.mpich (Hydra, PMI-1)" hybrid -- \
  mpirun.mpich -np 3 -genv XDEV_DEVICE hybrid "$rank" conformance all
run_under "srun --mpi=pmi2" hybrid -- srun --overcommit --mpi=pmi2 -n 3 "$rank" conformance all

# --- a rank killed under srun ----------------------------------------------
for case in shm:pmix shm:pmi2 psm:pmix psm:pmi2; do
  dev=${case%:*} mpi=${case#*:}
  step "srun --mpi=$mpi, $dev: rank 1 killed with SIGKILL"
  pidfile=$(mktemp -u /tmp/xdev-killed.XXXXXX)
  XDEV_DEVICE=$dev XDEV_RANK_PIDFILE=$pidfile timeout 60 \
    srun --overcommit --mpi=$mpi -n 3 "$rank" peer-killed >"$log" 2>&1 &
  job=$!
  for _ in $(seq 300); do [ -s "$pidfile" ] && break; sleep 0.1; done
  [ -s "$pidfile" ] || { kill "$job" 2>/dev/null; cat "$log" >&2; fail "rank 1 never wrote its pid"; }
  kill -9 "$(cat "$pidfile")"
  rm -f "$pidfile"
  rc=0
  wait "$job" || rc=$?
  cat "$log"
  ((rc != 124)) || fail "srun --mpi=$mpi hung after a rank was killed"
  ((rc != 0)) || fail "srun --mpi=$mpi reported success although rank 1 was killed"
  for r in 0 2; do
    grep -q "^rank $r: PeerLost from rank 1" "$log" || fail "rank $r did not report PeerLost ($dev, srun --mpi=$mpi)"
  done
  echo "ok: $dev: ranks 0 and 2 got PeerLost, srun --mpi=$mpi failed with status $rc"
done

# --- a rank that poses as another (issue 21) --------------------------------
# Rank 2 republishes rank 1's shm record with its own socket (xdev-rank
# impersonate). Where keys are not tied to their putter and the last put wins
# (Slurm's pmi2, Hydra's PMI-1), rank 1 must find its record replaced and
# rank 0 must refuse the record, so the job fails; under PMIx, which ties
# each key to its putter, the forged put changes nothing and rank 1 gets its
# message. Nobody may ever read a message meant for another rank.
impersonation() { # NAME WANT(refused|delivered) VARIANT -- command...
  local name=$1 want=$2 variant=$3 rc=0
  shift 4
  XDEV_IMPERSONATE=$variant timeout 120 "$@" "$rank" impersonate >"$log" 2>&1 || rc=$?
  cat "$log"
  ((rc != 124)) || fail "impersonation under $name hung"
  grep -q "READ A MESSAGE MEANT FOR ANOTHER RANK" "$log" && fail "rank 2 read rank 1's message under $name"
  grep -q "^rank 2: republished rank 1's record" "$log" || fail "rank 2 did not republish under $name"
  if [ "$want" = refused ]; then
    ((rc != 0)) || fail "impersonation under $name: the job succeeded"
    grep -q 'rank 1: opening shm refused: .*record "ag.1.1" was replaced' "$log" ||
      fail "rank 1 did not see its record replaced under $name"
    # Rank 0 refuses the forged record; or it cannot receive the inbox at
    # all because the process serving the record it read has already left
    # (rank 1 once it saw its record replaced, or rank 2 once it refused
    # rank 1's record itself): it accepts nothing either way.
    grep -qE "rank 0: opening shm refused: (protocol violation by rank [12]: (rank 1.s record: the inbox is served by process [0-9]+ .*not by the published process|ranks 1 and 2 both name process)|transport error: receiving rank 1's inbox)" "$log" ||
      fail "rank 0 did not refuse the forged record under $name"
    grep -q "^rank 1: received" "$log" && fail "a message went out under $name"
    echo "ok: $name ($variant pid): the forged record was refused by rank 0 and by rank 1, nobody sent"
  else
    ((rc == 0)) || fail "impersonation under $name: the job failed"
    grep -q "^rank 1: received the message meant for it" "$log" || fail "rank 1 got nothing under $name"
    grep -q "^rank 2: saw no message" "$log" || fail "rank 2 did not report under $name"
    echo "ok: $name: the forged put changed nothing, rank 1 got its message, rank 2 none"
  fi
}
step "a rank that republishes another's record (shm, 3 ranks)"
impersonation "srun --mpi=pmi2" refused victim -- srun --overcommit --mpi=pmi2 -n 3
impersonation "srun --mpi=pmi2" refused own -- srun --overcommit --mpi=pmi2 -n 3
impersonation "mpirun.mpich (PMI-1)" refused victim -- mpirun.mpich -np 3
impersonation "srun --mpi=pmix" delivered victim -- srun --overcommit --mpi=pmix -n 3
impersonation "mpirun.openmpi (PMIx)" delivered victim -- mpirun.openmpi --oversubscribe -np 3

# --- no launcher at all ----------------------------------------------------
step "a rank started with no launcher"
rc=0
env -u XDEV_BOOTSTRAP -u XDEV_RANK -u PMIX_RANK -u PMIX_NAMESPACE -u PMI_FD -u PMI_RANK -u PMI_SIZE \
  XDEV_DEVICE=shm timeout 20 "$rank" conformance all >"$log" 2>&1 || rc=$?
cat "$log"
((rc != 124)) || fail "a rank with no launcher hung"
((rc != 0)) || fail "a rank with no launcher succeeded"
for way in xdev-run "srun --mpi=pmix" mpirun.openmpi mpirun.mpich "srun --mpi=pmi2"; do
  grep -qF "$way" "$log" || fail "the no-launcher error does not name $way"
done
echo "ok: the no-launcher error names xdev-run, the PMIx and the PMI launchers"

step "PMIx without its library, and stale launcher variables: clear errors, no hang"
expect_error() { # WHAT TEXT -- command...
  local what=$1 text=$2 rc=0
  shift 3
  XDEV_DEVICE=shm timeout 60 "$@" "$rank" conformance all >"$log" 2>&1 </dev/null || rc=$?
  ((rc != 124)) || { cat "$log" >&2; fail "$what hung"; }
  ((rc != 0)) || { cat "$log" >&2; fail "$what succeeded"; }
  grep -qF "$text" "$log" || { cat "$log" >&2; fail "$what: no \"$text\""; }
  echo "ok: $what: $text"
}
expect_error "srun --mpi=pmix, libpmix missing" "PMIx not available:" -- \
  env XDEV_PMIX_LIBRARY=/nonexistent/libpmix.so.2 srun --overcommit --mpi=pmix -n 2
expect_error "PMIx variables, no server" "PMIx_Init failed" -- \
  env -u PMIX_SERVER_URI4 -u PMIX_SERVER_URI41 PMIX_RANK=0 PMIX_NAMESPACE=stale
expect_error "PMI_FD that is no socket" "is not a socket" -- env PMI_FD=0 PMI_RANK=0 PMI_SIZE=2
step "launchers: all passed"
