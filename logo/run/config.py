"""Typed training configs, registered with Hydra's ConfigStore as the schema of `conf/config.yaml`.

Groups (conf/<group>/<option>.yaml): model, attention, stage, data, logging, parallel, and `experiment`
presets (`# @package _global_`) that set several groups at once. `validate()` checks everything at start-up
and raises ConfigError naming the field.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from data.synthetic import TASK_PARAMS, TASKS, ParamError, SyntheticParams, check_params

from logo.config import AttentionConfig, ConfigError, ModelConfig
from logo.config import _fail  # one message format for every invalid field
from logo.model.lm_head import LOSS_IMPLS
from logo.parallel.cp import check_cp
from logo.parallel.tp import check_tp

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclass
class StageConfig:
    """One training stage: pretraining or a context-extension stage."""

    name: str = "smoke"
    seq_len: int = 512
    # Token budget: `tokens` if > 0, else tokens_per_param x total parameters (the scaling grid's 20 TPP).
    tokens: int = 0
    tokens_per_param: float = 0.0
    global_batch_tokens: int = 8192
    lr: float = 3e-3  # peak learning rate
    lr_min: float = 3e-4  # cosine floor
    warmup_fraction: float = 0.01
    rope_theta: Optional[float] = None  # None: keep model.rope_theta; context extension raises it


@dataclass
class TrainConfig:
    steps: int = 0  # > 0 overrides the steps derived from the token budget (smoke runs)
    micro_batch: int = 8  # sequences per rank per forward
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU | fp32 | bf16
    compile: bool = False
    # torch.compile mode of the blocks under train.compile: default | reduce-overhead (CUDA graphs replay each
    # block's kernels: for small, launch-bound models on one GPU; not with FSDP) | max-autotune-no-cudagraphs
    compile_mode: str = "default"
    activation_checkpointing: bool = False
    # LM-head loss: auto (CUDA: liger when a micro-batch's fp32 logits reach 4 GiB, else plain; CPU: chunked)
    # | liger | chunked | plain (materialised logits). liger and chunked never hold the (tokens, vocab) logits;
    # see logo/model/lm_head.py.
    loss: str = "auto"
    seed: int = 0
    # Python's automatic GC pauses at random points (a straggler for every other rank); instead collect
    # generations 0-1 every gc_interval steps on every rank at once (and fully at checkpoints). 0: automatic GC.
    gc_interval: int = 50

    @property
    def cuda_graphs(self) -> bool:
        """The blocks are replayed as CUDA graphs (train.compile with compile_mode=reduce-overhead)."""
        return self.compile and self.compile_mode == "reduce-overhead"


@dataclass
class SourceConfig:
    """One source of a data mixture (data=mix, docs/data.md): a corpus or a synthetic long-range task."""

    name: str = ""  # unique in the mixture: metrics data/tokens/<name>, eval/synthetic_<name>.json
    kind: str = "default"  # default: the embedded corpus | shards: a prepared corpus at `path` | synthetic
    weight: float = 1.0  # relative share of the rows (sequences) of every global batch; > 0
    path: str = ""  # shards
    # synthetic: the task and its episode (data/synthetic.py); the parameters of other tasks keep their defaults
    task: str = ""  # associative_recall | needle_retrieval | far_copy
    length: int = 0  # tokens per episode (one document), EOS included; 0: stage.seq_len; must divide stage.seq_len
    gap: float = 1.25  # fewest tokens between an answer and where it was given, x attention.window x model.n_layers
    pairs: int = 16  # associative_recall: key-value pairs
    queries: int = 8  # associative_recall: pairs asked
    needles: int = 4  # needle_retrieval: needles, each asked once
    distractors: int = 8  # needle_retrieval: decoy needles (half of them repeat a needle's key)
    value_len: int = 4  # needle_retrieval: tokens of a needle's value
    span: int = 32  # far_copy: tokens copied
    pool: int = 0  # every task: words in each of the key, value and filler pools it draws from; 0: the whole pools


def synthetic_params(src: SourceConfig, seq_len: int, window: int, n_layers: int) -> SyntheticParams:
    """A synthetic source's episode shape in tokens: length 0 -> seq_len, gap -> ceil(gap x window x layers)."""
    return SyntheticParams(task=src.task, length=src.length or seq_len, gap=math.ceil(src.gap * window * n_layers),
                           pairs=src.pairs, queries=src.queries, needles=src.needles, distractors=src.distractors,
                           value_len=src.value_len, span=src.span, pool=src.pool)


