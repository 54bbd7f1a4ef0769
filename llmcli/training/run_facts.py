"""What a run is, fixed when it is built: its folder, size, device and data (`RunFacts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmcli.training.mfu import mfu


@dataclass(frozen=True)
class RunFacts:
    """What a run is, fixed when it is built: its folder, model, device and data.

    Attributes:
        run_dir: the run directory.
        n_params: the model's parameters.
        vocab_size: the tokenizer's size.
        device, dtype: where and in what precision the steps run.
        world_size, rank: the DDP processes, and this one.
        tokens_per_step: training tokens per optimizer step, over every rank.
        resumed_from: the step a resumed run started from (None: a fresh start).
        config_name: the config's name (a shipped config's finds its reference curve).
        compiled: whether the step runs torch.compile's graphs (`train.compile`).
        source_hash: the corpus's content hash (a resume warns when it changed).
        tokenizer_training: how the tokenizer was made, as `meta.json` records it.
        meta_rows: the objective's rows of `meta.json` (`Objective.meta_rows`: a chat run's
            `chat_data`, conversations kept, cut, left out; DPO's `preference_data`, GRPO's
            `prompt_data`), and a LoRA run's `lora`: its `adapters` and `trainable` parameter
            counts (with the token matrices whose new rows train) and the base's
            `base_vocab_size` (`llmcli.training.lora.lora_meta`).
        metrics_bytes, head_metrics_bytes: the logs' sizes at the save a run resumed from,
            where it cuts them back (`llmcli.training.log.TrainLog.open`); None: not known.
        flops_per_token: training FLOPs per token (`llmcli.training.plan.flops_per_token`).
        peak_flops: the device's measured matrix-product FLOPs per second at the run's
            precision (`llmcli.training.mfu.peak_flops`); 0: not measured.
    """

    run_dir: Path
    n_params: int
    vocab_size: int
    device: str
    dtype: str
    world_size: int
    rank: int
    tokens_per_step: int
    resumed_from: int | None
    config_name: str
    compiled: bool
    source_hash: str | None
    tokenizer_training: dict | None
    meta_rows: dict = field(default_factory=dict)
    metrics_bytes: int | None = None
    head_metrics_bytes: int | None = None
    flops_per_token: int = 0
    peak_flops: float = 0.0

    def mfu(self, tokens_per_s: float) -> float | None:
        """The model FLOPs utilisation of training `tokens_per_s` tokens a second over every
        rank (`llmcli.training.mfu`); None where the peak was not measured."""
        if not self.peak_flops:
            return None
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.world_size)
