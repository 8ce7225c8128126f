"""A LoRA run's directory: PEFT's adapter and the training state in every step_*/, the merged HF
directory in the last one (peft and transformers load them and give floe's logits), the base's
record, a resume after SIGKILL equal to the uninterrupted run, --adapter, and each bad input as
one line before the first byte is written."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from run import checkpoint
from layers import lora
from run import hfdir
import train

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "reverse-tiny"
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "0"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "2e-2", *SMALL]


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _tree(d: Path) -> dict:
    """Every file under d -> its sha256 (symlinks as their target), a live run's `.lock` aside."""
    if not d.exists():
        return {}
    return {str(p.relative_to(d)): "-> " + os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.name != ".lock" and (p.is_file() or p.is_symlink())}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run on a copy of the shipped model, a checkpoint at each step."""
    d = tmp_path_factory.mktemp("lora")
    shutil.copytree(TINY, d / "base")
    train.main(["--model", str(d / "base"), "--steps", "2", "--save-every", "1", "--out-dir", str(d / "run"), *LORA])
    return d / "run"


def test_each_step_holds_the_adapter_and_the_last_one_the_merged_model(run):
    base = run.parent / "base"
    assert sorted(p.name for p in (run / "step_000001").iterdir()) == [lora.CONFIG, lora.WEIGHTS, "trainer_state"]
    assert os.readlink(run / "final") == "step_000002" and (run / "final" / checkpoint.MERGED / "config.json").is_file()
    record = json.loads((run / "config.json").read_text())["lora_base"]
    assert record == {"path": str(base.resolve()), "sha256": lora.weights_sha256(base),
                      "config": json.loads(json.dumps(dataclasses.asdict(hfdir.load(base).args)))}
    spec, tensors, named = lora.read_adapter(run / "final")
    assert (spec.rank, spec.alpha, named) == (4, 8.0, str(base.resolve()))
    state = load_file(str(run / "final" / "trainer_state" / "optim_rng-00000-of-00001.safetensors"))
    assert {k.rsplit("/", 1)[0][len("optim/"):] for k in state if k.startswith("optim/")} == {
        k.removeprefix(lora.PREFIX) for k in tensors}  # AdamW state of the adapters alone
    assert max(t.abs().max() for k, t in tensors.items() if "lora_B" in k) > 0  # it trained


def test_the_saved_adapter_in_peft_and_the_merged_model_in_transformers_give_floes_logits(run):
    model, _ = checkpoint.whole(run / "step_000002", checkpoint.lora_base(_cfg(run), _saved(run), run)[:2])
    ids = torch.randint(0, 32, (1, 21), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(run.parent / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(ids[0], torch.arange(21), torch.zeros(21, dtype=torch.long)) @ model.head_weight.T
        plain = hf(ids).logits[0]
        via_peft = peft.PeftModel.from_pretrained(hf, run / "final").eval()(ids).logits[0]
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "final" / checkpoint.MERGED,
                                                                   dtype=torch.float32).eval()(ids).logits[0]
    assert (ours - plain).abs().max() > 1e-3  # the adapter changed the model
    torch.testing.assert_close(via_peft, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, ours, atol=1e-5, rtol=0)


def _saved(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def _cfg(run: Path):
    return train.parse(["--model", str(run.parent / "base"), "--out-dir", str(run), *LORA])


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from layers import lora
import train
real, calls = lora.write_adapter, [0]
def dying(out_dir, tensors, spec, base):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint: half its adapter on disk, then SIGKILL
        (out_dir / lora.WEIGHTS).write_bytes(b"x" * 100)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(out_dir, tensors, spec, base)
lora.write_adapter = dying
train.main(sys.argv[1:])
"""