@dataclass
class DataConfig:
    kind: str = "default"  # default: the embedded corpus | shards: a prepared corpus at `path` | mix: `sources`
    path: str = ""
    sources: list[SourceConfig] = field(default_factory=list)  # data=mix: the weighted sources
    tokenizer: str = "cl100k_base"
    seed: int = 1234
    document_mask: bool = True
    # Deal each global batch's rows to the data-parallel ranks by attention work inside documents, so that the
    # ranks finish a step together (data/balance.py); false: rank r takes the r-th contiguous slice. The global
    # batch and its gradient are the same either way.
    balance: bool = True
    prefetch: bool = True  # build the next steps' batches on a background thread (pinned memory on CUDA)


@dataclass
class CheckpointConfig:
    enable: bool = True  # false: the run writes no checkpoint at all, not even at the end or on a stop (benchmarks)
    interval: int = 100  # steps between checkpoints (and one at the end)
    interval_minutes: float = 0.0  # also save when this much wall time passed since the last save; 0 = off
    keep: int = 3  # keep the last k
    keep_every_tokens: int = 0  # also save at every multiple of this many tokens and never prune those; 0 = off
    # none: the loop waits for the write | async: copy to host memory, write in the background | async_pinned:
    # the same with a reused pinned buffer filled while the next step computes (docs/training.md, "Checkpoints")
    async_mode: str = "async_pinned"
    writer_threads: int = 4  # DCP FileSystemWriter threads per rank (one file per thread)
    # A previous stage's checkpoint (run dir or step folder): model + thresholds only (context extension); or
    # hf:DIR, a Hugging Face folder of matching shape (a logo export or a Llama model; docs/export.md).
    init_from: str = ""
    resume: bool = True  # resume automatically from the run's latest complete checkpoint


@dataclass
class LoggingConfig:
    interval: int = 10
    progress_bar: bool = True  # on a terminal only: logs get one line per interval
    wandb: bool = False
    wandb_project: str = "logo"
    wandb_mode: str = "auto"  # auto: online when logged in, else offline | online | offline
    tensorboard: bool = False
    heatmap_interval: int = 100  # steps between layers x steps ratio heatmap images
    ratio_window: int = 0  # steps in logo/ratio_window/layer_i (the realized ratio over recent steps); 0: interval
    budget_tolerance: float = 0.02  # warn when, after the P-mask ramp, a layer's windowed ratio is further from rho


@dataclass
class ParallelConfig:
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda
    # Mesh (dp_shard, cp, tp): tensor/sequence-parallel and context-parallel ranks; data parallel takes the rest.
    tp: int = 1
    cp: int = 1
    # How the data-parallel ranks (dp_shard x cp) hold the model (logo/parallel/fsdp.py): replicate (DDP: whole
    # fp32 weights, gradients all-reduced in buckets during the backward, the same arithmetic as one GPU), shard
    # (FSDP2: weights, gradients and optimizer states sharded, bf16 weights all-gathered per unit), or auto: replicate
    # when tp=1 and the unsharded training state fits the GPU (`logo.parallel.memory`), else shard.
    data_parallel: str = "auto"
    # Collective timeouts (seconds): during start-up and the first step (compilation), then for the rest of the run.
    # A rank that dies or hangs makes the others fail within timeout_s; torchrun's --max-restarts or a SLURM
    # requeue then resumes from the last complete checkpoint.
    init_timeout_s: float = 300.0
    timeout_s: float = 100.0
    # NCCL flight recorder: the last N collectives of every rank, dumped to <run_dir>/comm_traces/ when a collective
    # times out (0: off)
    flight_recorder: int = 20000
    # FSDP2 (data_parallel=shard)
    reshard_after_forward: str = "auto"  # auto: every unit but the last block and norm+head | always | never
    reduce_dtype: str = "fp32"  # gradient reduction dtype: fp32 | bf16 (half the bytes, bf16-rounded sums)
    # replicate (DDP): MiB of gradients per all-reduce bucket (smaller: the reduction starts earlier in the backward
    # and overlaps more of it, in more collectives). None: 100 MiB, or for a model with LoGo layers without context
    # parallelism or CUDA graphs one bucket of every gradient, reduced after the backward (fsdp.ddp_bucket_mb)
    bucket_mb: Optional[int] = None
    forward_prefetch: int = 1  # units each unit all-gathers ahead in forward, issued explicitly (0: implicit only)
    backward_prefetch: int = 1  # the same in backward (0: FSDP2's default implicit prefetch of one unit)


