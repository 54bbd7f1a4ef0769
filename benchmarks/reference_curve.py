"""Write a shipped config's reference curve from a finished run: configs/references/<name>.json.

    python benchmarks/reference_curve.py RUN_DIR [--name NAME] [--commit SHA] [--date YYYY-MM-DD]
        [--note TEXT] [--out FILE]
    python benchmarks/reference_curve.py --none NAME --note "why it has no curve"

RUN_DIR is a run of the shipped config NAME (default: the name its meta.json records, else the
run folder's name), trained with that config unchanged: `llmcli train NAME`. The file holds the
run's evaluations (step, tokens, elapsed seconds, val loss), its resolved config, and where and
how it was measured: the date (default: when metrics.jsonl was last written), the llmcli commit
(default: this checkout's HEAD; pass the one that trained the run if it differs), the device,
dtype, world size, seed, steps, tokens, time and library versions from meta.json. `llmcli info`
and `llmcli compare --reference` read it; tests/test_reference.py checks that every shipped
config has one and that its config is still the shipped one in every key that changes the curve.

`--none NAME` writes a file with no points and the note saying why (a config too slow to measure
here), so that `llmcli info` says so instead of guessing. Prints the path written.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import shipped_configs  # noqa: E402
from llmcli.fileio import atomic_write_json  # noqa: E402
from llmcli.runs.formats import read_meta  # noqa: E402
from llmcli.runs.reference import FORMAT, reference_from_run, references_dir  # noqa: E402


def head_commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path, help="a finished run of the config")
    parser.add_argument("--name", help="the shipped config (default: from the run)")
    parser.add_argument("--none", metavar="NAME", help="write NAME's file with no curve")
    parser.add_argument("--commit", help="the llmcli commit that trained the run")
    parser.add_argument("--date", help="when it was measured (default: metrics.jsonl's time)")
    parser.add_argument("--note", help="a note for readers of the curve")
    parser.add_argument("--out", type=Path, help="default: configs/references/<name>.json")
    args = parser.parse_args()
    if args.none:
        name = args.none
        if not args.note:
            parser.error("--none needs --note saying why the config has no curve")
        content = {"format": FORMAT, "name": name, "note": args.note, "measured": {}}
        content |= {"points": [], "config": {}}
    else:
        if args.run_dir is None:
            parser.error("give RUN_DIR, or --none NAME")
        name = args.name or read_meta(args.run_dir / "meta.json").get("config_name")
        name = name or args.run_dir.resolve().name
        metrics = args.run_dir / "metrics.jsonl"
        date = args.date or datetime.date.fromtimestamp(metrics.stat().st_mtime).isoformat()
        content = reference_from_run(
            args.run_dir, name, commit=args.commit or head_commit(), date=date, note=args.note
        )
    if name not in shipped_configs():
        parser.error(f"{name!r} is not a shipped config ({', '.join(shipped_configs())})")
    out = args.out or references_dir() / f"{name}.json"
    atomic_write_json(out, content)
    print(out)


if __name__ == "__main__":
    main()
