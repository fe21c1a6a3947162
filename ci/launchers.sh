#!/usr/bin/env bash
# Launcher suite (issue 17): the conformance suite with 3 ranks, on shm and on
# psm, started the way clusters start jobs instead of by xdev-run:
#   mpirun.openmpi -np 3 -x XDEV_DEVICE   (Open MPI's PMIx server)
#   mpirun.mpich -np 3 -genv XDEV_DEVICE  (MPICH Hydra: PMI-1 over PMI_FD)
#   srun --mpi=pmix -n 3                  (Slurm's PMIx plugin)
#   srun --mpi=pmi2 -n 3                  (Slurm's PMI-2 server over PMI_FD)
# then, under srun, a rank killed with SIGKILL (the others report PeerLost, srun
# the failed job) and a rank started with no launcher (the three-way error).
#
# Installs openmpi-bin, mpich, slurm-wlm, munge and libpmix2 when missing and
# starts a one-node Slurm (as root, state under $XDEV_SLURM_DIR, default
# /tmp/xdev-slurm) unless one answers already. Idempotent; meant to run as
# root, as ci/test.sh does. Usage: bash ci/launchers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n--- %s\n' "$*"; }
fail() { echo "launchers: FAILED: $*" >&2; exit 1; }

need=()
for p in openmpi-bin mpich slurm-wlm munge libpmix2; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
  step "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

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
