"""A checkpoint's files (run/shardfiles.py): the streamed safetensors writer against safetensors' own
reader, the HF sharded layout against transformers, and a resume that falls back past a damaged
shard or a missing rank's optimizer file. (Two ranks: tests/test_distributed.py.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from run import checkpoint
import config as C
from run import hfdir
import model as M
from run import shardfiles
from run import start
import train
from tasks.textcodec import write_tokenizer

transformers = pytest.importorskip("transformers")
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "0"]
SHARD = 400_000  # bytes a weight file: reverse-tiny's 3.2 MB of fp32 weights in several files


def test_a_streamed_file_reads_back_as_safetensors_reads_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 3, generator=g), "half": torch.randn(4, generator=g).to(torch.bfloat16),
               "empty": torch.zeros(0, 7), "step": torch.tensor(3.0), "rng": torch.Generator().get_state(),
               "ids": torch.arange(6, dtype=torch.int64).view(2, 3)}
    shardfiles.write_file(tmp_path / "a.safetensors", tensors)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k


def test_each_rank_holds_the_rows_fsdp2_gives_it():
    for n in range(10):
        for world in range(1, 5):
            parts = torch.chunk(torch.arange(n), world) if n else ()
            want = [len(p) for p in parts] + [0] * (world - len(parts))
            assert [shardfiles.rows(n, r, world) for r in range(world)] == want, (n, world)


def test_weights_in_several_files_load_in_transformers_with_floes_logits(tmp_path, monkeypatch):
    monkeypatch.setattr(shardfiles, "MAX_SHARD_BYTES", SHARD)
    ours = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(ours, std=0.05, seed=3)
    write_tokenizer(tmp_path)
    state = ours.state_dict()
    (tmp_path / "ckpt").mkdir()
    assert shardfiles.save_weights(tmp_path / "ckpt", {k: tuple(v.shape) for k, v in state.items()}, state.get,
                                   True) is None
    hfdir.write_files(tmp_path / "ckpt", hfdir.saved_config(ours.args, tmp_path), tmp_path)
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    index = json.loads((tmp_path / "ckpt" / shardfiles.INDEX).read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert all(p.stat().st_size <= SHARD + 4096 for p in (tmp_path / "ckpt").glob("*.safetensors"))  # + the header
    back = hfdir.load(tmp_path / "ckpt")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, ref = ours(ids[0], torch.arange(20), torch.zeros(20, dtype=torch.long)) @ ours.head_weight.T, hf(ids).logits[0]
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A finished 2-step run, a checkpoint at each step, its weights in several files."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shardfiles, "MAX_SHARD_BYTES", SHARD)
        train.main(["--steps", "2", "--save-every", "1", "--out-dir", str(out), *SMALL])
    return out


def test_a_run_saves_in_several_files_that_transformers_loads_and_resumes_exactly(sharded, tmp_path):
    final = sharded / "final"
    assert len(list(final.glob("model-*-of-*.safetensors"))) > 2 and (final / shardfiles.INDEX).is_file()
    assert (final / "trainer_state" / "optim_rng-00000-of-00001.safetensors").is_file()
    ours = hfdir.load(final)
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ids = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, ref = ours(ids[0], torch.arange(20), torch.zeros(20, dtype=torch.long)) @ ours.head_weight.T, hf(ids).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    out = tmp_path / "run"
    shutil.copytree(sharded, out, symlinks=True)
    shutil.rmtree(out / "step_000002")
    train.main(["--steps", "2", "--resume", "--out-dir", str(out), *SMALL])  # step 2 again, from the shards
    assert _rows(out) == _rows(sharded)


def _shard(p: Path) -> Path:
    return sorted(p.glob("model-*-of-*.safetensors"))[1]


SPOIL = {  # a part of step_000002, damaged: what the warning names
    "truncated shard": (lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:-100]), "unreadable safetensors file"),
    "missing shard": (lambda p: _shard(p).unlink(), "which is missing"),
    "stray shard": (lambda p: shutil.copy(_shard(p), p / "model-extra.safetensors"), "does not name"),
    "missing optimizer file": (lambda p: (p / "trainer_state" / "optim_rng-00000-of-00001.safetensors").unlink(),
                               "optim_rng-00000-of-00001.safetensors: missing"),
}


@pytest.mark.parametrize("part", SPOIL)
def test_a_damaged_shard_or_a_missing_rank_file_falls_back_to_the_checkpoint_before(sharded, tmp_path, capsys, part):
    out = tmp_path / "run"
    shutil.copytree(sharded, out, symlinks=True)
    spoil, words = SPOIL[part]
    spoil(out / "step_000002")
    assert words in checkpoint.damage(out / "step_000002")
    capsys.readouterr()
    s = start.check_start(C.parse(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL]).resolve(False))
    said = capsys.readouterr().out
    assert s.resume_from.name == "step_000001" and "step_000002 is damaged" in said and words in said, said


def test_a_checkpoint_from_before_the_per_rank_files_still_resumes_exactly(sharded, tmp_path):
    """One process's file then was today's under the old name (optim_rng.safetensors): the resume reads it."""
    out = tmp_path / "run"
    shutil.copytree(sharded, out, symlinks=True)
    state = out / "step_000001" / "trainer_state"
    (state / "optim_rng-00000-of-00001.safetensors").rename(state / shardfiles.LEGACY)
    shutil.rmtree(out / "step_000002")
    assert checkpoint.damage(out / "step_000001") is None
    train.main(["--steps", "2", "--resume", "--out-dir", str(out), *SMALL])
    assert _rows(out) == _rows(sharded)
