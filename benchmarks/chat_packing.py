"""Packed chat SFT against one conversation a row: real tokens per window, assistant tokens/s.

    OMP_NUM_THREADS=1 python benchmarks/chat_packing.py [--config configs/chat.yaml]
        [--rounds 20] [--steps 5] [--threads N]

On a chat config's data and model (default the chat example's: `train.init_from` its run,
`checkpoints/tiny`, which must exist), one `llmcli.training.step.train_step` at a time with the
config's batch, optimizer and samplers, in interleaved rounds so that a busy machine slows
every way alike:

- `padded`: `ChatSampler`, one conversation a row from its first token, the rest padding
  (`data.packing: false`), with `next_token_loss`;
- `packed`: `PackedChatSampler`, whole conversations by best fit, with
  `packed_next_token_loss` (a bool block-diagonal causal mask `(B, 1, T, T)` and positions
  from 0 per conversation): what `data.packing: true` trains;
- `packed_float_mask`: the same batches with the mask given to SDPA as an additive float one
  (0 and -inf, built once a batch): the alternative measured, kept out of llmcli.

Each way's figures: `real_share` (the mean over windows of its share of positions that hold a
conversation's token), conversations and assistant (trained, target not -1) tokens per batch,
the median step time (the batch's drawing and packing included) and assistant tokens per
second. The ratios pair the ways round by round, as the load of a shared machine drifts:
`step_ratio` is the median over the rounds of packed's step time over padded's, and
`assistant_tok_s_ratio` packed's assistant tokens per batch over padded's, divided by it. The
ways keep their own models (the same start), so each trains as a run would. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import load_config  # noqa: E402
from llmcli.data.chat_batches import ChatSampler, PackedChatSampler  # noqa: E402
from llmcli.data.tokens import prepare_data  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.objectives.chat import packed_next_token_loss  # noqa: E402
from llmcli.objectives.packing import segment_mask, segment_positions  # noqa: E402
from llmcli.training.init_from import load_init_weights, resolve_init_from  # noqa: E402
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import Trainer, next_token_loss, train_step  # noqa: E402


def float_mask_loss(model, batch):
    """`packed_next_token_loss` with the mask as SDPA's additive float mask."""
    x, y, segments = batch
    allowed = segment_mask(segments)  # (B, 1, T, T) bool
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return model(x, y, mask=mask, input_pos=segment_positions(segments))[1], {}


class Counted:
    """A sampler whose batches' real positions, assistant tokens and conversations are
    counted as they are drawn."""

    def __init__(self, sampler, lengths: np.ndarray) -> None:
        self.sampler, self.lengths = sampler, lengths
        self.windows: list[float] = []  # each window's share of real positions
        self.assistant: list[int] = []  # each batch's assistant tokens
        self.conversations: list[int] = []  # each batch's conversations

    def next(self):
        T = self.sampler.context_length
        if isinstance(self.sampler, PackedChatSampler):
            batch = self.sampler.next()
            segments = batch[2]
            self.windows.extend(((segments != 0).sum(1) / T).tolist())
            self.conversations.append(int(segments.max(1).values.sum()))
        else:  # redraw its picks from a copy of its generator: their lengths are the real part
            g = torch.Generator().manual_seed(0)
            g.set_state(self.sampler.generator.get_state())
            picks = torch.randint(len(self.lengths), (self.sampler.batch_size,), generator=g)
            batch = self.sampler.next()
            self.windows.extend(((self.lengths[picks.numpy()] - 1) / T).tolist())
            self.conversations.append(self.sampler.batch_size)
        self.assistant.append(int((batch[1] != -1).sum()))
        return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "chat.yaml"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and way")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = resolve_init_from(load_config(args.config))
    tc, T = config.train, config.model.context_length
    data = prepare_data(config.data, T)
    assert data.chat is not None, "a data.format: chat config"
    split, vocab = data.chat.train, int(data.tokenizer.vocab_size)
    cpu = torch.device("cpu")

    def trainer(sampler, loss_fn) -> Trainer:
        model = Transformer(config.model, vocab)
        load_init_weights(model, tc.init_from)
        return Trainer(
            model=model,
            params=list(model.parameters()),
            optimizer=build_optimizer(model, tc, "cpu", []),
            precision=Precision.resolve(cpu, "float32"),
            batches=Counted(sampler, split.lengths),
            grad_accum=1,
            grad_clip=tc.grad_clip,
            loss_fn=loss_fn,
        )

    pad = data.chat.pad_id
    trainers = {
        "padded": trainer(ChatSampler(split, pad, tc.batch_size, T, tc.seed), next_token_loss),
        "packed": trainer(
            PackedChatSampler(split, pad, tc.batch_size, T, tc.seed), packed_next_token_loss
        ),
        "packed_float_mask": trainer(
            PackedChatSampler(split, pad, tc.batch_size, T, tc.seed), float_mask_loss
        ),
    }
    times: dict[str, list[float]] = {way: [] for way in trainers}
    for t in trainers.values():  # warm-up
        train_step(t)
    for r in range(args.rounds):
        for way in trainers if r % 2 == 0 else reversed(list(trainers)):
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                train_step(trainers[way])
                steps.append(time.perf_counter() - start)
            times[way].append(statistics.median(steps))

    def paired(way: str, other: str) -> float:
        return statistics.median(a / b for a, b in zip(times[way], times[other], strict=True))

    figures = {}
    for way, t in trainers.items():
        counted = t.batches
        step_s = statistics.median(times[way])
        assistant = float(np.mean(counted.assistant))
        figures[way] = {
            "real_share": round(float(np.mean(counted.windows)), 4),
            "real_share_p10": round(float(np.percentile(counted.windows, 10)), 4),
            "conversations_per_batch": round(float(np.mean(counted.conversations)), 2),
            "assistant_tokens_per_batch": round(assistant, 1),
            "step_s": round(step_s, 5),
            "assistant_tok_s": round(assistant / step_s, 1),
        }
    padded, packed = figures["padded"], figures["packed"]
    print(
        json.dumps(
            {
                "benchmark": "chat_packing",
                "config": Path(args.config).name,
                "batch_size": tc.batch_size,
                "context_length": T,
                "conversations": int(len(split.starts)),
                "mean_positions": round(float(np.mean(split.lengths - 1)), 2),
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "steps": args.steps,
                **{f"{way}_{k}": v for way, f in figures.items() for k, v in f.items()},
                "assistant_tok_s_ratio": round(
                    packed["assistant_tokens_per_batch"]
                    / padded["assistant_tokens_per_batch"]
                    / paired("packed", "padded"),
                    3,
                ),
                "step_ratio": round(paired("packed", "padded"), 3),
                "float_mask_step_ratio": round(paired("packed_float_mask", "packed"), 3),
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
