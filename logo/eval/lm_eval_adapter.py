"""A logo checkpoint as an lm-evaluation-harness model, registered as `logo`.

    python -m logo.eval lm_eval RUN_DIR --tasks hellaswag,piqa            # results -> RUN_DIR/eval/lm_eval.json
    python -m logo.eval.lm_eval_cli --model logo --model_args checkpoint=RUN_DIR --tasks hellaswag --device cuda
        # = the `lm_eval` command itself (every flag), with the `logo` model registered

lm-eval 0.4.13 finds models only in its own registry (no entry points; `--include_path` adds tasks, not
models), so the bare `lm_eval` command cannot see `logo`: importing this module registers it.

model_args: checkpoint (run directory or checkpoints/step_N, required), device, dtype (auto|fp32|bf16),
batch_size, max_length (default: the trained context, stage.seq_len), max_gen_toks (default 256), progress
(true|false; default: a bar on stderr only when it is a terminal); from Python, `loaded` (a
`logo.run.load.Loaded`) instead of checkpoint, and `progress` may be a `logo.eval.progress.Progress`.
The bars count requests and show the tokens/s of the tokens scored or read and generated.
Log-probabilities are softmax over the model's padded vocabulary (the training loss's distribution); greedy
checks and generation use the real vocabulary. generate_until decodes with static KV caches (`logo.eval.decode`), greedy or sampled.
"""
from __future__ import annotations

from typing import Optional

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from logo.eval.decode import generate
from logo.eval.load import EvalError
from logo.run.load import load_model
from logo.eval.progress import Progress
from logo.eval.scoring import hidden_states, token_logprobs
from data.tokenizer import load_tokenizer


