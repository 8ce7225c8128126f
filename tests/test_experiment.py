"""bench/experiment.py, the mismatch study: its table's numbers are the runs' own, and the
paired gap to reinforce is the per-seed difference."""

import json

import pytest

from conftest import bench_module

E = bench_module("experiment")


def _run(eval0, final, kl=1e-3, frac=None, entropy=1.0):
    return {"eval0": eval0, "eval": final, "kl": kl, "frac": frac, "entropy": entropy, "wall_s": 1.0,
            "collapsed": final < eval0 or entropy < 0.05}


def test_the_gap_is_paired_by_seed_and_flagged_beyond_two_std():
    s = E.Setting("bf16", 2)
    base = [_run(0.5, 0.52), _run(0.5, 0.55), _run(0.5, 0.50)]
    better = [_run(0.5, 0.57), _run(0.5, 0.61), _run(0.5, 0.54, frac=0.01)]  # +0.05, +0.06, +0.04
    noisy = [_run(0.5, 0.60), _run(0.5, 0.49), _run(0.5, 0.55, entropy=0.01)]  # +0.08, -0.06, +0.05
    mean, std = E.gap(better, base)
    assert mean == pytest.approx(0.05) and std == pytest.approx(0.01)
    rows = E.table({(s, "reinforce"): base, (s, "tis"): better, (s, "icepop"): noisy}).splitlines()[2:]
    assert rows[0].split(" | ")[7:9] == ["-", "-"]  # reinforce against itself: no gap
    assert rows[1].split(" | ")[7:10] == ["+0.050 ± 0.010", "yes", "0/3"]
    assert rows[2].split(" | ")[7:10] == ["+0.023 ± 0.074", "no", "2/3"]  # one fell below step 0, one lost entropy


def test_one_setting_runs_and_its_row_holds_the_runs_numbers(tmp_path):
    out = tmp_path / "exp"
    stats = E.main(["--only", "fp32", "--seeds", "2", "--steps", "1", "--out", str(out), "--md", "",
                    "--png", str(tmp_path / "exp.png"), "--extra",
                    "--prompts-per-step 2 --group-size 2 --eval-prompts 4 --max-new-tokens 6 --eval-every 1"])
    ((setting, loss), runs), = stats.items()
    assert (setting.engine, loss, len(runs)) == ("fp32", "reinforce", 2)
    for seed, r in enumerate(runs):
        rows = [json.loads(x) for x in (out / f"fp32-a0-reinforce-s{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert r["eval0"] == rows[0]["eval/reward"] and r["eval"] == rows[-1]["eval/reward"]
        assert r["kl"] == pytest.approx(rows[-1]["mismatch/kl"]) and r["kl"] < 1e-6  # fp32 engine: rounding only
    assert "| fp32-a0 | reinforce | 2 |" in (out / "results.md").read_text()
    assert (tmp_path / "exp.png").stat().st_size > 10_000


def test_the_distillation_demo_cuts_each_run_at_equal_train_time(tmp_path):
    """bench/distill.py: an eval's time is the sum of time/step up to its step (eval rows carry none), and
    a budget takes the run's last eval within it."""
    D = bench_module("distill")
    rows = [{"step": 0, "eval/reward": 0.5}, {"step": 1, "loss": 0.1, "time/step": 2.0},
            {"step": 2, "loss": 0.1, "time/step": 3.0, "eval/reward": 0.6}, {"step": 3, "loss": 0.1, "time/step": 4.0},
            {"step": 4, "loss": 0.1, "time/step": 1.0, "eval/reward": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = D.curve(tmp_path)
    assert c == [(0, 0.0, 0.5), (2, 5.0, 0.6), (4, 10.0, 0.7)]
    assert [D.at_time(c, t) for t in (0.0, 4.9, 5.0, 9.9, 10.0)] == [0.5, 0.5, 0.6, 0.6, 0.7]


def test_the_kv_drift_bench_shows_the_kept_cache_and_the_recompute(tmp_path):
    """bench/kvdrift.py on two saved steps: before the push every row is at the engine's precision
    mismatch; after it the kept cache's rows are far off B's own forward and the recomputed ones are not."""
    K = bench_module("kvdrift")
    text = K.main(["--train-steps", "2", "--from", "1", "--lags", "1", "--prompts", "8", "--out", str(tmp_path / "kv"),
                   "--png", str(tmp_path / "kv.png")])
    row = text.splitlines()[2].strip("| ").split(" | ")
    before, after, redone, alone_b = (float(row[k]) for k in (2, 3, 4, 6))
    assert before < 1e-2 and redone < 2 * alone_b < after
    assert (tmp_path / "kv.png").stat().st_size > 10_000


@pytest.mark.parametrize("arm", [a for a in E.ARMS if E.ARMS[a].fraction])
def test_each_race_arm_runs_and_logs_the_fraction_its_table_column_reads(arm, tmp_path):
    """A race arm's flags are a valid run, and its `fraction` names a metric the run logs: a wrong name would
    leave the table's masked/clipped column empty ("-") with no error."""
    import train

    run_dir = tmp_path / arm
    args = E.run_args(E.Setting("bf16", 1), arm, 0, 1, run_dir,
                      ["--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0", "--max-new-tokens", "6"])
    train.main(args)
    steps = [r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps and all(E.ARMS[arm].fraction in r for r in steps)


def test_the_harsh_settings_race_every_arm_and_the_study_keeps_its_three():
    assert all(s.losses == tuple(E.ARMS) for s in E.settings(1.0, harsh=True))
    assert {lo for s in E.settings(1.0) for lo in s.losses} == set(E.STUDY)


def test_each_grid_rewrites_only_its_own_section_of_the_doc():
    doc = "# Mismatch study\n\nold table\n\n## The race at harsher settings\n\nold race\n\n## Reading\n\nby hand\n"
    race = E.RACE + "\n\nnew race\n"
    assert E.splice(doc, "# Mismatch study\n\nnew table\n") == doc.replace("old table", "new table")
    assert E.splice(doc, race) == doc.replace("old race", "new race")
    assert E.splice("# Mismatch study\n\nold table\n", race) == "# Mismatch study\n\nold table\n\n" + race
