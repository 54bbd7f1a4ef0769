"""The offline viewer's features page: `<sae folder>/features.html`, one self-contained file.

`write_features_page` fills the template `llmcli/inspection/sae/features.html` (plain HTML, CSS and
JavaScript, no network) with a `FeatureReport` inlined as JSON (`llmcli.inspection.viewer`'s
`script_json`, safe inside a `<script>`): a list of the features, densest first, to filter by
index; for the one picked, its density, its top contexts with each token shaded by the
feature's activation on it (hover for the value), and the tokens its direction promotes and
suppresses.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from llmcli.fileio import atomic_write_text
from llmcli.inspection.sae.features import FeatureReport
from llmcli.inspection.viewer import script_json

#: The page's name, in the SAE folder.
PAGE = "features.html"
_DATA = "__FEATURE_DATA__"


def render_features_page(report: FeatureReport) -> str:
    """The page as one HTML string, `report` inlined."""
    template = resources.files("llmcli.inspection.sae").joinpath(PAGE).read_text(encoding="utf-8")
    return template.replace(_DATA, script_json(report.to_dict()), 1)


def write_features_page(report: FeatureReport, path: str | Path | None = None) -> Path:
    """Write the page (default: `features.html` in the SAE's folder); returns its path."""
    path = Path(path) if path is not None else Path(report.sae) / PAGE
    atomic_write_text(path, render_features_page(report))
    return path
