"""Read a Hugging Face folder (a logo export or a Llama-architecture model) into the native model.

Needs only `safetensors` (no `transformers`). Two uses:
- `load_pretrained` / evaluation: the native config comes from the folder itself and every tensor must be there;
- `checkpoint.init_from=hf:DIR`: the run's own config; the folder must match its shape, and LoGo-only
  parameters a plain Llama folder lacks keep their identity initialisation (thresholds too, unless the folder
  is a logo export that has them).
"""
from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Optional

import torch

from logo.config import AttentionConfig, ConfigError, ModelConfig
from logo.run.hf_layout import from_hf, is_logo_only, native_name_to_hf
from logo.model import Transformer
from logo.run.checkpoint import CheckpointError

log = logging.getLogger("logo.export")
MODEL_TYPES = ("llama", "logo")
HF_PREFIX = "hf:"


class ExportError(CheckpointError):
    """A Hugging Face folder is missing, corrupt or does not fit the model; the message names what."""


def is_hf_folder(path) -> bool:
    """A folder with a config.json that is neither a run directory nor a DCP checkpoint."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").exists() and not (p / ".metadata").exists() \
        and not (p / "checkpoints").is_dir()


def strip_prefix(spec: str) -> Optional[Path]:
    """'hf:DIR' -> Path(DIR); anything else -> None."""
    return Path(spec[len(HF_PREFIX):]) if spec.startswith(HF_PREFIX) else None


def read_config(path) -> dict:
    """config.json of a supported folder (model_type llama or logo); ExportError in one line otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"Hugging Face folder {p} does not exist")
    f = p / "config.json"
    if not f.exists():
        raise ExportError(f"{p} is not a Hugging Face folder: it has no config.json")
    try:
        d = json.loads(f.read_text())
        assert isinstance(d, dict), "not a JSON object"
    except Exception as e:  # noqa: BLE001 - any decode failure: one line naming the file
        raise ExportError(f"{f} is corrupted: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if d.get("model_type") not in MODEL_TYPES:
        raise ExportError(f"{f}: model_type {d.get('model_type')!r} is not supported; logo reads {list(MODEL_TYPES)}")
    return d


def _rope_theta(d: dict) -> float:
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise ExportError(f"rope_type {kind!r} is not supported (logo uses plain RoPE)")
    return float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))


def _check_llama(d: dict) -> None:
    h, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if kv != h:
        raise ExportError(f"grouped-query attention is not supported: num_key_value_heads={kv} but "
                          f"num_attention_heads={h} (logo models are multi-head)")
    if d.get("hidden_act", "silu") != "silu":
        raise ExportError(f"hidden_act={d['hidden_act']!r} is not supported (logo uses SwiGLU with silu)")
    for k in ("attention_bias", "mlp_bias"):
        if d.get(k):
            raise ExportError(f"{k}=true is not supported (logo projections have no bias)")
    hd = d.get("head_dim") or d["hidden_size"] // h
    if hd * h != d["hidden_size"]:
        raise ExportError(f"head_dim={hd} x num_attention_heads={h} != hidden_size={d['hidden_size']}")
    _rope_theta(d)


def model_config(d: dict) -> tuple[ModelConfig, dict]:
    """The native ModelConfig a folder describes, and its logo provenance ({} for a plain Llama folder)."""
    meta = d.get("logo") or {}
    if "model" in meta and "attention" in meta:
        names = {f.name for f in fields(ModelConfig)} - {"attention"}
        attn = AttentionConfig(**{k: v for k, v in meta["attention"].items()
                                  if k in {f.name for f in fields(AttentionConfig)}})
        return ModelConfig(**{k: v for k, v in meta["model"].items() if k in names}, attention=attn).validate(), meta
    _check_llama(d)
    return ModelConfig(name="hf", dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
                       n_heads=d["num_attention_heads"], vocab_size=d["vocab_size"], vocab_multiple=1,
                       ffn_hidden=d["intermediate_size"], rope_theta=_rope_theta(d),
                       norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                       attention=AttentionConfig(kind="full")).validate(), meta


def check_compatible(d: dict, cfg: ModelConfig, path) -> None:
    """One-line ExportError naming the first shape the folder and the model disagree on."""
    _check_llama(d)
    hd = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    for key, have, want in (("hidden_size", d["hidden_size"], cfg.dim),
                            ("num_hidden_layers", d["num_hidden_layers"], cfg.n_layers),
                            ("num_attention_heads", d["num_attention_heads"], cfg.n_heads),
                            ("head_dim", hd, cfg.head_dim),
                            ("intermediate_size", d["intermediate_size"], cfg.hidden_dim)):
        if have != want:
            raise ExportError(f"{path}: {key}={have} does not match the model's {want}")
    if d["vocab_size"] not in (cfg.vocab_size, cfg.padded_vocab_size):
        raise ExportError(f"{path}: vocab_size={d['vocab_size']} does not match the model's vocabulary "
                          f"({cfg.vocab_size}, padded {cfg.padded_vocab_size}); is it another tokenizer?")


