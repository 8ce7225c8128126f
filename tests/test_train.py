"""The loop: micro-batching changes nothing, and a short run writes what it promises."""

import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config as C
import data as D
from tasks.textcodec import TextCodec
import data
from tasks import task as T
import model as M
from run import hfdir
import rollout
import train
from conftest import one_line
from engines.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parent.parent


def _setup(seed=0):
    codec = TextCodec.tiny()
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.1, seed=seed)
    task = T.ReverseText(codec, eval_size=4)
    return codec, m, task


def _samples(cfg, m, codec, task):
    engine = TorchEngine(m, "bf16", codec.stop_ids, seed=1)
    samples, _ = rollout.rollout_phase(cfg, task, engine, random.Random(0), step=0, context=512)
    g = torch.Generator().manual_seed(5)
    for s in samples:  # a sampler far from the trainer, so the IcePop mask really fires
        s.logq = [lq + float(torch.randn((), generator=g)) * 0.3 for lq in s.logq]
        s.advantage += float(torch.randn((), generator=g))  # no group ties: every sample trains
    return samples


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_one_or_three_micro_batches_give_the_same_step(agg):
    codec, m, task = _setup()
    cfg = C.Config(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25, loss_agg=agg, prompts_per_step=4,
                   group_size=3, max_new_tokens=10)
    samples = _samples(cfg, m, codec, task)
    prompts = {tuple(s.prompt.ids) for s in samples}  # packed once per group (data.pack)
    total_tokens = sum(len(p) - 1 for p in prompts) + sum(len(s.completion) for s in samples)
    runs = []
    for T in (total_tokens + 64, total_tokens // 3 + 30):
        model = M.Transformer(m.args)
        model.load_state_dict(m.state_dict())
        cfg_t = C.dataclasses.replace(cfg, micro_batch_tokens=T)
        mbs, denom, _ = train.prepare(cfg_t, samples, 32, "cpu")
        metrics = train.backward_pass(cfg_t, model, model, mbs, denom, step=0)
        n_mb = len(data.pack(samples, T))
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs.append((n_mb, import_reduce(metrics), grads))
    (n1, m1, g1), (n3, m3, g3) = runs
    assert n1 == 1 and n3 >= 3
    assert 0.02 < m1["icepop/masked_fraction"] < 0.9  # the mask fired on some tokens, not all
    assert m1.keys() == m3.keys()
    for k in m1:
        assert m1[k] == pytest.approx(m3[k], abs=1e-6, rel=1e-6), k
    torch.testing.assert_close(g1, g3, atol=1e-6, rtol=1e-5)


def import_reduce(total):
    from layers.masks import reduce_metrics

    return reduce_metrics(total)


def test_short_rl_and_sft_runs_write_their_files(tmp_path):
    out = tmp_path / "rl"
    s = train.main(["--steps", "2", "--eval-every", "1", "--eval-prompts", "4", "--prompts-per-step", "2",
                    "--group-size", "2", "--out-dir", str(out), "--max-new-tokens", "8"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        for k in ("reward", "icepop/masked_fraction", "mismatch/kl", "entropy", "loss", "eval/reward"):
            assert k in r and r[k] == r[k], k  # present and not NaN
    assert json.loads((out / "config.json").read_text())["steps"] == 2
    assert hfdir.load(out / "final").args.vocab_size == 32
    # vLLM loads every top-level *.safetensors: the training state must not be one of them
    assert [p.name for p in (out / "final").glob("*.safetensors")] == ["model.safetensors"]
    assert s["eval/reward@0"] == rows[0]["eval/reward"]
    sft = tmp_path / "sft"
    train.main(["--stage", "sft", "--model", "scratch", "--steps", "2", "--eval-every", "0",
                "--prompts-per-step", "4", "--out-dir", str(sft)])
    assert (sft / "final" / "model.safetensors").is_file()


SMALL = ["--prompts-per-step", "3", "--group-size", "3", "--max-new-tokens", "10", "--eval-every", "2",
         "--eval-prompts", "4"]


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eval/reward"} for r in rows]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    train.main(["--steps", "4", "--out-dir", str(tmp_path / "a"), *SMALL])
    train.main(["--steps", "2", "--out-dir", str(tmp_path / "b"), *SMALL])
    other_spelling = os.path.relpath(tmp_path / "x" / ".." / "b")  # the same directory, written another way
    train.main(["--steps", "4", "--out-dir", other_spelling, "--resume", *SMALL])
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b  # every metric of every step, exactly


def test_an_fp16_run_resumes_with_its_loss_scale(tmp_path, monkeypatch):
    """The loss scale is training state: a resume carries it on (here it doubles after every finite
    step, so a resume that started over at 2^16 would log, and train, differently)."""
    monkeypatch.setattr(train.LossScale, "for_dtype", classmethod(lambda cls, d: cls(2.0**16, dynamic=True, growth=1)))
    flags = ["--train-dtype", "fp16", *SMALL]
    train.main(["--steps", "3", "--out-dir", str(tmp_path / "a"), *flags])
    train.main(["--steps", "2", "--out-dir", str(tmp_path / "b"), *flags])
    state = json.loads((tmp_path / "b" / "final" / "trainer_state" / "state.json").read_text())
    assert state["loss_scale"] == [2.0**18, 0]
    train.main(["--steps", "3", "--out-dir", str(tmp_path / "b"), "--resume", *flags])
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r.get("loss_scale") for r in a] == [None, 2.0**17, 2.0**18, 2.0**19]
    assert a == b


def test_resume_with_a_changed_flag_is_refused(tmp_path):
    train.main(["--steps", "1", "--out-dir", str(tmp_path), *SMALL])
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--steps", "2", "--out-dir", str(tmp_path), "--resume",
                        "--loss", "ppo", *SMALL], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--loss" in r.stderr


def _as_an_older_floe_wrote_it(out, **keys):
    """config.json with `keys` put back under their old names (config.RENAMED's inverse): what a run
    saved before a flag's rename holds."""
    old = {new: old for old, new in C.RENAMED.items()}
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({old.get(k, k): v for k, v in {**saved, **keys}.items()}, indent=2))


