"""Hugging Face export and import: `python -m logo.export PATH --out DIR`, `checkpoint.init_from=hf:DIR`,
and the folders `logo.load_pretrained` reads. See docs/export.md."""
from logo.export.writer import export
from logo.run.hf import ExportError

__all__ = ["export", "ExportError"]
