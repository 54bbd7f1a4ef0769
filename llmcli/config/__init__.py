"""The run configuration: the typed, validated sections and `Config` (`sections`), reading YAML
and `--set` overrides into them and writing them back (`loading`), and the configs shipped with
llmcli with the corpora they train on (`shipped`).

`from llmcli.config import ...` is how the rest of llmcli, the tests and the benchmarks reach
every name below; inside, `loading` imports `sections` and `shipped`, which import neither.
"""

from llmcli.config.loading import (
    apply_overrides,
    config_from_dict,
    dump_yaml,
    load_config,
    parse_override,
    read_yaml,
)
from llmcli.config.sections import (
    CONTEXT_POLICIES,
    SECTIONS,
    TRACKERS,
    Config,
    DataConfig,
    ModelConfig,
    SampleConfig,
    TrainConfig,
    default_keep,
    keep_range,
)
from llmcli.config.shipped import describe_shipped, find_config, shipped_configs, shipped_dir

__all__ = [
    "CONTEXT_POLICIES",
    "SECTIONS",
    "TRACKERS",
    "Config",
    "DataConfig",
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
