"""The run configuration: one typed, validated section per module (`model`, `data`, `train`,
`sample`; DPO's and GRPO's train settings checked in `objective_settings`) and the whole
`Config` (`sections`), with the rules they share (`rules`, and `lists` for settings given as a
list or a comma-separated text); reading YAML and `--set` overrides into them and writing them
back (`loading`); and the configs shipped with llmcli with the corpora they train on
(`shipped`).

`from llmcli.config import ...` is how the rest of llmcli, the tests and the benchmarks reach
every name below.
"""

from llmcli.config.data import DataConfig
from llmcli.config.loading import (
    apply_overrides,
    config_from_dict,
    dump_yaml,
    load_config,
    parse_override,
    read_yaml,
)
from llmcli.config.lora import LORA_TARGETS, LoraConfig
from llmcli.config.model import ModelConfig
from llmcli.config.sample import CONTEXT_POLICIES, SampleConfig, default_keep, keep_range
from llmcli.config.sections import SECTIONS, Config
from llmcli.config.shipped import describe_shipped, find_config, shipped_configs, shipped_dir
from llmcli.config.train import TRACKERS, TrainConfig

__all__ = [
    "CONTEXT_POLICIES",
    "LORA_TARGETS",
    "SECTIONS",
    "TRACKERS",
    "Config",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "SampleConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "default_keep",
    "describe_shipped",
    "dump_yaml",
    "find_config",
    "keep_range",
    "load_config",
    "parse_override",
    "read_yaml",
    "shipped_configs",
    "shipped_dir",
]
