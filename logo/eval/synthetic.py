"""Held-out accuracy on the long-range synthetic tasks (`data/synthetic.py`), teacher-forced.

Each held-out episode (`heldout_stream(seed)`: the same episodes for every run, none of them a training episode)
is one row of the model's input, read once; an answer counts when the greedy argmax of the next-token logits over
the real vocabulary is its token at every one of its positions (a needle's whole value, the whole pasted span).
`accuracy` is the fraction of answers right, `token_accuracy` the fraction of answer tokens right.

Span allocation (models with LoGo layers only): the routing of every LoGo layer in the same forwards
(`routing_recorded`), summarized by `allocation_stats` twice: `span.far` over the positions that predict an answer
token (answer token j is predicted at position j - 1, the episode's `far_targets` - 1: the predictions that need
context beyond the windows) and `span.all` over every position of the episodes. `layer_ratio` is then, per LoGo
layer (`span.layer_ids`), the fraction of those positions routed to the global branch.

The task's parameters come from the run: its mixture's source of that task (`resolve_task`), else the task's
defaults (`SourceConfig`), resolved against the run's stage.seq_len, attention.window and model.n_layers.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from data.synthetic import TASKS, EpisodeBatch, ParamError, SyntheticParams, SyntheticTask, heldout_stream
from logo.analysis.span_allocation import allocation_stats, routing_recorded
from logo.eval.load import EvalError
from logo.eval.progress import Progress
from logo.eval.scoring import hidden_states, token_logprobs
from logo.run.config import Config, SourceConfig, synthetic_params
from logo.run.load import Loaded


def resolve_task(cfg: Config, task: Optional[str] = None, source: Optional[str] = None,
                 length: Optional[int] = None) -> tuple[str, SyntheticParams]:
    """(label, episode shape) to score: the run's synthetic source `source`, or its one source of `task`, or `task`
    with the default parameters; `length` (tokens per episode) replaces the source's. The label names the results
    (eval/synthetic_<label>.json): the task, or the source's name when the run has several sources of that task."""
    mixed = [s for s in cfg.data.sources if s.kind == "synthetic"] if cfg.data.kind == "mix" else []
    if source is not None:
        found = [s for s in mixed if s.name == source]
        if not found:
            raise EvalError(f"the run has no synthetic source {source!r} (its synthetic sources: "
                            f"{', '.join(s.name for s in mixed) or 'none'}); name one, or pass --task")
        chosen = found[0]
        if task is not None and task != chosen.task:
            raise EvalError(f"source {source!r} is of task {chosen.task!r}, not {task!r}")
    elif task is not None:
        if task not in TASKS:
            raise EvalError(f"unknown synthetic task {task!r}; choose one of {list(TASKS)}")
        found = [s for s in mixed if s.task == task]
        chosen = found[0] if found else SourceConfig(name=task, kind="synthetic", task=task)
    else:
        raise EvalError("name a synthetic task (--task) or a synthetic source of the run (--source)")
    label = chosen.task if sum(s.task == chosen.task for s in mixed) <= 1 else chosen.name
    m = cfg.model
    params = synthetic_params(chosen, cfg.stage.seq_len, m.attention.window, m.n_layers)
    if length is not None:
        params = replace(params, length=length)
    return label, params


