"""README.md and docs/ against the code.

The reference pages are the generated ones (docs/reference.py) and name every command, option and
config key; every link of every page leads to a file and a heading that exist; a shown output is
what its command prints (docs/readme.py); every cheap command and Python block of every page runs
as a new user would type it, each page from an empty folder of its own (those that cannot run
here listed with why); and the site builds strictly (docs/site.py, mkdocs.yml) and renders in
headless Chromium.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
import yaml
from browser_helpers import needs_chromium, open_page, severe_messages
from conftest import ROOT, save_tiny_run

from llmcli.cli import main
from llmcli.config.shipped import shipped_configs
from llmcli.data.tokenizer import CharTokenizer
from llmcli.generation.sample import format_samples, sample_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_tool"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


readme = _load_tool("readme")
reference = _load_tool("reference")
PAGES = readme.pages()


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# --- the reference pages --------------------------------------------------------------------


def test_the_reference_pages_are_the_generated_ones() -> None:
    for page in reference.PARTS:
        assert page.read_text(encoding="utf-8") == reference.generated(page), (
            f"{page.name} is out of date: run python docs/reference.py --write"
        )


def test_the_config_reference_names_every_key_config_prints_and_what_it_does(capsys) -> None:
    code, out, _ = cli(capsys, "config", "tiny")
    printed = {f"{s}.{k}" for s, values in yaml.safe_load(out).items() for k in values}
    assert code == 0 and len(printed) > 60
    page = reference.CONFIG_PAGE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+\.\w+)` \|.*\| (.*) \|$", page, re.M))
    assert printed - set(rows) == set()
    assert [key for key, text in rows.items() if not text.strip()] == [], "say what it does"
    assert "Muon's momentum" in rows["train.muon_momentum"]
    assert "Sampling temperature" in rows["sample.temperature"]  # a sample setting's help


def test_the_commands_reference_names_every_command_and_option_help_shows(capsys) -> None:
    _, out, _ = cli(capsys, "--help")
    commands = re.findall(r"^  ([a-z][\w-]+)\s", out.split("Commands:")[1], re.M)
    assert len(commands) >= 15 and "inspect-attention" in commands
    page = reference.COMMANDS_PAGE.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## llmcli ([\w-]+)\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    assert sorted(sections) == sorted(commands)
    for command in commands:
        _, help_text, _ = cli(capsys, command, "--help")
        options = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", help_text))
        missing = {
            o
            for o in options
            if f"{o} " not in sections[command] and f"{o}`" not in sections[command]
        }
        assert options and not missing, (command, missing)


# --- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs' and Python-Markdown's toc make it (GitHub's agrees for
    the headings these pages use)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _prose(text: str) -> list[str]:
    """A Markdown text's lines outside fenced code blocks (those blank)."""
    lines = text.splitlines()
    for block in readme.code_blocks(text):
        for i in range(block.start - 1, block.start + len(block.lines) + 1):
            lines[i] = ""
    return lines


def _anchors(page: Path) -> set[str]:
    headings = (re.match(r"#{1,6} (.+)$", line) for line in _prose(page.read_text("utf-8")))
    return {_slug(h[1]) for h in headings if h}


def _links(page: Path) -> list[str]:
    """A page's relative links (images included), outside code blocks."""
    return [
        target
        for line in _prose(page.read_text(encoding="utf-8"))
        for target in _LINK.findall(line)
        if not re.match(r"[a-z]+:", target)
    ]


def test_every_link_of_every_page_leads_to_a_file_and_a_heading_that_exist() -> None:
    assert PAGES[0].name == "README.md" and len(PAGES) >= 18
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


SET_UP = [  # the main job on the bundled data, and the tests
    "pip install torch==2.13.0 && pip install -e . && llmcli train tiny && "
    'llmcli sample --prompt "ROMEO:"',
    'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q',
]


def test_readme_is_short_opens_with_the_set_up_commands_and_lists_every_command(capsys) -> None:
    text = PAGES[0].read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert [b.lines for b in readme.code_blocks(text)[:2]] == [[line] for line in SET_UP]
    _, out, _ = cli(capsys, "--help")
    for name in re.findall(r"^  ([a-z][\w-]+)\s", out.split("Commands:")[1], re.M):
        assert f"[`{name}`](docs/reference/commands.md#llmcli-{name})" in text, name


