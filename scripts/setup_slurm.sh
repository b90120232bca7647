#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the sweep launcher's tests: installs Debian's
# slurm-wlm and munge (as root), writes /etc/slurm/slurm.conf (controller and node on
# 127.0.0.1, the machine's CPUs and memory, one partition, requeue allowed, no cgroups: a
# container rarely has them), starts munged, slurmctld and slurmd, and waits until the node is
# idle. Idempotent: a cluster already up is left as it is. Its last line names the daemons it
# started, `started: NAME=PID ...` (empty when it started none), so that its caller stops them.
set -euo pipefail

conf_dir=/etc/slurm
started=()

node_state() { sinfo -h -N -n localhost -o %T 2>/dev/null | head -1; }
up() { case "$(node_state)" in idle*|mixed*|allocated*|completing*) return 0 ;; *) return 1 ;; esac; }

if command -v sinfo >/dev/null && [ -f "$conf_dir/slurm.conf" ] && up; then
  echo "started:"
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  [ "$(id -u)" -eq 0 ] || { echo "setup_slurm.sh: installing slurm-wlm and munge needs root" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
fi

# The node as slurmd sees it (CPUs, sockets, cores, memory), under the name `localhost`.
hardware=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ *UpTime=.*//')
mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > "$conf_dir/slurm.conf.new" <<EOF
# Written by jaxrl's scripts/setup_slurm.sh: one node on 127.0.0.1.
ClusterName=jaxrl
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
if cmp -s "$conf_dir/slurm.conf.new" "$conf_dir/slurm.conf"; then
  rm "$conf_dir/slurm.conf.new"
else
  mv "$conf_dir/slurm.conf.new" "$conf_dir/slurm.conf"
fi

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# munged runs as its own user, with its key from the package (made here if missing).
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
[ -f /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
if ! alive /run/munge/munged.pid; then
  runuser -u munge -- /usr/sbin/munged
  started+=("munged=$(cat /run/munge/munged.pid)")
fi
if ! alive /run/slurmctld.pid; then
  slurmctld
  for _ in $(seq 50); do [ -s /run/slurmctld.pid ] && break; sleep 0.1; done
  started+=("slurmctld=$(cat /run/slurmctld.pid)")
fi
if ! alive /run/slurmd.pid; then
  slurmd -N localhost
  for _ in $(seq 50); do [ -s /run/slurmd.pid ] && break; sleep 0.1; done
  started+=("slurmd=$(cat /run/slurmd.pid)")
fi

for _ in $(seq 120); do
  if up; then
    echo "started: ${started[*]}"
    exit 0
  fi
  sleep 0.5
done
echo "setup_slurm.sh: the node is not idle after 60 s (state: $(node_state)); see /var/log/slurm/" >&2
echo "started: ${started[*]}"
exit 1
