"""Budget controllers for LoGo thresholds (paper Eq. 11 and P-mask), and the routing record they keep.

Once per optimizer step, for every LoGo layer l, with F_l = selected_l / valid_l summed over every
micro-batch of the step and every data-parallel rank:

    threshold (paper, default)  b_l <- b_l + gamma * sign(F_l - rho)
    quantile                    b_l <- Q_l(1 - rho + I_l),   I_l <- I_l + k * (F_l - rho)
    aux_loss                    b_l <- min(b_l + gamma, 0.5)          (only the P-mask ramp)

Q_l(tau) is the tau-quantile of the layer's gate values in the last step (or an EMA over steps,
`quantile_decay`), read from a histogram of gate logits; so the threshold lands where a fraction rho of
the last step's tokens lie above it, in one step. I_l (integral feedback, gain k = `quantile_gain`) removes
the bias left by the gates moving between steps, and makes ties exact: with a flat gate (every p equal), F is
1 or 0, b moves across the single occupied bin and, since b is the integral of k * (F - rho) and stays
bounded, the mean of F over W steps is rho to within about 1/W (a sigma-delta modulator). With P-mask the
quantile controller follows the same ramp b <- b + gamma until b reaches Q or 0.5 (the end of the paper's
ramp), then switches to the rule above; without P-mask (b0 = 0.5) it switches at once.

The sign controller on a flat gate steps b back and forth across p every step: F alternates 1, 0 and averages
0.5 whatever rho is. The realized ratios are therefore kept per step in a ring buffer of the last
`window` steps (`logo/ratio_window/layer_i`), next to the last step's ratio.

Counts are summed first (over the ranks that see different tokens, by the `reduce` function the trainer gives,
e.g. `logo.parallel.sum_over_ranks`: one all-reduce of an (L, K) tensor per step) and the update computed after,
so every rank applies the same update and a distributed run matches a single-process run of the same global
batch. `state_dict()` holds everything besides the thresholds (which are model buffers): ring buffer,
integral, histogram, ramp flags; identical on every rank.
"""
from __future__ import annotations

import math
from typing import Optional
from collections.abc import Callable

import torch

from logo.kernels.gate import bin_counts
from logo.model.flops import realized_global_fraction

# Columns of the per-layer routing stats (logo.model.routing.routing_stats); the quantile controller's
# gate-logit histogram follows in columns HIST.. .
SELECTED, VALID, PSUM, PSQ, NEAR, HIST = 0, 1, 2, 3, 4, 5
# Histogram bins are uniform in u = asinh(s / LOGIT_SCALE), s = logit(p) clamped to +-LOGIT_MAX: about
# 2.6% relative resolution in s for |s| > 1e-4 and 2.6e-6 absolute below (1025 bins), so both a freshly
# initialized gate (|s| ~ 1e-2) and a saturated one are resolved.
LOGIT_SCALE, LOGIT_MAX = 1e-4, 30.0
U_MAX = math.asinh(LOGIT_MAX / LOGIT_SCALE)


def gate_histogram(p: torch.Tensor, valid: torch.Tensor, bins: int) -> torch.Tensor:
    """(bins,) fp32 counts of the gate logits of p (N,) over the tokens where valid (N,) (bool or 0/1) is set
    (`logo.kernels.gate.bin_counts`)."""
    u = torch.asinh(torch.logit(p.float()).clamp(-LOGIT_MAX, LOGIT_MAX) / LOGIT_SCALE)
    u = torch.nan_to_num(u, nan=0.0)  # a diverged step (skipped anyway) must not index out of range
    idx = ((u + U_MAX) * (bins / (2 * U_MAX))).floor().clamp(0, bins - 1)  # (N,) bin index, as a float
    return bin_counts(idx, valid, bins)


