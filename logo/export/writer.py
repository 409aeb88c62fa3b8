"""Write a Hugging Face folder from a loaded native model (weights, config, generation config, tokenizer, code).

attention=full -> a plain Llama folder (model_type "llama", no custom code). Every other kind -> model_type
"logo" with `configuration_logo.py` / `modeling_logo.py` next to the weights, registered through `auto_map`.
The padded vocabulary rows are kept (vocab_size = the padded size), so logits match the native model's.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from data.outputs import OutputError, OutputKind, check_out, folder_swapped_in
from logo.config import ConfigError
from logo.run.hf_layout import to_hf
from logo.export.tokenizer import save_tokenizer
from logo.run.hf import ExportError, is_hf_folder
from logo.run.load import load_model

REMOTE_DIR = Path(__file__).with_name("remote")
REMOTE_FILES = ("configuration_logo.py", "modeling_logo.py")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MAX_SHARD = "5GB"


def project_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("logo")
    except PackageNotFoundError:
        return "unknown"


def provenance(loaded) -> dict:
    """What the exported config records about its origin (read back by `logo.run.hf.model_config`)."""
    m = dataclasses.asdict(loaded.model.cfg)
    attn = m.pop("attention")
    return {"version": project_version(), "step": loaded.step, "source": str(loaded.checkpoint),
            "model": m, "attention": attn, "seq_len": loaded.seq_len, "tokenizer": loaded.cfg.data.tokenizer}


def hf_config(loaded, dtype: str, eot: int):
    """A LlamaConfig (full attention) or the remote LogoConfig describing `loaded.model`."""
    model, cfg = loaded.model, loaded.model.cfg
    common = dict(vocab_size=cfg.padded_vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.norm_eps, max_position_embeddings=loaded.seq_len, tie_word_embeddings=False,
                  bos_token_id=eot, eos_token_id=eot, logo=provenance(loaded),
                  dtype="bfloat16" if dtype == "bf16" else "float32")
    if cfg.attention.kind == "full":
        from transformers import LlamaConfig
        return LlamaConfig(num_key_value_heads=cfg.n_heads, rope_theta=cfg.rope_theta, hidden_act="silu",
                           attention_bias=False, mlp_bias=False, **common)
    from logo.export.remote.configuration_logo import LogoConfig
    a = cfg.attention
    kinds = a.layer_kinds(cfg.n_layers)
    thresholds = [float(model.layers[str(i)].attention.threshold) if k == "logo" else None
                  for i, k in enumerate(kinds)]
    c = LogoConfig(rope_theta=cfg.rope_theta, layer_kinds=kinds, window=a.window,
                   num_global_heads=a.num_global_heads(cfg.n_heads) if a.kind == "intra_layer" else 0,
                   transform=a.transform, context_norm=a.context_norm, fusion=a.fusion, thresholds=thresholds,
                   **common)
    c.auto_map = {"AutoConfig": "configuration_logo.LogoConfig",
                  "AutoModelForCausalLM": "modeling_logo.LogoForCausalLM"}
    c.architectures = ["LogoForCausalLM"]
    return c


def write_weights(out: Path, state: dict[str, torch.Tensor], progress: Optional[bool] = None) -> None:
    """model.safetensors, or shards near 5 GB with model.safetensors.index.json (written by the `safetensors`
    library); a bar on stderr counts the bytes written, shard by shard (progress None: only when stderr is a
    terminal)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from tqdm import tqdm
    split = split_torch_state_dict_into_shards(state, max_shard_size=MAX_SHARD,
                                               filename_pattern="model{suffix}.safetensors")
    total = sum(t.numel() * t.element_size() for t in state.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing weights", file=sys.stderr,
              disable=None if progress is None else not progress, leave=False) as bar:
        for filename, names in split.filename_to_tensors.items():
            bar.set_postfix_str(filename)
            shard = {n: state[n] for n in names}
            save_file(shard, out / filename, metadata={"format": "pt"})
            bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def write_folder(loaded, out: Path, dtype: str, progress: Optional[bool] = None) -> None:
    """Everything of an export into `out` (an empty folder)."""
    from transformers import GenerationConfig
    cfg = loaded.model.cfg
    eot = save_tokenizer(loaded.cfg.data.tokenizer, out, loaded.seq_len)
    state = {k: v.detach().to("cpu", DTYPES[dtype]) for k, v in loaded.model.state_dict().items()}
    write_weights(out, to_hf(state, cfg.head_dim), progress)
    config = hf_config(loaded, dtype, eot)
    config.save_pretrained(str(out))
    cached = cfg.attention.kind == "full"  # the remote code re-encodes instead of caching
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False,
                     use_cache=cached).save_pretrained(str(out))
    if not cached:
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_DIR / name, out / name)


def is_export(config: Path) -> bool:
    """Whether a config.json is one this module wrote (it records the export's provenance under "logo")."""
    try:
        return isinstance(json.loads(config.read_text()).get("logo"), dict)
    except (OSError, ValueError, AttributeError):
        return False


EXPORT = OutputKind("an export", ("config.json",),
                    ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", *REMOTE_FILES),
                    is_own=is_export)


def sources(path) -> list[Path]:
    """What exporting `path` reads: a run's checkpoints and config.yaml, a checkpoint folder and its run's
    config.yaml, or an exported folder."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        return [p / "checkpoints", p / "config.yaml"]
    if is_hf_folder(p):
        return [p]
    return [p, p.parent.parent / "config.yaml"] if p.parent.name == "checkpoints" else [p]


def check_target(path, out: Path, force: bool) -> None:
    """ExportError in one line unless `out` may be written: new, empty, or (with --force) an earlier export that
    holds nothing else and overlaps nothing the export reads."""
    try:
        if check_out(out, EXPORT, sources(path)) and not force:
            raise ExportError(f"output folder {out} holds an earlier export; pass --force to replace it")
    except OutputError as e:
        raise ExportError(str(e)) from None


def export(path, out, dtype: str = "bf16", force: bool = False, device: str = "cpu",
           progress: Optional[bool] = None) -> Path:
    """Export a run directory, a checkpoint folder or an exported folder to a Hugging Face folder `out`.
    Written to a temporary sibling folder and swapped in at the end: `out` never holds a partial export, and
    only an earlier export is ever replaced (force). Files and folders get the permissions of the user's umask.
    progress: a bar while the weights are written (None: only when stderr is a terminal)."""
    if dtype not in DTYPES:
        raise ConfigError(f"invalid dtype {dtype!r}: choose one of {list(DTYPES)}")
    out = Path(out)
    check_target(path, out, force)
    loaded = load_model(path, device=device, dtype="fp32")
    try:
        with folder_swapped_in(out, EXPORT, sources(path)) as tmp:
            write_folder(loaded, tmp, dtype, progress)
    except OutputError as e:
        raise ExportError(str(e)) from None
    return out
