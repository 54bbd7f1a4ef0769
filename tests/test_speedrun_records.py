"""benchmarks/speedrun.py's record keeping: the p-value of "new beats previous" and the verdict.

The Student t distribution is checked against its closed forms (1 and 2 degrees of freedom) and
against the density integrated numerically; the paired test against the t statistic computed by
hand; the verdict on made-up runs, since the timed runs themselves belong to the benchmark.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_spec = importlib.util.spec_from_file_location("speedrun", BENCHMARKS / "speedrun.py")
speedrun = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(speedrun)


@pytest.mark.parametrize("t", [-30.0, -6.9646, -2.0, -0.3, 0.0, 0.7, 4.0])
def test_the_t_cdf_equals_its_closed_forms(t: float) -> None:
    assert speedrun.student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    two = 0.5 + t / (2 * math.sqrt(2 + t * t))
    assert speedrun.student_t_cdf(t, 2) == pytest.approx(two, abs=1e-12)


@pytest.mark.parametrize("df", [3, 5, 12])
@pytest.mark.parametrize("t", [-5.0, -1.5, 0.4, 2.5])
def test_the_t_cdf_equals_the_integrated_density(df: int, t: float) -> None:
    # The density's integral from -200 (where the tail left out is below 1e-9) to t.
    x = np.linspace(-200.0, t, 2_000_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    integral = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(x)))
    assert speedrun.student_t_cdf(t, df) == pytest.approx(integral, abs=2e-6)


def test_the_paired_p_value_is_the_t_tail_of_the_seeds_differences() -> None:
    new, old = [8.1, 7.6, 8.4], [11.0, 11.3, 10.8]
    d = np.array(new) - np.array(old)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    expected = 0.5 + t / (2 * math.sqrt(2 + t * t))  # the closed form at 2 degrees of freedom
    assert speedrun.paired_p_value(new, old) == pytest.approx(expected, rel=1e-9)
    assert speedrun.paired_p_value(new, old) < speedrun.RECORD_P
    # A worse candidate gets a p-value near 1; identical differences are certain either way.
    assert speedrun.paired_p_value(old, new) == pytest.approx(1 - expected, rel=1e-9)
    assert speedrun.paired_p_value([1.0, 2.0], [2.0, 3.0]) == 0.0
    assert speedrun.paired_p_value([2.0, 3.0], [1.0, 2.0]) == 1.0
    with pytest.raises(ValueError, match="two pairs"):
        speedrun.paired_p_value([1.0], [2.0])


def _runs(walls: list[float], vals: list[float], repeats: int = 1) -> list[dict]:
    seeds = [1337, 1, 2] * repeats
    return [{"seed": s, "wall_s": w, "val": v} for s, w, v in zip(seeds, walls, vals, strict=True)]


@pytest.mark.parametrize(
    ("new_walls", "record"),
    [
        ([8.0, 8.2, 7.9], True),  # faster on every seed, p = 0.0008
        ([10.0, 7.0, 10.9], False),  # faster on every seed, but p = 0.13: noise could do it
        ([8.0, 8.2, 11.5], False),  # slower on one seed
    ],
)
def test_a_record_beats_the_previous_on_every_seed_with_p_below_the_bar(
    new_walls: list[float], record: bool
) -> None:
    track = speedrun.TRACKS["1.88"]
    config = BENCHMARKS.parent / "configs" / "speedrun-cpu.yaml"
    entries = {
        "candidate": _runs(new_walls, [1.85, 1.86, 1.87]),
        "previous": _runs([11.0, 11.1, 11.2], [1.82, 1.83, 1.83]),
    }
    verdict = speedrun.judge("1.88", track, config, entries, {"track": "1.88"})
    assert verdict["record"] is record
    walls = [e["wall_s"] for e in entries["candidate"]]
    expected_p = speedrun.paired_p_value(walls, [11.0, 11.1, 11.2])
    assert verdict["p_value"] == pytest.approx(expected_p)
    # A candidate over the track's target loss is no record however fast.
    entries["candidate"][0]["val"] = 1.9
    verdict = speedrun.judge("1.88", track, config, entries, {"track": "1.88"})
    assert verdict["record"] is False


def test_repeats_pair_every_run_for_the_wall_time_and_the_seeds_for_the_loss() -> None:
    config = BENCHMARKS.parent / "configs" / "speedrun-cpu.yaml"
    new_walls, old_walls = [8.0, 9.5, 8.4, 8.9, 8.1, 9.0], [11.0, 10.2, 11.9, 10.8, 12.4, 10.5]
    new_vals, old_vals = [1.87, 1.86, 1.87] * 2, [1.82, 1.83, 1.83] * 2
    entries = {
        "candidate": _runs(new_walls, new_vals, repeats=2),
        "previous": _runs(old_walls, old_vals, repeats=2),
    }
    fast = speedrun.judge("1.88", speedrun.TRACKS["1.88"], config, entries, {"track": "1.88"})
    assert fast["p_value"] == pytest.approx(speedrun.paired_p_value(new_walls, old_walls))
    assert fast["record"] is True  # 6 pairs, every one faster: p = 0.003
    # A loss is the same for every repeat of a seed: three pairs, not six.
    low = speedrun.judge("10min", speedrun.TRACKS["10min"], config, entries, {"track": "10min"})
    assert low["p_value"] == pytest.approx(speedrun.paired_p_value(new_vals[:3], old_vals[:3]))
    assert low["p_value"] != pytest.approx(speedrun.paired_p_value(new_vals, old_vals))
    # Each seed's median over its repeats decides "beats on every seed".
    assert speedrun.by_seed(entries["candidate"], "wall_s") == {1337: 8.45, 1: 8.8, 2: 8.7}


def test_the_records_page_shows_every_record() -> None:
    page = (BENCHMARKS.parent / "docs" / "speedrun.md").read_text(encoding="utf-8")
    table = speedrun.records_table(speedrun.load_records())
    assert table in page, "paste `python benchmarks/speedrun.py --table` into docs/speedrun.md"
    for row in speedrun.load_records():
        assert (BENCHMARKS.parent / row["snapshot"]).is_file(), row["snapshot"]


def test_records_with_one_pair_stop_with_a_message_before_running_anything(tmp_path: Path) -> None:
    script = BENCHMARKS / "speedrun.py"
    args = ["--records", "--seeds", "1337", "--workdir", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "at least two pairs" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run was started