def test_a_run_saved_before_the_mask_flags_rename_resumes_under_either_name(tmp_path, monkeypatch):
    """A run written with `"icepop": true` (the mask flag's old name) resumes exactly with --icepop (the
    alias) or --icepop-mask, is refused with a contradicting value, and config.json then holds the new
    key. A key no flag maps to is refused in one line. compile is free on resume: a run that compiled
    resumes on a machine with no C++ compiler."""
    import shutil

    flags = ["--loss", "ppo", "--icepop", "--icepop-alpha", "0.9", "--icepop-beta", "1.1", *SMALL]
    train.main(["--steps", "3", "--out-dir", str(tmp_path / "a"), *flags])
    for name, alias in (("b", "--icepop"), ("c", "--icepop-mask")):
        train.main(["--steps", "2", "--out-dir", str(tmp_path / name), *flags])
        _as_an_older_floe_wrote_it(tmp_path / name, compile="on")
        assert '"icepop": true' in (tmp_path / name / "config.json").read_text()
        monkeypatch.setattr(shutil, "which", lambda _: None)  # no C++ compiler here: --compile on runs eager
        train.main(["--steps", "3", "--out-dir", str(tmp_path / name), "--resume", "--compile", "on",
                    *[f if f != "--icepop" else alias for f in flags]])
        monkeypatch.undo()
        assert _rows(tmp_path / "a") == _rows(tmp_path / name)
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["icepop_mask"] is True and "icepop" not in saved
    _as_an_older_floe_wrote_it(tmp_path / "b")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--steps", "4", "--out-dir", str(tmp_path / "b"),
                        "--resume", *[f for f in flags if f != "--icepop"]], capture_output=True, text=True, timeout=120)
    one_line(r, 2, "--icepop-mask is False but the run", "used True")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    (tmp_path / "b" / "config.json").write_text(json.dumps({**saved, "ice_pop": True}))
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--steps", "4", "--out-dir", str(tmp_path / "b"),
                        "--resume", *flags], capture_output=True, text=True, timeout=120)
    one_line(r, 2, "sets 'ice_pop', which is no flag of this floe")


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from run import shardfiles
import train
real, calls = shardfiles.save_weights, [0]
def dying(d, shapes, tensor, write):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint: half a file on disk, then SIGKILL
        with open(d / "model.safetensors", "wb") as f:
            f.write(b"x" * 1000)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(d, shapes, tensor, write)
