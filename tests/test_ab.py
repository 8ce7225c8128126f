"""bench/ab.py's arithmetic: the pooled ratio, its bootstrap interval and the verdict, on runs
whose answer is known (the same steps, and the same steps scaled), and the /proc/stat reading
its quiet-machine wait rests on."""

import random
import pytest
from conftest import bench_module

ab = bench_module("ab")


def _runs(scale: float, seed: int, n: int = 4) -> list:
    """n runs of 6 steps around 0.2 s a step (each within 2%: a quiet machine), each phase scaled by
    `scale`. The 1.02 bar is for such a machine: with steps spread by 5% it takes more rounds."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        steps = [0.2 * (1 + 0.02 * rng.uniform(-1, 1)) for _ in range(6)]
        out.append(ab.Run({p: [s * scale for s in steps] for p in ab.PHASES}, rss=500e6 * scale, wall=5.0 * scale,
                          disturbed=0.0))
    return out


@pytest.mark.parametrize("scale,verdict", [(1.0, "pass"), (1.15, "slower"), (0.85, "faster")])
def test_the_ratio_is_the_pooled_medians_and_the_verdict_reads_its_interval(scale, verdict):
    a, b = _runs(1.0, seed=0), _runs(scale, seed=0)  # b: a's very steps, scaled
    for phase in ab.PHASES:
        ratio, lo, hi = ab.interval(a, b, phase, random.Random(0))
        assert ratio == pytest.approx(scale) and lo <= ratio <= hi
        assert ab.verdict(hi) == verdict
    for whole in ("rss", "wall"):  # one value a run: every resampling of runs gives the same ratio
        ratio, lo, hi = ab.interval(a, b, whole, random.Random(0))
        assert ratio == lo == hi == pytest.approx(scale)


def test_two_draws_of_the_same_speed_pass_and_a_real_gap_does_not():
    same = ab.interval(_runs(1.0, seed=1), _runs(1.0, seed=2), "time/step", random.Random(0))
    assert same[1] < 1.0 < same[2] and ab.verdict(same[2]) == "pass"
    gap = ab.interval(_runs(1.0, seed=1), _runs(1.1, seed=2), "time/step", random.Random(0))
    assert gap[1] > 1.02 and ab.verdict(gap[2]) == "slower"


def test_the_busy_share_is_read_from_proc_stat():
    busy, total = ab.cpu_jiffies()
    assert 0 <= busy <= total
    assert 0.0 <= ab.busy_share(0.2) <= 1.0


def test_the_table_shows_the_whole_process_wall_without_judging_it():
    """A compiled run pays its compile in `wall`: shown beside the phases, never a `slower` verdict."""
    from pathlib import Path

    a, b = _runs(1.0, seed=0), _runs(1.0, seed=0)
    for r in b:
        r.wall *= 3
    revs = [ab.Rev(n, n, Path("."), runs={"job": rs}) for n, rs in (("A", a), ("B", b))]
    text, failing = ab.table(*revs, ["job"], random.Random(0))
    wall = next(line for line in text.splitlines() if "| wall |" in line)
    assert "5.0 s | 15.0 s | 3.000" in wall and wall.endswith("(shown) |")
    assert failing == {}
