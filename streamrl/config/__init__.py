"""One typed configuration tree for a streamrl run.

A run is described by one TOML file whose top-level tables are the sections
(`[model]`, `[data]`, `[rollout]`, ...: `streamrl.config.sections`), composed
into `RunConfig` (`streamrl.config.run`), which checks the rules that span
sections and derives the values several keys decide. `load_config`
(`streamrl.config.loading`) turns any violation into a `ConfigError` that
names the file and the dotted key.
"""

from streamrl.config.loading import (
    apply_override,
    config_from_dict,
    dump_toml,
    load_config,
    to_toml_dict,
)
from streamrl.config.run import RunConfig
from streamrl.config.sections import (
    AlgorithmConfig,
    BufferConfig,
    ClusterConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    EngineConfig,
    EvalConfig,
    EvalDataset,
    LearnerConfig,
    LoggingConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    RolloutConfig,
    SamplingConfig,
    TrainConfig,
    WeightsConfig,
)

__all__ = [
    "AlgorithmConfig",
    "BufferConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "EvalDataset",
    "LearnerConfig",
    "LoggingConfig",
    "LoraConfig",
    "MegatronConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainConfig",
    "WeightsConfig",
    "apply_override",
    "config_from_dict",
    "dump_toml",
    "load_config",
    "to_toml_dict",
]
