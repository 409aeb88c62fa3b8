"""Span allocation in `python -m logo.eval synthetic`: per LoGo layer, the global ratio at the positions that predict
an answer token against every position, equal to the routing recorded in a separate forward; absent for models
without LoGo layers."""
import pytest
import torch

from conftest import TINY_RUN
from data.synthetic import SyntheticTask, heldout_stream
from logo.analysis.span_allocation import record_routing
from logo.eval.synthetic import resolve_task, synthetic_accuracy, synthetic_metrics
from logo.model import Transformer
from logo.run.config import compose
from logo.run.load import Loaded

SOURCES = "data.sources=[{name:text,kind:default},{name:recall,kind:synthetic,task:associative_recall,gap:0.5,pairs:4,queries:2}]"


def _loaded(tmp_path, attention: str) -> Loaded:
    cfg, _, _ = compose([*TINY_RUN, f"attention={attention}", "data=mix", SOURCES])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights()
    with torch.no_grad():
        for layer in model.logo_layers():  # a gate that routes some tokens each way
            layer.gate.weight.normal_(0, 0.3)
    model.eval()
    return Loaded(model, cfg, tmp_path, tmp_path, 0, torch.device("cpu"), "fp32")


def test_span_fields_equal_the_recorded_routing(tmp_path):
    loaded = _loaded(tmp_path, "logo")
    label, params = resolve_task(loaded.cfg, "associative_recall")
    res = synthetic_accuracy(loaded, params, episodes=3, batch_size=2, label=label)
    span = res["span"]
    ids = loaded.model.logo_layer_ids
    assert span["layer_ids"] == ids
    batch = SyntheticTask(params).episodes(range(3), heldout_stream(0))
    z = record_routing(loaded.model, torch.from_numpy(batch.tokens))  # (L, B, T): its own forward
    B, T = batch.tokens.shape
    far = [(b, int(s) + k - 1) for b in range(B) for s in batch.answer_starts[b] for k in range(batch.answer_len)]
    assert span["far"]["tokens"] == len(far) == 3 * 2 and span["all"]["tokens"] == B * T
    for i in range(len(ids)):
        at_far = sum(bool(z[i, b, t]) for b, t in far) / len(far)
        assert span["far"]["layer_ratio"][i] == pytest.approx(at_far, abs=1e-12)
        assert span["all"]["layer_ratio"][i] == pytest.approx(z[i].float().mean().item(), abs=1e-6)
    assert all(0.0 <= r <= 1.0 for r in span["far"]["layer_ratio"] + span["all"]["layer_ratio"])
    assert 0.0 < span["all"]["mean_ratio"] < 1.0  # the gate routes some tokens each way: the test can fail
    m = synthetic_metrics(res)
    assert m["eval/synthetic/associative_recall/far_global_ratio"] == span["far"]["mean_ratio"]


def test_no_span_fields_without_logo_layers(tmp_path):
    loaded = _loaded(tmp_path, "full")
    label, params = resolve_task(loaded.cfg, "associative_recall")
    res = synthetic_accuracy(loaded, params, episodes=2, batch_size=2, label=label)
    assert "span" not in res and 0.0 <= res["accuracy"] <= 1.0
    assert not any("global_ratio" in k for k in synthetic_metrics(res))


def test_commands_run_in_one_process_share_the_loaded_model(tmp_path, monkeypatch):
    """`python -m logo.eval`'s main with a `models` dict (as launch.study_eval calls it): the first command loads
    the checkpoint, the next ones with the same checkpoint, device and dtype reuse it; without the dict every
    command loads its own."""
    import logo.eval.__main__ as ev
    loads = []

    def load(path, device=None, dtype="auto"):
        loads.append(path)
        return _loaded(tmp_path, "logo")

    monkeypatch.setattr(ev, "load_model", load)
    cmd = ["synthetic", str(tmp_path), "--source", "recall", "--episodes", "2", "--batch-size", "2", "--no-progress"]
    models = {}
    assert ev.main(cmd, models=models) == 0 and ev.main(cmd, models=models) == 0
    assert len(loads) == 1 and (tmp_path / "eval" / "synthetic_associative_recall.json").is_file()
    assert ev.main(cmd) == 0 and len(loads) == 2
