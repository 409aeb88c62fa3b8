"""A torchrun entry point for the SLURM signal tests: records which signals reach each rank's process.

Each rank writes <PROBE_DIR>/ready.<rank> once its handlers are installed, then waits (at most 300 s) for
SIGUSR1 or SIGTERM and writes <PROBE_DIR>/rank<rank>.<start> = "<signals> <node>". On a restart of the job
(SLURM_RESTART_COUNT > 0) it exits at once, so the requeued job completes.
"""
import os
import signal
import time
from pathlib import Path

out, rank = Path(os.environ["PROBE_DIR"]), os.environ["RANK"]
start = os.environ.get("SLURM_RESTART_COUNT", "0")
node = os.environ.get("SLURMD_NODENAME", "?")
got = []
if start == "0":
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
    (out / f"ready.{rank}").write_text(f"{os.getpid()} {node}")
    deadline = time.monotonic() + 300
    while not got and time.monotonic() < deadline:
        time.sleep(0.1)
(out / f"rank{rank}.{start}").write_text(f"{','.join(got) or '-'} {node}")