def histogram_quantile(hist: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """Per row, the gate value p with a fraction `level` of the histogram's mass below it (linear inside a bin
    in u). hist (L, bins) float64, level (L,) in [0, 1] -> (L,) float64. Level 1 gives the upper edge of the
    last occupied bin (nothing above), level 0 the lower edge of the histogram (everything above)."""
    bins = hist.shape[1]
    total = hist.sum(1, keepdim=True).clamp_min(1e-300)
    cdf = hist.cumsum(1) / total  # (L, bins)
    lv = level.to(hist.dtype).clamp(0, 1)[:, None].contiguous()  # (L, 1)
    j = torch.searchsorted(cdf, lv).clamp_max(bins - 1)  # first bin whose cdf reaches the level
    below = torch.where(j > 0, cdf.gather(1, (j - 1).clamp_min(0)), torch.zeros_like(lv))
    mass = hist.gather(1, j) / total
    frac = ((lv - below) / mass.clamp_min(1e-300)).clamp(0, 1)
    u = -U_MAX + (j + frac) * (2 * U_MAX / bins)
    return torch.sigmoid(LOGIT_SCALE * torch.sinh(u)).squeeze(1)


def stats_columns(cfg) -> int:
    """K, the width of a layer's routing stats for this attention config."""
    return HIST + (cfg.quantile_bins if cfg.budget_control == "quantile" else 0)


class BudgetController:
    """Updates every LoGo layer's threshold once per step and keeps the routing record for metrics."""

    def __init__(self, model, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, window: int = 100):
        """reduce: sums a step's (L, K) float64 counts over the ranks and returns the sum (None: one process)."""
        if window < 1:
            raise ValueError(f"BudgetController window={window}: must be >= 1 step")
        self.layers = model.logo_layers()
        self.layer_ids = list(model.logo_layer_ids)
        self.model_cfg = model.cfg
        self.cfg = model.cfg.attention
        self.reduce = reduce
        self.window = window
        L = len(self.layers)
        dev = self.layers[0].threshold.device if self.layers else torch.device("cpu")
        self._acc: Optional[torch.Tensor] = None  # (L, K) float64, this step's running sums
        self._last: Optional[torch.Tensor] = None  # (L, K) float64, the last completed step (global sums)
        self.steps = 0  # controller steps taken (host int: the ring position, no sync)
        self._ring = torch.zeros(window, L, 2, dtype=torch.float64, device=dev)  # (W, L, [selected, valid])
        # quantile control
        self._hist: Optional[torch.Tensor] = None  # (L, bins) float64, (smoothed) gate-logit histogram
        self._integral = torch.zeros(L, dtype=torch.float64, device=dev)  # (L,) I_l, in quantile-level units
        self._engaged = torch.zeros(L, dtype=torch.bool, device=dev)  # (L,) the P-mask ramp has ended

    def accumulate(self, routing: Optional[torch.Tensor]) -> None:
        """Add one micro-batch's routing stats (L, K) (see SELECTED.. HIST). No host sync."""
        if routing is None:
            return
        r = routing.detach().to(torch.float64)
        self._acc = r if self._acc is None else self._acc + r

    @torch.no_grad()
    def step(self, skip: Optional[torch.Tensor] = None) -> None:
        """Reduce this step's counts over ranks and update every threshold (call after optimizer.step).
        `skip` () bool on the device: a non-finite step; then nothing changes (thresholds, integral, histogram)
        and the step counts as empty in the window. No host sync either way."""
        if not self.layers:
            return
        L = len(self.layers)
        K = stats_columns(self.cfg)
        acc = self._acc if self._acc is not None else torch.zeros(L, K, dtype=torch.float64, device=self._ring.device)
        if acc.shape[1] < K:
            raise ValueError(f"routing stats have {acc.shape[1]} columns, budget_control={self.cfg.budget_control} "
                             f"needs {K}")
        if self.reduce is not None:
            acc = self.reduce(acc)
        before = self._snapshot() if skip is not None else None
        b = self.thresholds().to(acc.device, torch.float64)  # (L,)
        if self.cfg.budget_control == "threshold":
            # sign(F - rho) = sign(selected - rho * valid); 0 when nothing valid was seen.
            new_b = b + self.cfg.gamma * torch.sign(acc[:, SELECTED] - self.cfg.rho * acc[:, VALID]) \
                * (acc[:, VALID] > 0)
        elif self.cfg.budget_control == "quantile":
            new_b = self._quantile_update(acc, b)
        else:
            new_b = (b + self.cfg.gamma).clamp_max(0.5)
        self._set_thresholds(new_b)
        slot = self.steps % self.window
        counts = acc[:, :2]
        if skip is not None:
            self._restore(before, skip)
            counts = torch.where(skip, torch.zeros_like(counts), counts)
        self._ring[slot].copy_(counts)
        self.steps += 1
        self._last, self._acc = acc, None

    def _quantile_update(self, acc: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The quantile rule (module docstring): (L,) float64 new thresholds; updates integral, histogram, flags."""
        c = self.cfg
        hist = acc[:, HIST:HIST + c.quantile_bins]
        if self._hist is None or c.quantile_decay == 0.0:
            self._hist = hist.clone()
        else:
            self._hist = c.quantile_decay * self._hist + (1.0 - c.quantile_decay) * hist
        valid = acc[:, VALID]
        F = acc[:, SELECTED] / valid.clamp_min(1)
        # Integral feedback only for the layers whose threshold this step already came from the quantile rule.
        grow = torch.where(self._engaged & (valid > 0), c.quantile_gain * (F - c.rho), torch.zeros_like(F))
        self._integral = (self._integral + grow).clamp(c.rho - 1.0, c.rho)  # level stays in [0, 1]
        q = histogram_quantile(self._hist, 1.0 - c.rho + self._integral)  # (L,)
        seen = self._hist.sum(1) > 0
        # The ramp ends where the paper's P-mask ends (b reaches 0.5, the initial gate centre) or earlier, once
        # b meets the quantile; from then on b follows the quantile (one step, whichever side it lies).
        self._engaged = self._engaged | (seen & ((b + c.gamma >= q) | (b + c.gamma >= 0.5)))
        new_b = torch.where(self._engaged, q, b + c.gamma)
        return torch.where(seen, new_b, b)  # no gate seen yet: keep b

    def _snapshot(self) -> dict:
        return {"thresholds": self.thresholds().clone(), "integral": self._integral.clone(),
                "engaged": self._engaged.clone(), "hist": None if self._hist is None else self._hist.clone()}

    def _restore(self, before: dict, skip: torch.Tensor) -> None:
        """Put back the state of `before` where skip is True (on the device, no sync)."""
        self._set_thresholds(torch.where(skip, before["thresholds"].to(skip.device), self.thresholds()))
        self._integral = torch.where(skip, before["integral"], self._integral)
        self._engaged = torch.where(skip, before["engaged"], self._engaged)
        if self._hist is not None:
            old = before["hist"] if before["hist"] is not None else torch.zeros_like(self._hist)
            self._hist = torch.where(skip, old, self._hist)

    def _set_thresholds(self, values: torch.Tensor) -> None:
        for layer, v in zip(self.layers, values):
            layer.threshold.copy_(v.to(layer.threshold.dtype).reshape(1))

    def thresholds(self) -> torch.Tensor:
        """(L,) fp32 current thresholds."""
        return torch.cat([layer.threshold.detach().float().reshape(1) for layer in self.layers])

    def window_ratios(self) -> torch.Tensor:
        """(L,) float64 realized ratio over the last `window` steps (selected / valid, both summed)."""
        s = self._ring.sum(0)  # (L, 2)
        return s[:, 0] / s[:, 1].clamp_min(1)

    def metrics(self) -> dict[str, float]:
        """`metrics_of` the current figures. One host sync."""
        figures = self.figures()
        return {} if figures is None else self.metrics_of(figures.cpu())

    def figures(self) -> Optional[torch.Tensor]:
        """(L, 8) per-layer figures of the last step on the device, a copy (no sync): selected, valid, gate sum and
        sum of squares, near-threshold count, window ratio, threshold, integral term; None before the first step."""
        if not self.layers or self._last is None:
            return None
        last = self._last[:, :NEAR + 1]
        return torch.cat((last, self.window_ratios()[:, None].to(last), self.thresholds().to(last)[:, None],
                          self._integral[:, None].to(last)), 1)

    def metrics_of(self, figures: torch.Tensor) -> dict[str, float]:
        """Per-layer ratios (last step and window), threshold, gate mean/std and fraction within gamma of b,
        integral term (quantile), and the realized global-attention FLOPs fraction, from `figures()` on the host."""
        L = len(self.layers)
        sel, valid, psum, psq, near, win, th, integral = figures.reshape(L, 8).unbind(1)
        n = valid.clamp_min(1)
        ratio, mean = sel / n, psum / n
        std = (psq / n - mean ** 2).clamp_min(0).sqrt()
        out: dict[str, float] = {}
        for j, i in enumerate(self.layer_ids):
            out[f"logo/ratio/layer_{i}"] = float(ratio[j])
            out[f"logo/ratio_window/layer_{i}"] = float(win[j])
            out[f"logo/threshold/layer_{i}"] = float(th[j])
            out[f"logo/gate_mean/layer_{i}"] = float(mean[j])
            out[f"logo/gate_std/layer_{i}"] = float(std[j])
            out[f"logo/gate_near_threshold/layer_{i}"] = float(near[j] / n[j])
            if self.cfg.budget_control == "quantile":
                out[f"logo/quantile_integral/layer_{i}"] = float(integral[j])
        out["logo/ratio_mean"] = float(ratio.mean())
        out["logo/ratio_window_mean"] = float(win.sum() / L)
        realized = realized_global_fraction(self.model_cfg, [float(w) for w in win])
        budget = realized_global_fraction(self.model_cfg, [self.cfg.rho] * L)
        out["logo/global_flops_fraction"] = realized
        out["logo/global_flops_vs_budget"] = realized / budget
        return out

    def state_dict(self) -> dict:
        """Everything but the thresholds (model buffers), on the CPU; identical on every rank."""
        order = [(self.steps + i) % self.window for i in range(self.window)]  # oldest first
        return {"steps": self.steps, "window": self._ring[order].cpu(), "integral": self._integral.cpu(),
                "engaged": self._engaged.cpu(), "hist": None if self._hist is None else self._hist.cpu(),
                "last": None if self._last is None else self._last.cpu(), "budget_control": self.cfg.budget_control}

    def load_state_dict(self, st: dict) -> None:
        """Restore `state_dict()`; a different window keeps the most recent steps that fit."""
        dev = self._ring.device
        win = st["window"].to(dev)[-self.window:]  # (w, L, 2) oldest first
        self._ring.zero_()
        self.steps = int(st["steps"])
        for i in range(win.shape[0]):  # newest lands at slot (steps - 1) % window
            self._ring[(self.steps - win.shape[0] + i) % self.window].copy_(win[i])
        same = st.get("budget_control") == self.cfg.budget_control
        self._integral = st["integral"].to(dev) if same else torch.zeros_like(self._integral)
        self._engaged = st["engaged"].to(dev) if same else torch.zeros_like(self._engaged)
        hist = st.get("hist") if same else None
        self._hist = hist.to(dev) if hist is not None else None
        self._last = st["last"].to(dev) if st.get("last") is not None else None
