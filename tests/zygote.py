"""Python commands of the tests as forks of one process that has already imported train.py's modules.

A `python train.py ...` of the tests spends most of its start importing torch, torch.distributed.checkpoint,
torch._dynamo and Hydra. The zygote (this file run as a script, one per test process, started at its first use)
imports them once; each command is then a fork that runs the script or module as `__main__` with the command's
argv, environment, working directory and standard streams, and ends like the interpreter: SystemExit's code, 1
with the traceback on stderr for an exception, atexit handlers and non-daemon threads run. `run` returns a
`subprocess.CompletedProcess`. LOGO_TEST_FORK=0 makes `run` start real subprocesses instead.

Protocol (one JSON line each way on the zygote's stdin / stdout): request {"argv", "env", "cwd", "out", "err"};
replies {"pid"} when the fork started, then {"returncode"} when it ended (negative: killed by that signal).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Modules every training run imports (none that a test runs as `-m`: runpy warns when its module was imported before);
# matplotlib.pyplot draws the ratio heatmap (its backend stays unset here: the code that plots picks Agg).
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "hydra", "omegaconf", "numpy",
           "logo.run.config", "logo.run.checkpoint", "logo.train.trainer", "logo.train.peers", "logo.train.rundir",
           "data.format", "data.default_corpus", "data.sources", "data.outputs", "data.tokenizer", "matplotlib.pyplot")


# ---- the zygote's side --------------------------------------------------------------------------------------------

def _exit_code(e: SystemExit) -> int:
    """The interpreter's exit status for SystemExit(e.code): None 0, an int itself, anything else printed and 1."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _child(req: dict) -> None:
    """In the fork: become the command, run it, end as the interpreter would (never returns)."""
    import io
    import runpy
    import threading
    import traceback
    os.setsid()  # its own process group: a timeout kills whatever it started too
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    argv = req["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to the interpreter
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # the interpreter's exit: wait for non-daemon threads, then the atexit handlers
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream at exit is ignored, as by the interpreter
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _serve() -> None:
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        reply.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


# ---- the test process's side --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


class _Zygote:
    """The zygote process and an unbuffered reader of its replies (select sees every byte not yet read)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, bufsize=0,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        self.streams = Path(tempfile.mkdtemp(prefix="logo-test-forks-"))
        atexit.register(shutil.rmtree, self.streams, True)

    def send(self, req: dict) -> None:
        self.proc.stdin.write((json.dumps(req) + "\n").encode())

    def reply(self, deadline: float | None = None) -> dict | None:
        """The next reply, or None at the deadline."""
        while b"\n" not in self.pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the test zygote ended (exit code {self.proc.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def usable(cmd: list) -> bool:
    """Whether `run` forks this command: the test interpreter running a script or `-m module` (torchrun too: the
    launcher is the fork, its ranks are the real processes it starts)."""
    if os.environ.get("LOGO_TEST_FORK", "1") == "0" or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if cmd[1] == "-m":
        return len(cmd) >= 3
    return not cmd[1].startswith("-")


def run(cmd: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`, forked from the
    zygote when `usable(cmd)`."""
    if not usable(cmd):
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    z = _zygote()
    out, err = (z.streams / f"{time.monotonic_ns()}.{name}" for name in ("out", "err"))
    z.send({"argv": cmd[1:], "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err)})
    pid = z.reply()["pid"]
    done = z.reply(time.monotonic() + timeout)
    if done is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        z.reply()
    stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
    for p in (out, err):
        p.unlink(missing_ok=True)
    if done is None:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, done["returncode"], stdout, stderr)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # this checkout's packages, as train.py's own directory gives them
    _serve()
