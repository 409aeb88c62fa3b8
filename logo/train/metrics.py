"""Metrics sinks (rank 0 only): console line, <run_dir>/metrics.jsonl (always), W&B and TensorBoard (optional),
and a layers x steps heatmap of the realized global ratio."""
from __future__ import annotations

import json
import logging
import re
import secrets
import string
from pathlib import Path
from typing import Optional

from logo.run.config import LoggingConfig
from logo.run.wandb import wandb_logged_in

log = logging.getLogger("logo")
RATIO_KEY = re.compile(r"^logo/ratio/layer_(\d+)$")
WINDOW_KEY = re.compile(r"^logo/ratio_window/layer_(\d+)$")


def new_wandb_id() -> str:
    """A fresh W&B run id (8 characters of [a-z0-9], W&B's own format; not every wandb release exports its
    generator). Stored with the checkpoint, so a resumed run continues the same W&B run."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def console_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step:>6}/{steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}",
             f"{m['tokens_per_s'] / 1e3:8.1f}k tok/s"]
    if "eval/loss" in m:
        parts.insert(2, f"eval {m['eval/loss']:.4f} (ppl {m['eval/ppl']:.2f})")
    if "step_time_s" in m:  # mean [min-max] step time of the logging interval
        parts.append(f"{m['step_time_s']:.3f}s [{m['step_time_min_s']:.3f}-{m['step_time_max_s']:.3f}]")
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if "memory_gib" in m:
        parts.append(f"mem {m['memory_gib']:.1f}GiB")
    if "logo/ratio_mean" in m:
        win = f" (window {m['logo/ratio_window_mean']:.3f})" if "logo/ratio_window_mean" in m else ""
        parts.append(f"ratio {m['logo/ratio_mean']:.3f}{win}")
        th = [v for k, v in m.items() if k.startswith("logo/threshold/")]
        parts.append(f"b {sum(th) / len(th):+.4f}")
    return " | ".join(parts)


class BudgetWatch:
    """Warns (one console line, at most once every `every` steps) when a LoGo layer's windowed realized ratio
    is further than `tolerance` from rho, once the P-mask ramp is over and the window holds only later steps."""

    def __init__(self, rho: float, tolerance: float, pmask_steps: int, window: int, every: Optional[int] = None,
                 hint: str = ""):
        self.rho, self.tolerance, self.window, self.hint = rho, tolerance, window, hint
        self.start = pmask_steps + window
        self.every = every if every is not None else 10 * window
        self.next_step = 0

    def check(self, step: int, m: dict) -> Optional[str]:
        """The warning line logged at this step, or None."""
        if self.tolerance <= 0 or step < self.start or step < self.next_step:
            return None
        off = {int(WINDOW_KEY.match(k).group(1)): v for k, v in m.items()
               if WINDOW_KEY.match(k) and abs(v - self.rho) > self.tolerance}
        if not off:
            return None
        self.next_step = step + self.every
        worst = max(off, key=lambda i: abs(off[i] - self.rho))
        others = "" if len(off) == 1 else " (also " + ", ".join(
            f"layer {i}: {v:.3f}" for i, v in sorted(off.items()) if i != worst) + ")"
        line = (f"LoGo budget: layer {worst} realized global ratio {off[worst]:.3f} over the last {self.window} "
                f"steps, rho={self.rho:g} (tolerance {self.tolerance:g}){others}{self.hint}")
        log.warning(line)
        return line


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, run_name: str, config: dict, resume_step: int = 0,
                 wandb_id: Optional[str] = None):
        self.run_dir, self.cfg = Path(run_dir), cfg
        self.path = self.run_dir / "metrics.jsonl"
        self.ratio_history: list[tuple[int, dict]] = []
        self._truncate_after(resume_step)  # a resumed run rewrites the steps logged after its checkpoint
        self.wandb_run = None
        self.wandb_id = wandb_id
        if cfg.wandb:
            import wandb
            mode = cfg.wandb_mode if cfg.wandb_mode != "auto" else ("online" if wandb_logged_in() else "offline")
            self.wandb_id = wandb_id or new_wandb_id()
            self.wandb_run = wandb.init(project=cfg.wandb_project, name=run_name, id=self.wandb_id, resume="allow",
                                        dir=str(self.run_dir), mode=mode, config=config)
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _truncate_after(self, step: int):
        if not self.path.exists():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))
        for ln in keep:
            rec = json.loads(ln)
            self._remember_ratios(rec["step"], rec)

    def _remember_ratios(self, step: int, m: dict):
        ratios = {int(RATIO_KEY.match(k).group(1)): v for k, v in m.items() if RATIO_KEY.match(k)}
        if ratios:
            self.ratio_history.append((step, ratios))

    def log(self, step: int, metrics: dict, heatmap: bool = False) -> None:
        """Append one record; with `heatmap`, also redraw the ratio heatmap and send it with the same step."""
        rec = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self._remember_ratios(step, metrics)
        extra = {}
        if heatmap and self.heatmap(step) is not None and self.wandb_run is not None:
            import wandb
            extra["logo/ratio_heatmap"] = wandb.Image(str(self.run_dir / "ratio_heatmap.png"))
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, **extra}, step=step)  # one call per step: W&B drops repeated steps
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def heatmap(self, step: int) -> Optional[Path]:
        """Write <run_dir>/ratio_heatmap.png (layers x steps so far) and add it to TensorBoard."""
        if not self.ratio_history:
            return None
        path = self.run_dir / "ratio_heatmap.png"
        fig = ratio_heatmap_figure(self.ratio_history)
        fig.savefig(path, dpi=110)
        if self.tb is not None:
            self.tb.add_figure("logo/ratio_heatmap", fig, step)
        import matplotlib.pyplot as plt
        plt.close(fig)
        return path

    def close(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tb is not None:
            self.tb.close()


def ratio_heatmap_figure(history: list[tuple[int, dict]]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    layers = sorted({i for _, r in history for i in r})
    grid = np.array([[r.get(i, np.nan) for _, r in history] for i in layers])  # (L, steps)
    steps = [s for s, _ in history]
    lo, hi = (steps[0], steps[-1]) if len(steps) > 1 else (steps[0] - 0.5, steps[0] + 0.5)
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(layers) + 1.5))
    im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                   extent=(lo, hi, -0.5, len(layers) - 0.5))
    ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set(xlabel="step", ylabel="layer", title="realized global ratio per layer")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    return fig
