"""The wrappers `logo/parallel/fsdp.py` applies (compile, activation checkpointing) leave the math and the
parameter names of the plain model unchanged."""
import pytest
import torch

from logo.config import AttentionConfig, ModelConfig
from logo.model import Transformer
from logo.parallel import parallelize

from conftest import TINY_RUN, read_metrics, run_train


def tiny_logo(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=300,
                      attention=AttentionConfig(kind="logo", window=8, gate_init_std=0.5))
    model = Transformer(cfg)
    model.init_weights()
    return model


def loss_and_grads(model, tokens, cu):
    out = model(tokens[:, :-1], cu_seqlens=cu)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, out.routing


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_compiled_blocks_match_eager_and_keep_parameter_names(ac):
    """With activation checkpointing too: each checkpointed block is compiled, and the LoGo layer's attention ops
    skip their own recomputation of the branch inputs (the block's rerun forward already recomputes them)."""
    tokens = torch.randint(0, 300, (2, 49))
    cu = torch.tensor([0, 20, 48, 70, 96], dtype=torch.int32)
    eager = tiny_logo()
    names = [n for n, _ in eager.named_parameters()]
    l0, g0, r0 = loss_and_grads(eager, tokens, cu)
    compiled = parallelize(tiny_logo(), None, torch.float32, activation_checkpointing=ac, compile_blocks=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints depend on neither
    assert [b.attention.attention_ops.block_recomputed for b in compiled.layers.values()] == [ac] * len(compiled.layers)
    if not ac:  # the checkpoint wrapper's module prefix shows in parameter names (its state_dict strips it)
        assert [n for n, _ in compiled.named_parameters()] == names
    l1, g1, r1 = loss_and_grads(compiled, tokens, cu)
    g1 = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in g1.items()}
    assert torch.equal(r0[:, :2], r1[:, :2])  # the same routing decisions (selected, valid per layer)
    torch.testing.assert_close(r1, r0, rtol=1e-5, atol=1e-5)  # gate sums: fused kernels round differently
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for n in names:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path, default_corpus):
    """Two training steps with and without activation checkpointing: the same losses and thresholds."""
    runs = {}
    for ac in ("false", "true"):
        d = tmp_path / f"ac_{ac}"
        run_train(*TINY_RUN, "train.steps=2", f"train.activation_checkpointing={ac}", f"run.dir={d}")
        runs[ac] = read_metrics(d)
    for a, b in zip(runs["false"], runs["true"]):
        assert a["loss"] == b["loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        assert all(a[k] == b[k] for k in a if k.startswith("logo/threshold/"))
