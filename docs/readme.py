"""Check, or rewrite, the parts of README.md that come from the code.

- The config table (section "Configs"): every key of every section, as the config classes define
  it (`llmcli config` prints the same keys), its choices read from the class, and a note per key
  held here in `NOTES`. A key added to a config class appears with no note until one is written.
- The outputs shown under commands: the fenced block after a line
  `<!-- output: COMMAND [| from "TEXT"] [| until "TEXT"] [| drop "TEXT"] -->` is what COMMAND
  prints on stdout, run from a folder that holds only the trained run `checkpoints/tiny`
  (README's figures come from `llmcli train tiny` run to its 2,000 steps on the bundled corpus;
  `--run DIR` gives another).
  `from` starts the shown part at the first line starting with TEXT, `until` ends it before the
  next line starting with TEXT, `drop` leaves out the lines starting with TEXT.

    python docs/readme.py                         # check both: exit 1 naming what differs
    python docs/readme.py --write                 # rewrite what differs
    python docs/readme.py --only config-table     # the table alone (needs no trained run)
    python docs/readme.py --run checkpoints/tiny  # the run the outputs come from (the default)

It also offers what tests/test_readme.py reads README with: `code_blocks`, `shell_words` (a
command line as the shell splits it, `$'...'` included) and `command_lines`.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# --------------------------------------------------------------------------------------------
# Reading README: code blocks and command lines.
# --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^```(\w*)\s*$")
_ANSI_C = re.compile(r"\$'((?:[^'\\]|\\.)*)'")


@dataclasses.dataclass
class Block:
    """A fenced code block: its language, the line after its opening fence (0-based), its lines."""

    lang: str
    start: int
    lines: list[str]


def code_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, in order."""
    blocks, current = [], None
    for i, line in enumerate(text.splitlines()):
        fence = _FENCE.match(line)
        if current is None and fence:
            current = Block(fence[1], i + 1, [])
        elif current is not None and line.rstrip() == "```":
            blocks.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    return blocks


@dataclasses.dataclass
class Command:
    """One command of a shell block.

    Attributes:
        words: its words as the shell splits them (`|`, `>` kept as words of their own).
        line: the block's line it is on (its continuation lines joined), comment included.
    """

    words: list[str]
    line: str

    @property
    def shell(self) -> str:
        """The command as a line for `bash -c`."""
        return " ".join(w if w in _OPERATORS else shlex.quote(w) for w in self.words)

    def before_pipe(self) -> list[str]:
        """Its words up to a `|`: what runs first."""
        return self.words[: self.words.index("|")] if "|" in self.words else self.words


_OPERATORS = {"|", ">", ">>", "<", ";"}


def command_lines(block: Block) -> list[Command]:
    """A shell block's commands: continuation lines joined, comments and blank lines left out,
    `a && b` split into `a` and `b`."""
    joined, pending = [], ""
    for line in block.lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    commands = []
    for line in joined:
        part: list[str] = []
        for word in [*shell_words(line), "&&"]:
            if word == "&&":
                if part:
                    commands.append(Command(part, line))
                part = []
            else:
                part.append(word)
    return commands


