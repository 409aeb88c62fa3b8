"""LoGo pretraining entry point.

    python train.py                                   # tiny LoGo model, embedded corpus, CPU-friendly
    torchrun --nproc_per_node=8 train.py model=1.5b attention=logo stage=pretrain_8k data=shards data.path=DIR
    python train.py experiment=controlled_1.5b/logo dry_run=true

See README.md and docs/training.md.
"""
import logging
import signal
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from data.format import DataError
from logo.config import ConfigError
from logo.run.checkpoint import CheckpointError
from logo.run.config import UnknownOption, compose, register_configs, to_dataclass
from logo.train.peers import lost_peer_message, report_lost_peer
from logo.train.rundir import RunComplete, RunDirLocked
from logo.train.trainer import TrainingDiverged, dry_run, train

register_configs()


def composition_error(argv: list[str]) -> str:
    """'' when the command line's overrides compose into a config, else the complaint as one line (an unknown
    group option, with the closest ones; Hydra's for an unknown key or a malformed override). Hydra's own flags
    (--help, --cfg, -m, ...) are left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return ""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    try:
        compose(argv)
    except UnknownOption as e:  # Hydra itself would skip a missing optional group (experiment) silently
        return str(e)
    except ConfigError:
        return ""  # composed; main() reports the invalid value in its own line
    except (HydraException, OmegaConfBaseException, ValueError) as e:  # ValueError: a group set to null
        return "invalid config: " + hydra_message(e)
    return ""


def hydra_message(e: BaseException) -> str:
    """Hydra's message in one line: its first line, a group's options on the same line, and the reason of the
    OmegaConf error behind it (the key or value it rejected)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0].removeprefix("In 'config': ") if lines else type(e).__name__
    if "Available options in" in str(e):
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Available options in"))
        options = [ln for ln in lines[start + 1:] if not ln.startswith(("Config search path", "provider="))]
        msg += f"; choose one of {', '.join(options)}"
    if msg.startswith("Multiple values for "):  # `+group=option` for a group the defaults list already has
        msg, _, rest = msg.partition(". To override a value use 'override ")
        group, _, option = rest.rstrip("'").partition(": ")
        msg += f": set it without the +: {group}={option}" if option else ""
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        msg = msg.rstrip(".") + f": {str(cause).strip().splitlines()[0]}"
    return msg


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("logo").disabled = False  # created at import time, before Hydra set up logging
    from hydra.core.hydra_config import HydraConfig
    attention_name = HydraConfig.get().runtime.choices.get("attention", "")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        conf = to_dataclass(cfg)
        if conf.dry_run:
            launch_set = any(o.lstrip("+~").startswith("launch.") for o in HydraConfig.get().overrides.task)
            dry_run(conf, resolved, attention_name, launch_set)
        else:
            train(conf, resolved, attention_name)
    except RunComplete as e:  # a finished run launched again: nothing to do
        print(e, file=sys.stderr)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged, RunDirLocked) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the training loop (it saves a checkpoint on Ctrl-C itself)
        print("interrupted before training started: this launch saved nothing", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:
        lost = lost_peer_message(e)
        if lost is None:
            raise
        report_lost_peer(lost)
        sys.exit(2)
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    problem = composition_error(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
