"""Loading for evaluation: the model and its config come from `logo.run.load` (shared with export);
`EvalError` is the evaluation commands' own error."""
from logo.run.load import DTYPES, Loaded, load_model, pick_device, run_config

__all__ = ["DTYPES", "EvalError", "Loaded", "load_model", "pick_device", "run_config"]


class EvalError(ValueError):
    """A bad evaluation request (unknown task, a length the model cannot take, ...); the message names it."""
