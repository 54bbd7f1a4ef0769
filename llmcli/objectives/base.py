"""What every objective answers, with the answers next-token training on text gives.

An objective (`llmcli.objectives.objective_for` picks one from the config) owns what differs
between next-token on text, conversations (packed or not), DPO and GRPO: how its data is read
(`read_data`) and drawn (`sampler`), what the training step's loss is (`wire`), what an
evaluation measures (`evaluate`, `eval_loss`) and which figures mean something
(`has_perplexity`, `head_metrics`, `by_position`), how many rows an example is
(`rows_per_example`), whether it needs a frozen reference (`needs_reference`), its memory and
plan terms (`memory_terms`, `timing_batch`, `plan_rows`) and its rows in `meta.json` and `info`
(`meta_rows`). The loop, build, plan, memory, checkpoint, evaluation and `llmcli eval` ask it;
none of them tests which objective a run has.

Objectives sit below evaluation and training: what they need from those (the reference model,
summing over ranks) the caller builds and passes in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from llmcli.config import Config
from llmcli.data.batches import BatchSampler
from llmcli.data.chat_template import ChatTemplate, template_from_file
from llmcli.data.prepared import TokenData
from llmcli.data.tokenizer import Tokenizer, load_tokenizer
from llmcli.data.tokens import prepare_data
from llmcli.errors import InputError

# Sums a tensor over the ranks in place (`torch.distributed.all_reduce`); None in one process.
SumRanks = Callable[[Tensor], None]


def next_token_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, dict]:
    """The language-modelling loss: `batch` is `(x, y)`, each `(B, T)`; no metrics."""
    x, y = batch
    return model(x, y)[1], {}


@dataclass(frozen=True)
class MemoryTerms:
    """What an objective's step holds beyond a next-token step of the same micro-batch.

    Attributes:
        rows: rows through the model per example (a DPO pair 2, a GRPO prompt `group_size`).
        values_per_token: fp32 values kept per row token beside the policy's activations (DPO:
            the reference's logits).
        reference: whether a frozen copy of the model is held.
        sampled_rows: rows sampled at once per example of the micro-batch, without gradients,
            before the step's forwards (GRPO: `grad_accum x group_size`).
    """

    rows: int = 1
    values_per_token: int = 0
    reference: bool = False
    sampled_rows: int = 0


class Objective:
    """Next-token prediction on a text stream: the answers every other objective starts from.

    Args:
        config: the run's config (re-ask `objective_for` once the micro-batch is settled).
    """

    name = "next_token"
    has_perplexity = True  # its loss is a mean next-token loss: exp(loss) is a perplexity
    head_metrics = True  # the induction-head probe and icl score mean something
    by_position = True  # its loss by position is the use of context (the icl score)
    templated = False  # its rows are encoded with a chat template
    encodes_with_init_from = False  # its rows are encoded with train.init_from's tokenizer
    eval_data = "text"  # what `llmcli eval` reads of the run with no --data
    # the rewards `llmcli eval` scores prompts with, and their weights (None: 1.0 each)
    reward_specs: tuple[str, ...] = ("exact",)
    reward_weights: list[float] | None = None
    examples = "sequences"  # what one of `train.batch_size` is, for `llmcli plan`
    # whether every row fills the context: else a step's rows are cut to their batch's longest
    # (or packed), and its real tokens, which the log counts, vary under `train.example_tokens`
    full_rows = True
    # The evaluation's figures that say how the run does, as metrics.jsonl names them ("val_":
    # the validation split's), which `meta.json` lists for `llmcli info`; and the step's own
    # figures the progress bar shows beside the loss (TRL's names).
    figures: tuple[str, ...] = ("val_loss", "val_ppl")
    bar_figures: tuple[str, ...] = ()
    memory_knobs = ""  # what else to lower when a step does not fit, before the model's size

    def __init__(self, config: Config) -> None:
        self.config = config

    @property
    def rows_per_example(self) -> int:
        """Rows one example of `train.batch_size` puts through the model (as
        `Config.example_tokens` counts them: a DPO pair 2, a GRPO prompt `group_size`)."""
        return self.config.example_tokens // self.config.model.context_length

    @property
    def needs_reference(self) -> bool:
        """Whether the step holds a frozen `train.init_from` model beside the policy."""
        return False

    def read_data(self, tokenizer: Tokenizer | None) -> TokenData:
        """The run's data (`tokenizer`: a resumed run's own, else None to make one)."""
        config = self.config
        return prepare_data(config.data, config.model.context_length, tokenizer=tokenizer)

    def sampler(
        self,
        data: TokenData,
        split: str,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        training: bool = False,
    ) -> Any:
        """The batches of `data`'s split ("train" or "val") for this rank, seeded with `seed`:
        the training stream's with `training`, else evaluation's."""
        tokens = data.train if split == "train" else data.val
        batch, context = self.config.train.batch_size, self.config.model.context_length
        return BatchSampler(
            tokens, batch, context, seed=seed, rank=rank, world_size=world_size, device=device
        )

    def wire(
        self,
        trainer: Any,
        model: nn.Module,
        data: TokenData,
        reference: nn.Module | None,
        world_size: int,
        sum_ranks: SumRanks | None,
    ) -> None:
        """Give `trainer` (`llmcli.training.step.Trainer`) this objective's loss and stream;
        `reference` is the frozen model when `needs_reference`. Next-token: as built."""

    def eval_loss(self, train_loss: Callable) -> Callable:
        """The loss the loop's evaluation estimates: the step's own (`train_loss`)."""
        return train_loss

    def evaluate(self, loss_fn: Any, data: TokenData, limit: int) -> tuple[dict, dict] | None:
        """An evaluation of its own: (each split's loss, figures by name); None to estimate
        the loss on `eval_steps` batches of each split, as next-token training does."""
        return None

    def memory_terms(self, vocab_size: int) -> MemoryTerms:
        """What a step holds beyond a next-token step's (see `MemoryTerms`)."""
        return MemoryTerms(rows=self.rows_per_example)

    def timing_batch(self, tokens: Tensor, n: int) -> tuple[Tensor, ...]:
        """`n` examples of the step's shape from `tokens` `(rows, T + 1)` (random ones, at
        least `n x rows_per_example` rows), for `llmcli plan`: `(x, y)`, each `(rows, T)`."""
        rows = n * self.rows_per_example
        return tokens[:rows, :-1], tokens[:rows, 1:]

    def timing_loss(self, make_reference: Callable[[], nn.Module]) -> Callable | None:
        """The loss `llmcli plan` times (None: `next_token_loss`); `make_reference` builds a
        frozen model of the run's shape, for a loss that reads one."""
        return None

    def plan_rows(self) -> list[tuple[str, str]]:
        """Lines `llmcli plan` adds: what its timing leaves out."""
        return []

    def meta_rows(self, data: TokenData) -> dict[str, Any]:
        """Rows of `meta.json`: the figures `llmcli info` shows, and (others) how many of its
        examples fit, were cut, were left out."""
        return {"figures": list(self.figures)}

    def eval_text(self, summary: dict[str, float], data: TokenData) -> str | None:
        """What an evaluation's log line says after the losses (None: the perplexity)."""
        return None

    def stalled(self, metrics: dict[str, float]) -> bool:
        """Whether a log step's figures say nothing is learned, whatever the gradient."""
        return False

    def stall_advice(self, metrics: dict[str, float]) -> str:
        """What to change when the gradient stays zero (or `stalled`) log step after log step."""
        return (
            "the loss does not depend on the weights that train: check that the data hold "
            "targets the model writes (a chat run's assistant turns) and that train.lr is not 0."
        )


def init_encoding(config: Config) -> tuple[Tokenizer, ChatTemplate | None]:
    """The tokenizer and chat template (None: the base has none) of a config that
    `resolve_init_from` resolved: the `train.init_from` run's, which DPO and GRPO encode with.

    Raises:
        InputError: an unreadable tokenizer or template file.
    """
    data = config.data
    assert data.tokenizer, "init_encoding needs a config resolve_init_from resolved"
    template = None if data.chat_template is None else template_from_file(data.chat_template)
    return load_tokenizer(data.tokenizer), template


def read_with_init_encoding(
    config: Config, name: str, resumed: Tokenizer | None, read: Callable[..., TokenData]
) -> TokenData:
    """Rows `read(data_cfg, context_length, tokenizer, template)` encodes with the
    `train.init_from` run's tokenizer and template (DPO's pairs, GRPO's prompts); a resumed
    run's own tokenizer (`resumed`) must still be that one (`check_init_tokenizer`)."""
    ours, template = init_encoding(config)
    if resumed is not None:
        check_init_tokenizer(config, name, ours, resumed)
    return read(config.data, config.model.context_length, ours, template)


def check_init_tokenizer(config: Config, name: str, ours: Tokenizer, resumed: Tokenizer) -> None:
    """Refuse a resumed run whose `train.init_from` now has another tokenizer than the run's
    (`resumed`): its rows are encoded with the base's (`ours`)."""
    if resumed.to_json() != ours.to_json():
        raise InputError(
            f"the run '{config.train.init_from}' (train.init_from) now has another tokenizer "
            f"than this {name.upper()} run, which started from it: its "
            "data are encoded with that run's tokenizer. Point train.init_from at the run "
            "this one started from, or start afresh with --overwrite."
        )
