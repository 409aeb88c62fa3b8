"""Progress of an evaluation command: tqdm bars on stderr and the summary line that closes the command.

`Progress(enabled)` counts the tokens a command processes and draws one bar per loop (`bar`); enabled True
draws the bars whatever stderr is, False never, None only when stderr is a terminal (tqdm's own rule). A
bar counted in tokens shows tqdm's own rate (tok/s); a bar over prompts or requests shows the token rate
as its postfix.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Optional

from tqdm import tqdm

TOKENS = "tok"


class Progress:
    """Tokens processed since construction, and the bar of the loop running now (if any)."""

    def __init__(self, enabled: Optional[bool] = None):
        self.enabled = enabled
        self.tokens = 0
        self.started = time.perf_counter()
        self.finished: Optional[float] = None
        self._bar: Optional[tqdm] = None
        self._bar_tokens = 0
        self._bar_started = 0.0

    @property
    def seconds(self) -> float:
        """Since construction, up to `finish()` once it was called."""
        return (self.finished or time.perf_counter()) - self.started

    def finish(self) -> None:
        """Stop the clock: what follows (writing results, logging them) is not part of the evaluation."""
        self.finished = time.perf_counter()

    @contextmanager
    def bar(self, total: int, desc: str, unit: str = TOKENS, hidden: bool = False):
        """A bar over `total` units of `unit` for the loop inside the block; `update` advances it. hidden:
        no bar (tokens are still counted)."""
        bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == TOKENS, dynamic_ncols=True, leave=False,
                   file=sys.stderr, disable=self._disable(hidden))
        self._bar, self._bar_tokens, self._bar_started = bar, 0, time.perf_counter()
        try:
            yield self
        finally:
            bar.refresh()  # the final counts are drawn once before the bar is cleared
            bar.close()
            self._bar = None

    def _disable(self, hidden: bool) -> Optional[bool]:
        """tqdm's `disable`: True hides the bar, None leaves it to whether stderr is a terminal."""
        if hidden or self.enabled is False:
            return True
        return None if self.enabled is None else False

    def update(self, n: int = 0, tokens: int = 0) -> None:
        """Advance the current bar by n units, and count `tokens` processed."""
        self.tokens += tokens
        bar = self._bar
        if bar is None or bar.disable:
            return
        self._bar_tokens += tokens
        if bar.unit != TOKENS:
            rate = self._bar_tokens / max(time.perf_counter() - self._bar_started, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
        bar.update(n)

    def summary(self, what: str, wrote) -> str:
        """One line: the tokens processed, the seconds, tokens/s and what was written."""
        seconds = self.seconds
        return (f"{what}: {self.tokens:,} tokens in {seconds:.1f} s ({self.tokens / max(seconds, 1e-9):,.0f} "
                f"tokens/s); wrote {wrote}")
