"""`python -m logo.eval` on a tiny checkpoint trained here (2 steps on CPU, held-out eval on): held-out loss in
metrics.jsonl, perplexity vs per-token losses computed directly, RULER pipeline and JSON, lm-eval on local
tasks (log-likelihoods vs the model's own log-probs), span-allocation PNGs, one-line errors, and the progress
bars and closing summary line of every command."""
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, read_metrics, run_python, run_train, scratch_dir
from logo.eval.__main__ import main

FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"
T = 128  # the checkpoint's context (stage.seq_len)
RUN = ["model=tiny", f"stage.seq_len={T}", "stage.global_batch_tokens=512", "train.micro_batch=2",
       "logging.interval=1", "logging.progress_bar=false", "logging.heatmap_interval=1000", "attention.window=16",
       "attention.gamma=0.01", "train.steps=2", "eval.interval=1", "eval.tokens=256"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, default_corpus):
    with scratch_dir(tmp_path_factory, "evalrun") as d:
        p = run_train(*RUN, f"run.dir={d}")
        yield d, p


@pytest.fixture(scope="module")
def loaded(run):
    from logo.run.load import load_model
    return load_model(run[0], device="cpu")


def test_training_logs_heldout_loss(run):
    d, p = run
    rows = [r for r in read_metrics(d) if "loss" in r]  # training records (evaluations append their own)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["eval/loss"]) and r["eval/ppl"] == pytest.approx(math.exp(r["eval/loss"]))
    assert rows[1]["eval/loss"] < rows[0]["eval/loss"]  # a training step lowers the held-out loss
    assert "eval " in p.stdout and "ppl" in p.stdout  # the console line shows it


def test_perplexity_equals_mean_of_direct_token_losses(run, loaded):
    from data.loader import IGNORE_INDEX, ShardDataset, TokenLoader
    from logo.eval.perplexity import corpus_path, perplexity
    res = perplexity(loaded, tokens=256, bucket_size=32, batch_size=1)
    ds = ShardDataset(corpus_path(loaded, None), "val")
    losses = []
    with torch.no_grad():  # the model's own forward on the first 2 windows of the validation split
        for b in TokenLoader(ds, T, 2, 2).iter_eval(max_batches=1):
            logits = loaded.model(b.inputs, cu_seqlens=b.cu_seqlens, valid=b.valid).logits
            ce = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), reduction="none",
                                 ignore_index=IGNORE_INDEX)
            losses.append(ce[b.labels.flatten() != IGNORE_INDEX].double())
    direct = torch.cat(losses)
    assert res["tokens"] == direct.numel() == 2 * T and res["seq_len"] == T and res["split"] == "val"
    assert res["loss"] == pytest.approx(float(direct.mean()), abs=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]))
    assert sum(b["tokens"] for b in res["buckets"]) == res["tokens"]
    assert sum(b["tokens"] * b["loss"] for b in res["buckets"]) == pytest.approx(res["loss"] * res["tokens"])
    assert [(b["start"], b["end"]) for b in res["buckets"]] == [(i, i + 32) for i in range(0, T, 32)]
    # the trainer's held-out loss at the last step read the same 256 tokens
    trained = [r for r in read_metrics(run[0]) if "loss" in r]
    assert res["loss"] == pytest.approx(trained[-1]["eval/loss"], abs=1e-5)


def test_heldout_eval_under_cuda_graphs_buckets_the_offsets_and_gives_the_same_loss(run, loaded):
    """With train.compile_mode=reduce-overhead the held-out evaluation pads each batch's document offsets to a
    bucketed length, as the training batches (`data.loader.bucket_doc_offsets`): the same loss."""
    from data.loader import ShardDataset, TokenLoader
    from logo.train.heldout import HeldOutEval
    from logo.eval.perplexity import corpus_path
    from logo.run.config import compose
    from logo.train.plan import make_plan
    train = TokenLoader(ShardDataset(corpus_path(loaded, None), "train"), T, 4, 2)
    losses = []
    for mode in ("default", "reduce-overhead"):
        cfg, _, name = compose([*RUN, "train.compile=true", f"train.compile_mode={mode}"])
        plan = make_plan(cfg, 1, name)
        ev = HeldOutEval(cfg, plan, train.ds.root, 0, 1, torch.device("cpu"))
        assert ev.doc_buckets == (mode == "reduce-overhead")
        losses.append(ev.maybe_evaluate(plan.steps, loaded.model, torch.autocast("cpu", enabled=False))["eval/loss"])
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    batches = list(ev.loader.iter_eval(max_batches=ev.batches))  # documents inside the rows: padding happened
    assert any(b.with_bucketed_offsets().cu_seqlens.shape[0] > b.cu_seqlens.shape[0] for b in batches)