shardfiles.save_weights = dying
train.main(sys.argv[1:])
"""


def test_a_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path):
    out = tmp_path / "run"
    args = ["--steps", "3", "--save-every", "1", "--out-dir", str(out), *SMALL]
    r = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), *args], capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL
    assert (out / "step_000002.tmp").is_dir() and not (out / "step_000002").exists()
    assert os.readlink(out / "final") == "step_000001"
    hfdir.load(out / "final")  # the previous checkpoint is whole
    train.main([*args, "--resume"])
    train.main(["--steps", "3", "--out-dir", str(tmp_path / "clean"), *SMALL])
    assert _rows(out) == _rows(tmp_path / "clean")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bf16_training_takes_the_fp32_step_to_bf16_rounding(device):
    """--train-dtype bf16 (autocast + a bf16 head, the Triton one on CUDA) against the fp32 step on the same
    batch, by bounds that hold on any CPU (native bf16 units or not round differently; a fixed relative
    tolerance on a metric held on one machine and failed on another):

    1. the logits move by at most bf16's rounding: 8 significant bits (u = 2^-8 relative), to first order
       once for each rounding on the way (autocast rounds the input of the 7 linears of each layer, the
       head its hidden state, weight and logits), of a dot product's scale max|h|*max|w_v|;
    2. per token, log p(a) moves by at most 2*max_v|dz_v| and the entropy by 2*log(V)*max_v|dz_v| (the
       log-softmax's and the entropy's Lipschitz constants in the logits' sup norm);
    3. each metric moves by at most what its tokens' own moves allow (abs_logratio: the mean |d log p(a)|;
       k3 = r - 1 - log r: |d log p| times the larger |r - 1| at the two ends; support_mass: each entry's
       u*r*(exp|d log p_v| - 1)), measured from the two steps' own log-probs;
    and the gradients agree in direction and norm; the weights and gradients stay fp32."""
    codec, m, task = _setup()
    cfg = C.Config(loss="icepop", prompts_per_step=4, group_size=3, max_new_tokens=10)
    samples = _samples(cfg, m, codec, task)
    runs = []
    for dtype in ("fp32", "bf16"):
        model = M.Transformer(m.args)
        model.load_state_dict(m.state_dict())
        model.to(device)
        cfg_d = C.dataclasses.replace(cfg, train_dtype=dtype)
        mbs, denom, _ = train.prepare(cfg_d, samples, 32, device)
        metrics = import_reduce(train.backward_pass(cfg_d, model, model, mbs, denom, step=0))
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        with torch.no_grad():
            tokens = [_bf16_probe(cfg_d, model, mb) for mb in mbs]
        probe = {k: torch.cat([t[k] for t in tokens]).double().cpu() for k in tokens[0]}
        runs.append((metrics, torch.cat([p.grad.flatten() for p in model.parameters()]).cpu(), probe))
    (m32, g32, a), (m16, g16, b) = runs
    dz = (b["logits"] - a["logits"]).abs().amax(-1)  # per loss token, sup over the vocabulary
    scale = (a["hidden"].abs() @ m.head_weight.detach().double().abs().T).amax(-1)  # sum_i |h_i*w_vi|, per token
    roundings = 7 * m.args.num_hidden_layers + 3
    assert (dz <= roundings * 2**-8 * scale).all(), (dz / scale).max()  # 1.
    d_logp, d_ent = (b["logp"] - a["logp"]).abs(), (b["entropy"] - a["entropy"]).abs()
    V = m.args.vocab_size
    assert (d_logp <= 2 * dz + 1e-5).all() and (d_ent <= 2 * math.log(V) * dz + 1e-5).all()  # 2.
    x, y = a["logp"] - a["logq"], b["logp"] - a["logq"]  # log r of each token in either step
    k3_slope = torch.maximum((x.exp() - 1).abs(), (y.exp() - 1).abs())  # k3' = r - 1 is monotone
    sx, sy = a["sup_logp"] - a["sup_logq"], b["sup_logp"] - a["sup_logq"]
    sup_move = (a["sup_u"] * sx.exp() * ((sy - sx).abs().exp() - 1)).sum() / a["rows"].sum()
    bounds = {"mismatch/abs_logratio": d_logp.mean(), "mismatch/kl": (d_logp * k3_slope).mean(),
              "entropy": d_ent.mean(), "score_centering/support_mass": sup_move}
    for k, bound in bounds.items():  # 3.
        assert abs(m32[k] - m16[k]) <= bound + 1e-6, (k, m32[k], m16[k], float(bound))
    cos = torch.nn.functional.cosine_similarity(g32, g16, dim=0)
    assert cos > 0.99 and (g16.norm() / g32.norm() - 1).abs() < 0.05, (cos, g16.norm(), g32.norm())
    assert not torch.equal(g32, g16)  # it did compute in bf16


def _bf16_probe(cfg, model, mb) -> dict:
    """One micro-batch's loss tokens as the step's head sees them: the full-vocabulary logits (V is
    tiny), the final hidden state, log p(a), the entropy, q; and the support entries of those tokens."""
    low = None if cfg.train_dtype == "fp32" else torch.bfloat16
    with torch.autocast(mb.tokens.device.type, torch.bfloat16, enabled=low is not None):
        hidden = model(mb.tokens, mb.positions, mb.doc_ids, mb.parents)
    w = model.head_weight
    logits = ((hidden.to(low) @ w.to(low).T) if low else hidden @ w.T).float()  # as kernels._chunk
    logp, entropy, sup_logp = train._head(cfg, model, model, mb)
    on = mb.loss_mask
    counts = mb.support.offsets[1:] - mb.support.offsets[:-1]
    rows = D.entry_rows(mb.support.offsets, mb.support.nnz)
    live = on[rows]
    return {"logits": logits[on], "hidden": hidden.float()[on], "logp": logp[on], "entropy": entropy[on],
            "logq": mb.logq[on], "sup_logp": sup_logp[live], "sup_logq": mb.support.logq[live],
            "sup_u": 1.0 / counts[rows][live].double(), "rows": (on & (counts > 0)).sum()[None]}  # K draws: u = 1/K


def _fp16_step(device, cfg, m, samples, scale):
    """One step through backward_pass and optimizer_step with plain SGD (lr 1, no clip), so the
    weights move by exactly the unscaled gradient: (metrics, the weights' change)."""
    model = M.Transformer(m.args)
    model.load_state_dict(m.state_dict())
    model.to(device)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mbs, denom, _ = train.prepare(cfg, samples, 32, device)
    metrics = train.backward_pass(cfg, model, model, mbs, denom, step=0, scale=scale.value)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    metrics.update(train.optimizer_step(cfg, model, opt, step=5, scale=scale, loss=metrics["loss"][0]))
    return import_reduce(metrics), before - torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_fp16_training_with_loss_scaling_takes_the_fp32_step(device):
    """--train-dtype fp16 (autocast + an fp16 head, the loss scaled by 2^16 and the gradient unscaled
    before the optimizer): one step's gradient against the fp32 step's on the same batch, cosine
    >= 0.999 and norm within 1%; the weights stay fp32."""
    codec, m, task = _setup()
    cfg = C.Config(loss="icepop", prompts_per_step=4, group_size=3, max_new_tokens=10, lr=1.0, grad_clip=0.0)
    samples = _samples(cfg, m, codec, task)
    m32, g32 = _fp16_step(device, cfg, m, samples, train.LossScale.for_dtype("fp32"))
    scale = train.LossScale.for_dtype("fp16")
    m16, g16 = _fp16_step(device, C.dataclasses.replace(cfg, train_dtype="fp16"), m, samples, scale)
    cos = torch.nn.functional.cosine_similarity(g32, g16, dim=0)
    assert cos >= 0.999 and (g16.norm() / g32.norm() - 1).abs() < 0.01, (cos, g16.norm(), g32.norm())
    assert not torch.equal(g32, g16)  # it did compute in fp16
    assert m16["loss_scale"] == 2.0**16 and m16["skipped/overflow"] == 0 and m16["skipped/nonfinite_step"] == 0
    assert m32["grad_norm"] == pytest.approx(m16["grad_norm"], rel=0.01)  # the norm of the unscaled gradient
    # no loss scale (fp16 with 1.0): small gradients flush to zero, which the scale is there to prevent
    _, g1 = _fp16_step(device, C.dataclasses.replace(cfg, train_dtype="fp16"), m, samples, train.LossScale())
    assert (g1 == 0).sum() > (g16 == 0).sum()


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale_a_nan_loss_stops():
    codec, m, task = _setup()
    cfg = C.Config(loss="icepop", prompts_per_step=4, group_size=3, max_new_tokens=10, lr=1.0, grad_clip=0.0,
                   train_dtype="fp16")
    samples = _samples(cfg, m, codec, task)
    scale = train.LossScale(2.0**100, dynamic=True)  # the scaled fp16 gradients overflow
    metrics, moved = _fp16_step("cpu", cfg, m, samples, scale)
    assert torch.equal(moved, torch.zeros_like(moved))  # nothing applied
    assert metrics["skipped/overflow"] == 1 and metrics["skipped/nonfinite_step"] == 0
    assert scale.value == 2.0**99 and metrics["loss_scale"] == 2.0**99
    for s in samples:
        s.advantage = float("nan")  # a broken batch: the loss itself is NaN, and no scale would help
    metrics, moved = _fp16_step("cpu", cfg, m, samples, train.LossScale.for_dtype("fp16"))
    assert torch.equal(moved, torch.zeros_like(moved))
    assert metrics["skipped/nonfinite_step"] == 1 and metrics["skipped/overflow"] == 0
    grown = train.LossScale(4.0, dynamic=True, growth=2)
    grown.update(True), grown.update(True)
    assert grown.value == 8.0 and grown.good == 0


def test_the_steps_run_with_start_up_objects_frozen_and_the_run_unfreezes_them(tmp_path, monkeypatch):
    """gc.freeze before the loop (a full collection mid-step then scans only what the steps made),
    gc.unfreeze when the run ends, so the interpreter finalizes everything at exit as usual."""
    import gc

    frozen, step = [], train.rl_step

    def spy(run, i, ahead=None):
        frozen.append(gc.get_freeze_count())
        return step(run, i, ahead)
    monkeypatch.setattr(train, "rl_step", spy)
    train.main(["--steps", "2", "--out-dir", str(tmp_path / "run"), *SMALL])
    assert len(frozen) == 2 and min(frozen) > 10_000, frozen
    assert gc.get_freeze_count() == 0