@dataclass
class LaunchConfig:
    """SLURM resources of a run, read by launch/sweep.sh (one task per node runs torchrun); training ignores them."""

    nodes: int = 1
    gpus_per_node: int = 8  # 0: a CPU run
    procs_per_node: int = 0  # training processes per node; 0: one per GPU (CPU runs: 1)
    cpus_per_node: int = 32  # CPU cores of the one task per node (torchrun and its workers)
    time: str = "24:00:00"  # SLURM time limit of one job; a longer run requeues itself and resumes


@dataclass
class EvalConfig:
    """Held-out loss during training (`logo/train/heldout.py`), on the corpus's validation split."""

    interval: int = 0  # optimizer steps between evaluations (and one at the last step); 0 = off
    tokens: int = 0  # held-out tokens per evaluation: the first ~N of the split (all of it if smaller)
    micro_batch: int = 0  # sequences per forward; 0 = train.micro_batch
    split: str = "val"


@dataclass
class RunConfig:
    name: str = ""  # default: <model>-<attention>-<stage>
    dir: str = ""  # default: runs/<name>
    # the run directory's lock (logo/train/rundir.py): on filesystems without fcntl locks, a holder whose heartbeat
    # is older than this is taken to be dead
    lock_stale_minutes: float = 10.0
    # train a finished run further (a larger train.steps or token budget than it completed): resumes from its last
    # checkpoint with the learning-rate schedule stretched to the new length; without it a finished run stays finished
    extend: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    experiment: str = ""  # set by experiment presets
    dry_run: bool = False


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="logo_schema", node=Config)


def compose(overrides: list[str]) -> tuple[Config, dict, str]:
    """The config `train.py OVERRIDES` would run (Hydra's compose API; for benchmarks and tools):
    (validated Config, resolved dict as written to config.yaml, the chosen attention option's name)."""
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict
    register_configs()
    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base=None):
        check_group_choices(overrides)
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    attention = cfg.hydra.runtime.choices.get("attention", "")
    with open_dict(cfg):
        del cfg["hydra"]
    return to_dataclass(cfg), OmegaConf.to_container(cfg, resolve=True), attention


class UnknownOption(ConfigError):
    """A config group set to an option that does not exist (Hydra skips a missing optional one silently)."""


def check_group_choices(overrides: list[str]) -> None:
    """UnknownOption naming the override, its closest options and the group's options when a command-line
    override picks an option a config group does not have (`experiment=controled_1.5b/logo`, with or without +).
    Runs inside Hydra's initialize context; overrides Hydra cannot parse are left to Hydra."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return
    loader = GlobalHydra.instance().config_loader()
    for o in parsed:
        value = None if o.is_delete() or o.is_sweep_override() else o.value()
        if not isinstance(value, str) or not loader.repository.group_exists(o.key_or_group):
            continue
        options = group_options(loader, o.key_or_group)
        if value not in options:
            raise UnknownOption(unknown_option_message(o.key_or_group, value, options))


def group_options(loader, group: str) -> list[str]:
    """Every option of a config group, those in its sub-folders as 'folder/name' (experiment presets)."""
    names = list(loader.get_group_options(group))
    for sub in loader.list_groups(group):
        names += [f"{sub}/{n}" for n in group_options(loader, f"{group}/{sub}")]
    return sorted(names)


def unknown_option_message(group: str, value: str, options: list[str]) -> str:
    """One line: the override, the closest options (difflib) and the group's options (a count when many)."""
    import difflib
    closest = difflib.get_close_matches(value, options, n=3, cutoff=0.0)
    listed = (f"choose one of {', '.join(options)}" if len(options) <= 20 else
              f"{len(options)} options in conf/{group}/")
    return (f"invalid config {group}={value}: conf/{group} has no option {value!r}; closest: {', '.join(closest)}; "
            f"{listed}")


