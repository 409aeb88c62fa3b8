"""The evaluation commands' own error (the model and its config load through `logo.run.load`)."""


class EvalError(ValueError):
    """A bad evaluation request (unknown task, a length the model cannot take, ...); the message names it."""
