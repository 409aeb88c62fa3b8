"""Faults of a multi-rank run (torchrun, gloo on CPU): a rank killed, a rank that stops answering, a rank blocked
in a collective on a dead peer, and torchrun's restart of a failed job. Each ends in one line, never a traceback;
a restart resumes from the last checkpoint with the losses of a run that never failed. (The single-process faults:
test_faults.py.)"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (ROOT, TINY_RUN, logged, rank_pid, read_metrics, run_python, run_train, train_cmd, train_env,
                      wait_for_train)


def test_a_dead_peer_rank_is_named_in_one_line(tmp_path, default_corpus):
    """Rank 1 of a two-process run is killed: rank 0 says in one line that rank 1 died and exits; torchrun's own
    report follows. No traceback of train.py, no gloo error text."""
    d = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(*TINY_RUN, "train.steps=50", "eval.interval=0", "checkpoint.interval=1000",
                                      f"run.dir={d}", nproc=2),
                            cwd=ROOT, env=train_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_train(lambda: logged(d, 2), proc)
    pid = rank_pid(proc.pid, 1)
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 60
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: rank 1 (pid {pid}) of this run died; rank 0 stops too; "
                      f"the last complete checkpoint stays latest: re-run the same command to resume"], err[-4000:]
    assert "Error executing job" not in err and "train.py\", line" not in err and "gloo" not in err.lower()
    assert "ChildFailedError" in err  # torchrun's report stays


WATCHED = """
import os, socket, subprocess, sys, time
from logo.train import peers
peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
peers._PEERS[:] = [(socket.gethostname(), os.getpid()), (socket.gethostname(), peer.pid)]
peers.PeerWatch(grace_s=float(sys.argv[1])).arm()
print("armed", peer.pid, flush=True)
if sys.argv[2] == "kill":
    peer.kill()
    peer.wait()  # reaped at once: gone from /proc, as a dead rank is once torchrun collects it
time.sleep(float(sys.argv[3]))  # a collective that never completes
peer.kill()
print("not ended", flush=True)
"""


@pytest.mark.parametrize("peer", ["kill", "kill_after_timeout", "live"])
def test_a_rank_blocked_on_a_dead_peer_is_ended_by_its_watch(peer, tmp_path):
    """A rank whose peer on the same host died while this rank waits in a collective that never fails (gloo may miss
    the closed connection; NCCL waits out its timeout) says so in one line within the watch's grace and exits 2; a
    live peer does not trip it (3 s blocked: the watch looks a dozen times, 6 graces). Where NCCL's flight recorder
    has dumped the ranks' collectives (a collective timed out, and the watchdog then ended the peer), the line says
    where and how to read them."""
    t0 = time.time()
    blocked = {"kill": 10, "kill_after_timeout": 10, "live": 3}[peer]
    traces = tmp_path / "comm_traces"
    traces.mkdir()
    if peer == "kill_after_timeout":
        (traces / "rank_1").write_bytes(b"")
    env = {**os.environ, "TORCH_FR_DUMP_TEMP_FILE": str(traces / "rank_")}
    p = subprocess.run([sys.executable, "-c", WATCHED, "0.5", peer[:4], str(blocked)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=env)
    took = time.time() - t0
    pid = p.stdout.split()[1]
    if peer == "live":
        assert p.returncode == 0 and "not ended" in p.stdout and "error" not in p.stderr, p.stderr
        return
    assert p.returncode == 2 and took < 8 and "not ended" not in p.stdout, (p.returncode, took, p.stderr)
    hint = (f" after a collective timed out (each rank's last collectives: python -m "
            f"torch.distributed.flight_recorder.fr_trace {traces} --prefix rank_ -j)") if peer != "kill" else ""
    assert p.stderr.splitlines() == [f"error: rank 1 (pid {pid}) of this run died{hint}; rank 0 stops too; the last "
                                     f"complete checkpoint stays latest: re-run the same command to resume"]


def test_a_hung_peer_rank_ends_the_run_within_the_timeout(tmp_path, default_corpus):
    """Rank 1 of a two-process run stops answering (SIGSTOP) after step 2: rank 0's next collective times out after
    parallel.timeout_s (the run's timeout from the second step on), it says so in one line and exits, and torchrun
    ends the job: bounded by the timeout and torchrun's grace period, not by the 30-minute default."""
    d = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(*TINY_RUN, "train.steps=50", "eval.interval=0", "checkpoint.interval=1000",
                                      "parallel.timeout_s=5", f"run.dir={d}", nproc=2),
                            cwd=ROOT, env=train_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_train(lambda: logged(d, 2), proc)
    rank0, pid = rank_pid(proc.pid, 0), rank_pid(proc.pid, 1)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    while Path(f"/proc/{rank0}").exists() and time.time() - t0 < 120:  # rank 0 gives up on its own
        time.sleep(0.2)
    waited = time.time() - t0
    os.kill(pid, signal.SIGKILL)  # the stopped rank: torchrun would wait out its grace period for it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and waited < 60, waited
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == ["error: a collective of rank 0 timed out (parallel.timeout_s): another rank stopped answering "
                      "(hung, or stuck in a slow step); rank 0 stops; the last complete checkpoint stays latest: re-run "
                      "the same command to resume"], err[-4000:]
    assert "train.py\", line" not in err


@pytest.mark.slow
def test_torchrun_restarts_resume_from_the_last_checkpoint(tmp_path, default_corpus):
    """torchrun --max-restarts=1: rank 1 dies in step 5 of the first attempt; torchrun restarts both ranks, which
    resume from the step-4 checkpoint and finish with the losses of a run that never failed."""
    args = [*TINY_RUN, "train.steps=6", "eval.interval=0", "checkpoint.interval=2"]
    run_train(*args, f"run.dir={tmp_path / 'clean'}", nproc=2, timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(ROOT / "tests" / "fault_entry.py"), *args, f"run.dir={tmp_path / 'restarted'}"]
    p = run_python(cmd, env=train_env(2, {"LOGO_FAULT": "die:5:1"}), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stderr + p.stdout
    clean = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "clean")}
    restarted = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "restarted")}  # steps 5-6 logged again
    assert restarted == clean
