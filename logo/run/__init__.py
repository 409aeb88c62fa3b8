"""What a run leaves on disk, and how training, evaluation and export read it: the typed run config
(`config`), checkpoint folders (`checkpoint`: errors, resolving a run directory, digests, train state, loading a
model's weights), Hugging Face folders (`hf`), a model and its config rebuilt from any of them (`load`), and the
helpers every writer shares (`files`: fsync; `ranks`: rank 0 decides, every rank raises).

This package is the floor below `logo.train`, `logo.eval` and `logo.export`: it imports `logo.config`,
`logo.model` and `logo.parallel`, never those three (docs/architecture.md, tests/test_imports.py)."""
