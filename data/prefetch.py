"""Background preparation of the next steps' batches for a `TokenLoader`.

`StepLoader(loader, prefetch=True)` builds global batches b, b+1, ... (reading the memory-mapped shards,
document offsets, pinned copies when CUDA) on one background thread, at most `depth` steps ahead, while the
main thread trains. The main thread takes them in order; the loader's position (`batches_consumed`, what
`state_dict()` saves) moves only when a step is taken, never when it is prepared, so a checkpoint resumes
exactly where the consumed data ended. With `prefetch=False` the same batches are built inline.

A failure on the thread (a `DataError`, say) is raised by `next_step()` of the step that needed the batch.
"""
from __future__ import annotations

import queue
import threading
from typing import Optional

import torch

from data.loader import StepData, TokenLoader


class StepLoader:
    """Yields `StepData` in order; the same batches with or without the background thread."""

    def __init__(self, loader: TokenLoader, prefetch: bool = True, pin_memory: bool = False,
                 device: Optional[torch.device] = None, depth: int = 2, doc_buckets: bool = False):
        """doc_buckets: pad every micro-batch's document offsets to a bucketed length (`bucket_doc_offsets`;
        for CUDA graphs, which record one graph per input shape)."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.doc_buckets = doc_buckets
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU, seen from the main thread
        self.loader, self.prefetch, self.pin, self.device, self.depth = loader, prefetch, pin_memory, device, depth
        self._thread: Optional[threading.Thread] = None
        self._queue: Optional[queue.Queue] = None
        self._stop: Optional[threading.Event] = None

    def _build(self, b: int) -> StepData:
        data = self.loader.step_data(b)
        if self.doc_buckets:
            data = StepData([mb.with_bucketed_offsets() for mb in data.micro_batches], data.target_tokens)
        if self.pin:
            data = StepData([mb.pin_memory() for mb in data.micro_batches], data.target_tokens)
        return data

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(target=self._work, args=(self.loader.batches_consumed, self._queue,
                                                                 self._stop), name="logo-prefetch", daemon=True)
        self._thread.start()

    def _work(self, b: int, q: queue.Queue, stop: threading.Event) -> None:
        if self.pin and self.device is not None and self.device.type == "cuda":
            # pinned allocations create a CUDA context on the thread's current device: make it this rank's GPU
            torch.cuda.set_device(self.device)
        while not stop.is_set():
            try:
                item = (b, self._build(b))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
                item = (b, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            b += 1

    def next_step(self) -> StepData:
        """The next step's data; the loader's position moves past it."""
        b = self.loader.batches_consumed
        if not self.prefetch:
            data = self._build(b)
        else:
            if self._thread is None:
                self._start()
            got_b, data = self._get()
            if got_b != b:
                raise RuntimeError(f"prefetch thread produced global batch {got_b}, expected {b}")
            if isinstance(data, BaseException):
                self.close()
                raise data
        self.loader.batches_consumed = b + 1
        return data

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data prefetch thread stopped without a batch") from None

    def state_dict(self) -> dict:
        """The consumed position (batches prepared ahead are not part of it)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()  # what was prepared belongs to the old position
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the thread and drop what it prepared (the next `next_step()` starts a new one)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)
        self._thread = self._queue = self._stop = None
