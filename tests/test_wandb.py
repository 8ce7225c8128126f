"""--wandb-project: an offline run records the same metrics as metrics.jsonl; without it wandb is never touched.

Offline, wandb 0.31 writes only its transaction log (`run-<id>.wandb`; wandb-summary.json
and config.yaml come from the sync). The log is a LevelDB-style record file (7-byte
header ":W&B" + magic 0xBEE1 + version, then 32 KiB blocks of records framed by
crc32/length/type) whose payloads are wandb's own `Record` protobufs; `_records` below undoes
the framing and lets wandb's protobuf classes parse what wandb wrote.
"""

import json
import struct
import sys

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

import train  # noqa: E402

TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
        "--eval-every", "1", "--eval-prompts", "4"]
BLOCK, HEADER = 32768, 7  # the LevelDB log block and the record header (crc u32, length u16, type u8)
FULL, LAST = 1, 4


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline, silent, and every wandb directory inside tmp_path: no network, no files in $HOME."""
    home = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return home


def _records(path):
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    pos, payload = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if left < HEADER or (length, kind) == (0, 0):  # the tail of a block is zero padding
            pos += left
            continue
        payload += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(payload)
            yield rec
            payload = b""


def _history(records):
    """{step: {metric: value}} from the history records, wandb's own bookkeeping keys dropped."""
    out = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            items = {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item}
            out[rec.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def test_offline_run_holds_the_metrics(tmp_path, wandb_env):
    out = tmp_path / "run"
    train.main(TINY + ["--wandb-project", "floe-test", "--out-dir", str(out)])
    logs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    records = list(_records(logs[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "floe-test"
    config = {it.key: json.loads(it.value_json) for it in run.config.update}
    assert config["steps"] == 2 and config["loss"] == "icepop"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = _history(records)
    assert sorted(history) == [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        expected = {k: v for k, v in row.items() if k != "step"}
        assert history[row["step"]] == pytest.approx(expected, rel=1e-12)
    assert "eval/reward" in history[0] and "mismatch/kl" in history[2]


def test_no_flag_no_wandb(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    out = tmp_path / "run"
    train.main(TINY + ["--out-dir", str(out)])
    assert (out / "metrics.jsonl").is_file()
    assert not list(out.rglob("*wandb*")) and not wandb_env.exists()


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, wandb_env):
    out = tmp_path / "run"
    train.main(TINY + ["--wandb-project", "floe-test", "--out-dir", str(out)])
    train.main(TINY + ["--wandb-project", "floe-test", "--out-dir", str(out), "--steps", "3", "--resume"])
    logs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2, logs
    ids = {next(r.run for r in _records(p) if r.WhichOneof("record_type") == "run").run_id for p in logs}
    assert ids == {(out / "wandb_id").read_text().strip()}
    assert 3 in _history(_records(logs[1]))
