"""The processes behind the ranks of a distributed run, so that a rank whose collective failed because a peer died
can name the rank that died in one line, or say that its collective timed out (torchrun's own report still says how
it ended). `PeerWatch` ends a rank whose collective waits on a dead peer without failing."""
from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

_PEERS: list[tuple[str, int]] = []  # (host, pid) of every rank, gathered when the process group starts
_REPORTED = threading.Lock()  # taken by the first lost-peer report of this process: a rank says it once
RESUME = "the last complete checkpoint stays latest: re-run the same command to resume"


def record_peers() -> None:
    """Every rank's (host, pid); once, right after the process group starts (a collective)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
    _PEERS[:] = gathered


def _alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet collected by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal test alone (a zombie still counts as alive there)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _me():
    """This process's rank in the recorded peers ("?" before they are recorded)."""
    return next((r for r, peer in enumerate(_PEERS) if peer == (socket.gethostname(), os.getpid())), "?")


def _local_peers() -> list[tuple[int, int]]:
    """(rank, pid) of the other ranks on this host."""
    host, me = socket.gethostname(), os.getpid()
    return [(r, pid) for r, (h, pid) in enumerate(_PEERS) if h == host and pid != me]


def dead_peers(wait_s: float = 2.0) -> list[int]:
    """The ranks on this host whose process has ended, waiting up to `wait_s` for one to be seen gone (a killed
    process closes its connections a moment before it is dead)."""
    local = _local_peers()
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r, pid in local if not _alive(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def lost_peer_message(error: BaseException) -> Optional[str]:
    """One line naming the rank(s) that died, or saying that a collective timed out, when `error` came from a
    collective of a distributed run that lost a peer; None otherwise (a single process, or another error)."""
    if len(_PEERS) < 2 or not isinstance(error, (RuntimeError, ConnectionError)):
        return None
    dead = dead_peers()
    remote = re.search(r"Connection (?:closed|reset) by peer \[([^\]]+)\]", str(error))  # gloo's words
    me = _me()
    if dead:
        return _died(dead, me)
    if remote:  # on another host: its process cannot be looked at from here
        return f"the rank at {remote.group(1)} of this run died; rank {me} stops too; {RESUME}"
    if re.search(r"timed out|timeout", str(error), re.IGNORECASE):
        traces = _read_traces()
        return (f"a collective of rank {me} timed out (parallel.timeout_s): another rank stopped answering (hung, or "
                f"stuck in a slow step){f' ({traces})' if traces else ''}; rank {me} stops; {RESUME}")
    return None


def _died(dead: list[int], me) -> str:
    who = ", ".join(f"rank {r} (pid {_PEERS[r][1]})" for r in dead)
    traces = _read_traces()
    after = f" after a collective timed out ({traces})" if traces else ""
    return f"{who} of this run died{after}; rank {me} stops too; {RESUME}"


def _read_traces() -> str:
    """How to read the ranks' last collectives, where NCCL's flight recorder dumped them (it does on a collective's
    timeout, before the watchdog ends the rank: a death then followed a hang); empty where it did not."""
    prefix = Path(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", ""))
    if not prefix.name or not any(prefix.parent.glob(prefix.name + "*")):
        return ""
    return (f"each rank's last collectives: python -m torch.distributed.flight_recorder.fr_trace {prefix.parent} "
            f"--prefix {prefix.name} -j")


def report_lost_peer(line: str) -> None:
    """Print `error: line` to stderr unless this process already reported a lost peer."""
    if _REPORTED.acquire(blocking=False):
        sys.stderr.flush()
        os.write(2, f"error: {line}\n".encode())


class PeerWatch:
    """While armed, a daemon thread looks at this host's other ranks every POLL_S. Once one has been dead for
    `grace_s`, this rank reports it in one line and exits with code 2: a collective that waits on a dead peer does
    not always fail (gloo can miss the closed connection, NCCL waits out its timeout, and torchrun's SIGTERM cannot
    run the stop handler of a thread blocked in one). The main thread's own report, when its collective fails
    first, is the one printed. Peers on other hosts are left to the collectives' timeout (parallel.timeout_s)."""

    POLL_S = 0.25

    def __init__(self, grace_s: float = 5.0):
        self.grace_s = grace_s
        self._armed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self) -> PeerWatch:
        """Start watching (nothing to watch in a single-process run, or without other ranks on this host)."""
        if _local_peers():
            self._armed.set()
            self._thread = threading.Thread(target=self._watch, name="logo-peer-watch", daemon=True)
            self._thread.start()
        return self

    def disarm(self) -> None:
        """Stop watching: the loop ended, and peers may now exit on their own."""
        self._armed.clear()

    def _watch(self) -> None:
        since = None
        while self._armed.is_set():
            dead = dead_peers(wait_s=0.0)
            if not dead:
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= self.grace_s and self._armed.is_set():
                report_lost_peer(_died(dead, _me()))
                os._exit(2)
            time.sleep(self.POLL_S)
