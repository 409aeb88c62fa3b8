"""Needle-style RULER tasks (Hsieh et al. 2024) built offline: the paper's long-range recall evaluation.

Eight tasks, as in the paper's Tables 10-11: three single-needle (S-NIAH-1/2/3), three multi-key (MK-NIAH-1/2/3),
multi-query (MQ-NIAH) and multi-value (MV-NIAH). A needle reads
"One of the special magic {numbers|uuids} for {key} is: {value}." and the prompt ends with the question and an
answer prefix; the model's greedy continuation scores the fraction of expected values it contains (x100).

Haystacks: S-NIAH-1 repeats a fixed noise passage; the "essay" haystacks use prose shipped with Python
(`pydoc_data.topics`), since no download is possible here; MK-NIAH-2/3 fill the context with distractor
needles. The haystack grows until the prompt reaches the requested token length (within one unit).
"""
from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional
from logo.eval.generate import greedy_generate
from logo.eval.load import EvalError
from logo.eval.decode import generate
from logo.eval.progress import Progress

TASKS = ("s_niah_1", "s_niah_2", "s_niah_3", "mk_niah_1", "mk_niah_2", "mk_niah_3", "mq_niah", "mv_niah")
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lagoon", "meadow", "nebula", "obsidian", "prairie", "quartz", "raven", "saffron", "tundra",
         "umber", "violet", "willow", "xenon", "yarrow", "zephyr")


@dataclass
class NeedleSample:
    task: str
    prompt: str
    answers: list[str]
    prompt_tokens: int


def _essay_units() -> list[str]:
    from pydoc_data.topics import topics
    paras = [p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if len(p.strip()) > 80]
    return [" ".join(p.split()) + " " for p in paras]


def _key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(10, 99)}"


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128)))
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}. "


