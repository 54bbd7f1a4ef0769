"""Hugging Face Hub names: from `gpt2` or `org/name@revision` to a local folder, offline too.

`resolve_pretrained` is how llmcli reads anything that can come from the Hub (a tokenizer, a
model to start from): an existing local file or folder is used as it is; any other name that is
a Hub repo id, optionally with `@revision` (a branch, tag or commit), is fetched through the
Hugging Face cache with `huggingface_hub.snapshot_download`, only the files the caller asks for.
The cache and the switches are Hugging Face's own, read when the call is made (not when
`huggingface_hub` was imported): `HF_HUB_CACHE` (else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`), `HF_HUB_OFFLINE=1` (use the cache only: a warm cache works with no
network) and `HF_ENDPOINT`. Every failure (a name not cached while offline, no network, a repo
that does not exist or is gated) is an `InputError` that names the setting and the name and says
what to do; never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

# `huggingface_hub` loads its submodules on first use: `snapshot_download` (and the HTTP client
# behind it, ~0.4 s to import) is only loaded when a Hub name is actually resolved.
import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from llmcli.errors import InputError, describe_os_error

_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub takes as true in an environment variable
# Folders that hold llmcli's own files, never Hub organisations: `checkpoints/chat` is a run
# that is not made yet, and asking the Hub for it would blame the network.
LOCAL_ROOTS = ("checkpoints",)


def looks_local(name: str) -> bool:
    """Whether `name`, though it may spell a Hub repo id, reads as a local path: its first part
    is a folder here (`runs/chat` with `runs/` present) or one of llmcli's own (`LOCAL_ROOTS`)."""
    first, slash, _ = name.partition("/")
    return bool(slash) and (first in LOCAL_ROOTS or Path(first).expanduser().is_dir())


def split_hub_name(name: str) -> tuple[str, str | None] | None:
    """`(repo_id, revision)` for a Hub name (`gpt2`, `org/name`, `org/name@revision`), or None
    when `name` cannot be one (a path such as `./x`, `/abs/x`, `a/b/c` or `x y`) or reads as a
    local path (`looks_local`: `checkpoints/chat`)."""
    if looks_local(name):
        return None
    repo_id, at, revision = name.partition("@")
    if at and not revision:
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache that `snapshot_download` uses, from the environment now."""
    env = os.environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(os.path.expandvars(env[key])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(os.path.expandvars(env["XDG_CACHE_HOME"])).expanduser() / "huggingface" / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether Hugging Face's offline mode is on (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE`),
    from the environment now or as `huggingface_hub` read it at import."""
    env = os.environ
    flags = (env.get("HF_HUB_OFFLINE"), env.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any((v or "").upper() in _TRUE for v in flags)


def _download_command(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id}{rev}` (`huggingface-cli download` in older huggingface_hub)"


def resolve_pretrained(name: str | os.PathLike, *, what: str, patterns: Sequence[str]) -> Path:
    """A local folder for `name`: the folder itself when it exists, else a Hub repo id
    (`gpt2`, `openai-community/gpt2`, `org/name`, optionally `@revision`) resolved through the
    Hugging Face cache with `huggingface_hub.snapshot_download(..., allow_patterns=patterns)`,
    which honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (a warm cache works offline).

    An existing file is returned as it is too, for callers that accept one. A Hub name gives its
    snapshot folder in the cache, holding those of `patterns` that the repo has.

    Args:
        name: a local path or a Hub name.
        what: what `name` is for, as the user wrote it (`data.tokenizer`), for messages.
        patterns: the files to fetch (glob patterns, e.g. `["tokenizer.json", "*.json"]`).

    Raises:
        InputError: `name` is neither a path on disk nor a Hub name; or a Hub name not in the
            cache while offline or with the Hub unreachable; or a repo or revision that does
            not exist or is gated; the message says which.
    """
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.exists():
        return path
    parsed = split_hub_name(text)
    if parsed is None:
        raise InputError(
            f"{what} {text!r} is neither an existing file or folder nor a Hugging Face Hub name "
            "(like 'gpt2' or 'org/name', optionally with '@revision'): check the path."
        )
    repo_id, revision = parsed
    cache, offline = hub_cache_dir(), hub_offline()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # huggingface_hub reads it at import only
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(patterns),
            endpoint=endpoint,
        )
    except Exception as exc:  # the Hub's errors and its HTTP client's vary by version
        raise InputError(
            _failure_message(exc, f"{what} {text!r}", repo_id, revision, cache, offline, endpoint)
        ) from None
    return Path(folder)


def _failure_message(
    exc: Exception,
    subject: str,
    repo_id: str,
    revision: str | None,
    cache: Path,
    offline: bool,
    endpoint: str | None,
) -> str:
    """What went wrong resolving a Hub name, and what to do, for each kind of failure."""
    not_cached = f"{subject} is a Hugging Face Hub name that is not in the cache at {cache}"
    download = _download_command(repo_id, revision)
    if isinstance(exc, IncompleteSnapshotError):
        return (
            f"{subject}: its copy in the cache at {cache} is incomplete ({_first_line(exc)}). "
            f"To complete it, run once with the network, or {download}."
        )
    if isinstance(exc, LocalEntryNotFoundError) and offline:
        return (
            f"{not_cached}, and offline mode is on (HF_HUB_OFFLINE=1). To fill the cache, run "
            f"once with the network (HF_HUB_OFFLINE unset), or {download}; or give a local folder."
        )
    if isinstance(exc, LocalEntryNotFoundError):  # what the Hub makes of connection errors
        return (
            f"{not_cached}, and the Hub ({endpoint or constants.ENDPOINT}) could not be reached "
            f"(no network?): connect and run again, or give a local folder. ({_first_line(exc)})"
        )
    if isinstance(exc, GatedRepoError):
        return (
            f"{subject}: the Hugging Face Hub repository {repo_id!r} is gated: accept its terms "
            "on its page and log in (`hf auth login`), or give a local folder."
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{subject}: there is no Hugging Face Hub repository {repo_id!r} (or it is private "
            "and you are not logged in): check the name."
        )
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"{subject}: the Hugging Face Hub repository {repo_id!r} has no revision "
            f"{revision!r} (a branch, tag or commit): check the part after '@'."
        )
    if isinstance(exc, OSError) and not isinstance(exc, HfHubHTTPError) and exc.errno:
        return f"{subject}: cannot write the cache at {cache} ({describe_os_error(exc)})."
    return (
        f"{subject}: could not fetch it from the Hugging Face Hub "
        f"({type(exc).__name__}: {_first_line(exc)}); try again, or give a local folder."
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