def score_episodes(model, batch: EpisodeBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(answers right (B, A) bool, answer tokens right (B, A, answer_len) bool) of the model on the episodes,
    each one row, teacher-forced. Runs under the caller's autocast and inference mode."""
    tokens = torch.from_numpy(batch.tokens).to(device)  # (B, L)
    B, L = tokens.shape
    targets = batch.answer_starts[:, :, None] + np.arange(batch.answer_len)  # (B, A, len) token indices
    # each answer token is predicted at the position before it, in the flattened (B*L) rows
    before = torch.from_numpy((np.arange(B)[:, None, None] * L + targets - 1).reshape(-1)).to(device)  # (n,)
    h = hidden_states(model, tokens).flatten(0, 1)[before]  # (n, d)
    _, hits = token_logprobs(model, h, tokens.flatten()[before + 1], greedy=True)
    hits = hits.view(*targets.shape).cpu()  # (B, A, len)
    return hits.all(dim=2), hits


def far_positions(batch: EpisodeBatch) -> torch.Tensor:
    """(B, L) bool: the input positions whose prediction is an answer token (far_targets - 1)."""
    B, L = batch.tokens.shape
    targets = batch.answer_starts[:, :, None] + np.arange(batch.answer_len)  # (B, A, len)
    far = torch.zeros(B, L, dtype=torch.bool)
    far[torch.arange(B)[:, None], torch.from_numpy(targets.reshape(B, -1) - 1)] = True
    return far


def span_stats(z: torch.Tensor, far: torch.Tensor, layer_ids: list[int]) -> dict:
    """z (L_logo, B, T) routing, far (B, T) -> {"layer_ids", "far": allocation_stats at the far positions, "all":
    allocation_stats over every position}."""
    return {"layer_ids": list(layer_ids), "far": allocation_stats(z, far), "all": allocation_stats(z)}


@torch.inference_mode()
def synthetic_accuracy(loaded: Loaded, params: SyntheticParams, episodes: int = 256, batch_size: int = 8,
                       seed: int = 0, progress: Optional[Progress] = None, label: Optional[str] = None) -> dict:
    """Teacher-forced exact-match accuracy of the loaded model on `episodes` held-out episodes of `params`
    (`heldout_stream(seed)`, episodes 0..N-1), `batch_size` episodes per forward. Results dict: task, label, params,
    seed, episodes, answers, accuracy, token_accuracy, fingerprint, and span (only for models with LoGo layers)."""
    if episodes < 1 or batch_size < 1:
        raise EvalError(f"--episodes and --batch-size must be >= 1 (got {episodes}, {batch_size})")
    if params.length > loaded.seq_len:
        raise EvalError(f"synthetic episodes of {params.length} tokens are longer than the model's context of "
                        f"{loaded.seq_len} tokens (stage.seq_len it was trained at); pass --length <= {loaded.seq_len}")
    try:
        task = SyntheticTask(params, loaded.cfg.data.tokenizer)
    except ParamError as e:
        raise EvalError(f"synthetic task {params.task}: {e}") from None
    if task.vocab.max_id >= loaded.model.cfg.vocab_size:
        raise EvalError(f"the model's vocabulary ({loaded.model.cfg.vocab_size} ids) does not hold the synthetic "
                        f"tokens (up to id {task.vocab.max_id}) of the tokenizer {loaded.cfg.data.tokenizer!r}")
    stream, progress = heldout_stream(seed), progress or Progress(enabled=False)
    layer_ids = loaded.model.logo_layer_ids
    right, token_right, routing, far = [], [], [], []
    with progress.bar(episodes, f"synthetic [{params.task}]", unit="episode"):
        for start in range(0, episodes, batch_size):
            batch = task.episodes(range(start, min(start + batch_size, episodes)), stream)
            sink: list[torch.Tensor] = []
            with loaded.autocast(), routing_recorded(loaded.model, sink):
                answers, tokens = score_episodes(loaded.model, batch, loaded.device)
            right.append(answers)
            token_right.append(tokens)
            if layer_ids:
                routing.append(torch.stack(sink))  # (L_logo, B, T)
                far.append(far_positions(batch))
            progress.update(batch.tokens.shape[0], tokens=batch.tokens.size)
    right_all, tokens_all = torch.cat(right), torch.cat(token_right)
    res = {"task": params.task, "label": label or params.task, "params": params.relevant(), "seed": seed,
           "episodes": episodes, "answers": int(right_all.numel()), "accuracy": float(right_all.float().mean()),
           "token_accuracy": float(tokens_all.float().mean()), "fingerprint": task.fingerprint}
    if layer_ids:
        res["span"] = span_stats(torch.cat(routing, dim=1), torch.cat(far), layer_ids)
    return res


def synthetic_metrics(res: dict) -> dict:
    """eval/synthetic/<label>/accuracy and .../token_accuracy; with span allocation also .../far_global_ratio and
    .../global_ratio (the mean over LoGo layers at the far positions and at every position)."""
    key = f"eval/synthetic/{res['label']}"
    out = {f"{key}/accuracy": res["accuracy"], f"{key}/token_accuracy": res["token_accuracy"]}
    if "span" in res:
        out.update({f"{key}/far_global_ratio": res["span"]["far"]["mean_ratio"],
                    f"{key}/global_ratio": res["span"]["all"]["mean_ratio"]})
    return out