def test_a_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    args = ["--steps", "3", "--save-every", "1", *LORA]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), *args, "--out-dir", str(out)],
                       capture_output=True, timeout=300, cwd=ROOT)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert os.readlink(out / "final") == "step_000001" and not (out / "step_000002").exists()
    train.main([*args, "--out-dir", str(out), "--resume"])
    train.main([*args, "--out-dir", str(tmp_path / "clean")])
    assert _rows(out) == _rows(tmp_path / "clean")  # every metric of every step, exactly
    a, b = (load_file(str(d / "final" / lora.WEIGHTS)) for d in (out, tmp_path / "clean"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_adapter_starts_a_run_with_its_weights(run, tmp_path):
    """--adapter DIR (a LoRA run's final step) on its base samples as the merged model does: a full
    fine-tuning run from final/merged/ evaluates at step 0 and draws its first batch with the same
    rewards, bit for bit (the engine merges W + (alpha / r) B A as the merged save does)."""
    flags = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "1",
             "--eval-prompts", "8"]
    train.main(["--model", str(run.parent / "base"), "--adapter", str(run / "final"), "--out-dir", str(tmp_path / "a"), *flags])
    train.main(["--model", str(run / "final" / checkpoint.MERGED), "--out-dir", str(tmp_path / "b"), *flags])
    train.main(["--model", str(run.parent / "base"), "--out-dir", str(tmp_path / "c"), *flags])
    a, b, c = (_rows(tmp_path / x) for x in "abc")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["lora_rank"] == 4  # from the adapter's config
    for key in ("eval/reward", "reward"):
        assert a[0 if key.startswith("eval") else 1][key] == b[0 if key.startswith("eval") else 1][key]
    assert a[0]["eval/reward"] != c[0]["eval/reward"]  # the base alone samples otherwise


def _refused(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(list(args))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags,words", [
    (["--lora-rank", "-1"], ["--lora-rank", ">= 0"]),
    (["--lora-rank", "65"], ["--lora-rank 65", "larger than", "k_proj", "width 64"]),
    (["--lora-rank", str(10**12)], ["larger than", "k_proj's width 64", "narrowest", "use a rank <= 64"]),
    (["--lora-rank", "4", "--lora-targets", "q_proj", "qkv_proj"], ["--lora-targets qkv_proj", "matches no linear layer"]),
    (["--lora-rank", "4", "--lora-targets", "lm_head"], ["--lora-targets lm_head", "LM head stay frozen"]),
    (["--lora-alpha", "16"], ["--lora-alpha 16", "--lora-rank 0"]),
])
def test_bad_lora_flags_are_one_line_before_the_first_byte(tmp_path, capsys, flags, words):
    line = _refused(capsys, "--steps", "1", "--out-dir", str(tmp_path / "run"), *SMALL, *flags)
    assert all(w in line for w in words), line
    assert not (tmp_path / "run").exists()


def test_an_adapter_that_does_not_fit_the_model_is_one_line(run, tmp_path, capsys):
    spec, tensors, base = lora.read_adapter(run / "final")
    key = next(iter(tensors))
    tensors[key] = tensors[key][:, :-1]  # trained on a narrower model
    lora.write_adapter(tmp_path / "narrow", tensors, spec, base)
    line = _refused(capsys, "--steps", "1", "--out-dir", str(tmp_path / "a"), "--adapter", str(tmp_path / "narrow"), *SMALL)
    assert "--adapter" in line and "does not fit --model" in line and key in line
    line = _refused(capsys, "--steps", "1", "--out-dir", str(tmp_path / "b"), "--adapter", str(run / "final"),
                    "--lora-rank", "8", *SMALL)
    assert "--lora-rank 8 is not --adapter" in line and "'s 4" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_adapter_trained_on_other_weights_is_one_line(run, tmp_path, capsys):
    """The adapter's base (a local directory) must hold --model's weights: here the run's base was a copy of
    the shipped model that then changed; the shapes alone would fit."""
    other = tmp_path / "other"
    shutil.copytree(run.parent / "base", other)
    m = hfdir.load(other)
    with torch.no_grad():
        m.model.norm.weight.add_(0.1)
    hfdir.save(m, other, other)
    line = _refused(capsys, "--model", str(other), "--steps", "1", "--out-dir", str(tmp_path / "a"),
                    "--adapter", str(run / "final"), *SMALL)
    assert "was trained on" in line and "differ from --model" in line
    assert not (tmp_path / "a").exists()


