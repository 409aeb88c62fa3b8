"""Budget controller for LoGo thresholds (paper Eq. 11 and P-mask).

Once per optimizer step, for every LoGo layer l:

    F_l = selected_l / valid_l      summed over every micro-batch of the step and every data-parallel rank
    b_l <- b_l + gamma * sign(F_l - rho)            (budget_control = "threshold")
    b_l <- min(b_l + gamma, 0.5)                    (budget_control = "aux_loss": only the P-mask ramp)

The counts are summed first (one all-reduce of an (L, 4) tensor) and the sign taken after, so every rank
applies the same update and a distributed run matches a single-process run of the same global batch.
With P-mask, b starts at 0.5 - gamma * S: all tokens are routed global (p in (0, 1)) and F = 1 > rho, so b
rises by exactly gamma per step and reaches 0.5 after S steps.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class BudgetController:
    def __init__(self, model, process_group: Optional[dist.ProcessGroup] = None):
        self.layers = model.logo_layers()
        self.layer_ids = list(model.logo_layer_ids)
        self.cfg = model.cfg.attention
        self.group = process_group
        self._acc: Optional[torch.Tensor] = None  # (L, 4) float64, this step's running sums
        self._last: Optional[torch.Tensor] = None  # (L, 4) float64, the last completed step (global sums)

    def accumulate(self, routing: Optional[torch.Tensor]) -> None:
        """Add one micro-batch's routing stats (L, 4) [selected, valid, sum p, sum p^2]. No host sync."""
        if routing is None:
            return
        r = routing.detach().to(torch.float64)
        self._acc = r if self._acc is None else self._acc + r

    @torch.no_grad()
    def step(self) -> None:
        """Reduce this step's counts over ranks and update every layer's threshold (call after optimizer.step)."""
        if not self.layers:
            return
        device = self.layers[0].threshold.device
        acc = self._acc if self._acc is not None else torch.zeros(len(self.layers), 4, dtype=torch.float64,
                                                                   device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        selected, valid = acc[:, 0], acc[:, 1]
        if self.cfg.budget_control == "threshold":
            # sign(F - rho) = sign(selected - rho * valid); 0 when nothing valid was seen.
            delta = self.cfg.gamma * torch.sign(selected - self.cfg.rho * valid) * (valid > 0)
            for layer, d in zip(self.layers, delta):
                layer.threshold.add_(d.to(layer.threshold.dtype))
        else:
            for layer in self.layers:
                layer.threshold.copy_((layer.threshold + self.cfg.gamma).clamp_max(0.5))
        self._last, self._acc = acc, None

    def thresholds(self) -> torch.Tensor:
        """(L,) fp32 current thresholds."""
        return torch.cat([layer.threshold.detach().float().reshape(1) for layer in self.layers])

    def metrics(self) -> dict[str, float]:
        """Per-layer realized ratio, threshold, gate mean/std of the last step (one host sync)."""
        if not self.layers or self._last is None:
            return {}
        sel, valid, psum, psq = self._last.cpu().unbind(1)
        n = valid.clamp_min(1)
        ratio, mean = sel / n, psum / n
        std = (psq / n - mean ** 2).clamp_min(0).sqrt()
        th = self.thresholds().cpu()
        out: dict[str, float] = {}
        for j, i in enumerate(self.layer_ids):
            out[f"logo/ratio/layer_{i}"] = float(ratio[j])
            out[f"logo/threshold/layer_{i}"] = float(th[j])
            out[f"logo/gate_mean/layer_{i}"] = float(mean[j])
            out[f"logo/gate_std/layer_{i}"] = float(std[j])
        out["logo/ratio_mean"] = float(ratio.mean())
        return out