# --- reading commands ------------------------------------------------------------------------


def test_shell_words_split_as_bash_does() -> None:
    assert readme.shell_words(r"llmcli lens --prompt $'a b\n\nKIN'  # a comment") == [
        "llmcli",
        "lens",
        "--prompt",
        "a b\n\nKIN",
    ]
    assert readme.shell_words(r'llmcli sample --stop "\n\n" | jq -r "." > x') == [
        "llmcli",
        "sample",
        "--stop",
        r"\n\n",
        "|",
        "jq",
        "-r",
        ".",
        ">",
        "x",
    ]
    block = readme.Block("bash", 0, ["a 1 && b 2 \\", "   --c 3   # why", "", "# alone"])
    assert [c.words for c in readme.command_lines(block)] == [["a", "1"], ["b", "2", "--c", "3"]]


def test_a_shown_output_is_rewritten_to_what_its_command_prints(tmp_path) -> None:
    tokenizer = CharTokenizer.train(["ROMEO: what say you, my lord?\n"])
    raw = {"model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}}
    run = save_tiny_run(tmp_path / "run", tokenizer, raw, sharpen=4.0)
    command = "llmcli sample --seed 3 --max-new-tokens 12 --prompt ROMEO"
    stale = f"Before.\n\n<!-- output: {command} -->\n```\nstale text\n```\n\nAfter.\n"
    new, changed = readme.with_outputs(stale, run)
    assert changed == [command]
    samples = sample_run(run, ["ROMEO"], {"seed": 3, "max_new_tokens": 12})
    expected = [line.rstrip() for line in format_samples(samples).rstrip("\n").splitlines()]
    shown = "\n".join(expected)
    assert new == f"Before.\n\n<!-- output: {command} -->\n```\n{shown}\n```\n\nAfter.\n"
    assert readme.with_outputs(new, run) == (new, [])
    part = readme.Shown(command, "b", "d", readme.Block("", 0, []))
    assert readme.select("a\nb 1\nc  \nd\ne\n", part) == ["b 1", "c"]
    part = readme.Shown(command, None, None, readme.Block("", 0, []), drop="wrote")
    assert readme.select("t 1\nt 2\nwrote x\n\nh 1\n\n", part) == ["t 1", "t 2", "", "h 1"]


# --- every cheap command, as a new user types it ---------------------------------------------

# Commands the test does not run, by how they start, and why.
SKIP = {
    "pip": "installs packages (tests/test_wheel.py installs the wheel)",
    "python -m pytest": "the test suite itself",
    "torchrun": "DDP across processes (tests/test_fault_tolerance.py runs 2 ranks)",
    "lm_eval": "another program (benchmarks/lm_eval_check.py)",
    "curl": "needs `llmcli serve` running (tests/test_serve.py)",
    "llama-completion": "llama.cpp (benchmarks/gguf_check.py)",
    "tensorboard": "another program",
    "llmcli serve": "a server that runs until Ctrl-C (tests/test_serve.py)",
    "llmcli export --format gguf": "needs the gguf extra and a BPE run (docs/gguf.md: a char run "
    "is refused; tests/test_gguf.py)",
}
# Python blocks the test does not run, by what they import, and why (those using `load_run` run).
PYTHON_SKIP = {
    "from openai import": "needs `llmcli serve` running (tests/test_serve_chat.py runs the chat "
    "example as copied; tests/test_serve.py the completions)",
    "from peft import": "needs a LoRA run's export (tests/test_lora.py loads one with peft)",
    "from sae_lens import": "needs sae-lens and a trained SAE (tests/test_sae_folder.py loads one)",
    "from circuit_tracer": "needs circuit-tracer and a graph (tests/test_graph_circuit_tracer.py)",
}
# What makes a command cheap, appended to its words (a repeated option's last value wins).
CHEAP = {
    "train": [
        *("--set", "train.max_steps=2", "--set", "train.eval_steps=1"),
        *("--set", "train.log_interval=1", "--no-progress"),
    ],
    "sample": ["--max-new-tokens", "24"],
    "eval": ["--steps", "2", "--no-progress"],
    "sae": ["--steps", "2", "--no-progress"],
    "inspect-attention": ["--ablation-steps", "1", "--no-pictures", "--no-progress"],
}
# Files the pages' commands expect the user to have.
USER_FILES = {"prompts.txt": "ROMEO:\nJULIET:\n"}


CLONE = "needs the repository's files (the page says: from a clone)"
HUB = "needs the Hub's TinyStories (tests/test_shipped.py runs the config on local files)"
NO_TENSORBOARD = "needs the tensorboard extra"
NO_CUDA = "asks for a CUDA device, and there is none here"
OTHER = "another program"
COMPILES = "compiles the decode step, about a minute (tests/test_compiled_decode.py compiles one)"


def _skip_reason(command) -> str | None:
    if "from a clone" in command.line:
        return CLONE
    if any("tinystories" in word for word in command.words):
        return HUB
    text = " ".join(command.words)
    for start, reason in SKIP.items():
        if text.startswith(start):
            return reason
    if "train.logger=tensorboard" in text and importlib.util.find_spec("tensorboard") is None:
        return NO_TENSORBOARD
    if "--device cuda" in text and not torch.cuda.is_available():
        return NO_CUDA
    if "--compile" in command.words:
        return COMPILES
    if command.words[0] not in ("llmcli", "printf"):  # printf writes a file a command reads
        return OTHER
    return None


def _cheap(words: list[str]) -> list[str]:
    extra = CHEAP.get(words[1], [])
    if words[1] == "inspect-attention" and "--ablation" not in words:
        extra = extra[2:]
    return words[1:] + extra


def _runs_first(words: list[str], folder: Path) -> list[list[str]]:
    """`llmcli train NAME` for each `checkpoints/NAME` a compare needs that no command made."""
    if words[1] != "compare":
        return []
    needed = [Path(w).name for w in words if w.startswith("checkpoints/") and "*" not in w]
    return [
        ["llmcli", "train", name]
        for name in needed
        if not (folder / "checkpoints" / name).exists() and name in shipped_configs()
    ]


class _Reader:
    """A new user typing a page's commands, in order, in one folder."""

    def __init__(self, folder: Path, monkeypatch, capsys) -> None:
        self.folder, self.monkeypatch, self.capsys = folder, monkeypatch, capsys
        self.failures, self.ran, self.skipped = [], [], []

    def read(self, page: Path) -> None:
        """Type the page's commands, in order."""
        self.monkeypatch.chdir(self.folder)
        for block in readme.code_blocks(page.read_text("utf-8")):
            where = f"{page.relative_to(ROOT)} line {block.start}"
            code = "\n".join(block.lines)
            skip = next((why for start, why in PYTHON_SKIP.items() if start in code), None)
            if block.lang == "python" and skip is not None:
                self.skipped.append((f"the python block of {where}", skip))
            elif block.lang == "python":
                try:
                    exec(compile(code, str(page), "exec"), {})
                    self.ran.append(f"the python block of {where}")
                except Exception as exc:  # noqa: BLE001 (reported with the rest)
                    self.failures.append(f"the python block of {where}: {exc!r}")
            elif block.lang == "bash":
                for command in readme.command_lines(block):
                    self.type(command, where)

    def type(self, command, where: str) -> None:
        reason = _skip_reason(command)
        if reason is not None:
            self.skipped.append((" ".join(command.words), reason))
            return
        words = command.before_pipe()
        if words[0] != "llmcli":  # printf > romeo.txt
            subprocess.run(["bash", "-c", command.shell], cwd=self.folder, check=True)
            self.ran.append(command.shell)
            return
        for first in _runs_first(words, self.folder):
            cli(self.capsys, *_cheap(first))
        self.monkeypatch.setattr(sys, "stdin", io.StringIO("ROMEO:\n"))
        threads = torch.get_num_threads()
        code, _, err = cli(self.capsys, *_cheap(words))
        torch.set_num_threads(threads)
        self.ran.append(" ".join(words))
        if code != 0:
            self.failures.append(f"{where}: {' '.join(words)} exited {code}: {err[-600:]}")


@pytest.mark.slow  # about a hundred commands: a minute on a busy machine
def test_every_cheap_command_of_every_page_runs_as_a_new_user_types_it(
    tmp_path, monkeypatch, capsys
) -> None:
    """Each page, README first, in an empty folder of its own: a page makes the runs it reads
    (`llmcli train tiny --resume auto`, ...) as it says, so its commands run as written from an
    empty folder; those that cannot run here are listed with why (`SKIP`, `_skip_reason`)."""
    monkeypatch.setenv("LLMCLI_CACHE", str(tmp_path / "cache"))
    readers = []
    for page in PAGES:
        folder = tmp_path / page.relative_to(ROOT).with_suffix("").as_posix().replace("/", "-")
        folder.mkdir()
        for name, text in USER_FILES.items():
            (folder / name).write_text(text)
        reader = _Reader(folder, monkeypatch, capsys)
        reader.read(page)
        readers.append(reader)
    failures = [f for r in readers for f in r.failures]
    assert not failures, "\n\n".join(failures)
    assert sum(len(r.ran) for r in readers) >= 35
    known = {*SKIP.values(), *PYTHON_SKIP.values(), CLONE, HUB, NO_TENSORBOARD, NO_CUDA, OTHER}
    known.add(COMPILES)
    assert {reason for r in readers for _, reason in r.skipped} <= known


# --- the site --------------------------------------------------------------------------------


def _build_site(site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The site, built once for the tests that read it (a build takes seconds): its folder and
    the build's outcome, which each test checks."""
    site = tmp_path_factory.mktemp("site")
    return site, _build_site(site)


@pytest.mark.slow
def test_the_site_builds_strictly_and_fails_on_a_broken_link(built_site, tmp_path) -> None:
    site, built = built_site
    assert built.returncode == 0, built.stderr
    home = (site / "index.html").read_text(encoding="utf-8")
    # README's links lead to the site's pages, and files outside docs/ come in under repo/.
    assert 'href="getting-started.html"' in home
    assert 'href="reference/commands.html#llmcli-sample"' in home
    assert (site / "repo" / "configs" / "tiny.yaml").is_file()
    # The same validation settings on a page whose link's heading is not there.
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a heading](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    keep = ("site_name", "theme", "markdown_extensions", "validation")
    broken = {
        **{k: config[k] for k in keep},
        "docs_dir": str(docs),
        "nav": ["index.md", "other.md"],
    }
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "broken.yml"]
    failed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert failed.returncode != 0 and "no-such-heading" in failed.stderr, failed.stderr


@needs_chromium
def test_the_built_home_page_and_a_guide_render_in_chromium(browser, built_site, tmp_path) -> None:
    """Screenshots of the home page and the training guide (kept where LLMCLI_DOCS_SCREENSHOTS
    says, to be looked at), each checked to have rendered: Material's header and navigation
    styled, the page's own heading and pictures shown, no console errors."""
    site, built = built_site
    assert built.returncode == 0, built.stderr
    keep = Path(os.environ.get("LLMCLI_DOCS_SCREENSHOTS", tmp_path))
    keep.mkdir(parents=True, exist_ok=True)
    for name, heading in (("index", "llmcli"), ("training", "Training")):
        open_page(browser, site / f"{name}.html")
        state = browser.execute_script(
            """const header = document.querySelector('header.md-header');
            const img = document.querySelector('article img');
            return {h1: document.querySelector('article h1').textContent.replace('¶', '').trim(),
                    header: header && getComputedStyle(header).backgroundColor,
                    sticky: header && getComputedStyle(header).position,
                    nav: document.querySelectorAll('nav.md-nav a.md-nav__link').length,
                    img: img ? img.naturalWidth : -1};"""
        )
        assert state["h1"] == heading
        assert state["sticky"] == "sticky" and state["header"] not in ("rgba(0, 0, 0, 0)", None)
        assert state["nav"] >= 20, state  # every page of mkdocs.yml's nav
        if name == "index":
            assert state["img"] > 0, "the picture did not load"
        assert severe_messages(browser) == []
        shot = keep / f"site-{name}.png"
        assert browser.save_screenshot(str(shot))
        colours = _colours(shot)
        assert colours > 50, f"{shot} looks blank ({colours} colours)"


def _colours(png: Path) -> int:
    """How many distinct colours a PNG holds (a blank page has one or two)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    return len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()})
