"""train.py with a fault injected into the checkpoint writer, for the fault-injection tests.

    LOGO_FAULT=slow_write:STEP:SECONDS   DCP's FileSystemWriter sleeps before writing step STEP (a slow disk)
    LOGO_FAULT=enospc:STEP               writing step STEP writes part of a shard, then fails with ENOSPC
    LOGO_FAULT=slow_rename:STEP:SECONDS  sleeps after step STEP is written, just before its rename
    LOGO_FAULT=die:STEP:RANK             rank RANK kills itself (SIGKILL) in step STEP's update, in the first
                                         attempt of a torchrun --max-restarts job only
    LOGO_FAULT_RELEASE=PATH              the slow faults' sleep ends early once PATH exists (a test that has seen
                                         what it waits for lets the write go on instead of waiting it out)

Everything else is the real train.py (run with runpy, so Hydra sees the same command line).
"""
import errno
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, before any installed copy


def _stall(seconds: float) -> None:
    """Sleep `seconds`, or until the file LOGO_FAULT_RELEASE names exists."""
    release = os.environ.get("LOGO_FAULT_RELEASE")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (release and Path(release).exists()):
        time.sleep(0.05)


def _install(fault: str) -> None:
    kind, step, *rest = fault.split(":")
    tag = f"step_{int(step):08d}"
    from torch.distributed.checkpoint import FileSystemWriter
    import logo.train.checkpoint as ck
    write_data = FileSystemWriter.write_data

    def hits(path) -> bool:
        return tag in str(path)

    if kind == "slow_write":
        def slow(self, plan, planner):
            if hits(self.path):
                _stall(float(rest[0]))
            return write_data(self, plan, planner)
        FileSystemWriter.write_data = slow
    elif kind == "enospc":
        def full(self, plan, planner):
            if hits(self.path):
                Path(self.path, "__partial.distcp").write_bytes(b"\0" * 4096)  # what a filling disk leaves
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            return write_data(self, plan, planner)
        FileSystemWriter.write_data = full
    elif kind == "slow_rename":
        fsync_dir = ck.fsync_dir

        def slow_fsync(path):
            fsync_dir(path)
            if hits(path) and str(path).endswith(".tmp"):
                _stall(float(rest[0]))
        ck.fsync_dir = slow_fsync
    elif kind == "die":
        import signal
        import logo.train.step as st
        update = st.optimizer_step

        def die(opt, sched, ctrl, out, monitor, n):
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if n == int(step) and os.environ.get("RANK") == rest[0] and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            return update(opt, sched, ctrl, out, monitor, n)
        st.optimizer_step = die  # before train.py imports the trainer, which takes it by name
    else:
        raise SystemExit(f"unknown LOGO_FAULT {fault!r}")


if __name__ == "__main__":
    if os.environ.get("LOGO_FAULT"):
        _install(os.environ["LOGO_FAULT"])
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