def test_cli_perplexity_writes_results_and_metrics(run):
    d = run[0]
    assert main(["perplexity", str(d), "--tokens", "128", "--device", "cpu"]) == 0
    rec = json.loads((d / "eval" / "perplexity.json").read_text())
    assert (rec["kind"], rec["step"]) == ("perplexity", 2) and rec["checkpoint"].endswith("step_00000002")
    assert set(rec["results"]) == {"dataset", "split", "seq_len", "tokens", "loss", "ppl", "buckets"}
    last = read_metrics(d)[-1]
    assert last["step"] == 2 and last["eval/ppl"] == pytest.approx(rec["results"]["ppl"])


def _summary(stdout: str) -> tuple[str, int, str]:
    """The closing line of a command: (what, tokens, what it wrote); fails unless it is the summary line."""
    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"(\w+): ([0-9,]+) tokens in [0-9.]+ s \(([0-9,]+) tokens/s\); wrote (.+)", last)
    assert m, last
    return m[1], int(m[2].replace(",", "")), m[4]


def test_perplexity_progress_bar_and_summary_line(run, capsys):
    d = run[0]
    assert main(["perplexity", str(d), "--tokens", "256", "--device", "cpu", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert _summary(out) == ("perplexity", 256, str(d / "eval" / "perplexity.json"))
    frames = [f for f in err.replace("\r", "\n").splitlines() if f.startswith("perplexity [val]")]
    assert frames and "256/256" in frames[-1] and "tok/s" in frames[-1], err


def test_no_progress_bar_when_stderr_is_not_a_terminal_or_when_turned_off(run, capsys):
    for flags in ([], ["--no-progress"]):
        assert main(["perplexity", str(run[0]), "--tokens", "128", "--device", "cpu", *flags]) == 0
        out, err = capsys.readouterr()
        assert "perplexity [val]" not in err and "tok/s" not in err, err
        assert _summary(out)[:2] == ("perplexity", 128)


def test_ruler_progress_counts_prompt_and_generated_tokens(loaded, capsys, monkeypatch):
    from data.tokenizer import load_tokenizer
    from logo.eval import decode, ruler
    from logo.eval.progress import Progress
    from logo.eval.ruler import NeedleTaskBuilder, run_ruler

    def two_tokens_each(model, prompts, max_new_tokens, stop_ids=None, **kw):  # a decoder that always writes 2
        return decode.Generation([[11, 12] for _ in prompts])
    monkeypatch.setattr(ruler, "generate", two_tokens_each)
    tok = load_tokenizer(loaded.cfg.data.tokenizer)
    progress = Progress(enabled=True)
    run_ruler(loaded.model, tok, [100], ["s_niah_1"], samples=3, batch_size=2, max_new_tokens=4, progress=progress)
    prompts = sum(NeedleTaskBuilder(tok).sample("s_niah_1", 100, i).prompt_tokens for i in range(3))
    assert progress.tokens == prompts + 3 * 2
    frames = [f for f in capsys.readouterr().err.replace("\r", "\n").splitlines() if f.startswith("ruler")]
    assert frames and "3/3" in frames[-1] and "prompt" in frames[-1] and "tok/s" in frames[-1], frames


def test_lm_eval_progress_counts_the_scored_tokens(loaded, capsys):
    from logo.eval.lm_eval_adapter import LogoLM
    from logo.eval.progress import Progress
    lm = LogoLM(loaded=loaded, batch_size=2, progress=Progress(enabled=True))
    pairs = [("The capital of France is", " Paris"), ("x", " = 1"), ("Two plus", " two")]
    lm.loglikelihood(_instances("loglikelihood", pairs))
    assert lm.progress.tokens == sum(len(lm.tok.encode_ordinary(c + x)) - 1 for c, x in pairs)
    frames = [f for f in capsys.readouterr().err.replace("\r", "\n").splitlines() if f.startswith("loglikelihood")]
    assert frames and "3/3" in frames[-1] and "tok/s" in frames[-1], frames
    assert LogoLM(loaded=loaded, progress="false").progress.enabled is False


def _corpus_with_val(tmp_path, val_tokens: list) -> Path:
    """A prepared corpus (one training document) whose validation split holds `val_tokens` (one document)."""
    import numpy as np

    from data.format import atomic_write_json, file_sha256
    from data.prepare import prepare
    out = tmp_path / f"corpus_val{len(val_tokens)}"
    manifest = prepare(["A short training document."], out, {"kind": "test"}, val_fraction=0.0, progress=False)
    shards = []
    if val_tokens:
        np.asarray(val_tokens, dtype=np.uint32).tofile(out / "val_00000.bin")
        np.asarray([len(val_tokens)], dtype=np.uint64).tofile(out / "val_00000.idx")
        shards = [{"name": "val_00000", "num_tokens": len(val_tokens), "num_documents": 1,
                   "sha256": file_sha256(out / "val_00000.bin"), "idx_sha256": file_sha256(out / "val_00000.idx")}]
    manifest["splits"]["val"] = {"num_tokens": len(val_tokens), "num_documents": len(shards), "shards": shards}
    manifest["num_tokens"] += len(val_tokens)
    manifest["num_documents"] += len(shards)
    atomic_write_json(out / "manifest.json", manifest)
    return out


@pytest.mark.parametrize("val_tokens", [[], [100257]])
def test_perplexity_on_an_empty_split_is_one_line_error(run, tmp_path, capsys, val_tokens):
    corpus = _corpus_with_val(tmp_path, val_tokens)
    assert main(["perplexity", str(run[0]), "--data", str(corpus), "--device", "cpu", "--progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: split 'val' of the corpus {corpus} has {len(val_tokens)} token"), err


def test_ruler_pipeline_and_json(run, capsys):
    d = run[0]
    assert main(["ruler", str(d), "--lengths", "100,128", "--tasks", "s_niah_1,s_niah_2", "--samples", "2",
                 "--batch-size", "2", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    from data.tokenizer import load_tokenizer
    from logo.eval.ruler import NeedleTaskBuilder
    builder = NeedleTaskBuilder(load_tokenizer("cl100k_base"))
    prompts = sum(builder.sample(t, n, i).prompt_tokens for t in ("s_niah_1", "s_niah_2") for n in (100, 128)
                  for i in range(2))
    what, tokens, wrote = _summary(capsys.readouterr().out)
    assert (what, wrote) == ("ruler", str(d / "eval" / "ruler.json")) and prompts <= tokens <= prompts + 8 * 4
    res = json.loads((d / "eval" / "ruler.json").read_text())["results"]
    assert set(res["scores"]) == {"s_niah_1", "s_niah_2"}
    for per in res["scores"].values():
        assert set(per) == {"100", "128"} and all(0.0 <= v <= 100.0 for v in per.values())
    assert set(res["average"]) == {"100", "128"}
    assert "eval/ruler/s_niah_1/128" in read_metrics(d)[-1]


@pytest.mark.parametrize("argv,needle", [
    (["ruler", "{run}", "--lengths", "256"], "RULER length 256 is longer than the model's context of 128"),
    (["ruler", "{run}", "--lengths", "128", "--tasks", "s_niah_9"], "unknown RULER task 's_niah_9'"),
    (["ruler", "{run}", "--lengths", "40", "--tasks", "s_niah_1"], "RULER length 40 is too short"),
    (["ruler", "{missing}", "--lengths", "128"], "does not exist"),
    (["perplexity", "{missing}"], "does not exist"),
    (["perplexity", "{run}", "--data", "{missing}"], "is not a prepared corpus"),
    (["perplexity", "{run}", "--split", "test"], "has no split 'test'"),
    (["lm_eval", "{run}", "--tasks", "no_such_task_xyz"], "unknown lm-eval task(s) ['no_such_task_xyz']"),
    (["span", "{run}", "--text", "{missing}"], "does not exist"),
])
def test_bad_inputs_give_one_line_errors(run, tmp_path, capsys, argv, needle):
    missing = str(tmp_path / "nope")
    argv = [a.format(run=run[0], missing=missing) for a in argv] + ["--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err


def test_run_dir_without_checkpoint_or_config(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert main(["perplexity", str(tmp_path)]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err


def _instances(kind, args):
    from lm_eval.api.instance import Instance
    return [Instance(kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_lm_eval_loglikelihoods_equal_model_logprobs(loaded):
    """Batched (3 rows of different lengths) log-likelihoods and greedy flags == the model's own log-softmax
    on each sequence alone; rolling == the sum over the text after an end-of-text token."""
    from logo.eval.lm_eval_adapter import LogoLM
    lm = LogoLM(loaded=loaded, batch_size=3)
    pairs = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b"), ("x", " = 1")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    tok = lm.tok
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        whole, n_ctx = tok.encode_ordinary(ctx + cont), len(tok.encode_ordinary(ctx))
        with torch.no_grad():
            logp = loaded.model(torch.tensor([whole])).logits[0].double().log_softmax(-1)
        pos = range(n_ctx - 1, len(whole) - 1)
        ref = sum(float(logp[j, whole[j + 1]]) for j in pos)
        assert ll == pytest.approx(ref, abs=1e-4)
        vocab = loaded.model.cfg.vocab_size
        assert greedy == all(int(logp[j, :vocab].argmax()) == whole[j + 1] for j in pos)
    text = "Two plus two equals four."
    (rolled,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    ids = [tok.eot_token] + tok.encode_ordinary(text)
    with torch.no_grad():
        logp = loaded.model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    assert rolled == pytest.approx(sum(float(logp[j, ids[j + 1]]) for j in range(len(ids) - 1)), abs=1e-4)


def test_lm_eval_generate_until_is_greedy_and_stops(loaded):
    from logo.eval.generate import greedy_generate
    from logo.eval.lm_eval_adapter import LogoLM
    lm = LogoLM(loaded=loaded, batch_size=2)
    ctxs = ["The sky on a clear day is", "Two plus two"]
    ref = [lm.tok.decode(greedy_generate(loaded.model, lm.tok.encode_ordinary(c), 5, use_cache=False))
           for c in ctxs]
    out = lm.generate_until(_instances("generate_until", [(c, {"until": ["\n"], "max_gen_toks": 5}) for c in ctxs]))
    assert out == [r.split("\n")[0] for r in ref]
    stop = ref[0][len(ref[0]) // 2:][:1] or "\n"  # a stop string taken from the greedy text itself
    cut = lm.generate_until(_instances("generate_until", [(ctxs[0], {"until": [stop], "max_gen_toks": 5})]))
    assert cut == [ref[0].split(stop)[0]]



def test_lm_eval_generate_until_samples_when_asked(loaded):
    """do_sample with a temperature samples through `generate` (seed 0); a nucleus of one is greedy; bad settings
    end in one error naming them."""
    from logo.eval.decode import generate
    from logo.eval.lm_eval_adapter import LogoLM
    from logo.eval.load import EvalError
    lm = LogoLM(loaded=loaded, batch_size=2)
    ctxs = ["The sky on a clear day is", "Two plus two"]
    ids = [lm.tok.encode_ordinary(c) for c in ctxs]
    sample = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 1.5}
    out = lm.generate_until(_instances("generate_until", [(c, sample) for c in ctxs]))
    ref = generate(loaded.model, ids, 6, {lm.eot_token_id}, temperature=1.5, top_p=1.0, seed=0).tokens
    assert out == [lm.tok.decode(r) for r in ref]
    greedy = lm.generate_until(_instances("generate_until", [(c, {"until": [], "max_gen_toks": 6}) for c in ctxs]))
    nucleus = lm.generate_until(_instances("generate_until", [(c, {**sample, "top_p": 1e-6}) for c in ctxs]))
    assert nucleus == greedy
    with pytest.raises(EvalError, match="top_p=2.0"):
        lm.generate_until(_instances("generate_until", [(ctxs[0], {**sample, "top_p": 2.0})]))

def test_lm_eval_local_tasks_end_to_end(run, capsys):
    d = run[0]
    assert main(["lm_eval", str(d), "--tasks", "logo_tiny_mc,logo_tiny_rolling,logo_tiny_gen",
                 "--include-path", str(FIXTURES), "--batch-size", "4", "--device", "cpu"]) == 0
    what, tokens, wrote = _summary(capsys.readouterr().out)
    assert (what, wrote) == ("lm_eval", str(d / "eval" / "lm_eval.json")) and tokens > 0
    res = json.loads((d / "eval" / "lm_eval.json").read_text())["results"]
    assert 0.0 <= res["logo_tiny_mc"]["acc,none"] <= 1.0
    assert res["logo_tiny_rolling"]["word_perplexity,none"] > 1.0
    assert res["logo_tiny_gen"]["exact_match,none"] == 0.0  # two training steps know no answers
    assert "eval/lm_eval/logo_tiny_mc/acc" in read_metrics(d)[-1]


@pytest.mark.slow
def test_lm_eval_command_line_with_the_logo_model(run):
    """The lm_eval CLI itself (every flag), with the `logo` model registered by importing the adapter."""
    p = run_python([sys.executable, "-m", "logo.eval.lm_eval_cli", "--model", "logo", "--model_args",
                    f"checkpoint={run[0]}", "--device", "cpu", "--tasks", "logo_tiny_mc", "--include_path",
                    str(FIXTURES), "--limit", "2"], timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "logo_tiny_mc" in p.stdout and "acc" in p.stdout


def _texts(tmp_path, *names):
    bodies = {"prose": "The grass is green. The sky is blue. " * 30, "code": "def f(x):\n    return x\n" * 40}
    for name in names:
        (tmp_path / f"{name}.txt").write_text(bodies[name])
    return [str(tmp_path / f"{name}.txt") for name in names]


def test_span_cli_writes_one_figure_per_output(run, tmp_path, capsys):
    """The span-statistics figure (one row per text), one word-level figure per text and the JSON: nothing else,
    and no two files alike."""
    out = tmp_path / "span"
    assert main(["span", str(run[0]), "--text", *_texts(tmp_path, "prose", "code"), "--out", str(out),
                 "--device", "cpu"]) == 0
    files = {"span_allocation.png", "prose_words.png", "code_words.png", "span_allocation.json"}
    assert {f.name for f in out.iterdir()} == files
    for f in files - {"span_allocation.json"}:
        assert (out / f).stat().st_size > 1000, f
    assert len({(out / f).read_bytes() for f in files}) == len(files)
    rep = json.loads((out / "span_allocation.json").read_text())["texts"]
    assert set(rep) == {"prose", "code"} and len(rep["prose"]["layer_ratio"]) == 4
    assert sum(rep["code"]["global_layers_histogram"]) == rep["code"]["tokens"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    n = rep["prose"]["tokens"] + rep["code"]["tokens"]
    assert re.fullmatch(rf"span: {n:,} tokens in [0-9.]+ s \([0-9,]+ tokens/s\); wrote {re.escape(str(out))}/ "
                        r"\(span_allocation.png, prose_words.png, code_words.png, span_allocation.json\)", last), last


def test_span_of_one_text_writes_no_duplicate(run, tmp_path):
    out = tmp_path / "span"
    assert main(["span", str(run[0]), "--text", *_texts(tmp_path, "prose"), "--out", str(out), "--device", "cpu"]) == 0
    assert {f.name for f in out.iterdir()} == {"span_allocation.png", "prose_words.png", "span_allocation.json"}
    assert (out / "span_allocation.png").read_bytes() != (out / "prose_words.png").read_bytes()


def test_word_spans_average_tokens_and_keep_split_characters():
    from logo.analysis.span_allocation import word_spans
    toks = [b"The", b" gr", b"ass", b" \xe4\xb8", b"\xad\xe6\x96\x87", b"\n", b"end"]  # "中文" split mid-character
    words = word_spans(toks, [0.0, 2.0, 4.0, 1.0, 3.0, 0.0, 5.0])
    assert words == [("The", 0.0), ("grass", 3.0), ("中文", 2.0), ("end", 5.0)]
