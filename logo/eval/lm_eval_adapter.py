"""A logo checkpoint as an lm-evaluation-harness model, registered as `logo`.

    python -m logo.eval lm_eval RUN_DIR --tasks hellaswag,piqa            # results -> RUN_DIR/eval/lm_eval.json
    python -m logo.eval.lm_eval_cli --model logo --model_args checkpoint=RUN_DIR --tasks hellaswag --device cuda
        # = the `lm_eval` command itself (every flag), with the `logo` model registered

lm-eval 0.4.13 finds models only in its own registry (no entry points; `--include_path` adds tasks, not
models), so the bare `lm_eval` command cannot see `logo`: importing this module registers it.

model_args: checkpoint (run directory or checkpoints/step_N, required), device, dtype (auto|fp32|bf16),
batch_size, max_length (default: the trained context, stage.seq_len), max_gen_toks (default 256); `loaded`
(a `logo.eval.load.Loaded`) instead of checkpoint from Python.
Log-probabilities are softmax over the model's padded vocabulary (the training loss's distribution); greedy
checks and generation use the real vocabulary. generate_until is greedy with KV caches (`logo.eval.decode`).
"""
from __future__ import annotations

from typing import Optional

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from logo.eval.load import EvalError, load_model
from logo.eval.scoring import hidden_states, token_logprobs


@register_model("logo")
class LogoLM(TemplateLM):
    def __init__(self, checkpoint: Optional[str] = None, device: Optional[str] = None, dtype: str = "auto",
                 batch_size=1, max_length: Optional[int] = None, max_gen_toks: int = 256, loaded=None,
                 **_ignored):
        super().__init__()
        if not checkpoint and loaded is None:
            raise EvalError("the logo model needs --model_args checkpoint=<run dir or checkpoint folder>")
        from data.tokenizer import load_tokenizer
        self.loaded = loaded or load_model(checkpoint, device, dtype)
        self.model = self.loaded.model
        self._device = self.loaded.device
        self.tok = load_tokenizer(self.loaded.cfg.data.tokenizer)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self._max_length = int(max_length or self.loaded.seq_len)
        self.max_gen_toks = int(max_gen_toks)

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
        with self.loaded.autocast():
            h = hidden_states(self.model, inp.to(dev), valid=valid.to(dev))
            keep = (tgt != -100).flatten().to(dev)
            logp, greedy = token_logprobs(self.model, h.flatten(0, 1)[keep], tgt.flatten().to(dev)[keep])
        out, i = [], 0
        for _, n in rows:
            out.append((float(logp[i:i + n].double().sum()), bool(greedy[i:i + n].all())))
            i += n
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context_enc, continuation_enc); the whole sequence is cut from
        the left to max_length + 1 tokens."""
        rows = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            rows.append((whole, min(len(cont), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths batched together
        res: list = [None] * len(rows)
        for s in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="loglikelihood"):
            idx = order[s:s + self.batch_size]
            for i, r in zip(idx, self._score([rows[i] for i in idx])):
                res[i] = r
                if requests[i][0] is not None:  # rolling windows carry no strings
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings in disjoint windows of max_length tokens (one token of context)."""
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="loglikelihood_rolling"):
            windows = [(None, *lm_utils.make_disjoint_window(w)) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # --- generation --------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until one of its `until` strings (cut there) or max_gen_toks."""
        from logo.eval.decode import generate
        reqs = []
        for context, kw in (r.args for r in requests):
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if kw.get("do_sample") and float(kw.get("temperature", 1.0)) > 0:
                raise EvalError("the logo model decodes greedily; set do_sample=false (or temperature=0)")
            n = int(kw.get("max_gen_toks", self.max_gen_toks))
            ctx = self.tok_encode(context)[-max(1, self.max_length - n):]
            reqs.append((ctx or [self.eot_token_id], until, n))
        order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i][0]))
        res: list = [None] * len(reqs)
        for s in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="generate_until"):
            idx = order[s:s + self.batch_size]
            stops = [reqs[i][1] for i in idx]

            def hit(b, toks, stops=stops):
                text = self.tok_decode(toks)
                return any(u in text for u in stops[b])
            with self.loaded.autocast():
                gen = generate(self.model, [reqs[i][0] for i in idx], max(reqs[i][2] for i in idx),
                               {self.eot_token_id}, stop_fn=hit)
            for b, i in enumerate(idx):
                text = self.tok_decode(gen.tokens[b][:reqs[i][2]])
                for u in reqs[i][1]:
                    text = text.split(u)[0] if u else text
                res[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return res

