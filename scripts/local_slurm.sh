#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try a job script before a real cluster's queue
# (tests/slurm_cluster.py starts the same cluster for the `slurm` tests).
#
#   bash scripts/local_slurm.sh install       # apt-get install slurm-wlm munge (root; Debian/Ubuntu)
#   bash scripts/local_slurm.sh start DIR     # config, state and logs in DIR; prints SLURM_CONF
#   export SLURM_CONF=DIR/slurm.conf
#   sbatch --nodes=1 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 \
#     slurm/dapo.sbatch configs/quickstart.yaml
#   squeue; scancel --signal=USR1 JOBID       # the time-limit warning, now
#   bash scripts/local_slurm.sh stop DIR      # stops the daemons by their PIDs
#
# No systemd, no cgroups: proctrack/linuxproc, task/none, select/cons_tres; the node is
# `hostname -s` with CPUs = its cores (`nproc`, OMP_NUM_THREADS aside). Runs as root (slurmd
# starts jobs as the submitting user; munged runs as the munge user). A requeued job waits ~2 min (BeginTime) unless nudged:
# `scontrol update JobId=J StartTime=now`.
set -euo pipefail

usage() {
  echo "usage: bash scripts/local_slurm.sh install | start DIR | stop DIR" >&2
  exit 2
}

install() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

# The cores this machine may run on. Not plain `nproc`: it answers OMP_NUM_THREADS (1 under
# the test suite's two workers), and a node of 1 CPU leaves a 2-task job pending forever
# (Reason=PartitionConfig).
cores() {
  env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc
}

write_config() {
  local dir=$1 node=$2
  cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
MinJobAge=300
SchedulerType=sched/backfill
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(cores) State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null | unmunge >/dev/null 2>&1; then
    return 0 # already running (this script's or the system's): not ours to stop
  fi
  # munged's own default folders: the munge user must reach them (a test's temporary folder,
  # private to root, will not do)
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  runuser -u munge -- munged
  cp /run/munge/munged.pid "$1/munged.pid" # ours: stop stops it
}

start() {
  local dir node i
  dir=$(realpath -m "$1")
  node=$(hostname -s)
  mkdir -p "$dir/state" "$dir/spool"
  write_config "$dir" "$node"
  export SLURM_CONF=$dir/slurm.conf
  start_munge "$dir"
  slurmctld -f "$SLURM_CONF" -i
  slurmd -f "$SLURM_CONF"
  for i in $(seq 1 300); do # 30 s: the node registers and goes idle within a second or two
    if [ "$(sinfo -h -N -n "$node" -o %t 2>/dev/null)" = "idle" ]; then
      echo "SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.1
  done
  echo "error: the local SLURM node did not become idle in 30 s; logs: $dir/slurmctld.log, $dir/slurmd.log" >&2
  stop "$dir"
  return 1
}

stop() {
  local dir name pid i jobs
  dir=$(realpath -m "$1")
  # jobs still running (a test that failed mid-job): cancelled first, so no task outlives slurmd
  jobs=$(SLURM_CONF=$dir/slurm.conf squeue -h -o %A 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    SLURM_CONF=$dir/slurm.conf scancel $jobs 2>/dev/null || true
    for i in $(seq 1 400); do # 40 s: SIGTERM, SIGKILL after KillWait (30 s)
      [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h -o %A 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  for name in slurmd slurmctld munged; do
    [ -f "$dir/$name.pid" ] || continue
    pid=$(cat "$dir/$name.pid")
    kill "$pid" 2>/dev/null || continue
    for i in $(seq 1 100); do # 10 s, then SIGKILL
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
}

case "${1:-}" in
  install) install ;;
  start) [ $# -eq 2 ] || usage; start "$2" ;;
  stop) [ $# -eq 2 ] || usage; stop "$2" ;;
  *) usage ;;
esac
