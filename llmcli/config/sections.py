"""A whole run's configuration: the four sections together, and the rules between them.

Each section is its own module (`model`, `data`, `train`, `sample`) and checks its own values;
`Config.validate` adds what depends on two of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmcli.config.data import DataConfig
from llmcli.config.model import ModelConfig
from llmcli.config.sample import SampleConfig
from llmcli.config.train import TrainConfig
from llmcli.errors import ConfigError


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    # Where the config came from (not a YAML key): its file stem names the default run directory.
    name: str = field(default="run", compare=False, repr=False)

    def validate(self) -> None:
        # `sample` checked itself when it was made; its context_keep depends on the model.
        for section in (self.model, self.data, self.train):
            section.validate()
        self.sample.keep_for(self.model.context_length)
        self._validate_objective()
        lora = self.train.lora
        if lora is not None and lora.rank > self.model.n_embed:
            raise ConfigError(
                f"train.lora.rank ({lora.rank}) is larger than the layers it adapts, whose "
                f"smaller side is model.n_embed ({self.model.n_embed}): choose a rank of at "
                f"most {self.model.n_embed} (8 or 16 are usual)."
            )
        tokens, T = self.train.tokens_per_step, self.example_tokens
        if tokens is not None and tokens % T:
            rows = {"dpo": "2", "grpo": "train.group_size"}.get(self.train.objective)
            what = f"{rows} x model.context_length" if rows else "model.context_length"
            raise ConfigError(
                f"train.tokens_per_step ({tokens}) must be a multiple of {what} ({T}): a step "
                f"is whole {self.example_name}; for "
                f"example {max(T, tokens // T * T)} or {(tokens // T + 1) * T}."
            )

    @property
    def example_name(self) -> str:
        """What one of `train.batch_size` is: "sequences", "pairs" (DPO), "prompts" (GRPO)."""
        return {"dpo": "pairs", "grpo": "prompts"}.get(self.train.objective, "sequences")

    @property
    def example_tokens(self) -> int:
        """The tokens one example of a batch (one of `train.batch_size`) trains on: a sequence
        of `model.context_length`, or with DPO a pair, whose chosen and rejected rows are two,
        or with GRPO a prompt, whose `train.group_size` completions are a row each."""
        rows = {"dpo": 2, "grpo": self.train.group_size}.get(self.train.objective, 1)
        return rows * self.model.context_length

    def _validate_objective(self) -> None:
        """DPO reads preference pairs and GRPO prompts, and those are read only by them; GRPO
        samples its replies, so not greedily."""
        objective, format_ = self.train.objective, self.data.format
        for needs, reads, learns, rows in _OBJECTIVE_DATA:
            if objective == needs and format_ != reads:
                raise ConfigError(
                    f"train.objective is {needs}, which learns from {learns}, but data.format "
                    f"is {format_!r}: set data.format: {reads} and data.path to .jsonl files of "
                    f"{rows} rows."
                )
            if format_ == reads and objective != needs:
                raise ConfigError(
                    f"data.format is {reads}, which only {needs.upper()} reads, but "
                    f"train.objective is {objective!r}: set train.objective: {needs} (and "
                    "train.init_from to the run to start from), or data.format: chat for "
                    "conversations."
                )
        if objective == "grpo" and self.sample.temperature == 0:
            raise ConfigError(
                "sample.temperature (0) is greedy decoding, so the train.group_size replies "
                "GRPO samples to a prompt would all be the same: their rewards equal, every "
                "advantage zero, and nothing learned. Set sample.temperature: 1.0 (TRL's "
                "default)."
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The fully resolved config as plain data (what `config.yaml` in a run holds)."""
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}


# The objectives that read data of their own: (objective, data.format, what it learns from,
# the rows' keys).
_OBJECTIVE_DATA = (
    ("dpo", "preference", "preference pairs", '{"prompt", "chosen", "rejected"}'),
    ("grpo", "prompts", "rewards on prompts", '{"prompt", "answer"}'),
)

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
}
