"""Hugging Face export and import: `python -m logo.export PATH --out DIR`, `checkpoint.init_from=hf:DIR`,
and the folders `logo.load_pretrained` reads. See docs/export.md."""
from logo.export.reader import ExportError


def export(path, out, dtype: str = "bf16", force: bool = False, device: str = "cpu"):
    """Write the Hugging Face folder `out` from a run directory, checkpoint folder or exported folder."""
    from logo.export.writer import export as _export
    return _export(path, out, dtype=dtype, force=force, device=device)


__all__ = ["export", "ExportError"]
