"""logo/train/step.py: a non-finite step changes nothing on the device (weights, AdamW moments and step count,
LoGo thresholds) and is reported once, naming its step; micro-batch splits give the same step; on a GPU the
step makes no host sync."""
import re
from contextlib import nullcontext

import pytest
import torch

from conftest import TINY_RUN, run_train
from data.loader import Batch, StepData
from logo.config import AttentionConfig, model_config
from logo.model import BudgetController, Transformer
from logo.train.step import (DivergenceMonitor, Readout, TrainingDiverged, make_optimizer, optimizer_step, read_back,
                             train_step)

CPU = torch.device("cpu")
V, T = 300, 32


def build(lr, kind="logo", device=CPU):
    torch.manual_seed(0)
    cfg = model_config("tiny", vocab_size=V, attention=AttentionConfig(kind=kind, window=8, gamma=0.01))
    model = Transformer(cfg).to(device)
    model.init_weights()
    opt = make_optimizer(model, lr, (0.9, 0.95), 1e-8, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, BudgetController(model), DivergenceMonitor(device)


def batch(step, rows=2):
    t = torch.randint(0, V, (rows, T + 1), generator=torch.Generator().manual_seed(step))
    return Batch(t[:, :-1], t[:, 1:], None, torch.ones(rows, T, dtype=torch.bool))


def snapshot(model, opt):
    """(weights, LoGo thresholds, AdamW state: exp_avg, exp_avg_sq, step of every parameter)."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    thresholds = {n: b.clone() for n, b in model.named_buffers() if n.endswith("threshold")}
    return params, thresholds, [v.clone() for p in model.parameters() for v in opt.state[p].values()]


def test_non_finite_step_is_skipped_on_the_device_and_named():
    """lr=1e4 blows the weights up; the first non-finite step and every later one leave everything as it was."""
    model, opt, sched, ctrl, monitor = build(lr=1e4)
    states, first_bad = [], None
    for step in range(1, 6):
        out = train_step(model, StepData([batch(step)], 2 * T), device=CPU, autocast=nullcontext(), ctrl=ctrl,
                         grad_clip=1.0, world=1, data_parallel=False)
        optimizer_step(opt, sched, ctrl, out, monitor, step)
        states.append(snapshot(model, opt))
        loss, gnorm, diverged = read_back(out, monitor)
        if first_bad is None and diverged[0]:
            first_bad = step
            assert diverged[0] == step and not (loss == loss and gnorm == gnorm and abs(gnorm) < float("inf"))
    assert first_bad is not None and first_bad >= 2  # step 1 is finite and applied
    good = states[first_bad - 2]  # after step first_bad - 1
    for later in states[first_bad - 1:]:
        for a, b in zip(good, later):
            if isinstance(a, dict):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            else:
                assert all(torch.equal(x, y) for x, y in zip(a, b))  # moments and the step count
    assert len(good[1]) == 4  # the thresholds of the tiny model's 4 LoGo layers were compared
    # the loss may stay finite (the fused loss takes its gradients in the forward); the gradient norm does not
    with pytest.raises(TrainingDiverged, match=rf"^training diverged at step {first_bad}: loss \S+, grad norm nan "
                                               rf"\(not finite\).* those of step {first_bad - 1}\. Last good "
                                               rf"checkpoint: none\."):
        DivergenceMonitor.check(read_back(out, monitor)[2], lambda: None)


def test_micro_batch_split_gives_the_same_step():
    """One micro-batch of 4 rows vs two of 2: the same loss, gradient norm and weights after the update."""
    rows = batch(7, rows=4)
    halves = [Batch(rows.inputs[i:i + 2], rows.labels[i:i + 2], None, rows.valid[i:i + 2]) for i in (0, 2)]
    results = []
    for micro in ([rows], halves):
        model, opt, sched, ctrl, monitor = build(lr=1e-3)
        out = train_step(model, StepData(micro, 4 * T), device=CPU, autocast=nullcontext(), ctrl=ctrl, grad_clip=1.0,
                         world=1, data_parallel=False)
        optimizer_step(opt, sched, ctrl, out, monitor, 1)
        results.append((read_back(out, monitor), [p.detach().clone() for p in model.parameters()],
                        ctrl.thresholds()))
    (a, pa, ta), (b, pb, tb) = results
    assert a[0] == pytest.approx(b[0], rel=1e-6) and a[1] == pytest.approx(b[1], rel=1e-5) and a[2] == b[2]
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)  # Adam: m / sqrt(v) of tiny gradients
    assert torch.equal(ta, tb)  # the routing counts of the two halves add up to the whole


def test_train_py_stops_with_one_line_naming_the_step_and_the_last_good_checkpoint(tmp_path, default_corpus):
    """lr=1e4 on the tiny model: a step goes non-finite between log steps; the next log/checkpoint step stops the
    run with one line, before any checkpoint of a skipped step is written."""
    p = run_train(*[a for a in TINY_RUN if not a.startswith("logging.interval")], "logging.interval=4",
                  "train.steps=6", "checkpoint.interval=2", "stage.lr=1e4", "stage.lr_min=1e3", f"run.dir={tmp_path}",
                  check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    m = re.match(r"error: training diverged at step (\d+): loss \S+, grad norm \S+ \(not finite\); .* those of step "
                 r"(\d+)\. Last good checkpoint: (\S+)\. Lower stage\.lr", errors[0])
    assert m, errors[0]
    bad, before, last_good = int(m.group(1)), int(m.group(2)), m.group(3)
    assert before == bad - 1 and bad >= 2  # step 1 is finite
    # every checkpoint before the bad step was written, none at or after it, and the last of them is named
    ckpts = tmp_path / "checkpoints"
    good = [f"step_{s:08d}" for s in range(2, bad, 2)]
    saved = sorted(x.name for x in ckpts.iterdir()) if ckpts.exists() else []
    assert saved == good and last_good == (str(ckpts / good[-1]) if good else "none"), (saved, last_good)


def test_document_offsets_are_checked_on_the_host_only():
    """A micro-batch's document offsets are checked on the host before the copy (a bad one is named before the
    model runs); offsets already on a device are not read by the model (on a GPU that read synchronised every
    forward): a meta-device layout builds without touching its values."""
    from logo.model.layers import PackedSeqs

    class NeverCalled(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("the model ran on a bad batch")

    t = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(0))
    bad = Batch(t[:, :-1], t[:, 1:], torch.tensor([0, 9, 5, T, 2 * T], dtype=torch.int32),
                torch.ones(2, T, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"cu_seqlens must be increasing offsets over the flattened 2x{T} batch"
                                         rf".*got \[0, 9, 5, {T}, {2 * T}\]"):
        train_step(NeverCalled(), StepData([bad], 2 * T), device=CPU, autocast=nullcontext(), ctrl=None,
                   grad_clip=1.0, world=1, data_parallel=False)
    seqs = PackedSeqs.build(2, T, "meta", torch.tensor([0, 9, T, 2 * T], dtype=torch.int32, device="meta"))
    assert seqs.has_documents and seqs.pos.shape == (2 * T,)
    with pytest.raises(ValueError, match="every row boundary"):  # on the CPU the model checks them itself
        PackedSeqs.build(2, T, "cpu", torch.tensor([0, 9, 2 * T], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,documents", [("full", False), ("logo", True)])
def test_step_makes_no_host_sync_on_cuda(kind, documents):
    """train_step + optimizer_step under CUDA's sync debug mode, which raises on any synchronizing call: full
    attention on whole rows, and LoGo on a batch with document offsets (checked on the host, not read on the
    device). The first step runs outside the mode: it compiles LoGo's glue region (Inductor's compilation reads
    the device) and allocates the optimizer state; the steps after it must not synchronise."""
    dev = torch.device("cuda")
    model, opt, sched, ctrl, monitor = build(lr=1e-3, kind=kind, device=dev)
    mbs = [batch(1), batch(2)]
    if documents:
        cu = torch.tensor([0, 7, T, T + 20, 2 * T], dtype=torch.int32)
        mbs = [Batch(mb.inputs, mb.labels, cu, mb.valid) for mb in mbs]
    data = StepData([mb.pin_memory() for mb in mbs], 4 * T)
    readouts = []
    for step in (1, 2, 3):
        torch.cuda.set_sync_debug_mode("default" if step == 1 else "error")
        try:
            out = train_step(model, data, device=dev, autocast=torch.autocast("cuda", dtype=torch.bfloat16),
                             ctrl=ctrl, grad_clip=1.0, world=1, data_parallel=False)
            optimizer_step(opt, sched, ctrl, out, monitor, step)
            figures = ctrl.figures()  # the loop's record of a logging step, staged without a sync
            readouts.append((Readout(out, monitor, figures), read_back(out, monitor) if step == 1 else None))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert read_back(out, monitor)[2][0] == 0
    (first, synced), *_ = readouts
    assert first.values()[:3] == synced  # read after two more steps: still step 1's values
    if kind == "logo":
        assert ctrl.metrics_of(readouts[-1][0].values()[3]) == ctrl.metrics()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["full", "logo"])
def test_cuda_graph_blocks_accumulate_gradients(kind):
    """train.compile_mode=reduce-overhead with two micro-batches per step: the blocks replayed as CUDA graphs give
    the losses and weights of the same blocks compiled without graphs (bf16 tolerance) over three steps. (Marking
    a new graph iteration per micro-batch let the second replay overwrite the first micro-batch's gradients.)"""
    from logo.parallel import parallelize
    dev = torch.device("cuda")
    runs = []
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        model, opt, sched, ctrl, monitor = build(lr=1e-3, kind=kind, device=dev)
        parallelize(model, None, torch.bfloat16, compile_blocks=True, compile_mode=mode)
        data = StepData([batch(1).pin_memory(), batch(2).pin_memory()], 4 * T)
        losses = []
        for step in (1, 2, 3):
            out = train_step(model, data, device=dev, autocast=torch.autocast("cuda", dtype=torch.bfloat16),
                             ctrl=ctrl, grad_clip=1.0, world=1, data_parallel=False)
            optimizer_step(opt, sched, ctrl, out, monitor, step)
            losses.append(read_back(out, monitor)[0])
        runs.append((losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}))
    (want, w_want), (got, w_got) = runs
    assert got == pytest.approx(want, rel=2e-2)
    for n in w_want:  # each AdamW step moves a weight by about lr at most: 3 steps apart by at most ~2 x 3 lr
        assert (w_got[n] - w_want[n]).abs().max() <= 6e-3, n


def test_a_readout_holds_its_steps_values_after_the_sources_change():
    """The loop reads a logging step's figures one step later: the readout is a copy taken at the step."""
    from logo.train.step import StepOutput
    out = StepOutput(loss_sum=torch.tensor(6.0), n_tokens=torch.tensor(2.0), grad_norm=torch.tensor(0.5))
    monitor = DivergenceMonitor(torch.device("cpu"))
    extra = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    r = Readout(out, monitor, extra)
    out.loss_sum.fill_(18.0)
    out.grad_norm.fill_(9.0)
    monitor.state.fill_(7.0)
    extra.fill_(0.0)
    loss, gnorm, diverged, rest = r.values()
    assert (loss, gnorm, diverged, rest.tolist()) == (3.0, 0.5, [0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0])
    assert read_back(out, monitor) == (9.0, 9.0, [7.0, 7.0, 7.0])
