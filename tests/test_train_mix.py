"""train.py with data=mix (tiny model, the embedded corpus and the three synthetic tasks): tokens per source in
metrics.jsonl, the resolved mixture in plan.json and the checkpoint, a bit-exact resume; `python -m logo.eval
synthetic` on the run (its teacher-forced exact match checked against the model's own logits); one-line errors
for bad mixtures."""
import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import TINY_RUN, read_metrics, run_train, same_rows, scratch_dir
from data.format import DataError
from data.synthetic import heldout_stream
from logo.config import ConfigError
from logo.eval.__main__ import main as eval_main
from logo.run.config import compose
from test_data_fixtures import prepared_fixture  # noqa: F401 (the fixture `prepared`)

N = 4  # steps; checkpoints at 2 and 4
SOURCES = ("data.sources=["
           "{name:text,kind:default,weight:0.5},"
           "{name:recall,kind:synthetic,task:associative_recall,weight:0.2,gap:0.5,pairs:8,queries:4},"
           "{name:needles,kind:synthetic,task:needle_retrieval,weight:0.15,gap:0.5,needles:2,distractors:2,"
           "value_len:2},"
           "{name:copy,kind:synthetic,task:far_copy,weight:0.15,gap:0.5,span:4}]")
ARGS = [*TINY_RUN, "data=mix", SOURCES, f"train.steps={N}", "checkpoint.interval=2", "checkpoint.keep=10",
        "eval.interval=2", "checkpoint.async_mode=none"]
NAMES = ("text", "recall", "needles", "copy")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, default_corpus):
    with scratch_dir(tmp_path_factory, "mixed") as d:
        run_train(*ARGS, f"run.dir={d}")
        yield d


