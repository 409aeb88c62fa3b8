"""Python commands of the tests as forks of one process that has already imported train.py's modules.

A `python train.py ...` of the tests spends most of its start importing torch, torch.distributed.checkpoint,
torch._dynamo and Hydra. The zygote (this file run as a script, one per test process, started at its first use)
imports them once; each command is then a fork that runs the script or module as `__main__` with the command's
argv, environment, working directory and standard streams, and ends like the interpreter: SystemExit's code, 1
with the traceback on stderr for an exception, atexit handlers and non-daemon threads run. `run` returns a
`subprocess.CompletedProcess`; `start` runs the command in the background and returns a `Forked`, the part of
`subprocess.Popen` the tests use. LOGO_TEST_FORK=0 makes both start real subprocesses instead; so does a machine
with a CUDA device (a fork cannot use CUDA that its parent started).

Protocol (one JSON line each way on the zygote's stdin / stdout; several commands may run at once, each named by the
request's id): request {"id", "argv", "env", "cwd", "out", "err"}; replies {"id", "pid"} when the fork started, then
{"id", "returncode"} when it ended (negative: killed by that signal).
"""
from __future__ import annotations

import atexit
import io
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


def _reply(msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _serve() -> None:
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()  # SIGCHLD writes a byte here: a fork ended
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: dict = {}  # pid: request id
    pending = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            _reply({"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return  # the test process ended
        pending += chunk
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                _child(req)
            running[pid] = req["id"]
            _reply({"id": req["id"], "pid": pid})


# ---- the test process's side --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


class _Zygote:
    """The zygote process and an unbuffered reader of its replies (select sees every byte not yet read)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, bufsize=0,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        self.replies: dict = {}  # request id: what its replies said so far
        self.ids = 0
        self.streams = Path(tempfile.mkdtemp(prefix="logo-test-forks-"))
        atexit.register(shutil.rmtree, self.streams, True)

    def send(self, cmd: list, env: dict, cwd) -> tuple[int, Path, Path]:
        """Ask for a fork running `cmd`; returns (request id, stdout file, stderr file)."""
        self.ids += 1
        out, err = (self.streams / f"{self.ids}.{name}" for name in ("out", "err"))
        req = {"id": self.ids, "argv": cmd[1:], "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        return self.ids, out, err

    def _read(self, deadline: float | None) -> bool:
        """Take in the replies that arrive before the deadline (None: wait for one); False if none did."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return False
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"the test zygote ended (exit code {self.proc.wait()})")
        self.pending += chunk
        while b"\n" in self.pending:
            line, _, self.pending = self.pending.partition(b"\n")
            msg = json.loads(line)
            self.replies.setdefault(msg.pop("id"), {}).update(msg)
        return True

    def reply(self, rid: int, key: str, deadline: float | None = None):
        """The `key` ("pid" or "returncode") of request `rid`, or None at the deadline."""
        while key not in self.replies.get(rid, {}):
            if not self._read(deadline):
                return None
        return self.replies[rid][key]


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def _cuda_present() -> bool:
    """A CUDA device here: the preloaded modules may start CUDA in the zygote, and a fork of a process that has
    started CUDA cannot use it, so commands on a GPU node run as real subprocesses."""
    import torch
    return torch.cuda.is_available()


def usable(cmd: list) -> bool:
    """Whether `run` forks this command: the test interpreter running a script or `-m module` (torchrun too: the
    launcher is the fork, its ranks are the real processes it starts), on a machine without CUDA devices."""
    if os.environ.get("LOGO_TEST_FORK", "1") == "0" or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if _cuda_present():
        return False
    if cmd[1] == "-m":
        return len(cmd) >= 3
    return not cmd[1].startswith("-")


def _read_streams(out: Path, err: Path) -> tuple[str, str]:
    """The text a fork wrote to its stdout and stderr files, which are then removed."""
    texts = tuple(p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
    for p in (out, err):
        p.unlink(missing_ok=True)
    return texts


def run(cmd: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`, forked from the
    zygote when `usable(cmd)`."""
    if not usable(cmd):
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    forked = Forked(cmd, env, cwd)
    try:
        forked.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(forked.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = forked.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
    stdout, stderr = forked.communicate()
    return subprocess.CompletedProcess(cmd, forked.returncode, stdout, stderr)


class Forked:
    """A command forked from the zygote in the background, with the part of `subprocess.Popen` the tests use: pid,
    returncode, poll, wait, send_signal, terminate, kill, communicate (text); stdout and stderr, read after it ended,
    hold what it wrote (files, not pipes: nothing can be read while it runs)."""

    def __init__(self, cmd: list, env: dict, cwd):
        self.args, self._z = cmd, _zygote()
        self._rid, self._out, self._err = self._z.send(cmd, env, cwd)
        self.pid = self._z.reply(self._rid, "pid")
        self.returncode = None
        self._texts = None

    def _ended(self, deadline: float | None):
        if self.returncode is None:
            code = self._z.reply(self._rid, "returncode", deadline)
            if code is not None:
                self.returncode = code
                del self._z.replies[self._rid]
        return self.returncode

    def poll(self):
        return self._ended(time.monotonic())

    def wait(self, timeout: float | None = None) -> int:
        if self._ended(None if timeout is None else time.monotonic() + timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._texts is None:
            self._texts = _read_streams(self._out, self._err)
        return self._texts

    @property
    def stdout(self):
        return io.StringIO(self.communicate(0)[0])

    @property
    def stderr(self):
        return io.StringIO(self.communicate(0)[1])


def start(cmd: list, env: dict, cwd):
    """`subprocess.Popen(cmd, env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True)`, forked from the zygote (a
    `Forked`) when `usable(cmd)`."""
    if not usable(cmd):
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Forked(cmd, env, cwd)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # this checkout's packages, as train.py's own directory gives them
    _serve()
