"""Recorded software versions and the warnings when they change (llmcli/runs/versions.py)."""

from __future__ import annotations

import platform
from importlib import metadata

from llmcli import __version__
from llmcli.runs.versions import record, warnings_for


def test_record_matches_the_installed_packages() -> None:
    versions = record()
    assert versions["llmcli"] == __version__
    assert versions["python"] == platform.python_version()
    assert versions["torch"] == metadata.version("torch")
    assert versions["tokenizers"] == metadata.version("tokenizers")


def test_same_or_patch_level_versions_give_no_warning() -> None:
    versions = record()
    assert warnings_for(versions) == []
    patched = dict(versions)
    major, minor = versions["torch"].split("+")[0].split(".")[:2]
    patched["torch"] = f"{major}.{minor}.99+cu121"
    assert warnings_for(patched) == []


def test_minor_version_change_warns_with_both_versions() -> None:
    changed = dict(record())
    changed["tokenizers"] = "0.1.0"
    changed["torch"] = "1.0.0"
    lines = warnings_for(changed)
    assert len(lines) == 2
    assert any(
        "tokenizers 0.1.0" in line and metadata.version("tokenizers") in line for line in lines
    )
    assert any("torch 1.0.0" in line for line in lines)


def test_missing_record_warns_once() -> None:
    assert len(warnings_for(None)) == 1
