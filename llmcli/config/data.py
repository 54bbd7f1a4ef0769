"""The `data:` section: where the text comes from and how it becomes tokens."""

from __future__ import annotations

from dataclasses import dataclass

from llmcli.config.rules import require, require_size, size_bytes
from llmcli.errors import ConfigError


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    path: str | None = "data/shakespeare.txt"  # a text file, a folder of .txt files or a glob
    val_path: str | None = None  # a separate validation file (default: the last val_fraction)
    # a `datasets` name, local json/jsonl/csv/parquet files or a save_to_disk folder
    dataset: str | None = None
    split: str = "train"  # the dataset's training split
    val_split: str | None = None  # the dataset's validation split (default: the last val_fraction)
    text_column: str = "text"  # the dataset's column of text
    tokenizer: str = "char"  # char, bpe, a tokenizer.json (or a folder holding one) or a Hub name
    vocab_size: int = 1024  # BPE's vocabulary size
    # BPE trains on at most this much text, spread evenly over the corpus ("128MB", bytes, or
    # null for all of it): its memory grows with the text it counts words in (about 1 GB for
    # 128 MiB of varied text), not with the corpus.
    tokenizer_sample: int | str | None = "128MB"
    # data.dataset read through `datasets`' streaming mode: rows are tokenized as they arrive,
    # into a cache written in pieces that an interrupted prepare continues.
    streaming: bool = False
    val_fraction: float = 0.1  # the part of the text held out for validation
    cache_dir: str | None = None  # token cache (default: $LLMCLI_CACHE, else ~/.cache/llmcli)
    # text: plain text; chat: conversations, rows of {"messages": [{role, content}, ...]} in
    # .jsonl files (data.path) or a dataset's messages column, with the loss on the assistant's
    # turns only; one longer than the context is cut after a reply that fits, or skipped;
    # preference: TRL's preference pairs for train.objective dpo, rows of {"prompt", "chosen",
    # "rejected"} (text, or messages rendered by the init_from run's chat template) in .jsonl
    # files (data.path) or a dataset's columns; a pair longer than the context has its
    # completions cut, or is skipped; prompts: prompts to answer for train.objective grpo, rows
    # of {"prompt", "answer"} (the prompt text or messages, the answer what the reward checks
    # against) in .jsonl files (data.path)
    format: str = "text"
    # chat: a Jinja chat template file in Hugging Face's format (default: the built-in one)
    chat_template: str | None = None
    # chat: pack whole conversations into each training row by best fit, each attending only
    # to itself with its positions from 0 (false: one conversation a row, the rest padding);
    # evaluation keeps one a row either way. Ignored by the other formats.
    packing: bool = True

    def validate(self) -> None:
        if self.path is None and self.dataset is None:
            raise ConfigError(
                "data: give either data.path (a file, folder or glob of text) or data.dataset "
                "(a Hugging Face datasets name or local json/csv/parquet files); both are empty."
            )
        if self.path is not None and self.dataset is not None:
            raise ConfigError(
                f"data: data.path ({self.path!r}) and data.dataset ({self.dataset!r}) are both "
                "set; keep one of them (set the other to null)."
            )
        require(self.vocab_size > 0, "data", "vocab_size", self.vocab_size, "must be positive")
        require_size("data", "tokenizer_sample", self.tokenizer_sample, "the whole corpus")
        require(
            not self.streaming or self.dataset is not None,
            "data",
            "streaming",
            self.streaming,
            "needs data.dataset (a Hugging Face datasets name or local json/jsonl/csv/parquet "
            "files): a data.path is read piece by piece already",
        )
        require(
            0 < self.val_fraction < 1,
            "data",
            "val_fraction",
            self.val_fraction,
            "must be between 0 and 1 (exclusive)",
        )
        require(
            self.format in ("text", "chat", "preference", "prompts"),
            "data",
            "format",
            self.format,
            "must be 'text' (plain text), 'chat' (JSONL conversations), 'preference' (JSONL "
            "preference pairs, for train.objective dpo) or 'prompts' (JSONL prompts with "
            "answers, for train.objective grpo)",
        )
        require(
            self.chat_template is None or self.format in ("chat", "preference", "prompts"),
            "data",
            "chat_template",
            self.chat_template,
            "is read only with data.format: chat, preference or prompts",
        )
        require(
            not (self.streaming and self.format != "text"),
            "data",
            "streaming",
            self.streaming,
            f"is for plain text: data.format {self.format} reads its rows whole (set "
            "data.streaming: false)",
        )
        require(
            self.tokenizer != "",
            "data",
            "tokenizer",
            self.tokenizer,
            "must be 'char', 'bpe', a tokenizer.json (or a folder holding one) or a Hub name",
        )

    @property
    def tokenizer_sample_bytes(self) -> int | None:
        """`tokenizer_sample` in bytes; None for the whole corpus (or a string that is not a
        size, which `validate` refuses)."""
        return size_bytes(self.tokenizer_sample)
