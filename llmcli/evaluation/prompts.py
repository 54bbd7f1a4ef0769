"""Greedy pass@1 on prompts with answers: `llmcli eval --data prompts.jsonl`, and GRPO's evaluation.

Each prompt (`llmcli.data.prompts`: `{"prompt", "answer"}`, text or messages, encoded with the
run's tokenizer and chat template) is answered greedily, in order, `batch_size` prompts a batch,
up to its end token, `sample.max_new_tokens`, or the room the context leaves. Replies are
scored with a reward: a GRPO run's own (`train.reward`), else `exact` (the reply is the answer,
spaces around either aside). `reward` is its mean over all prompts; pass@1 is the share of the
prompts it judges whose reply it passes, giving 1 or more: the built-in verifiers (1 or 0) judge
the prompts with an answer; a function of the user's judges every prompt, and its 1 is a pass
whatever its scale (the verifiers' pass). A prompt that
leaves no room in the context for a reply is skipped and counted, as training skips it. On a
GRPO run with no file, its own validation prompts are answered.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.data.chat_template import load_run_template
from llmcli.data.prompts import PromptEncoder, encode_prompts, read_prompt_rows
from llmcli.errors import InputError
from llmcli.evaluation.chat import is_conversations
from llmcli.evaluation.preferences import first_row_keys
from llmcli.objectives import objective_for
from llmcli.objectives.greedy_answers import greedy_figures
from llmcli.objectives.rewards import load_rewards
from llmcli.progress import counted
from llmcli.runs.loading import LoadedRun


@dataclass
class PromptEvalResult:
    """What `evaluate_prompts` measured (JSON-ready through `to_dict`)."""

    run_dir: str
    weights: str
    step: int
    data: str
    reward_name: str
    prompts: int  # answered
    skipped: int  # too long for the context
    passed: int  # replies the reward passes (1 or more)
    answered: int  # prompts the reward judges (with an answer, for a built-in verifier)
    reward: float
    elapsed_s: float
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    per_token: None = None  # eval's --per-token is for text windows only

    @property
    def pass_at_1(self) -> float:
        return self.passed / self.answered if self.answered else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "per_token"}
        return {**out, "pass@1": self.pass_at_1}


def is_prompt_data(data: str | Path | None, grpo: bool) -> bool:
    """Whether `llmcli eval`'s data are prompts with answers: with no file, a GRPO run's
    validation prompts; a `.jsonl` file whose first row has "prompt" and "answer" and is not
    a preference pair."""
    if data is None:
        return grpo
    if not is_conversations(data):  # not a .jsonl file
        return False
    keys = first_row_keys(Path(data))
    return {"prompt", "answer"} <= keys and "chosen" not in keys


def evaluate_prompts(
    run: LoadedRun,
    data: Path | None,
    batch_size: int,
    *,
    progress: bool = False,
    t0: float | None = None,
) -> PromptEvalResult:
    """`llmcli eval` on prompts: every prompt of `data` (None: a GRPO run's validation
    prompts, `data.val_path`) answered greedily by the run's model.

    Raises:
        InputError: a missing or malformed file (its line named), conversational prompts on a
            run without a chat template, a GRPO run without a validation file and no `data`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    config = run.config
    if data is None:
        if config.data.val_path is None:
            raise InputError(
                "this GRPO run held out the last data.val_fraction of its prompts, which llmcli "
                "eval does not split again: give the prompts as --data FILE.jsonl."
            )
        data = Path(config.data.val_path)
    encoder = PromptEncoder(run.tokenizer, load_run_template(run.run_dir))
    rows = list(read_prompt_rows(data))
    if not rows:
        raise InputError(f"'{data}' holds no prompts: add some.")
    split = encode_prompts(rows, encoder, config.model.context_length)
    objective = objective_for(config)  # a GRPO run's own rewards, else exact
    specs = list(objective.reward_specs)
    reward = load_rewards(specs, objective.reward_weights, config.train.reward_timeout)
    run.model.eval()
    figures = greedy_figures(
        run.model,
        split,
        encoder.end_ids,
        config.sample,
        reward,
        run.tokenizer.decode,
        batch_size,
        progress=progress,
    )
    return PromptEvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=str(data),
        reward_name=",".join(specs),
        prompts=len(split),
        skipped=split.counts["skipped"],
        passed=figures["passed"],
        answered=figures["answered"],
        reward=figures["reward"],
        elapsed_s=time.perf_counter() - t0,
        per_prompt=figures["replies"],
    )


def format_prompt_result(result: PromptEvalResult) -> str:
    """A few human-readable lines (`--json` has each prompt's reply)."""
    return (
        f"run {result.run_dir} (step {result.step}, {Path(result.weights).name})\n"
        f"data: {result.data}: {counted(result.prompts, 'prompt')} answered greedily "
        f"({result.skipped:,} skipped as longer than the context)\n"
        f"pass@1 ({result.reward_name}): {result.passed:,} of {result.answered:,} replies pass "
        f"({100 * result.pass_at_1:.1f}%); mean reward {result.reward:.4f}"
    )
