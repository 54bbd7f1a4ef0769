"""Next-token training on conversations (`data.format: chat`), the assistant's tokens scored:
`Chat`, the objective; and the loss of packed rows (`data.packing`), where each conversation
attends only to itself, its positions counted from 0.

A packed batch (`llmcli.data.chat_batches.PackedChatSampler`) is `(x, y, segments)`, each
`(B, T)`, where `segments` numbers a row's conversations 1, 2, ... and its padding 0. From it
`segment_mask` builds the block-diagonal causal mask and `segment_positions` the positions
(`llmcli.objectives.packing`), which the model's forward takes as any caller's (`mask`,
`input_pos`): a conversation's logits,
loss and gradients are then those of the same conversation alone at the start of a row. The
training step calls `packed_next_token_loss` as its `loss_fn`; evaluation keeps the padded
rows of `ChatSampler`, whose losses compare with a padded run's.

The mask is the bool one the model documents. Measured against SDPA's additive float mask (0
and -inf, built once a batch, where SDPA turns a bool one into that inside every layer's call)
on the chat example's model (4 layers, 128 wide, 32 rows of 64, one CPU thread,
benchmarks/chat_packing.py), the two steps took the same time within the machine's noise (the
float one's step 0.94x to 1.03x the bool one's across four runs), and a packed step about the
padded one's (0.99x to 1.06x): the mask and positions cost little beside the rest of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llmcli.data.chat_batches import ChatSampler, PackedChatSampler
from llmcli.data.prepared import TokenData
from llmcli.objectives.base import Objective, SumRanks, next_token_loss
from llmcli.objectives.packing import segment_mask, segment_positions


def packed_next_token_loss(
    model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, dict]:
    """The language-modelling loss of packed rows: `batch` is `(x, y, segments)`, each
    `(B, T)`; no metrics (`llmcli.training.step.LossFn`)."""
    x, y, segments = batch
    return model(x, y, mask=segment_mask(segments), input_pos=segment_positions(segments))[1], {}


class Chat(Objective):
    """Next-token training on conversations: the assistant's tokens scored (the others are
    targets of -1), one conversation a row, or several packed into rows with `data.packing`
    (`PackedChatSampler`, `packed_next_token_loss`). Evaluation keeps one conversation a row
    (`ChatSampler`), whose losses compare with an unpacked run's."""

    name = "chat"
    full_rows = False
    by_position = False  # positions follow the template's turns, not the use of context
    templated = True
    eval_data = "conversations"

    @property
    def packs(self) -> bool:
        """Whether the training stream packs conversations into rows (`data.packing`)."""
        return bool(self.config.data.packing)

    def sampler(
        self,
        data: TokenData,
        split: str,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        training: bool = False,
    ) -> ChatSampler:
        assert data.chat is not None
        chat = data.chat.train if split == "train" else data.chat.val
        kind = PackedChatSampler if training and self.packs else ChatSampler
        batch, context = self.config.train.batch_size, self.config.model.context_length
        return kind(chat, data.chat.pad_id, batch, context, seed, rank, world_size, device)

    def wire(
        self,
        trainer: Any,
        model: nn.Module,
        data: TokenData,
        reference: nn.Module | None,
        world_size: int,
        sum_ranks: SumRanks | None,
    ) -> None:
        if self.packs:  # each conversation of a row attends to itself, its positions from 0
            trainer.loss_fn = packed_next_token_loss

    def eval_loss(self, train_loss: Callable) -> Callable:
        return next_token_loss  # evaluation's rows hold one conversation each

    def meta_rows(self, data: TokenData) -> dict[str, Any]:
        assert data.chat is not None
        return super().meta_rows(data) | {"chat_data": data.chat.counts()}  # fit, cut, left
