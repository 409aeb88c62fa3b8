"""Bad configs and bad checkpoint paths stop with one clear message naming the field (or path)."""
import pytest
from hydra import compose, initialize_config_dir

from logo.config import ConfigError
from logo.run.config import register_configs, to_dataclass

from conftest import ROOT, TINY_RUN, run_train


def load(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return to_dataclass(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("overrides,field", [
    (["attention.rho=0"], "attention.rho"),
    (["attention.rho=1.5"], "attention.rho"),
    (["attention.rho=-0.1"], "attention.rho"),
    (["model.n_heads=3"], "model.n_heads"),
    (["attention.window=0"], "attention.window"),
    (["attention.kind=sparse"], "attention.kind"),
    (["attention.transform=mlp"], "attention.transform"),
    (["attention=inter_layer", "attention.global_fraction=0.3"], "attention.global_fraction"),
    (["stage.global_batch_tokens=1000"], "stage.global_batch_tokens"),
    (["stage.lr_min=1.0"], "stage.lr_min"),
    (["stage.seq_len=0"], "stage.seq_len"),
    (["checkpoint.interval=0"], "checkpoint.interval"),
    (["train.dtype=fp8"], "train.dtype"),
    (["train.compile_mode=fast"], "train.compile_mode"),
    (["data=shards", "data.path="], "data.path"),
    (["model.attention.rho=0.3"], "model.attention"),
    (["parallel.reshard_after_forward=sometimes"], "parallel.reshard_after_forward"),
    (["parallel.reduce_dtype=fp16"], "parallel.reduce_dtype"),
    (["parallel.bucket_mb=0"], "parallel.bucket_mb"),
    (["parallel.forward_prefetch=-1"], "parallel.forward_prefetch"),
    (["parallel.backward_prefetch=9"], "parallel.backward_prefetch"),
    (["eval.interval=-1"], "eval.interval"),
    (["eval.interval=10", "eval.tokens=0"], "eval.tokens"),
    (["checkpoint.async_mode=background"], "checkpoint.async_mode"),
    (["checkpoint.interval_minutes=-5"], "checkpoint.interval_minutes"),
    (["checkpoint.keep_every_tokens=-1"], "checkpoint.keep_every_tokens"),
    (["checkpoint.writer_threads=0"], "checkpoint.writer_threads"),
    (["checkpoint.enable=false", "checkpoint.keep_every_tokens=4096"], "checkpoint.keep_every_tokens"),
    (["checkpoint.enable=false", "checkpoint.interval_minutes=30"], "checkpoint.interval_minutes"),
    (["run.lock_stale_minutes=0"], "run.lock_stale_minutes"),
])
def test_bad_value_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert field in str(e.value)
    value = overrides[-1].split("=", 1)[1]
    if value and field != "model.attention":
        assert value in str(e.value)  # and the offending value


def test_rho_one_is_allowed():
    assert load("attention.rho=1.0").model.attention.rho == 1.0


@pytest.mark.parametrize("overrides,needle", [
    (["attention.rho=1.5"], "attention.rho=1.5"),
    (["model.n_heads=3"], "model.n_heads=3"),
    (["attention.window=0"], "attention.window=0"),
    (["attention.kind=sparse"], "attention.kind='sparse'"),
    (["attention=nonexistent"], "invalid config attention=nonexistent: conf/attention has no option"),
    (["model=nonexistent"], "invalid config model=nonexistent: conf/model has no option 'nonexistent'; closest: "),
    (["train.nonexistent=3"], "Could not override 'train.nonexistent'"),
    (["stage.seq_len=abc"], "stage.seq_len"),
    (["model.dim=100"], "invalid config model.dim=100: with model.n_heads=4 each head has 25 channels"),
])
def test_cli_prints_one_clear_error(overrides, needle, tmp_path):
    """Hydra's unknown options and keys too: one `error:` line, exit code 2, no traceback."""
    p = run_train(*overrides, "dry_run=true", f"run.dir={tmp_path}", check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr + p.stdout


@pytest.mark.parametrize("override,closest", [
    ("experiment=controled_1.5b/logo", "closest: controlled_1.5b/logo, "),
    ("+experiment=controled_1.5b/logo", "closest: controlled_1.5b/logo, "),
    ("experiment=nope/x", "closest: "),
    ("attention=logoo", "closest: logo, "),
])
def test_unknown_group_option_is_refused_before_anything_runs(override, closest, tmp_path):
    """An option a config group does not have (also the optional `experiment`, which Hydra would skip silently
    and train the default config): one line with the closest options, exit 2, no run directory."""
    p = run_train(override, f"run.dir={tmp_path / 'run'}", check=False)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    value = override.lstrip("+")
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    group, option = value.split("=")
    assert lines[0].startswith(f"error: invalid config {value}: conf/{group} has no option {option!r}; {closest}")
    assert not (tmp_path / "run").exists()


def test_group_options_include_nested_presets():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from logo.run.config import group_options
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        options = group_options(GlobalHydra.instance().config_loader(), "experiment")
    presets = sorted(str(f.relative_to(ROOT / "conf" / "experiment").with_suffix(""))
                     for f in (ROOT / "conf" / "experiment").rglob("*.yaml"))
    assert options == presets and "controlled_1.5b/logo" in options


def test_default_dry_run_plans_for_one_process(tmp_path):
    """`python train.py dry_run=true` on the default config: planned for one process, and says why."""
    p = run_train("dry_run=true", f"run.dir={tmp_path}")
    assert "world size 1 (one process" in p.stdout and (tmp_path / "plan.json").exists()
    p = run_train("dry_run=true", "launch.gpus_per_node=2", "stage.global_batch_tokens=2048", f"run.dir={tmp_path}")
    assert "world size 2 (the SLURM resources of launch.* options" in p.stdout


def test_unwritable_run_dir_is_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    p = run_train(*TINY_RUN, "train.steps=1", f"run.dir={blocked / 'run'}", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: invalid config run.dir='{blocked / 'run'}': it cannot be created or written "
                      f"(NotADirectoryError: Not a directory); choose a writable directory"]


def test_missing_init_checkpoint_is_named(tmp_path):
    missing = tmp_path / "no_such_run"
    p = run_train(*TINY_RUN, "train.steps=2", f"run.dir={tmp_path / 'run'}", f"checkpoint.init_from={missing}",
                  check=False)
    assert p.returncode != 0 and str(missing) in p.stderr and "does not exist" in p.stderr
    assert "Traceback" not in p.stderr


def test_corrupt_checkpoint_is_named(tmp_path):
    bad = tmp_path / "bad_ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"not a checkpoint")
    (bad / "train_state.pt").write_bytes(b"garbage")
    p = run_train(*TINY_RUN, "train.steps=2", f"run.dir={tmp_path / 'run'}", f"checkpoint.init_from={bad}",
                  check=False)
    assert p.returncode != 0 and str(bad) in p.stderr
    assert "Traceback" not in p.stderr
    # a directory that is not a checkpoint at all
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run_train(*TINY_RUN, "train.steps=2", f"run.dir={tmp_path / 'run2'}", f"checkpoint.init_from={empty}",
                  check=False)
    assert p.returncode != 0 and str(empty) in p.stderr and "not a complete checkpoint" in p.stderr
