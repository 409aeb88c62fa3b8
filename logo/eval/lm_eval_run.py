"""Run lm-evaluation-harness tasks on a loaded checkpoint; results as lm-eval reports them."""
from __future__ import annotations

import math
from typing import Optional

from logo.eval.load import EvalError
from logo.run.load import Loaded


def run_lm_eval(loaded: Loaded, tasks: list[str], include_path: Optional[str] = None,
                num_fewshot: Optional[int] = None, limit: Optional[float] = None, batch_size: int = 8,
                max_length: Optional[int] = None, max_gen_toks: int = 256, progress=None) -> dict:
    """{task: {metric: value}} (numeric metrics as lm-eval names them, e.g. "acc,none"). `progress` (a
    `logo.eval.progress.Progress`): the bars of the model's request loops and their token count."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from logo.eval.lm_eval_adapter import LogoLM
    tasks = [t.strip() for t in tasks if t.strip()]
    tm = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if not tasks or unknown:
        raise EvalError(f"unknown lm-eval task(s) {unknown or tasks}; list them with `lm_eval ls tasks`"
                        f"{' --include_path ' + include_path if include_path else ''}")
    lm = LogoLM(loaded=loaded, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks,
                progress=progress)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=tm,
                                  log_samples=False, bootstrap_iters=0)
    return {task: {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            for task, metrics in out["results"].items()}


def lm_eval_metrics(res: dict) -> dict:
    """eval/lm_eval/<task>/<metric> (lm-eval's ",none" filter suffix dropped)."""
    return {f"eval/lm_eval/{t}/{k.removesuffix(',none')}": v for t, m in res.items() for k, v in m.items()}