def shell_words(line: str) -> list[str]:
    """`line` split as bash splits it (quotes, `$'\\n'`, a `#` comment), operators kept as words."""
    expanded = _ANSI_C.sub(
        lambda m: shlex.quote(codecs.decode(m[1], "unicode_escape")), line.strip()
    )
    lexer = shlex.shlex(expanded, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


# --------------------------------------------------------------------------------------------
# The config table.
# --------------------------------------------------------------------------------------------

# What a key's name and type do not say; shown after it in parentheses. Keys with no note are
# listed by name (and their choices).
NOTES = {
    "data.path": "file, folder of `.txt` or glob",
    "data.dataset": "Hugging Face `datasets` name, local json/jsonl/csv/parquet files or a "
    "`save_to_disk` folder, with `split`, `text_column`",
    "data.val_path": "a separate validation file, or `val_split` of a dataset",
    "data.tokenizer": "`char`, `bpe`, a `tokenizer.json` or a folder holding one, or a Hub name",
    "data.vocab_size": "BPE",
    "data.cache_dir": "default `$LLMCLI_CACHE`, else `~/.cache/llmcli`",
    "train.threads": "CPU threads, also for `eval` and `inspect-attention` on the run; default "
    "`auto`: the CPUs nothing else is using; null: torch's own count; see Threads, under Quick "
    "start",
    "model.attn_dropout": "the rate on the attention weights; null: `dropout`",
    "train.dtype": "`auto`: fp32 on CPU and MPS, bf16 autocast on CUDA where supported, else fp16 "
    "with a GradScaler; `bfloat16` also on the CPU, and on MPS with macOS 14+",
    "train.batch_size": "a number, or `auto`: the largest micro-batch that fits",
    "train.tokens_per_step": "tokens per optimizer step: needed by `batch_size: auto`, sets "
    "`grad_accum` otherwise",
    "train.memory_limit": "bytes or a size such as `4GB`; null: the device's free memory",
    "train.spike_guard": "default true",
    "train.spike_factor": "2.0",
    "train.spike_window": "50",
    "train.spike_skips": "3",
    "train.spike_lr_factor": "0.5",
    "train.spike_lr_steps": "100",
    "train.spike_rollbacks": "3",
    "train.log_layers": 'default false; see "Is it healthy?"',
    "train.head_metrics": "each head's scores on the repeated-token probe and the in-context "
    "learning score at every evaluation; default true",
    "train.muon_lr": "Muon's rate for the matrices",
    "train.muon_momentum": "Muon's momentum",
    "train.decay_fraction": "the part of the run a `wsd` schedule decays over",
    "train.init_from": "a Hugging Face folder or Hub name",
    "train.logger": "`none`/`tensorboard`/`wandb` or a list",
    "train.wandb_project": "default: the config's name",
    "train.wandb_name": "default: the run directory's name",
    "train.save_interval": "steps, null: off",
    "train.save_interval_s": "default 300; null: off",
    "train.resume": "`false`/`true`/`auto`",
    "sample.context_keep": "null: context_length // 2",
    "sample.ignore_eos": "default false: a sample ends at the end-of-text token",
}
# Words before a key that start a group of keys.
HEADINGS = {"model.pos_emb": "recipe options, off by default:"}
# Keys shown in another key's note rather than on their own.
IN_NOTES = {"data.split", "data.text_column", "data.val_split"}
SECTIONS = ("model", "data", "train", "sample")
TABLE_START = "<!-- config-table: generated by docs/readme.py -->"
TABLE_END = "<!-- end of config-table -->"


def _choices(tp: typing.Any) -> list[str]:
    """The values of a `Literal` type (inside `X | None` too), as strings."""
    if typing.get_origin(tp) is typing.Literal:
        return [str(v).lower() if isinstance(v, bool) else str(v) for v in typing.get_args(tp)]
    return [c for arg in typing.get_args(tp) for c in _choices(arg)]


def _key_cell(section: str, field: dataclasses.Field, hints: dict) -> str:
    """A key as the table shows it: its name, its choices (unless its note names them all), its
    note; after a heading if one starts there."""
    key = f"{section}.{field.name}"
    note = NOTES.get(key)
    choices = _choices(hints[field.name])
    parts = [note] if note else []
    if choices and not (note and all(f"`{c}`" in note for c in choices)):
        parts.insert(0, "/".join(f"`{c}`" for c in choices))
    text = f"`{field.name}`" + (f" ({'; '.join(parts)})" if parts else "")
    return f"{HEADINGS[key]} {text}" if key in HEADINGS else text


def config_table() -> str:
    """The config table, between its markers: one row per section, every key of it."""
    from llmcli.config.sections import Config

    rows = ["| section | keys |", "| --- | --- |"]
    for section in SECTIONS:
        cls = typing.get_type_hints(Config)[section]
        hints = typing.get_type_hints(cls, include_extras=True)
        cells = []
        for field in dataclasses.fields(cls):
            if f"{section}.{field.name}" in IN_NOTES:
                continue
            cells.append(_key_cell(section, field, hints))
        rows.append(f"| `{section}` | {', '.join(cells)} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


def table_keys(table: str) -> set[str]:
    """`section.key` for every key a config table names (a key's note may name others)."""
    keys = set()
    for line in table.splitlines():
        m = re.match(r"\| `(\w+)` \| (.*) \|$", line)
        if m:
            keys |= {f"{m[1]}.{k}" for k in re.findall(r"`(\w+)`", m[2])}
    return keys


def _replace_between(text: str, start: str, end: str, new: str) -> str:
    a, b = text.index(start), text.index(end) + len(end)
    return text[:a] + new + text[b:]


# --------------------------------------------------------------------------------------------
# The outputs shown under commands.
# --------------------------------------------------------------------------------------------

_OUTPUT = re.compile(r"^<!-- output: (.+?) -->$")


@dataclasses.dataclass
class Shown:
    """A command's output shown in README: the marker's command and filters, and its block."""

    command: str
    start: str | None
    until: str | None
    block: Block
    drop: str | None = None


def shown_outputs(text: str) -> list[Shown]:
    """Every `<!-- output: ... -->` marker with the code block after it."""
    lines = text.splitlines()
    blocks = {b.start - 1: b for b in code_blocks(text)}  # opening fence line -> block
    shown = []
    for i, line in enumerate(lines):
        m = _OUTPUT.match(line)
        if not m:
            continue
        command, *filters = [part.strip() for part in m[1].split(" | ")]
        options = dict(re.fullmatch(r'(from|until|drop) "(.*)"', f).groups() for f in filters)
        block = blocks.get(i + 1)
        if block is None:
            raise ValueError(f"README line {i + 1}: no code block right after {line!r}")
        shown.append(
            Shown(command, options.get("from"), options.get("until"), block, options.get("drop"))
        )
    return shown


def select(output: str, shown: Shown) -> list[str]:
    """The lines of `output` that `shown`'s filters pick, trailing spaces removed."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()]
    if shown.start is not None:
        first = next((i for i, line in enumerate(lines) if line.startswith(shown.start)), None)
        lines = [] if first is None else lines[first:]
    if shown.until is not None:
        end = next((i for i, line in enumerate(lines) if line.startswith(shown.until)), None)
        lines = lines if end is None else lines[:end]
    if shown.drop is not None:
        lines = [line for line in lines if not line.startswith(shown.drop)]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_command(command: str, folder: Path) -> str:
    """`llmcli ...` run in `folder` with this Python (its llmcli); its stdout. Fails loudly."""
    words = shell_words(command)
    assert words[0] == "llmcli", command
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(
        [sys.executable, "-m", "llmcli", *words[1:]],
        cwd=folder,
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def outputs(text: str, run: Path, folder: Path) -> Iterator[tuple[Shown, list[str]]]:
    """Each shown output with the lines its command prints now, run from `folder`, which gets
    a copy of `run` as `checkpoints/tiny` (commands may write into the run)."""
    shutil.copytree(run, folder / "checkpoints" / "tiny", ignore=shutil.ignore_patterns("state.pt"))
    for shown in shown_outputs(text):
        yield shown, select(run_command(shown.command, folder), shown)


def with_outputs(text: str, run: Path) -> tuple[str, list[str]]:
    """README with every shown output as its command prints it now, and the commands whose
    output changed."""
    lines = text.splitlines()
    changed = []
    with tempfile.TemporaryDirectory() as tmp:
        found = list(outputs(text, run, Path(tmp)))
    for shown, now in reversed(found):  # from the end: earlier line numbers stay right
        b = shown.block
        if b.lines != now:
            changed.append(shown.command)
            lines[b.start : b.start + len(b.lines)] = now
    return "\n".join(lines) + "\n", changed[::-1]


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md")
    parser.add_argument("--only", choices=("config-table", "outputs"), help="one part only")
    parser.add_argument("--run", type=Path, default=ROOT / "checkpoints" / "tiny")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    new, differs = text, []
    if args.only in (None, "config-table"):
        new = _replace_between(new, TABLE_START, TABLE_END, config_table())
        if new != text:
            differs.append("the config table")
    if args.only in (None, "outputs"):
        if not (args.run / "config.yaml").is_file():
            print(f"no trained run at {args.run}: train one (llmcli train tiny) or pass --run")
            return 2
        new, changed = with_outputs(new, args.run)
        differs += [f"the output of `{command}`" for command in changed]
    for what in differs:
        print(f"{'rewrote' if args.write else 'differs:'} {what}")
    if args.write and new != text:
        args.readme.write_text(new, encoding="utf-8")
    return 1 if differs and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
