"""Decisions every rank must take alike: rank 0 reads the files (or checks the disk), every rank gets its
answer, and when it fails every rank raises the same error, so that no rank waits in a collective alone."""
from __future__ import annotations

import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def rank0_decides(fn, errors: tuple = (Exception,), share_result: bool = True):
    """fn() on rank 0; on every rank its result (share_result=False: rank 0 keeps it, the others get None) or,
    when fn raised one of `errors`, that error (same type and message) raised on every rank."""
    result, error = None, None
    if rank() == 0:
        try:
            result = fn()
        except errors as e:
            error = (type(e), str(e))
    if is_dist():
        box = [result if share_result else None, error]
        dist.broadcast_object_list(box, src=0)
        if rank() != 0:
            result = box[0]
        error = box[1]
    if error is not None:
        raise error[0](error[1]) from None
    return result
