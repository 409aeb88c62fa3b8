"""LoGo pretraining entry point.

    python train.py                                   # tiny LoGo model, embedded corpus, CPU-friendly
    torchrun --nproc_per_node=8 train.py model=1.5b attention=logo stage=pretrain_8k data=shards data.path=DIR
    python train.py +experiment=controlled_1.5b/logo dry_run=true

See README.md and docs/training.md.
"""
import logging
import sys
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

from logo.train.config import register_configs

register_configs()
log = logging.getLogger("logo")


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from data.format import DataError
    from logo.config import ConfigError
    from logo.train.checkpoint import CheckpointError
    from logo.train.config import to_dataclass
    from logo.train.rundir import RunDirLocked
    from logo.train.trainer import TrainingDiverged, dry_run, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("logo").disabled = False  # created at import time, before Hydra set up logging
    # DCP warns on every save/load in a single process; that is the intended use here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    from hydra.core.hydra_config import HydraConfig
    attention_name = HydraConfig.get().runtime.choices.get("attention", "")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        conf = to_dataclass(cfg)
        if conf.dry_run:
            dry_run(conf, resolved, attention_name)
        else:
            train(conf, resolved, attention_name)
    except (ConfigError, DataError, CheckpointError, TrainingDiverged, RunDirLocked) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
