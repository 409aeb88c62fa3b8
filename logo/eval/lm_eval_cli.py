"""The `lm_eval` command with the `logo` model registered (every lm_eval flag works as documented there):

    python -m logo.eval.lm_eval_cli --model logo --model_args checkpoint=RUN_DIR --tasks hellaswag --device cuda

lm-eval 0.4.13 discovers models only in its own registry (no entry points; --include_path is for tasks), so
the bare `lm_eval` command cannot load `logo`; this runs lm-eval's own CLI after registering it.
"""
import logo.eval.lm_eval_adapter  # noqa: F401 - registers the `logo` model
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