class NeedleTaskBuilder:
    """Builds prompts of a target token length with a tokenizer exposing encode(str) -> list[int]."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tok = tokenizer
        self.seed = seed
        self._essay = None

    def _units(self, task: str, rng: random.Random, kind: str) -> Callable[[int], str]:
        if task == "s_niah_1":
            return lambda i: NOISE
        if task in ("mk_niah_2", "mk_niah_3"):
            return lambda i: _needle(_key(rng), _value(rng, kind), kind)
        if self._essay is None:
            self._essay = _essay_units()
        start = rng.randrange(len(self._essay))
        return lambda i: self._essay[(start + i) % len(self._essay)]

    def sample(self, task: str, length: int, index: int) -> NeedleSample:
        if task not in TASKS:
            raise ValueError(f"unknown RULER task {task!r}; choose from {list(TASKS)}")
        rng = random.Random(f"{self.seed}-{task}-{length}-{index}")
        kind = "uuids" if task in ("s_niah_3", "mk_niah_3") else "numbers"
        n_needles = {"mk_niah_1": 4, "mq_niah": 4, "mv_niah": 4}.get(task, 1)
        keys = []
        while len(keys) < n_needles:
            k = _key(rng)
            if k not in keys:
                keys.append(k)
        if task == "mv_niah":  # one key, several values
            needles = [(keys[0], _value(rng, kind)) for _ in range(4)]
            queried, answers = [keys[0]], [v for _, v in needles]
        else:
            needles = [(k, _value(rng, kind)) for k in keys]
            queried = keys if task == "mq_niah" else [keys[0]]
            answers = [v for k, v in needles if k in queried]
        if len(queried) > 1:
            question = (f"What are all the special magic {kind} for {', '.join(queried[:-1])} and {queried[-1]} "
                        f"mentioned in the provided text?")
            prefix = f"The special magic {kind} for {', '.join(queried[:-1])} and {queried[-1]} mentioned in the provided text are"
        else:
            multi = "all the special magic" if task == "mv_niah" else "the special magic"
            question = f"What are {multi} {kind} for {queried[0]} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {queried[0]} mentioned in the provided text {'are' if task == 'mv_niah' else 'is'}"
        head = ("Some special magic " + kind + " are hidden within the following text. Make sure to memorize them. "
                "I will quiz you about the " + kind + " afterwards.\n")
        tail = f"\n{question} {prefix}"
        unit = self._units(task, rng, kind)
        budget = length - len(self.tok.encode(head + tail)) - sum(len(self.tok.encode(_needle(k, v, kind)))
                                                                  for k, v in needles)
        hay, used = [], 0
        while True:
            u = unit(len(hay))
            n = len(self.tok.encode(u))
            if used + n > budget:
                break
            hay.append(u)
            used += n
        depths = sorted(rng.randint(0, len(hay)) for _ in needles)  # uniform needle depths
        for offset, (d, (k, v)) in enumerate(zip(depths, needles)):
            hay.insert(d + offset, _needle(k, v, kind))
        prompt = head + "".join(hay) + tail
        return NeedleSample(task, prompt, answers, len(self.tok.encode(prompt)))


def score(output: str, answers: list[str]) -> float:
    """Fraction of expected values that appear in the output (RULER's string-match-all), in [0, 1]."""
    return sum(a in output for a in answers) / len(answers)


def evaluate(generate: Callable[[NeedleSample], str], builder: NeedleTaskBuilder, lengths: list[int],
             samples: int = 50, tasks: Optional[list[str]] = None) -> dict[str, float]:
    """Scores x100 per `ruler/{task}/{length}`, per-length averages `ruler/avg/{length}` and `ruler/avg`."""
    tasks = list(tasks or TASKS)
    out: dict[str, float] = {}
    for length in lengths:
        per_task = []
        for task in tasks:
            vals = [score(generate(s), s.answers) for s in (builder.sample(task, length, i) for i in range(samples))]
            out[f"ruler/{task}/{length}"] = 100.0 * sum(vals) / len(vals)
            per_task.append(out[f"ruler/{task}/{length}"])
        out[f"ruler/avg/{length}"] = sum(per_task) / len(per_task)
    out["ruler/avg"] = sum(out[f"ruler/avg/{n}"] for n in lengths) / len(lengths)
    return out


def model_generate_fn(model, tokenizer, max_new_tokens: int = 64, autocast_dtype=None):
    """A `generate` for `evaluate` that greedily decodes with a model, stopping at a newline or EOS."""
    stop = {tokenizer.eot_token, *tokenizer.encode("\n")}

    def run(sample: NeedleSample) -> str:
        ids = greedy_generate(model, tokenizer.encode(sample.prompt), max_new_tokens, stop_ids=stop,
                              autocast_dtype=autocast_dtype)
        return tokenizer.decode(ids)
    return run


def check_request(lengths: list[int], tasks: list[str], context: int) -> None:
    """One-line errors for an unknown task or a length the model cannot take (> its trained context)."""
    for t in tasks:
        if t not in TASKS:
            raise EvalError(f"unknown RULER task {t!r}; choose from {list(TASKS)}")
    for n in lengths:
        if n > context:
            raise EvalError(f"RULER length {n} is longer than the model's context of {context} tokens "
                             f"(stage.seq_len it was trained at); pass lengths <= {context} or --max-context N")
        if n < 1:
            raise EvalError(f"RULER length {n} must be a positive number of tokens")


def run_ruler(model, tokenizer, lengths: list[int], tasks: Optional[list[str]] = None, samples: int = 50,
              batch_size: int = 1, max_new_tokens: int = 64, seed: int = 0, autocast=None,
              progress=None) -> dict:
    """Scores x100 {"scores": {task: {length: s}}, "average": {length: s}} with KV-cache greedy decoding,
    `batch_size` prompts at a time (right-padded), stopping at a newline or end of text. `progress` (a
    `logo.eval.progress.Progress`): a bar over the prompts, counting prompt and generated tokens."""
    from contextlib import nullcontext

    tasks = list(tasks or TASKS)
    builder = NeedleTaskBuilder(tokenizer, seed=seed)
    stop = {tokenizer.eot_token, *tokenizer.encode("\n")}
    items = {(n, t): [builder.sample(t, n, i) for i in range(samples)] for n in lengths for t in tasks}
    for (n, t), batch in items.items():  # every request checked before any decoding
        short = [s for s in batch if s.prompt_tokens > n]
        if short:
            raise EvalError(f"RULER length {n} is too short for task {t!r}: its prompt needs "
                            f"{short[0].prompt_tokens} tokens without any haystack")
    progress = progress or Progress(enabled=False)
    scores: dict[str, dict[str, float]] = {t: {} for t in tasks}
    with progress.bar(sum(map(len, items.values())), "ruler", unit="prompt"):
        for (n, t), todo in items.items():
            vals = []
            for i in range(0, len(todo), batch_size):
                batch = todo[i:i + batch_size]
                prompts = [tokenizer.encode(s.prompt) for s in batch]
                with autocast or nullcontext():
                    out = generate(model, prompts, max_new_tokens, stop)
                vals += [score(tokenizer.decode(ids), s.answers) for ids, s in zip(out.tokens, batch)]
                progress.update(len(batch), tokens=sum(map(len, prompts)) + sum(map(len, out.tokens)))
            scores[t][str(n)] = 100.0 * sum(vals) / len(vals)
    average = {str(n): sum(scores[t][str(n)] for t in tasks) / len(tasks) for n in lengths}
    return {"scores": scores, "average": average}


def ruler_metrics(res: dict) -> dict:
    """eval/ruler/<task>/<length> and eval/ruler/avg/<length>."""
    m = {f"eval/ruler/{t}/{n}": v for t, per in res["scores"].items() for n, v in per.items()}
    m.update({f"eval/ruler/avg/{n}": v for n, v in res["average"].items()})
    return m
