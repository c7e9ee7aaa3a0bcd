"""The one config schema: training keys (`schema`), the dataset list (`datasets`), loading (`load`)."""

from difftune.config.datasets import DatasetPlan, ImageDataset, TextEmbedsDataset
from difftune.config.load import ConfigError, RunConfig, load_config
from difftune.config.schema import TrainConfig

__all__ = [
    "ConfigError",
    "DatasetPlan",
    "ImageDataset",
    "RunConfig",
    "TextEmbedsDataset",
    "TrainConfig",
    "load_config",
]
