"""The typed run config moved to `logo.run.config` (training, evaluation and export all read it); this import
path keeps working."""
from logo.run.config import (COMPILE_MODES, CheckpointConfig, Config, DataConfig, EvalConfig, LaunchConfig,
                             LoggingConfig, ParallelConfig, RunConfig, StageConfig, TrainConfig, compose,
                             register_configs, to_dataclass, validate, validate_launch)

__all__ = ["COMPILE_MODES", "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "LaunchConfig", "LoggingConfig",
           "ParallelConfig", "RunConfig", "StageConfig", "TrainConfig", "compose", "register_configs",
           "to_dataclass", "validate", "validate_launch"]
