"""Hugging Face export and import: `python -m logo.export PATH --out DIR`, `checkpoint.init_from=hf:DIR`,
and the folders `logo.load_pretrained` reads. See docs/export.md."""


# Both names load on first use: `logo.export.files` (the report's umask helper) must not import torch.
def export(path, out, dtype: str = "bf16", force: bool = False, device: str = "cpu", progress=None):
    """Write the Hugging Face folder `out` from a run directory, checkpoint folder or exported folder.
    progress: a bar on stderr while the weights are written (None: only when stderr is a terminal)."""
    from logo.export.writer import export as _export
    return _export(path, out, dtype=dtype, force=force, device=device, progress=progress)


def __getattr__(name):  # lazy: `logo.export.files` (used by the report) stays free of torch
    if name == "ExportError":
        from logo.run.hf import ExportError
        return ExportError
    raise AttributeError(f"module 'logo.export' has no attribute {name!r}")


__all__ = ["export", "ExportError"]
