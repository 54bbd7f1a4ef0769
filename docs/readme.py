"""Check, or rewrite, the outputs that README.md and the pages in docs/ show under commands.

The fenced block after a line `<!-- output: COMMAND [| from "TEXT"] [| until "TEXT"] [| drop
"TEXT"] [| stdin "TEXT"] -->` is what COMMAND prints on stdout, run from a folder that holds only
the trained run `checkpoints/tiny` (the pages' figures come from `llmcli train tiny` run to its
2,000 steps on the bundled corpus; `--run DIR` gives another). `from` starts the shown part at
the first line starting with TEXT, `until` ends it before the next line starting with TEXT,
`drop` leaves out the lines starting with TEXT, `stdin` is the command's input (`\\n` for a new
line; else none). A shown command that reads another run, `checkpoints/NAME`, gets this
checkout's (the page says how to make it).

    python docs/readme.py                         # check every page: exit 1 naming what differs
    python docs/readme.py --write                 # rewrite what differs
    python docs/readme.py --page docs/plan.md     # one page
    python docs/readme.py --run checkpoints/tiny  # the run the outputs come from (the default)

It also offers what tests/test_docs.py reads the pages with: `pages` (README, then docs/ in the
site's order), `code_blocks`, `shell_words` (a command line as the shell splits it, `$'...'`
included) and `command_lines`. The generated reference pages are docs/reference.py's.
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
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def pages() -> list[Path]:
    """README.md, then the pages of docs/ in the order of the site's navigation (mkdocs.yml),
    then any page of docs/ it leaves out: the order a reader meets them in."""
    import yaml

    def walk(entries) -> Iterator[str]:
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from walk(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    listed = [ROOT / "docs" / uri for uri in walk(nav) if (ROOT / "docs" / uri).is_file()]
    rest = sorted(set((ROOT / "docs").rglob("*.md")) - set(listed))
    return [README, *listed, *rest]


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
# The outputs shown under commands.
# --------------------------------------------------------------------------------------------

_OUTPUT = re.compile(r"^<!-- output: (.+?) -->$")


@dataclasses.dataclass
class Shown:
    """A command's output shown on a page: the marker's command and filters, and its block."""

    command: str
    start: str | None
    until: str | None
    block: Block
    drop: str | None = None
    stdin: str | None = None


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
        options = dict(re.fullmatch(r'(from|until|drop|stdin) "(.*)"', f).groups() for f in filters)
        block = blocks.get(i + 1)
        if block is None:
            raise ValueError(f"line {i + 1}: no code block right after {line!r}")
        stdin = options.get("stdin")
        stdin = None if stdin is None else codecs.decode(stdin, "unicode_escape")
        start, until, drop = options.get("from"), options.get("until"), options.get("drop")
        shown.append(Shown(command, start, until, block, drop, stdin))
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


def run_command(command: str, folder: Path, stdin: str | None = None) -> str:
    """`llmcli ...` run in `folder` with this Python (its llmcli), `stdin` its input; its
    stdout. Fails loudly."""
    words = shell_words(command)
    assert words[0] == "llmcli", command
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(
        [sys.executable, "-m", "llmcli", *words[1:]],
        cwd=folder,
        capture_output=True,
        text=True,
        env=env,
        input=stdin if stdin is not None else "",
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def outputs(text: str, run: Path, folder: Path) -> Iterator[tuple[Shown, list[str]]]:
    """Each shown output with the lines its command prints now, run from `folder`, which gets
    a copy of `run` as `checkpoints/tiny` (commands may write into the run), and, from the
    first command that reads it on, of every other `checkpoints/NAME` a shown command reads,
    from this checkout's `checkpoints/` (so that until then `tiny` is the latest run, as it is
    for a reader who has not made the others yet)."""
    no_state = shutil.ignore_patterns("state.pt")
    shutil.copytree(run, folder / "checkpoints" / "tiny", ignore=no_state)
    for shown in shown_outputs(text):
        for name in re.findall(r"checkpoints/([\w.-]+)", shown.command):
            source, copy = ROOT / "checkpoints" / name, folder / "checkpoints" / name
            if copy.exists():
                continue
            if not (source / "config.yaml").is_file():
                raise RuntimeError(f"no run at checkpoints/{name}: make it as the page says")
            shutil.copytree(source, copy, ignore=no_state)
        yield shown, select(run_command(shown.command, folder, shown.stdin), shown)


def with_outputs(text: str, run: Path) -> tuple[str, list[str]]:
    """A page with every shown output as its command prints it now, and the commands whose
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
    parser.add_argument("--write", action="store_true", help="rewrite the pages that differ")
    parser.add_argument("--page", type=Path, action="append", help="only this page (repeatable)")
    parser.add_argument("--run", type=Path, default=ROOT / "checkpoints" / "tiny")
    args = parser.parse_args(argv)
    if not (args.run / "config.yaml").is_file():
        print(f"no trained run at {args.run}: train one (llmcli train tiny) or pass --run")
        return 2
    differs = 0
    for page in args.page or pages():
        text = page.read_text(encoding="utf-8")
        if not shown_outputs(text):
            continue
        new, changed = with_outputs(text, args.run)
        for command in changed:
            verb = "rewrote" if args.write else "differs:"
            print(f"{page.relative_to(ROOT)}: {verb} the output of `{command}`")
        differs += len(changed)
        if args.write and new != text:
            page.write_text(new, encoding="utf-8")
    return 1 if differs and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
