"""The processes behind the ranks of a distributed run, so that a rank whose collective failed because a peer died
can name the rank that died in one line, or say that its collective timed out (torchrun's own report still says how
it ended)."""
from __future__ import annotations

import os
import re
import socket
import time
from typing import Optional

import torch.distributed as dist

_PEERS: list[tuple[str, int]] = []  # (host, pid) of every rank, gathered when the process group starts


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


def dead_peers(wait_s: float = 2.0) -> list[int]:
    """The ranks on this host whose process has ended, waiting up to `wait_s` for one to be seen gone (a killed
    process closes its connections a moment before it is dead)."""
    host, me = socket.gethostname(), os.getpid()
    local = [(r, pid) for r, (h, pid) in enumerate(_PEERS) if h == host and pid != me]
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
    me = next((r for r, peer in enumerate(_PEERS) if peer == (socket.gethostname(), os.getpid())), "?")
    resume = "the last complete checkpoint stays latest: re-run the same command to resume"
    if dead:
        who = ", ".join(f"rank {r} (pid {_PEERS[r][1]})" for r in dead)
    elif remote:
        who = f"the rank at {remote.group(1)}"  # on another host: its process cannot be looked at from here
    elif re.search(r"timed out|timeout", str(error), re.IGNORECASE):
        return (f"a collective of rank {me} timed out (parallel.timeout_s): another rank stopped answering (hung, or "
                f"stuck in a slow step); rank {me} stops; {resume}")
    else:
        return None
    return f"{who} of this run died; rank {me} stops too (its last collective failed); {resume}"