@register_model("logo")
class LogoLM(TemplateLM):
    def __init__(self, checkpoint: Optional[str] = None, device: Optional[str] = None, dtype: str = "auto",
                 batch_size=1, max_length: Optional[int] = None, max_gen_toks: int = 256, loaded=None,
                 progress=None, **_ignored):
        super().__init__()
        if not checkpoint and loaded is None:
            raise EvalError("the logo model needs --model_args checkpoint=<run dir or checkpoint folder>")
        self.loaded = loaded or load_model(checkpoint, device, dtype)
        self.model = self.loaded.model
        self._device = self.loaded.device
        self.tok = load_tokenizer(self.loaded.cfg.data.tokenizer)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self._max_length = int(max_length or self.loaded.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress if isinstance(progress, Progress) else Progress(_flag(progress))

    # --- tokenizer ---------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_token

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode_ordinary(string)  # as the corpus was prepared: no special tokens in text

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(list(tokens))

    # --- scoring -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """rows: (tokens, n) -> (sum of log p of the last n tokens given the rest, all of them argmax)."""
        dev = self.loaded.device
        T = max(len(t) for t, _ in rows) - 1
        inp = torch.zeros(len(rows), T, dtype=torch.long)
        tgt = torch.full((len(rows), T), -100, dtype=torch.long)
        valid = torch.zeros(len(rows), T, dtype=torch.bool)
        for b, (toks, n) in enumerate(rows):
            L = len(toks) - 1
            inp[b, :L] = torch.tensor(toks[:-1])
            tgt[b, L - n:L] = torch.tensor(toks[L - n + 1:])
            valid[b, :L] = True
        keep = (tgt != -100).flatten().nonzero().squeeze(1)  # on the host: no device read
        with self.loaded.autocast():
            h = hidden_states(self.model, inp.to(dev), valid=valid.to(dev))
            logp, greedy = token_logprobs(self.model, h.flatten(0, 1)[keep.to(dev)], tgt.flatten()[keep].to(dev))
        logp, greedy = logp.double().cpu(), greedy.cpu()
        out, i = [], 0
        for _, n in rows:
            out.append((float(logp[i:i + n].sum()), bool(greedy[i:i + n].all())))
            i += n
        return out

    def _rows(self, requests) -> list[tuple[list[int], int]]:
        """(tokens, n) per ((context, continuation), context_enc, continuation_enc): the whole sequence cut from
        the left to max_length + 1 tokens, its last n tokens scored."""
        rows = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            rows.append((whole, min(len(cont), len(whole) - 1)))
        return rows

    def _score_by_length(self, rows, advance: bool) -> list[tuple[float, bool]]:
        """`_score` over batches of rows of similar lengths, counting their tokens; advance: each row is one
        unit of the current bar."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        res: list = [None] * len(rows)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, r in zip(idx, self._score([rows[i] for i in idx])):
                res[i] = r
            self.progress.update(len(idx) if advance else 0, tokens=sum(len(rows[i][0]) - 1 for i in idx))
        return res

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_enc, continuation_enc); the whole sequence is cut from
        the left to max_length + 1 tokens."""
        with self.progress.bar(len(requests), "loglikelihood", unit="req", hidden=disable_tqdm):
            res = self._score_by_length(self._rows(requests), advance=True)
        for req, r in zip(requests, res):
            if req[0] is not None:  # rolling windows carry no strings
                self.cache_hook.add_partial("loglikelihood", req[0], r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings in disjoint windows of max_length tokens (one token of context)."""
        out = []
        with self.progress.bar(len(requests), "loglikelihood_rolling", unit="req", hidden=disable_tqdm):
            for (string,) in (r.args for r in requests):
                windows = [(None, *lm_utils.make_disjoint_window(w)) for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                total = sum(ll for ll, _ in self._score_by_length(self._rows(windows), advance=False))
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
                out.append(total)
                self.progress.update(1)
        return out

    # --- generation --------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until one of its `until` strings (cut there) or max_gen_toks: greedy, or sampled
        when a request sets do_sample with a temperature > 0 (top_p honoured). Rows of one batch share their
        sampling settings."""
        reqs = []
        for context, kw in (r.args for r in requests):
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kw.get("temperature", 1.0)) if kw.get("do_sample") else 0.0
            top_p = float(kw.get("top_p", 1.0) or 1.0)
            if temperature < 0 or not 0 < top_p <= 1:
                raise EvalError(f"generate_until: temperature={temperature} / top_p={top_p} are out of range "
                                "(temperature >= 0, 0 < top_p <= 1)")
            n = int(kw.get("max_gen_toks", self.max_gen_toks))
            ctx = self.tok_encode(context)[-max(1, self.max_length - n):]
            reqs.append((ctx or [self.eot_token_id], until, n, (temperature, top_p)))
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i][3], -len(reqs[i][0])))
        res: list = [None] * len(reqs)
        with self.progress.bar(len(reqs), "generate_until", unit="req", hidden=disable_tqdm):
            s = 0
            while s < len(order):
                idx = [i for i in order[s:s + self.batch_size] if reqs[i][3] == reqs[order[s]][3]]
                for i, text in zip(idx, self._generate([reqs[i] for i in idx])):
                    res[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                s += len(idx)
        return res

    def _generate(self, batch: list[tuple[list[int], list[str], int, tuple[float, float]]]) -> list[str]:
        """(context ids, until strings, max new tokens, (temperature, top_p)) per row -> each row's text, cut at
        its first `until`."""
        stops = [until for _, until, _, _ in batch]
        temperature, top_p = batch[0][3]

        def hit(b, toks):
            text = self.tok_decode(toks)
            return any(u in text for u in stops[b])
        with self.loaded.autocast():
            gen = generate(self.model, [ctx for ctx, _, _, _ in batch], max(n for _, _, n, _ in batch),
                           {self.eot_token_id}, stop_fn=hit, temperature=temperature, top_p=top_p)
        texts = []
        for (_, until, n, _), new in zip(batch, gen.tokens):
            text = self.tok_decode(new[:n])
            for u in until:
                text = text.split(u)[0] if u else text
            texts.append(text)
        self.progress.update(len(batch), tokens=sum(len(ctx) for ctx, *_ in batch) + sum(map(len, gen.tokens)))
        return texts


def _flag(value) -> Optional[bool]:
    """A model_args switch: true/false (lm-eval passes bools or strings), None when not given."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise EvalError(f"invalid model_args progress={value!r}: use true or false")
