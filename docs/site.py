"""MkDocs hooks (mkdocs.yml `hooks:`): the site is the repository's pages as GitHub shows them.

The pages link the way GitHub resolves links, relative to the file: `docs/training.md` links
`../configs/tiny.yaml`, README links `docs/training.md`. MkDocs sees only `docs/`, so these hooks

- make README.md the site's home page (`index.md`), as it is the repository's;
- bring every other repository file a page links to (a config, a script, benchmarks/RESULTS.md
  and the pages it links in turn) into the site under `repo/`, at its path in the repository:
  Markdown as a page, anything else as a file to open;
- rewrite each page's relative links to where their targets are in the site (a folder's to its
  README.md or `__init__.py`).

So a link works on GitHub and in the site alike, and `mkdocs build --strict` fails on one whose
target is in neither (and on a missing anchor).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
HOME = "README.md"
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^\s*```")


def _repo_path(src_uri: str) -> str:
    """The repository path of a site file: `docs/X` for a page of docs/, else what it came from."""
    if src_uri == "index.md":
        return HOME
    return src_uri.removeprefix("repo/") if src_uri.startswith("repo/") else f"docs/{src_uri}"


def _site_uri(repo_path: str, files: Files) -> str:
    """Where a repository file is in the site."""
    if repo_path == HOME:
        return "index.md"
    page = files.get_file_from_path(repo_path[5:]) if repo_path.startswith("docs/") else None
    if page is not None and not page.inclusion.is_excluded():
        return repo_path[5:]
    return f"repo/{repo_path}"  # docs/'s own scripts, which mkdocs.yml keeps out, come in here


def _relative_links(markdown: str):
    """Each relative link of a Markdown text outside code blocks: (match, target, anchor)."""
    inside = False
    for line_match in re.finditer(r"[^\n]*\n?", markdown):
        line = line_match.group()
        if _FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        for m in _LINK.finditer(line):
            target, _, anchor = m[2].partition("#")
            if target and not re.match(r"[a-z]+:", target) and not target.startswith("/"):
                yield line_match.start() + m.start(), m, target, anchor


def _target(page_repo_path: str, target: str) -> str:
    """The repository file a link of a page leads to. A folder (which GitHub lists) leads to
    what says what it holds: its README.md, or a package's `__init__.py`."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), target))
    if (ROOT / path).is_dir():
        for name in ("README.md", "__init__.py"):
            if (ROOT / path / name).is_file():
                return f"{path}/{name}"
    return path


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / HOME)))
    queue = [f for f in files if f.src_uri.endswith(".md")]
    while queue:
        page = queue.pop()
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for _, _, target, _ in _relative_links(text):
            path = _target(_repo_path(page.src_uri), target)
            uri = _site_uri(path, files)
            if (ROOT / path).is_file() and files.get_file_from_path(uri) is None:
                added = File.generated(config, uri, abs_src_path=str(ROOT / path))
                files.append(added)
                if uri.endswith(".md"):
                    queue.append(added)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    here = _repo_path(page.file.src_uri)
    pieces, last = [], 0
    for start, m, target, anchor in _relative_links(markdown):
        path = _target(here, target)
        if not (ROOT / path).is_file():
            continue  # left as it is: the build reports it
        uri = _site_uri(path, files)
        link = posixpath.relpath(uri, posixpath.dirname(page.file.src_uri) or ".")
        link += f"#{anchor}" if anchor else ""
        pieces += [markdown[last : start + len(m[1])], link]
        last = start + len(m[1]) + len(m[2])
    return "".join([*pieces, markdown[last:]])
