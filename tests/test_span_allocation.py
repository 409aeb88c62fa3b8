"""Span-allocation analysis records exactly the routing the model used."""
import torch

from logo.analysis.span_allocation import allocation_stats, plot_allocation, record_routing, word_scores
from logo.config import AttentionConfig, model_config
from logo.model import Transformer


def test_recorded_routing_matches_the_forward_counts(tmp_path):
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", vocab_size=300, attention=AttentionConfig(kind="logo", window=8)))
    model.init_weights()
    with torch.no_grad():
        for layer in model.logo_layers():
            layer.gate.weight.normal_(0, 0.3)
    tokens = torch.randint(0, 300, (2, 40))
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, 30:] = False
    z = record_routing(model, tokens, valid=valid)
    assert z.shape == (4, 2, 40)
    with torch.no_grad():
        out = model(tokens, valid=valid)
    assert torch.equal(z.flatten(1).sum(1).float(), out.routing[:, 0])
    assert not z[:, 1, 30:].any()
    stats = allocation_stats(z, valid)
    assert stats["tokens"] == 70 and sum(stats["global_layers_histogram"]) == 70
    torch.testing.assert_close(torch.tensor(stats["layer_ratio"], dtype=torch.float64), out.routing[:, 0].double() / 70)
    w = word_scores(z)
    assert torch.equal(w[:, 1:], z.sum(0)[:, :-1].float()) and torch.all(w[:, 0] == 0)
    plot_allocation(stats, "test", str(tmp_path / "alloc.png"))
    assert (tmp_path / "alloc.png").stat().st_size > 1000


def test_record_routing_rejects_models_without_logo_layers():
    import pytest
    model = Transformer(model_config("tiny", vocab_size=300, attention=AttentionConfig(kind="full")))
    with pytest.raises(ValueError, match="no LoGo layers"):
        record_routing(model, torch.zeros(1, 4, dtype=torch.long))
