#!/usr/bin/env bash
# A throw-away SLURM cluster on this machine (munged + slurmctld + slurmd started by hand, no systemd, no
# cgroups), for testing the launchers against a real scheduler. Needs root and the Debian/Ubuntu packages
# slurmctld, slurmd, slurm-client and munge. All state lives in $LOGO_SLURM_DIR (default /tmp/logo-slurm).
#
#   launch/local_slurm.sh up [--nodes N]   # start (idempotent); N > 1: N slurmd on this host as nodes n1..nN
#   eval "$(launch/local_slurm.sh env)"    # point sbatch/squeue/scontrol at it (SLURM_CONF)
#   launch/local_slurm.sh down             # stop the daemons it started (by their pid files), keep the logs
#   launch/local_slurm.sh purge            # down, then delete $LOGO_SLURM_DIR
#
# Ports: slurmctld on $LOGO_SLURM_PORT (default 16817), the slurmd of node i on LOGO_SLURM_PORT + i.
set -euo pipefail
DIR="${LOGO_SLURM_DIR:-${TMPDIR:-/tmp}/logo-slurm}"
PORT="${LOGO_SLURM_PORT:-16817}"
CONF="$DIR/slurm.conf"

die() { echo "local_slurm: $*" >&2; exit 2; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
is_up() { alive "$DIR/munged.pid" && alive "$DIR/slurmctld.pid" && SLURM_CONF="$CONF" scontrol ping >/dev/null 2>&1; }
node_names() { if [ "$1" -eq 1 ]; then hostname -s; else seq -f "n%g" 1 "$1"; fi; }

write_conf() {  # nodes
    local n=$1 cpus mem host
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 9 / 10 / n ))
    host=$(hostname -s)
    cat > "$CONF" <<EOF
# written by launch/local_slurm.sh ($n node(s)); state in $DIR
ClusterName=logo-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=90
InactiveLimit=0
PlugStackConfig=$DIR/plugstack.conf
MailProg=/bin/true
EOF
    local i=0 name
    for name in $(node_names "$n"); do
        i=$((i + 1))
        echo "NodeName=$name NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$CONF"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$CONF"
}

up() {
    local n=1
    [ "${1:-}" = "--nodes" ] && { n="${2:?--nodes N}"; [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "--nodes wants a positive integer, got '$n'"; }
    for exe in munged slurmctld slurmd sbatch scontrol; do
        command -v "$exe" >/dev/null || die "'$exe' not found: apt-get install -y slurmctld slurmd slurm-client munge"
    done
    [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd runs jobs as their user)"
    if is_up; then
        local have; have=$(grep -c '^NodeName=' "$CONF")
        [ "$have" -eq "$n" ] || die "already up with $have node(s) in $DIR; run '$0 down' first"
        echo "local_slurm: already up ($n node(s), SLURM_CONF=$CONF)"
        return 0
    fi
    down quiet
    mkdir -p "$DIR/ctld"
    chmod 700 "$DIR"
    [ -f "$DIR/munge.key" ] || { head -c 1024 /dev/urandom > "$DIR/munge.key"; chmod 600 "$DIR/munge.key"; }
    write_conf "$n"
    : > "$DIR/plugstack.conf"
    munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
    export SLURM_CONF="$CONF"
    slurmctld -i -f "$CONF"
    local name
    for name in $(node_names "$n"); do
        mkdir -p "$DIR/spool-$name"
        if [ "$n" -eq 1 ]; then slurmd -f "$CONF"; else slurmd -f "$CONF" -N "$name"; fi
    done
    for _ in $(seq 60); do  # wait until every node is idle
        if scontrol ping >/dev/null 2>&1 && [ "$(sinfo -h -N -t idle -o %N | sort -u | wc -l)" -eq "$n" ]; then
            echo "local_slurm: up ($n node(s), SLURM_CONF=$CONF)"
            return 0
        fi
        sleep 1
    done
    sinfo -N >&2 || true
    die "nodes not idle after 60 s; see $DIR/*.log"
}

down() {
    local f stopped=0
    if is_up; then  # end the jobs first, so that no slurmstepd outlives its slurmd
        SLURM_CONF="$CONF" scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 60); do
            [ -z "$(SLURM_CONF="$CONF" squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
            sleep 1
        done
    fi
    for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
        alive "$f" || { rm -f "$f"; continue; }
        local pid; pid=$(cat "$f")
        kill "$pid"
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        rm -f "$f"
        stopped=$((stopped + 1))
    done
    [ "${1:-}" = quiet ] || echo "local_slurm: down ($stopped daemon(s) stopped; logs in $DIR)"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    purge) down; rm -rf "$DIR" ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    status) if is_up; then SLURM_CONF="$CONF" sinfo -N; else echo "local_slurm: down"; exit 1; fi ;;
    *) die "usage: $0 up [--nodes N] | down | purge | env | status" ;;
esac
