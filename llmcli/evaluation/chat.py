"""`llmcli eval --data conversations.jsonl` on a chat run: the loss of the assistant's tokens,
and with `--answers` how many greedy replies are exactly the assistant's turns.

Each row of the JSONL file is a conversation (`llmcli.data.conversations.read_jsonl`), encoded
with the run's chat template and masked as training masks it: the target at position `t + 1`
counts when `mask[t + 1]` is set, that is for the assistant's text and the end-of-turn token
after it, never for the system's and user's turns or the role markers. A conversation longer
than the model's window (`context_length + 1` tokens: `context_length` inputs predicting as
many targets) is cut exactly as training cuts it (`llmcli.data.chat.conversation_windows`):
after the last assistant turn that ends within the window, or skipped when none does. Both are
counted and reported, so no reply is scored half, and every scored token sees its whole
conversation before it.

`--answers` asks the model, for each assistant turn of the (truncated) conversations, for a
greedy reply to the turns before it (`ConversationEncoder.prompt`), until the end-of-turn token
or `ANSWER_MARGIN` tokens past the expected reply's length. A reply matches when its text is
exactly the turn's content, whitespace included (the template writes the content verbatim,
so that is what training taught), and the reply ended with the end-of-turn token.

Shapes: `B` conversations in a batch, `L` positions, `V` vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmcli.data.chat import conversation_windows
from llmcli.data.chat_batches import IGNORE
from llmcli.data.chat_template import require_run_template
from llmcli.data.conversations import ConversationEncoder, Encoded, Messages, read_jsonl
from llmcli.data.tokens import prepare_data
from llmcli.errors import InputError
from llmcli.evaluation.metrics import perplexity
from llmcli.evaluation.text import token_losses
from llmcli.generation.replies import replies
from llmcli.progress import Progress, counted

if TYPE_CHECKING:
    from llmcli.runs.loading import LoadedRun

CONVERSATIONS_SUFFIX = ".jsonl"
# Reply tokens allowed past the expected reply's own length (and its end-of-turn token): enough
# to show what a too-long reply goes on with, and to let a tokenizer spell the same text in a
# few more tokens.
ANSWER_MARGIN = 8


def is_conversations(data: str | Path | None) -> bool:
    """True for a `--data` file of conversations (a `.jsonl` file), False for plain text."""
    return data is not None and Path(data).suffix.lower() == CONVERSATIONS_SUFFIX


@dataclass
class Conversation:
    """A conversation as scored: the messages kept (whole turns) and their ids and mask."""

    where: str  # "file line N"
    messages: Messages | None  # None: the validation split keeps only ids and mask
    encoded: Encoded
    truncated: bool | None  # turns at its end were left out to fit (None: not known)


@dataclass(frozen=True)
class Answer:
    """One assistant turn answered greedily: `turn` is its index in the conversation."""

    where: str
    turn: int
    expected: str
    got: str
    match: bool


@dataclass
class ChatEvalResult:
    """What `evaluate_conversations` measured (JSON-ready through `to_dict`)."""

    run_dir: str
    weights: str
    step: int
    data: str
    conversations: int  # scored (truncated ones included)
    truncated: int
    skipped: int  # too long for the context
    skipped_at: list[str]  # where they are (a file's lines; empty for the validation split)
    tokens: int  # assistant tokens scored
    loss: float  # mean nats per assistant token, over all of them
    perplexity: float
    elapsed_s: float
    per_conversation: list[dict[str, Any]] = field(default_factory=list)
    answers: list[Answer] | None = None  # with `--answers`
    per_token: None = None  # eval's --per-token is for text windows only

    @property
    def matches(self) -> int | None:
        return None if self.answers is None else sum(a.match for a in self.answers)

    @property
    def exact_match(self) -> float | None:
        """Matches / assistant turns answered (None without `--answers`, NaN for none)."""
        if self.answers is None:
            return None
        return self.matches / len(self.answers) if self.answers else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """Every figure and each conversation; with `--answers`, each answer and their count."""
        summary = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del summary["per_token"], summary["answers"]
        if self.answers is not None:
            summary["answers"] = [dataclasses.asdict(a) for a in self.answers]
            summary.update(matches=self.matches, turns=len(self.answers))
            summary["exact_match"] = self.exact_match
        return summary


# --- Reading: conversations that fit the context ---------------------------------------------


def _assistant_turns_kept(messages: Messages, mask: np.ndarray) -> Messages:
    """The messages up to the last assistant turn whose tokens `mask` (a kept start of the
    conversation's) holds: one run of marked tokens per assistant turn."""
    runs = int(np.sum(mask & ~np.concatenate([[False], mask[:-1]])))
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    return messages if runs >= len(ends) else messages[: ends[runs - 1]]


def read_conversations(
    path: Path, encoder: ConversationEncoder, context_length: int
) -> tuple[list[Conversation], list[str]]:
    """The conversations of a JSONL file cut to the context as training cuts them
    (`llmcli.data.chat.conversation_windows`), and where the skipped ones are.

    Raises:
        InputError: a malformed line (file and line named), a file with no conversation, or
            one whose every conversation is too long for the context.
    """
    rows = [(messages, where, encoder.encode(messages)) for messages, where in read_jsonl(path)]
    if not rows:
        raise InputError(f"--data {str(path)!r} holds no conversations: one JSON row per line.")
    lengths = [len(e.ids) for _, _, e in rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # (R + 1,)
    mask = np.concatenate([e.mask for _, _, e in rows])  # (N,)
    starts, kept_lengths, _ = conversation_windows(mask, offsets, context_length)
    rows_kept = np.searchsorted(offsets, starts).tolist()  # the row each window starts
    kept_rows = dict(zip(rows_kept, kept_lengths.tolist(), strict=True))
    kept, skipped = [], []
    for r, (messages, where, encoded) in enumerate(rows):
        if r not in kept_rows:
            skipped.append(where)
            continue
        n = kept_rows[r]
        cut = Encoded(encoded.ids[:n], encoded.mask[:n])
        turns = _assistant_turns_kept(messages, cut.mask)
        kept.append(Conversation(where, turns, cut, truncated=n < len(encoded.ids)))
    if not kept:
        raise InputError(
            f"every conversation of {str(path)!r} is longer than the model's context "
            f"({context_length} tokens) at its first assistant turn already: shorten them."
        )
    return kept, skipped


def split_conversations(run: LoadedRun) -> tuple[list[Conversation], dict[str, int], str]:
    """The run's validation conversations as training cut them, their counts (`truncated`,
    `skipped`, ...) and a label: rebuilt from the run's config (the same source must still be
    readable).

    Raises:
        InputError: the validation split cannot be rebuilt (the message says how to go on).
    """
    ctx = run.config.model.context_length
    try:
        split = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer).chat.val
    except InputError as exc:
        raise InputError(
            f"cannot rebuild the validation split of '{run.run_dir}': {exc} Or pass --data "
            "FILE.jsonl to score conversations of a file."
        ) from None
    conversations = []
    for i, (start, n) in enumerate(zip(split.starts, split.lengths, strict=True)):
        ids = np.asarray(split.tokens[start : start + n], dtype=np.int64)
        mask = np.asarray(split.mask[start : start + n], dtype=bool)
        where = f"validation conversation {i}"
        conversations.append(Conversation(where, None, Encoded(ids, mask), truncated=None))
    data = run.config.data
    label = f"validation split of {data.val_path or data.path or data.dataset}"
    return conversations, split.counts, label


# --- The assistant tokens' loss ----------------------------------------------------------------


@torch.no_grad()
def score_conversations(
    model: Any,
    conversations: list[Conversation],
    batch_size: int,
    *,
    progress: bool = False,
) -> list[tuple[int, float]]:
    """Each conversation's `(assistant tokens, their summed nats)`, batch by batch.

    A batch is right-padded to its longest conversation: attention is causal, so the padding
    after a conversation changes none of its logits, and its positions are not scored.
    """
    device = next(model.parameters()).device
    model.eval()
    batches = [conversations[i : i + batch_size] for i in range(0, len(conversations), batch_size)]
    bar = Progress(len(batches), desc="eval", unit="batch", enabled=progress, tenths=True)
    scores = []
    for batch in batches:
        L = max(len(c.encoded.ids) for c in batch) - 1
        x = np.zeros((len(batch), L), dtype=np.int64)  # (B, L)
        y = np.zeros((len(batch), L), dtype=np.int64)  # (B, L)
        keep = np.zeros((len(batch), L), dtype=bool)  # (B, L): the targets with loss
        for b, c in enumerate(batch):
            n = len(c.encoded.ids) - 1
            x[b, :n], y[b, :n] = c.encoded.ids[:-1], c.encoded.ids[1:]
            keep[b, :n] = c.encoded.mask[1:]  # target t + 1 counts when mask[t + 1]
        y[~keep] = IGNORE  # padding, and the tokens the model does not write
        logits, _ = model(torch.from_numpy(x).to(device))  # (B, L, V)
        nats = token_losses(logits, torch.from_numpy(y).to(device)).sum(dim=1)  # (B,)
        scores += [(int(k), float(s)) for k, s in zip(keep.sum(1), nats.tolist(), strict=True)]
        bar.update()
    bar.close()
    return scores


# --- Greedy answers ------------------------------------------------------------------------------


def answer_turns(
    model: Any,
    encoder: ConversationEncoder,
    conversations: list[Conversation],
    batch_size: int,
    *,
    sample: Any,
    progress: bool = False,
) -> list[Answer]:
    """A greedy reply to every assistant turn of `conversations`, compared with the turn.

    Args:
        model: the run's model in eval mode.
        encoder: the run's template and tokenizer.
        conversations: as `read_conversations` fitted them.
        batch_size: prompts generated together (each gets what it would alone).
        sample: the run's `SampleConfig` (its context policy; the rest is set to greedy).
        progress: show progress (a bar on a terminal, plain lines elsewhere).
    """
    turns = [
        (c.where, i, c.messages[:i], m["content"])
        for c in conversations
        for i, m in enumerate(c.messages or [])
        if m["role"] == "assistant"
    ]
    bar = Progress(len(turns), desc="answers", unit="reply", enabled=progress, tenths=True)
    answers = []
    for lo in range(0, len(turns), batch_size):
        batch = turns[lo : lo + batch_size]
        prompts = [encoder.prompt(before) for _, _, before, _ in batch]
        budgets = [
            len(encoder.tokenizer.encode(expected)) + ANSWER_MARGIN for *_, expected in batch
        ]
        vocab = encoder.tokenizer.vocab_size
        replies = greedy_replies(model, prompts, budgets, encoder.reply_end_ids, sample, vocab)
        for (where, turn, _, expected), (ids, end) in zip(batch, replies, strict=True):
            got = encoder.tokenizer.decode(ids)
            answers.append(Answer(where, turn, expected, got, end is not None and got == expected))
        bar.update(len(batch))
    bar.close()
    return answers


def greedy_replies(
    model: Any,
    prompts: list[list[int]],
    budgets: list[int],
    end_ids: tuple[int, ...],
    sample: Any,
    vocab_size: int | None = None,
) -> list[tuple[list[int], int | None]]:
    """Each prompt's greedy reply before its first token of `end_ids` (`replies` at temperature
    0), and that token, where it came within the prompt's budget (None: cut there)."""
    greedy = dataclasses.replace(sample, temperature=0.0)
    return replies(model, prompts, budgets, end_ids, greedy, vocab_size)


# --- The whole evaluation --------------------------------------------------------------------


def evaluate_conversations(
    run: LoadedRun,
    data: Path | None,
    batch_size: int,
    *,
    steps: int | None = None,
    answers: bool = False,
    progress: bool = False,
    t0: float | None = None,
) -> ChatEvalResult:
    """`llmcli eval` on a loaded chat run's conversations (see the module doc).

    Args:
        run: the loaded run; it must hold a chat template.
        data: a JSONL file of conversations (None: the run's validation split; with `answers`,
            its `data.val_path` file).
        batch_size: conversations scored (and prompts answered) together.
        steps: score only the first `steps` batches (None: every conversation).
        answers: also answer every assistant turn greedily (`answer_turns`); needs `data` or
            a `data.val_path` file.
        progress: show progress of the scoring and answering passes.
        t0: when the command began, for `elapsed_s` (None: now).

    Raises:
        InputError: a run without a chat template (saying how to make one), a malformed file,
            `answers` without `data` or a `data.val_path` file.
    """
    t0 = time.perf_counter() if t0 is None else t0
    encoder = ConversationEncoder(require_run_template(run.run_dir), run.tokenizer)
    val_file = run.config.data.val_path
    if data is None and answers and val_file and Path(val_file).is_file():
        data = Path(val_file)  # the validation conversations, as written, from their file
    if data is None:
        if answers:
            raise InputError(
                "--answers compares replies with the assistant's turns as written: give the "
                "conversations as --data FILE.jsonl (the validation split cut from the training "
                "file keeps only their ids)."
            )
        conversations, counts, label = split_conversations(run)
        truncated, skipped, skipped_at = counts["truncated"], counts["skipped"], []
    else:
        ctx = run.config.model.context_length
        conversations, skipped_at = read_conversations(data, encoder, ctx)
        truncated = sum(bool(c.truncated) for c in conversations)
        skipped, label = len(skipped_at), str(data)
    if steps is not None:
        conversations = conversations[: steps * batch_size]
    scores = score_conversations(run.model, conversations, batch_size, progress=progress)
    tokens = sum(n for n, _ in scores)
    loss = sum(nats for _, nats in scores) / tokens if tokens else float("nan")
    records = [_record(c, *score) for c, score in zip(conversations, scores, strict=True)]
    answered = None
    if answers:
        sample = run.config.sample
        answered = answer_turns(
            run.model, encoder, conversations, batch_size, sample=sample, progress=progress
        )
    return ChatEvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=label,
        conversations=len(conversations),
        truncated=truncated,
        skipped=skipped,
        skipped_at=skipped_at,
        tokens=tokens,
        loss=loss,
        perplexity=perplexity(loss),
        elapsed_s=time.perf_counter() - t0,
        per_conversation=records,
        answers=answered,
    )


def _record(conversation: Conversation, tokens: int, nats: float) -> dict[str, Any]:
    """A conversation's line of `--json`'s `per_conversation`."""
    messages = conversation.messages
    return {
        "where": conversation.where,
        "messages": None if messages is None else len(messages),
        "truncated": conversation.truncated,
        "tokens": tokens,
        "loss": nats / tokens if tokens else float("nan"),
    }


def format_chat_result(result: ChatEvalResult) -> str:
    """A few human-readable lines (`--json` has each conversation and each answer)."""
    text = (
        f"run {result.run_dir} (step {result.step}, {Path(result.weights).name})\n"
        f"data: {result.data}: {counted(result.conversations, 'conversation')} "
        f"({result.truncated:,} truncated at a turn boundary, {result.skipped:,} skipped "
        f"as longer than the context), {result.tokens:,} assistant tokens scored\n"
        f"assistant loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}"
    )
    if result.answers is not None:
        text += (
            f"\nanswers: {result.matches:,} of {len(result.answers):,} greedy replies exact "
            f"({100 * result.exact_match:.1f}%)"
        )
    return text