def read_weights(path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors or of the shards in model.safetensors.index.json (CPU)."""
    from safetensors.torch import load_file
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as e:  # noqa: BLE001
            raise ExportError(f"{index} is corrupted: {type(e).__name__}: {e}") from None
    elif (p / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{p} has no model.safetensors (nor a model.safetensors.index.json)")
    out = {}
    for name in files:
        try:
            out.update(load_file(str(p / name)))
        except Exception as e:  # noqa: BLE001 - missing shard, truncated file, bad header
            raise ExportError(f"could not read weights {p / name}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return out


def _fit_vocab(t: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """An unpadded (V, d) table into the padded (V_pad, d) one: rows past V keep their initial values."""
    if t.shape[0] < init.shape[0]:
        out = init.clone()
        out[:t.shape[0]] = t
        return out
    return t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP-sharded DTensor gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def native_state(model, path, strict: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """A folder's weights and LoGo thresholds as a full native state dict for `model`, and what was loaded.
    strict: every parameter and threshold must come from the folder; else LoGo-only ones may keep their init."""
    path = Path(path)
    d = read_config(path)
    cfg: ModelConfig = model.cfg
    check_compatible(d, cfg, path)
    hf = read_weights(path)
    if "lm_head.weight" not in hf and d.get("tie_word_embeddings") and "model.embed_tokens.weight" in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # tied embeddings: the head is the table
    native, unknown = from_hf(hf, cfg.head_dim)
    out, missing, kept = {}, [], []
    for name, t in model.state_dict().items():
        if name.endswith("attention.threshold"):
            continue
        if name not in native:
            (kept if is_logo_only(name) and not strict else missing).append(name)
            continue
        src = native[name]
        if name in ("tok_embeddings.weight", "output.weight"):
            src = _fit_vocab(src, _full(t).cpu())
        if src.shape != t.shape:
            raise ExportError(f"{path}: tensor {native_name_to_hf(name)} has shape {tuple(src.shape)}, "
                              f"the model needs {tuple(t.shape)}")
        out[name] = src.to(t.dtype)
    if missing:
        raise ExportError(f"{path} lacks {len(missing)} tensor(s) the model needs, e.g. "
                          f"{native_name_to_hf(missing[0])}")
    extra = sorted(set(native) - set(out)) + unknown
    if extra:
        log.info("ignored %d tensor(s) of %s the model does not have, e.g. %s", len(extra), path, extra[0])
    thresholds = d.get("thresholds") or [None] * cfg.n_layers
    loaded_th = []
    for i in model.logo_layer_ids:
        b = thresholds[i] if i < len(thresholds) else None
        if b is None:
            if strict:
                raise ExportError(f"{path}: config.json has no LoGo threshold for layer {i}")
            continue
        out[f"layers.{i}.attention.threshold"] = torch.full((1,), float(b), dtype=torch.float32)
        loaded_th.append(i)
    return out, {"kept_init": kept, "ignored": extra, "threshold_layers": loaded_th}


def load_into(model, path, strict: bool) -> dict:
    """Copy a folder's weights (and LoGo thresholds) into a native `Transformer`, plain or FSDP-sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    state, info = native_state(model, path, strict)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return info


def has_thresholds(spec: str) -> bool:
    """Whether an init_from 'hf:DIR' folder carries LoGo thresholds (a logo export of a LoGo model)."""
    p = strip_prefix(spec)
    if p is None or not (p / "config.json").exists():
        return False
    try:
        return any(b is not None for b in json.loads((p / "config.json").read_text()).get("thresholds") or [])
    except Exception:  # noqa: BLE001 - a broken folder is reported where it is loaded
        return False


def native_from_folder(path, device) -> tuple:
    """(model in eval mode on `device`, ModelConfig, logo provenance) from a folder's own config; strict."""
    d = read_config(path)
    try:
        cfg, meta = model_config(d)
    except (KeyError, TypeError) as e:
        raise ExportError(f"{Path(path) / 'config.json'} lacks or has a bad field: {e}") from None
    except ConfigError as e:
        raise ExportError(f"{Path(path) / 'config.json'}: {e}") from None
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights()
    load_into(model, path, strict=True)
    return model.eval(), cfg, meta