def to_dataclass(cfg: DictConfig) -> Config:
    """The resolved Hydra config as plain, validated dataclasses."""
    try:
        obj: Config = OmegaConf.to_object(cfg)
    except Exception as e:  # noqa: BLE001 - OmegaConf type/validation errors: one line naming the key
        raise ConfigError(f"invalid config: {e}".splitlines()[0] + _first_key_hint(e)) from None
    if obj.model.attention != AttentionConfig():
        raise ConfigError("invalid config model.attention: set attention fields at the top level "
                          "(attention=<preset> attention.rho=0.25 ...), not under model.attention")
    model = dataclasses.replace(obj.model, attention=obj.attention)
    if obj.stage.rope_theta is not None:
        model = dataclasses.replace(model, rope_theta=obj.stage.rope_theta)
    obj.model = model
    validate(obj)
    return obj


def _first_key_hint(e: Exception) -> str:
    key = getattr(e, "full_key", None)
    return f" (key {key})" if key else ""


def validate(c: Config) -> None:
    c.model.validate()
    s, t = c.stage, c.train
    for name, v in (("stage.seq_len", s.seq_len), ("stage.global_batch_tokens", s.global_batch_tokens),
                    ("train.micro_batch", t.micro_batch), ("checkpoint.interval", c.checkpoint.interval),
                    ("checkpoint.keep", c.checkpoint.keep), ("logging.interval", c.logging.interval)):
        if not isinstance(v, int) or v < 1:
            _fail(name, v, "must be a positive integer")
    if s.global_batch_tokens % s.seq_len:
        _fail("stage.global_batch_tokens", s.global_batch_tokens, f"not a multiple of stage.seq_len={s.seq_len}")
    if s.tokens < 0 or s.tokens_per_param < 0 or (s.tokens == 0 and s.tokens_per_param == 0 and t.steps <= 0):
        _fail("stage.tokens", s.tokens, "set stage.tokens, stage.tokens_per_param or train.steps")
    if t.steps < 0:
        _fail("train.steps", t.steps, "must be >= 0 (0 = derive from the token budget)")
    if not (0 < s.lr_min <= s.lr):
        _fail("stage.lr_min", s.lr_min, f"must be in (0, stage.lr={s.lr}]")
    if not (0 <= s.warmup_fraction < 1):
        _fail("stage.warmup_fraction", s.warmup_fraction, "must be in [0, 1)")
    if t.dtype not in ("auto", "fp32", "bf16"):
        _fail("train.dtype", t.dtype, "choose auto, fp32 or bf16")
    if t.loss not in LOSS_IMPLS:
        _fail("train.loss", t.loss, f"choose one of {list(LOSS_IMPLS)}")
    if t.compile_mode not in COMPILE_MODES:
        _fail("train.compile_mode", t.compile_mode, f"choose one of {list(COMPILE_MODES)}")
    if t.grad_clip <= 0:
        _fail("train.grad_clip", t.grad_clip, "must be > 0")
    if not isinstance(t.gc_interval, int) or t.gc_interval < 0:
        _fail("train.gc_interval", t.gc_interval, "must be an integer >= 0 (0: Python's automatic GC)")
    validate_data(c)
    if c.parallel.backend not in ("auto", "nccl", "gloo"):
        _fail("parallel.backend", c.parallel.backend, "choose auto, nccl or gloo")
    if c.parallel.device not in ("auto", "cpu", "cuda"):
        _fail("parallel.device", c.parallel.device, "choose auto, cpu or cuda")
    for name in ("init_timeout_s", "timeout_s"):
        if not getattr(c.parallel, name) > 0:
            _fail(f"parallel.{name}", getattr(c.parallel, name), "must be > 0 seconds")
    if c.parallel.flight_recorder < 0:
        _fail("parallel.flight_recorder", c.parallel.flight_recorder, "must be >= 0 (collectives recorded; 0: off)")
    if c.parallel.data_parallel not in ("auto", "replicate", "shard"):
        _fail("parallel.data_parallel", c.parallel.data_parallel, "choose auto, replicate or shard")
    if c.parallel.data_parallel == "replicate" and c.parallel.tp > 1:
        _fail("parallel.data_parallel", c.parallel.data_parallel, f"replication composes with context parallelism "
              f"only; with parallel.tp={c.parallel.tp} use shard (or auto)")
    if c.parallel.reshard_after_forward not in ("auto", "always", "never"):
        _fail("parallel.reshard_after_forward", c.parallel.reshard_after_forward, "choose auto, always or never")
    for name in ("tp", "cp"):
        v = getattr(c.parallel, name)
        if not isinstance(v, int) or v < 1:
            _fail(f"parallel.{name}", v, "must be an integer >= 1")
    if c.parallel.tp > 1:
        check_tp(c.model, c.parallel.tp)
        if c.stage.seq_len % c.parallel.tp:
            _fail("parallel.tp", c.parallel.tp, f"stage.seq_len={c.stage.seq_len} must be divisible by it "
                  "(sequence parallelism splits the residual stream along time)")
    if c.parallel.cp > 1:
        check_cp(c.stage.seq_len, c.parallel.cp)
        if not c.model.attention.document_mask:
            _fail("parallel.cp", c.parallel.cp, "context parallelism needs attention.document_mask=true (use "
                  "data.document_mask=false to attend across documents)")
        if c.parallel.tp > 1 and (c.stage.seq_len // c.parallel.cp) % c.parallel.tp:
            _fail("parallel.tp", c.parallel.tp, f"each context-parallel shard of {c.stage.seq_len // c.parallel.cp}"
                  " tokens must be divisible by it")
    if c.parallel.reduce_dtype not in ("fp32", "bf16"):
        _fail("parallel.reduce_dtype", c.parallel.reduce_dtype, "choose fp32 or bf16")
    if c.parallel.bucket_mb is not None and not c.parallel.bucket_mb >= 1:
        _fail("parallel.bucket_mb", c.parallel.bucket_mb, "must be >= 1 (MiB per all-reduce bucket) or null (automatic)")
    for name in ("forward_prefetch", "backward_prefetch"):
        v = getattr(c.parallel, name)
        if not isinstance(v, int) or not 0 <= v <= 4:
            _fail(f"parallel.{name}", v, "must be an integer in [0, 4] (units prefetched ahead)")
    if not isinstance(c.logging.ratio_window, int) or c.logging.ratio_window < 0:
        _fail("logging.ratio_window", c.logging.ratio_window, "must be an integer >= 0 (0 = logging.interval)")
    if not (c.logging.budget_tolerance >= 0):
        _fail("logging.budget_tolerance", c.logging.budget_tolerance, "must be >= 0 (0 = no budget warning)")
    if not isinstance(c.run.lock_stale_minutes, (int, float)) or c.run.lock_stale_minutes <= 0:
        _fail("run.lock_stale_minutes", c.run.lock_stale_minutes, "must be > 0")
    ck = c.checkpoint
    if ck.async_mode not in ("none", "async", "async_pinned"):
        _fail("checkpoint.async_mode", ck.async_mode, "choose none, async or async_pinned")
    if not isinstance(ck.interval_minutes, (int, float)) or ck.interval_minutes < 0:
        _fail("checkpoint.interval_minutes", ck.interval_minutes, "must be >= 0 (0 = off)")
    if not isinstance(ck.keep_every_tokens, int) or ck.keep_every_tokens < 0:
        _fail("checkpoint.keep_every_tokens", ck.keep_every_tokens, "must be an integer >= 0 (0 = off)")
    if not isinstance(ck.writer_threads, int) or not 1 <= ck.writer_threads <= 64:
        _fail("checkpoint.writer_threads", ck.writer_threads, "must be an integer in [1, 64]")
    if not isinstance(ck.enable, bool):
        _fail("checkpoint.enable", ck.enable, "must be true or false")
    if not ck.enable and (ck.keep_every_tokens or ck.interval_minutes):
        which = "keep_every_tokens" if ck.keep_every_tokens else "interval_minutes"
        _fail(f"checkpoint.{which}", getattr(ck, which), "asks for saves but checkpoint.enable=false writes none")
    if c.logging.wandb_mode not in ("auto", "online", "offline"):
        _fail("logging.wandb_mode", c.logging.wandb_mode, "choose auto, online or offline")
    for name, v in (("eval.interval", c.eval.interval), ("eval.tokens", c.eval.tokens),
                    ("eval.micro_batch", c.eval.micro_batch)):
        if not isinstance(v, int) or v < 0:
            _fail(name, v, "must be an integer >= 0 (0 = off / default)")
    if c.eval.interval > 0 and c.eval.tokens == 0:
        _fail("eval.tokens", c.eval.tokens,
              "set a held-out token budget > 0, or eval.interval=0 to turn evaluation off")
    validate_launch(c.launch)


def validate_launch(la: LaunchConfig) -> None:
    for name, v, lo in (("nodes", la.nodes, 1), ("gpus_per_node", la.gpus_per_node, 0),
                        ("procs_per_node", la.procs_per_node, 0), ("cpus_per_node", la.cpus_per_node, 1)):
        if not isinstance(v, int) or v < lo:
            _fail(f"launch.{name}", v, f"must be an integer >= {lo}")
    if not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", la.time):
        _fail("launch.time", la.time, "not a SLURM time limit (MM, HH:MM:SS or D-HH:MM:SS)")


SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def validate_data(c: Config) -> None:
    d = c.data
    if d.kind not in ("default", "shards", "mix"):
        _fail("data.kind", d.kind, "choose default, shards or mix")
    if d.kind == "shards" and not d.path:
        _fail("data.path", d.path, "data=shards needs data.path=DIR (a corpus made by python -m data.prepare)")
    if d.kind != "mix":
        if d.sources:
            _fail("data.sources", [s.name for s in d.sources], f"only data=mix reads sources (data.kind={d.kind!r})")
        return
    if not d.sources:
        _fail("data.sources", [], "data=mix needs at least one source (docs/data.md, Mixtures)")
    names = [s.name for s in d.sources]
    for i, src in enumerate(d.sources):
        validate_source(c, i, src)
        if names.index(src.name) != i:
            _fail(f"data.sources.{i}.name", src.name, "another source has this name; names must be unique")
    if c.eval.interval > 0 and not any(s.kind in ("default", "shards") for s in d.sources):
        _fail("eval.interval", c.eval.interval, "the held-out loss reads a corpus's validation split and this "
              "mixture has no default or shards source; set eval.interval=0 (score synthetic sources with "
              "python -m logo.eval synthetic)")


def validate_source(c: Config, i: int, src: SourceConfig) -> None:
    """One source of data=mix: errors name data.sources.<i>.<field>."""
    key = f"data.sources.{i}"
    if not SOURCE_NAME.fullmatch(src.name or ""):
        _fail(f"{key}.name", src.name, "every source needs a name of letters, digits, '_', '.' or '-'")
    if src.kind not in ("default", "shards", "synthetic"):
        _fail(f"{key}.kind", src.kind, "unknown source kind; choose default, shards or synthetic")
    if not (isinstance(src.weight, (int, float)) and math.isfinite(src.weight) and src.weight > 0):
        _fail(f"{key}.weight", src.weight, "must be a finite number > 0 (weights are relative)")
    if src.kind == "shards" and not src.path:
        _fail(f"{key}.path", src.path, "a shards source needs path=DIR (a corpus made by python -m data.prepare)")
    if src.kind != "shards" and src.path:
        _fail(f"{key}.path", src.path, f"only a shards source reads a path (kind={src.kind!r})")
    if src.kind != "synthetic":
        if src.task:
            _fail(f"{key}.task", src.task, f"only a synthetic source has a task (kind={src.kind!r})")
        return
    if src.task not in TASKS:
        _fail(f"{key}.task", src.task, f"unknown synthetic task; choose one of {list(TASKS)}")
    defaults = SourceConfig()
    for name in sorted({p for ps in TASK_PARAMS.values() for p in ps} - set(TASK_PARAMS[src.task])):
        if getattr(src, name) != getattr(defaults, name):
            _fail(f"{key}.{name}", getattr(src, name), f"task {src.task} does not read it (it reads "
                  f"{', '.join(('length', 'gap') + TASK_PARAMS[src.task])})")
    if not (isinstance(src.gap, (int, float)) and math.isfinite(src.gap) and src.gap > 0):
        _fail(f"{key}.gap", src.gap, "must be a number > 0 (a multiple of attention.window x model.n_layers)")
    T, m = c.stage.seq_len, c.model
    if src.length < 0 or src.length > T or (src.length and T % src.length):
        _fail(f"{key}.length", src.length, f"must divide stage.seq_len={T} (0: one episode per sequence), so that "
              f"every sequence holds whole episodes")
    try:
        check_params(synthetic_params(src, T, m.attention.window, m.n_layers))
    except ParamError as e:
        why = e.why
        if e.field in ("length", "gap"):
            why += (f" (gap {src.gap} x attention.window={m.attention.window} x model.n_layers={m.n_layers} = "
                    f"{math.ceil(src.gap * m.attention.window * m.n_layers)} tokens; length 0 is stage.seq_len={T})")
        _fail(f"{key}.{e.field}", getattr(src, e.field), why)