def test_metrics_plan_and_checkpoint_record_the_mixture(mixed):
    from logo.run.checkpoint import read_train_state
    rows = [r for r in read_metrics(mixed) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    for r in rows:
        per_source = [r[f"data/tokens/{n}"] for n in NAMES]
        assert sum(per_source) == r["tokens"] and all(v % 64 == 0 for v in per_source)  # whole rows of 64 tokens
    assert rows[-1]["data/tokens/text"] >= 2 * 64 * N - 64  # half the rows (floor or ceil of 2 a step)
    assert math.isfinite(rows[1]["eval/loss"])  # held-out loss on the text source's validation split
    plan = json.loads((mixed / "plan.json").read_text())
    got = {s["name"]: s for s in plan["data_sources"]}
    assert list(got) == list(NAMES) and sum(s["share"] for s in got.values()) == pytest.approx(1.0)
    assert all(len(s["fingerprint"]) >= 16 for s in got.values()) and got["text"]["kind"] == "default"
    assert got["recall"]["params"] == {"task": "associative_recall", "length": 64, "gap": 32, "pairs": 8, "queries": 4}
    state = read_train_state(mixed / "checkpoints" / "step_00000002")["data"]
    assert state["batches_consumed"] == 2 and [s["name"] for s in state["sources"]] == list(NAMES)
    assert [s["rows"] * 64 for s in state["sources"]] == [rows[1][f"data/tokens/{n}"] for n in NAMES]


def test_resume_is_exact(mixed, tmp_path):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(mixed / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    p = run_train(*ARGS, f"run.dir={resumed}")
    assert "resumed from" in p.stderr + p.stdout
    same_rows(read_metrics(mixed), read_metrics(resumed), range(3, N + 1))  # losses, data/tokens/*, eval/loss


@pytest.fixture(scope="module")
def loaded(mixed):
    from logo.run.load import load_model
    return load_model(mixed, device="cpu")


def _argmax(loaded, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L) the model's greedy next token at every position, over the real vocabulary."""
    with torch.no_grad():
        return loaded.model(tokens).logits[..., :loaded.model.cfg.vocab_size].argmax(-1)


@pytest.mark.parametrize("task", ["associative_recall", "far_copy"])
def test_exact_match_is_the_models_own_greedy_answer(loaded, task):
    """Episodes whose answers are replaced, token by token, by the model's own greedy prediction score 1; with the
    last answer token then changed, exactly the last answer is wrong; on the real episodes the token hits equal a
    direct comparison with the model's logits."""
    from logo.eval.synthetic import resolve_task, score_episodes
    from data.synthetic import SyntheticTask
    label, params = resolve_task(loaded.cfg, task)
    batch = SyntheticTask(params).episodes(range(3), heldout_stream(0))
    real = torch.from_numpy(batch.tokens)
    answers, hits = score_episodes(loaded.model, batch, torch.device("cpu"))
    targets = torch.from_numpy(batch.answer_starts[:, :, None] + np.arange(batch.answer_len))  # (B, A, len)
    greedy = _argmax(loaded, real)
    assert torch.equal(hits, greedy.gather(1, targets.flatten(1) - 1).view_as(targets) == real.gather(
        1, targets.flatten(1)).view_as(targets))
    assert torch.equal(answers, hits.all(2))
    planted = real.clone()
    for j in sorted(set(targets.flatten(1)[0].tolist())):  # in order: a planted token changes later predictions
        planted[:, j] = _argmax(loaded, planted)[:, j - 1]
    batch.tokens = planted.numpy()
    answers, hits = score_episodes(loaded.model, batch, torch.device("cpu"))
    assert answers.all() and hits.all()
    last = int(targets[0, -1, -1])
    batch.tokens[:, last] = np.where(batch.tokens[:, last] == 1000, 1001, 1000)
    answers, _ = score_episodes(loaded.model, batch, torch.device("cpu"))
    assert (~answers[:, -1]).all() and answers[:, :-1].all()


def test_eval_cli_writes_the_accuracy(mixed, capsys):
    assert eval_main(["synthetic", str(mixed), "--task", "needle_retrieval", "--episodes", "6", "--batch-size", "4",
                      "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rec = json.loads((mixed / "eval" / "synthetic_needle_retrieval.json").read_text())
    res = rec["results"]
    assert (rec["kind"], rec["step"], res["episodes"], res["answers"]) == ("synthetic", N, 6, 12)
    assert 0.0 <= res["accuracy"] <= res["token_accuracy"] <= 1.0  # a right answer: all its tokens right
    assert res["params"] == {"task": "needle_retrieval", "length": 64, "gap": 32, "needles": 2, "distractors": 2,
                             "value_len": 2}
    last = read_metrics(mixed)[-1]
    assert last["step"] == N and last["eval/synthetic/needle_retrieval/accuracy"] == res["accuracy"]
    assert "needle_retrieval: accuracy" in out and out.strip().splitlines()[-1].startswith("synthetic: 384 tokens")
    assert eval_main(["synthetic", str(mixed), "--source", "copy", "--episodes", "2", "--device", "cpu"]) == 0
    assert json.loads((mixed / "eval" / "synthetic_far_copy.json").read_text())["results"]["params"]["span"] == 4


@pytest.mark.parametrize("argv,needle", [
    (["--source", "nope"], "the run has no synthetic source 'nope' (its synthetic sources: recall, needles, copy)"),
    (["--task", "sorting"], "unknown synthetic task 'sorting'"),
    (["--task", "far_copy", "--episodes", "0"], "--episodes and --batch-size must be >= 1"),
    (["--task", "far_copy", "--length", "128"], "longer than the model's context of 64 tokens"),
    (["--task", "far_copy", "--length", "40"], "far_copy: length=40: an episode of far_copy with gap=32, span=4"),
    ([], "name a synthetic task (--task) or a synthetic source"),
])
def test_eval_cli_bad_inputs_are_one_line(mixed, capsys, argv, needle):
    def written():
        return sorted((p.name, p.stat().st_mtime_ns) for p in (mixed / "eval").glob("*")), \
            (mixed / "metrics.jsonl").read_text()
    before = written()
    assert eval_main(["synthetic", str(mixed), *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
    assert written() == before  # nothing written


@pytest.mark.parametrize("overrides,needle", [
    (["data.sources.1.kind=corpus"], "data.sources.1.kind='corpus': unknown source kind"),
    (["data.sources.0.weight=0"], "data.sources.0.weight=0.0: must be a finite number > 0"),
    (["data.sources.1.weight=-1"], "data.sources.1.weight=-1.0"),
    (["data.sources.1.task=sorting"], "data.sources.1.task='sorting': unknown synthetic task"),
    (["data.sources.1.span=3"], "data.sources.1.span=3: task associative_recall does not read it"),
    (["data.sources.1.length=48"], "data.sources.1.length=48: must divide stage.seq_len=512"),
    (["data.sources.1.pairs=300"], "data.sources.1.length=0: an episode of associative_recall with gap=256, pairs=300"),
    (["data.sources.1.name=text"], "data.sources.1.name='text': another source has this name"),
    (["data.sources.1.name=a/b"], "data.sources.1.name='a/b'"),
    (["data.sources.0.kind=shards"], "data.sources.0.path='': a shards source needs path=DIR"),
    (["data.sources.0.path=/x"], "data.sources.0.path='/x': only a shards source reads a path"),
    (["data.sources=[]"], "data.sources=[]: data=mix needs at least one source"),
    (["data.sources=[{name:c,kind:synthetic,task:far_copy,gap:0.5}]"], "eval.interval=50: the held-out loss reads a corpus"),
])
def test_bad_mixtures_name_the_field(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose(["data=mix", *overrides])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sources_outside_a_mixture_are_refused():
    with pytest.raises(ConfigError, match=r"data.sources=\['a'\]: only data=mix reads sources"):
        compose(["data.sources=[{name:a}]"])
    cfg = compose(["data=mix", "data.sources.1.weight=0.3"])[0]  # a list element's field from the command line
    assert [(s.name, s.weight) for s in cfg.data.sources] == [("text", 0.8), ("recall", 0.3)]


def test_a_missing_corpus_is_named_before_anything_runs(tmp_path):
    from logo.train.loaders import check_data
    cfg = compose(["data=mix", "data.sources.0.kind=shards", f"data.sources.0.path={tmp_path / 'nope'}"])[0]
    with pytest.raises(DataError, match=r"invalid config data.sources.0.path='.*nope': data directory .* does not"):
        check_data(cfg)


def test_a_corpus_of_another_tokenizer_stops_the_run_in_one_line(prepared, tmp_path):
    corpus = tmp_path / "r50k"
    shutil.copytree(prepared[0], corpus)
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["tokenizer"]["name"] = "r50k_base"
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    p = run_train(*TINY_RUN, "data=mix", "data.sources.0.kind=shards", f"data.sources.0.path={corpus}",
                  "train.steps=1", f"run.dir={tmp_path / 'run'}", check=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"data.sources.0.path='{corpus}': the corpus was tokenized with 'r50k_base'" in errors[0]
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched
