"""plot.py: two fake runs become one valid PNG; a missing or empty metrics.jsonl is one line, exit 2."""

import json
import struct

import pytest

pytest.importorskip("matplotlib")
import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(path, loss, steps=6):
    """metrics.jsonl as runlog.Logger writes it: eval rows at 0 and every 3 steps, train rows from 1."""
    path.mkdir()
    rows = [{"step": 0, "eval/reward": 0.5}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward": 0.5 + 0.02 * s, "loss": -0.01, "mismatch/kl": 1e-4 * s if s > 1 else 0.0}
        if loss != "reinforce":
            row[f"{loss}/masked_fraction"] = 0.01 * s
        if s % 3 == 0:
            row["eval/reward"] = 0.5 + 0.03 * s
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_two_runs_make_one_png(tmp_path):
    runs = [_fake_run(tmp_path / "icepop-bf16", "icepop"), _fake_run(tmp_path / "ipo-fp16", "ipo")]
    out = plot.main([str(r) for r in runs] + ["--out", str(tmp_path / "figs" / "curves.png")])
    width, height = _png_size(out)
    assert width > 600 and height > 400
    assert out.stat().st_size > 20_000  # four panels of curves, not a blank canvas


def test_group_averages_runs_into_one_line(tmp_path):
    runs = [_fake_run(tmp_path / f"s{i}", "icepop", steps=4 + i) for i in range(2)]
    assert plot.series([plot.load(r) for r in runs], "reward")[0] == [1, 2, 3, 4]  # steps both runs logged
    out = plot.plot(runs, tmp_path / "mean.png", group=lambda d: "icepop")
    assert _png_size(out)[0] > 600


@pytest.mark.parametrize("empty", [False, True])
def test_missing_or_empty_metrics_is_one_line_exit_2(tmp_path, capsys, empty):
    run = tmp_path / "run"
    run.mkdir()
    if empty:
        (run / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        plot.main([str(run), "--out", str(tmp_path / "x.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("plot: error:") and "metrics.jsonl" in err
    assert ("empty" if empty else "no such file") in err
    assert not (tmp_path / "x.png").exists()