def test_a_resume_whose_base_changed_is_one_line_and_changes_nothing(tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(TINY, base)
    out = tmp_path / "run"
    train.main(["--model", str(base), "--steps", "1", "--out-dir", str(out), *LORA])
    m = hfdir.load(base)
    with torch.no_grad():
        m.model.norm.weight.add_(0.1)  # someone retrained or replaced the base in place
    hfdir.save(m, base, base)
    capsys.readouterr()
    before = _tree(out)
    line = _refused(capsys, "--model", str(base), "--steps", "2", "--out-dir", str(out), "--resume", *LORA)
    assert "--resume: the base model in" in line and "changed since the run started" in line
    assert _tree(out) == before


def test_a_damaged_adapter_falls_back_to_the_checkpoint_before(run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    spec, tensors, base = lora.read_adapter(out / "step_000002")
    key = sorted(tensors)[-1]
    tensors[key] = tensors[key][:-1]
    lora.write_adapter(out / "step_000002", tensors, spec, base)
    capsys.readouterr()
    train.main(["--model", str(run.parent / "base"), "--steps", "2", "--out-dir", str(out), "--resume", *LORA])
    said = capsys.readouterr().out
    assert "step_000002 is damaged (ValueError: adapter_model.safetensors:" in said and "trying the one before it" in said
    assert _rows(out) == _rows(run)  # step 2 redone from step 1's checkpoint, exactly


def _adapter_copy(run: Path, tmp_path: Path) -> Path:
    d = tmp_path / "adapter"
    d.mkdir()
    for name in (lora.CONFIG, lora.WEIGHTS):
        shutil.copy(run / "final" / name, d / name)
    return d


def _edit(path: Path, edit) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,words", [
    ("corrupt", [lora.WEIGHTS, "unreadable safetensors file"]),
    ("truncated", [lora.WEIGHTS, "unreadable safetensors file"]),
    ("list", [lora.CONFIG, "not a JSON object"]),
    ("no_r", [lora.CONFIG, "r must be the adapter's rank, an integer >= 1, got null"]),
    ("r_0", [lora.CONFIG, "r must be the adapter's rank, an integer >= 1, got 0"]),
    ("alpha", [lora.CONFIG, 'lora_alpha must be a number > 0, got "8"']),
])
def test_an_adapter_directory_that_does_not_read_is_one_line_naming_the_file(run, tmp_path, capsys, damage, words):
    d = _adapter_copy(run, tmp_path)
    weights = d / lora.WEIGHTS
    if damage == "corrupt":
        weights.write_bytes(b"\x00" * 64 + weights.read_bytes()[64:])
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "list":
        (d / lora.CONFIG).write_text("[1, 2]")
    else:
        _edit(d / lora.CONFIG, {"no_r": lambda c: c.pop("r"), "r_0": lambda c: c.update(r=0),
                                "alpha": lambda c: c.update(lora_alpha="8")}[damage])
    line = _refused(capsys, "--steps", "1", "--out-dir", str(tmp_path / "a"), "--adapter", str(d), *SMALL)
    assert line.startswith(f"floe: error: --adapter {d}: {d}/") and all(w in line for w in words), line
    assert "--lora-targets" not in line and not (tmp_path / "a").exists()


@pytest.mark.parametrize("where", ["adapter", "base"])
def test_a_fifo_in_the_adapter_or_its_recorded_base_is_refused_not_read(run, tmp_path, where):
    """A FIFO named like an adapter's weights, or among the weights of the base its config names, would
    block the read forever."""
    d = _adapter_copy(run, tmp_path)
    if where == "adapter":
        (d / lora.WEIGHTS).unlink()
        os.mkfifo(d / lora.WEIGHTS)
        fifo = d / lora.WEIGHTS
    else:
        base = tmp_path / "base"
        shutil.copytree(run.parent / "base", base)
        fifo = base / "extra.safetensors"
        os.mkfifo(fifo)
        _edit(d / lora.CONFIG, lambda c: c.update(base_model_name_or_path=str(base)))
    r = subprocess.run([sys.executable, "train.py", "--steps", "1", "--out-dir", str(tmp_path / "a"), "--adapter", str(d),
                        *SMALL], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert f"{fifo}: not a regular file" in r.stderr and not (tmp_path / "a").exists()


def test_an_adapter_on_a_scratch_model_is_refused(run, tmp_path, capsys):
    line = _refused(capsys, "--model", "scratch", "--steps", "1", "--out-dir", str(tmp_path / "a"),
                    "--adapter", str(run / "final"), *SMALL)
    assert "needs the base it was trained on as --model" in line and not (tmp_path / "a").exists()


def test_a_lora_resume_without_its_rank_names_the_rank(run, tmp_path, capsys):
    """--lr's default follows --lora-rank: the line names the flag left out, not the default it moved."""
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    line = _refused(capsys, "--model", str(run.parent / "base"), "--steps", "3", "--out-dir", str(out), "--resume", *SMALL)
    assert "--resume: --lora-rank is 0 but the run" in line and "used 4" in line, line


def test_a_resume_whose_bases_config_changed_is_one_line(run, tmp_path, capsys):
    """The same weights under another config.json (rms_norm_eps 1e-6 -> 0.5) are another model."""
    base, out = tmp_path / "base", tmp_path / "run"
    shutil.copytree(run.parent / "base", base)
    shutil.copytree(run, out, symlinks=True)
    _edit(base / "config.json", lambda c: c.update(rms_norm_eps=0.5))
    _edit(out / "config.json", lambda c: c["lora_base"].update(path=str(base.resolve())))
    before = _tree(out)
    line = _refused(capsys, "--model", str(base), "--steps", "3", "--out-dir", str(out), "--resume", *LORA)
    assert "changed since the run started (its config.json's rms_norm_eps was 1e-06, now 0.5)" in line, line
    assert _tree(out) == before
