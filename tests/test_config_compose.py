"""Every config in conf/ composes and validates; every experiment preset dry-runs to the paper's numbers."""
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from logo.config import PEAK_LR, AttentionConfig, ConfigError
from logo.run.config import register_configs, to_dataclass
from logo.train.plan import make_plan
from logo.train.trainer import dry_run

from conftest import ROOT, run_train

CONF = ROOT / "conf"
GROUPS = ["model", "attention", "stage", "data", "logging", "parallel"]
EXPERIMENTS = sorted(str(p.relative_to(CONF / "experiment").with_suffix("")) for p in (CONF / "experiment").rglob("*.yaml"))
PLAN_KEYS = {"params_total", "params_non_embedding", "tokens_total", "global_batch_tokens", "micro_batch", "grad_accum",
             "steps", "pmask_steps", "threshold_init", "attention_flops_per_token"}


def compose_cfg(*overrides):
    register_configs()
    with initialize_config_dir(str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_groups_are_complete():
    assert set(options("model")) >= {"tiny", "small", "200m", "470m", "900m", "1.5b", "3.3b"}
    assert set(options("attention")) >= {"full", "local", "inter_layer", "intra_layer", "logo", "inter_layer_logo",
                                         "logo_shared_params", "logo_full_params", "logo_so", "logo_no_contextnorm",
                                         "logo_so_no_contextnorm", "logo_additive", "logo_aux_loss", "logo_no_pmask"}
    assert set(options("stage")) >= {"smoke", "pretrain_8k", "ctx_32k", "ctx_128k"}
    assert len(EXPERIMENTS) >= 40


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(group, option):
    extra = {("data", "shards"): ["data.path=/some/corpus"],  # the long-range tasks need more than 512 tokens
             ("data", "mix_long_range"): ["stage.seq_len=2048", "stage.global_batch_tokens=8192"]}.get((group, option), [])
    cfg = compose_cfg(f"{group}={option}", *extra)
    c = to_dataclass(cfg)
    if group == "attention":
        preset = OmegaConf.load(CONF / "attention" / f"{option}.yaml")
        for k, v in preset.items():  # the preset reached the model's attention config
            assert getattr(c.model.attention, k) == v, (option, k)
    if group == "model":
        assert c.model.name == option


def test_default_is_tiny_logo_smoke():
    c = to_dataclass(compose_cfg())
    assert (c.model.name, c.model.attention.kind, c.stage.name, c.data.kind) == ("tiny", "logo", "smoke", "default")
    plan = make_plan(c, 1, "logo")
    assert plan.steps == 100 and plan.pmask_steps == 20
    assert plan.threshold_init == pytest.approx(0.5 - c.model.attention.gamma * 20)


def test_cli_style_overrides_reach_the_model():
    c = to_dataclass(compose_cfg("model=1.5b", "attention=logo", "stage=pretrain_8k", "attention.rho=0.25",
                                 "attention.window=256"))
    assert (c.model.dim, c.model.n_layers, c.model.attention.rho, c.model.attention.window) == (2048, 24, 0.25, 256)
    c = to_dataclass(compose_cfg("attention=full", "stage=ctx_32k"))
    assert c.model.attention.kind == "full" and c.model.rope_theta == c.stage.rope_theta == 500000.0


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_dry_runs(exp, tmp_path):
    cfg = compose_cfg(f"experiment={exp}", f"run.dir={tmp_path}")
    c = to_dataclass(cfg)
    plan = dry_run(c, OmegaConf.to_container(cfg, resolve=True), "")
    written = json.loads((tmp_path / "plan.json").read_text())
    assert PLAN_KEYS <= set(written)
    assert written["steps"] == plan.steps > 0
    assert written["micro_batch"] * written["grad_accum"] * written["dp"] * plan.seq_len == \
        written["global_batch_tokens"]
    assert (tmp_path / "config.yaml").exists()
    assert c.experiment == exp


def _plan(*overrides, world=1):
    return make_plan(to_dataclass(compose_cfg(*overrides)), world)


@pytest.mark.parametrize("size", ["200m", "470m", "900m", "1.5b", "3.3b"])
@pytest.mark.parametrize("att", ["full", "logo"])
def test_scaling_grid(size, att):
    c = to_dataclass(compose_cfg(f"experiment=scaling/{size}_{att}"))
    p = make_plan(c, 8)
    assert c.model.attention.kind == att and c.model.name == size
    assert p.tokens_total == round(20 * p.params_total)  # 20 tokens per parameter
    assert p.global_batch_tokens == (1 << 20 if size == "3.3b" else 1 << 19)
    assert p.seq_len == 8192
    assert p.lr == PEAK_LR[size] and p.lr_min == pytest.approx(0.1 * PEAK_LR[size])
    if att == "logo":
        assert p.pmask_steps == round(0.2 * p.steps)
        assert p.threshold_init == pytest.approx(0.5 - 0.0005 * p.pmask_steps)


def test_controlled_1_5b_and_context_extension():
    p = _plan("experiment=controlled_1.5b/logo")
    assert (p.tokens_total, p.global_batch_tokens, p.seq_len, p.lr, p.lr_min) == (100e9, 4 << 20, 8192, 6e-4, 6e-5)
    assert p.steps == math.ceil(100e9 / (4 << 20)) == 23842
    assert p.warmup_steps == 238 and p.pmask_steps == 4768
    assert p.threshold_init == pytest.approx(0.5 - 0.0005 * 4768)
    for stage, seq, batch in (("ctx32k", 32768, 4 << 20), ("ctx128k", 131072, 8 << 20)):
        for base in ("logo", "transformer", "inter_layer", "intra_layer"):
            c = to_dataclass(compose_cfg(f"experiment=controlled_1.5b/{base}_{stage}"))
            p = make_plan(c, 8)
            assert (p.seq_len, p.global_batch_tokens, p.tokens_total, p.lr_min) == (seq, batch, 10e9, 1e-5)
            assert c.checkpoint.init_from, "a context-extension stage starts from the previous stage"
            assert c.model.rope_theta == c.stage.rope_theta > 10000.0
            assert p.pmask_steps == 0  # thresholds come from the previous stage


def test_ratio_sweep_and_hybrids_budgets():
    for r in (25, 5, 75):
        rho = {25: 0.25, 5: 0.5, 75: 0.75}[r]
        assert _plan(f"experiment=ratio_sweep/logo_{r}").attention_budget == pytest.approx(rho)
        assert _plan(f"experiment=ratio_sweep/inter_layer_{r}").attention_budget == pytest.approx(rho)
        for kind in ("logo", "inter_layer"):  # the 32k stage keeps the budget and starts from its own 8k run
            c = to_dataclass(compose_cfg(f"experiment=ratio_sweep/{kind}_{r}_ctx32k"))
            p = make_plan(c, 1)
            assert (p.attention_budget, p.seq_len, p.pmask_steps) == (pytest.approx(rho), 32768, 0)
            assert c.checkpoint.init_from == f"runs/ratio_sweep-{kind}_{r}-pretrain_8k"
    expect = {"inter_layer_1to1": 0.5, "inter_layer_1to3": 0.25, "inter_layer_1to1_logo_0.5": 0.25,
              "inter_layer_1to1_logo_0.7": 0.35}
    for name, budget in expect.items():
        assert _plan(f"experiment=hybrid_compat/{name}").attention_budget == pytest.approx(budget), name


def test_ablations_change_one_design_choice():
    base = to_dataclass(compose_cfg("experiment=controlled_1.5b/logo"))
    expected = {"shared_params": {"transform"}, "full_params": {"transform"}, "so": {"transform"},
                "no_contextnorm": {"context_norm"}, "so_no_contextnorm": {"transform", "context_norm"},
                "additive": {"fusion"}, "aux_loss": {"budget_control"}, "no_pmask": {"pmask"}}
    for name, fields in expected.items():
        c = to_dataclass(compose_cfg(f"experiment=ablations/{name}"))
        diff = {f.name for f in dataclasses.fields(AttentionConfig)
                if getattr(c.model.attention, f.name) != getattr(base.model.attention, f.name)}
        assert diff == fields, name
        assert dataclasses.replace(c.stage) == base.stage and c.model.dim == base.model.dim
    assert _plan("experiment=ablations/no_pmask").threshold_init == 0.5


def test_token_budget_does_not_depend_on_world_size():
    plans = {w: _plan("experiment=controlled_1.5b/logo", world=w) for w in (1, 2, 4, 8, 64)}
    for w, p in plans.items():
        assert (p.tokens_total, p.steps, p.global_batch, p.pmask_steps) == \
            (plans[1].tokens_total, plans[1].steps, plans[1].global_batch, plans[1].pmask_steps)
        assert p.micro_batch * p.grad_accum * w == p.global_batch
    with pytest.raises(ConfigError, match="stage.global_batch_tokens"):
        _plan("experiment=controlled_1.5b/logo", world=3)
    ok = _plan("stage.global_batch_tokens=6144", "train.micro_batch=4", world=3)  # 12 seqs: 4 per rank
    assert (ok.micro_batch, ok.grad_accum) == (4, 1)
    with pytest.raises(ConfigError, match="train.micro_batch=2"):
        _plan("stage.global_batch_tokens=5120", "train.micro_batch=2", world=2)  # 5 sequences per rank


def test_cli_dry_run_writes_plan(tmp_path):
    p = run_train("model=1.5b", "attention=logo", "stage=pretrain_8k", "dry_run=true", f"run.dir={tmp_path}")
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert PLAN_KEYS <= set(plan) and plan["params_total"] > 1.5e9
    assert "threshold init" in p.stdout and "P-mask steps" in p.stdout
    assert not (tmp_path / "checkpoints").exists()  # no training


def test_run_dir_is_deterministic():
    c = to_dataclass(compose_cfg("experiment=scaling/470m_logo"))
    assert make_plan(c, 1).run_dir == make_plan(c, 8).run_dir == str(Path("runs") / "scaling-470m_logo-pretrain_8k")
    assert make_plan(to_dataclass(compose_cfg("run.name=abc")), 1).run_dir == str(Path("runs") / "abc")
    assert make_plan(to_dataclass(compose_cfg("run.dir=/x/y")), 1).run_dir == "/x/y"


def test_bf16_reduction_of_replicated_weights_needs_a_gpu():
    """DDP reduces in bf16 through NCCL only: a CPU plan with replicated weights refuses it in one line (FSDP2's
    bf16 reduction runs on gloo too)."""
    from logo.config import ConfigError
    args = ("model=tiny", "stage.seq_len=64", "stage.global_batch_tokens=256", "train.micro_batch=1",
            "parallel.reduce_dtype=bf16")
    with pytest.raises(ConfigError, match=r"^invalid config parallel.reduce_dtype='bf16': replicated data "
                                          r"parallelism reduces in bf16 through NCCL only"):
        _plan(*args, "parallel.data_parallel=replicate", "parallel.device=cpu", world=2)
    assert _plan(*args, "parallel.data_parallel=shard", "parallel.device=cpu", world=2).data_parallel == "shard"


def test_cuda_graph_blocks_on_several_ranks_need_replicated_data_parallelism():
    """train.compile_mode=reduce-overhead (CUDA-graphed blocks) plans on several ranks only with replicated data
    parallelism and tp = cp = 1 (DDP's all-reduce runs outside the blocks); FSDP, tp or cp refuse in one line."""
    from logo.config import ConfigError
    args = ("model=tiny", "stage.seq_len=64", "stage.global_batch_tokens=512", "train.micro_batch=1",
            "train.compile=true", "train.compile_mode=reduce-overhead", "parallel.device=cpu")
    assert _plan(*args, "parallel.data_parallel=replicate", world=2).data_parallel == "replicate"
    for extra, world in ((("parallel.data_parallel=shard",), 2), (("parallel.tp=2",), 2), (("parallel.cp=2",), 4)):
        with pytest.raises(ConfigError, match=r"^invalid config train.compile_mode='reduce-overhead' with \d ranks"):
            _plan(*args, *extra, world=world)
