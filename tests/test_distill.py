"""On-policy distillation (--teacher, --distill-coeff, --distill-estimator): terms.distill_term against
the dense fp64 reference of tests/loss_reference.py (forward, metrics and gradient, both estimators,
with and without support rows), the model's own tokens alone, a teacher equal to the student, the
refusals (one line, exit 2, nothing written) and short runs of train.py. CPU, tiny shapes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import config as C
import loss as L
from layers.masks import reduce_metrics
from loss_reference import F64, assemble, assert_metrics_close, cfg_for, grads, make_docs, reference, run_loss, STEP

ROOT = Path(__file__).resolve().parent.parent


def distill_cfg(loss: str = "reinforce", estimator: str = "k1", **kw):
    return cfg_for(loss, teacher="teacher", distill_coeff=0.7, distill_estimator=estimator, **kw)


def with_teacher(docs, same: bool = False, seed: int = 7):
    """Each doc's teacher logits: the student's plus noise (or the student's own, `same`)."""
    g = torch.Generator().manual_seed(seed)
    for d in docs:
        d.teacher = d.logits.detach().clone() + (0 if same else torch.randn(d.logits.shape, generator=g, dtype=F64))
    return docs


def teacher_logits(docs, T: int) -> torch.Tensor:
    """[T, V]: the docs' teacher logits as `assemble` packs them, zeros on the padding."""
    n = sum(len(d.labels) for d in docs)
    return torch.cat([d.teacher for d in docs] + [torch.zeros(T - n, docs[0].teacher.shape[1], dtype=F64)])


def compare(cfg, kind: str, support: bool = True, old: bool = False, same: bool = False, docs=None):
    """loss.py against the reference on one micro-batch: loss, metrics and logit gradients; the reference's metrics."""
    docs = with_teacher(docs or make_docs(kind), same)
    if not support:  # no rows at all: the reference centers nothing and exact falls back to k1
        docs = [replace(d, rows=[([], [])] * len(d.rows), replayed=[False] * len(d.rows)) for d in docs]
    mb, logits, noise = assemble(docs, T=24, with_support=support)
    teacher = teacher_logits(docs, 24)
    got, got_m = run_loss([mb], [logits], cfg, old_list=[noise] if old else None, teachers=[teacher])
    want, want_m = reference(docs, cfg, STEP, old)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert_metrics_close(got_m, want_m)
    leaves = [d.logits for d in docs]
    for g1, g2 in zip(grads(got, leaves), grads(want, leaves)):
        assert torch.allclose(g1, g2, rtol=1e-9, atol=1e-12)
    return want_m


@pytest.mark.parametrize("support", [True, False])
@pytest.mark.parametrize("kind", ["replayed", "draws"])
@pytest.mark.parametrize("estimator", ["k1", "exact"])
@pytest.mark.parametrize("loss,old", [("reinforce", False), ("icepop", False), ("ppo", True)])
def test_distill_matches_dense_reference(loss, old, estimator, kind, support):
    m = compare(distill_cfg(loss, estimator), kind, support, old)
    assert m["distill/kl"] != 0 and 0 < m["distill/share"] < 1


@pytest.mark.parametrize("estimator", ["k1", "exact"])
@pytest.mark.parametrize("extra", [dict(loss_agg="sequence"), dict(kl_coeff=0.3, kl_estimator="exact"),
                                   dict(seq_mask="geometric", seq_mask_low=0.6, seq_mask_high=1.5)])
def test_distill_with_the_rest_of_the_loss(estimator, extra):
    """Beside the sequence normalization, the sampler KL and a mask (which never masks distillation)."""
    compare(distill_cfg("tis", estimator, **extra), "draws")
    compare(distill_cfg("tis", estimator, **extra), "replayed")


@pytest.mark.parametrize("estimator", ["k1", "exact"])
def test_pure_distillation_is_adv_tau_0(estimator):
    """--adv-tau 0: the reward's term is exactly 0; the loss is distillation alone (share 1)."""
    m = compare(distill_cfg("icepop", estimator, adv_tau=0.0), "draws")
    assert m["distill/share"] == 1.0


@pytest.mark.parametrize("estimator", ["k1", "exact"])
@pytest.mark.parametrize("kind", ["replayed", "draws"])
def test_a_teacher_equal_to_the_student_adds_exactly_nothing(estimator, kind):
    """Same logits through the same head: KL 0 exactly, and the loss and gradient of the run without it."""
    docs = make_docs(kind)
    m = compare(distill_cfg("icepop", estimator), kind, same=True, docs=docs)
    assert m["distill/kl"] == 0.0 and m["distill/share"] == 0.0
    mb, logits, _ = assemble(docs, T=24)
    with_it, _ = run_loss([mb], [logits], distill_cfg("icepop", estimator), teachers=[logits.detach()])
    without, _ = run_loss([mb], [logits], cfg_for("icepop"))
    assert with_it.item() == without.item()
    leaves = [d.logits for d in docs]
    for g1, g2 in zip(grads(with_it, leaves), grads(without, leaves)):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("estimator", ["k1", "exact"])
def test_episodes_distill_only_the_models_own_tokens(estimator):
    """An environment's reply is no loss token (data.pack's mask): whatever the teacher says of it is not
    trained on, and the reference, which reads the mask, agrees."""
    docs = make_docs("draws")
    for d in docs[:2]:  # a reply in the middle of the completion
        d.mask[-3:-1] = False
    compare(distill_cfg("reinforce", estimator), "draws", docs=docs)
    mb, logits, _ = assemble(with_teacher(docs), T=24)
    teacher = teacher_logits(docs, 24)
    garbage = teacher.clone()
    garbage[~mb.loss_mask] = 50 * torch.randn(int((~mb.loss_mask).sum()), teacher.shape[1], dtype=F64)
    a, _ = run_loss([mb], [logits], distill_cfg("reinforce", estimator), teachers=[teacher])
    b, _ = run_loss([mb], [logits], distill_cfg("reinforce", estimator), teachers=[garbage])
    assert a.item() == b.item()


def test_support_and_the_sparse_backward_follow_the_estimator():
    """exact reads every loss token's row, k1 none; under K draws either needs the dense backward."""
    plain = dict(loss="ppo", teacher="t", distill_coeff=1.0)
    assert L.reads_support(C.Config(**plain, distill_estimator="exact"))
    assert not L.reads_support(C.Config(**plain, distill_estimator="k1"))
    support = object()
    assert not L.sparse_ok(C.Config(loss="reinforce", teacher="t", distill_coeff=1.0), support)
    assert L.sparse_ok(C.Config(loss="reinforce"), support)
    assert L.sparse_ok(C.Config(loss="reinforce", teacher="t", distill_coeff=1.0, top_k=4), support)


# ----------------------------------------------------------------------------- refusals

def train(args, out: Path, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(out), "--eval-every", "0"],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def swapped_tokenizer(tmp_path: Path) -> Path:
    """checkpoints/reverse-tiny with two tokens' ids swapped: the same size, another vocabulary."""
    d = tmp_path / "swapped"
    shutil.copytree(ROOT / "checkpoints/reverse-tiny", d)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


def corrupt(tmp_path: Path) -> Path:
    d = tmp_path / "corrupt"
    shutil.copytree(ROOT / "checkpoints/reverse-tiny", d)
    (d / "model.safetensors").write_bytes(b"not safetensors")
    return d


@pytest.mark.parametrize("case,args,words", [
    ("negative", ["--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "-1"], "--distill-coeff must be >= 0"),
    ("nan", ["--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "nan"], "--distill-coeff must be a finite number"),
    ("inf", ["--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "inf"], "--distill-coeff must be a finite number"),
    ("no coeff", ["--teacher", "checkpoints/reverse-tiny"], "--teacher checkpoints/reverse-tiny needs --distill-coeff > 0"),
    ("no teacher", ["--distill-coeff", "1"], "--distill-coeff 1 needs --teacher DIR"),
    ("adv-tau 0 alone", ["--adv-tau", "0"], "--adv-tau must be > 0 (0 only with --teacher"),
    ("estimator alone", ["--distill-estimator", "exact"], "--distill-estimator exact has no effect with --distill-coeff 0"),
    ("base without LoRA", ["--teacher", "base", "--distill-coeff", "1"], "--teacher base is LoRA's frozen base"),
    ("sft", ["--stage", "sft", "--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "1"], "--teacher is for --stage rl"),
    ("another vocabulary", ["--teacher", "checkpoints/arith-tiny", "--distill-coeff", "1"],
     "--teacher checkpoints/arith-tiny: its tokenizer has 45 tokens, the student's 32"),
    ("swapped ids", ["--teacher", "{swapped}", "--distill-coeff", "1"], "its tokenizer differs from the student's: 'a' is id 3 in the student's, id 4 in the teacher's"),
    ("missing", ["--teacher", "{tmp}/nowhere", "--distill-coeff", "1"], "no such directory"),
    ("corrupt", ["--teacher", "{corrupt}", "--distill-coeff", "1"], "unreadable safetensors file"),
])
def test_refusals_are_one_line_exit_2_nothing_written(case, args, words, tmp_path):
    paths = {"swapped": swapped_tokenizer(tmp_path) if "{swapped}" in args else "",
             "corrupt": corrupt(tmp_path) if "{corrupt}" in args else "", "tmp": tmp_path}
    r = train([a.format(**paths) for a in args], tmp_path / "run")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_head_of_another_size_is_refused():
    from model import ModelArgs, TINY, Transformer
    from run.teacher import check_head
    with torch.device("meta"):
        student, teacher = Transformer(ModelArgs(32, **TINY)), Transformer(ModelArgs(64, **TINY))
    with pytest.raises(ValueError, match="vocab_size is 64, the student's 32"):
        check_head(teacher, student)
    check_head(student, student)


def test_the_shipped_checkpoints_really_differ_in_vocabulary():
    tok = {n: json.loads((ROOT / f"checkpoints/{n}/tokenizer.json").read_text())["model"]["vocab"]
           for n in ("arith-tiny", "reverse-tiny", "guess-tiny")}
    assert tok["arith-tiny"] != tok["reverse-tiny"] and tok["guess-tiny"] == tok["reverse-tiny"]


# ----------------------------------------------------------------------------- runs

def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--steps", "3", "--prompts-per-step", "8", "--group-size", "4"]


def test_a_run_distilled_from_its_own_start_has_kl_0_at_step_1(tmp_path):
    """The default student (checkpoints/reverse-tiny) and the same directory as teacher: step 1 scores the
    same weights twice, so distill/kl is exactly 0; later steps have moved the student."""
    r = train(["--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "1.0", *SMALL], tmp_path / "run")
    assert r.returncode == 0, r.stderr
    got = [row for row in rows(tmp_path / "run") if "distill/kl" in row]
    assert [row["step"] for row in got] == [1, 2, 3]
    assert got[0]["distill/kl"] == 0.0 and got[-1]["distill/kl"] != 0.0
    assert all(row["time/teacher"] > 0 for row in got)


def test_pure_distillation_from_another_teacher_runs(tmp_path):
    """--adv-tau 0 with --group-size 1 (no group to center), the exact estimator over K draws."""
    r = train(["--teacher", "checkpoints/guess-tiny", "--distill-coeff", "1.0", "--adv-tau", "0",
               "--distill-estimator", "exact", "--steps", "2", "--prompts-per-step", "8", "--group-size", "1"],
              tmp_path / "run")
    assert r.returncode == 0, r.stderr
    got = [row for row in rows(tmp_path / "run") if "distill/kl" in row]
    assert len(got) == 2 and all(row["distill/kl"] > 0 and row["distill/share"] == 1.0 for row in got)


def test_the_memory_plan_counts_the_teachers_weights():
    """Its fp32 shard on each trainer rank, and under FSDP2 its root, which stays gathered after its forward."""
    from run import memplan, planreport
    shape = memplan.Shape.from_dir(ROOT / "checkpoints/reverse-tiny")
    for world in (1, 4):
        without = memplan.plan(shape, memplan.Setup(world=world))
        with_it = memplan.plan(shape, memplan.Setup(world=world, teacher=shape))
        extra = 4 * shape.params() // world + (4 * shape.root_params() if world > 1 else 0)
        assert with_it.role("trainer rank").total - without.role("trainer rank").total == extra
        assert "| teacher |" in planreport.table(with_it) and "| teacher |" not in planreport.table(without)


def test_torchrun_shards_the_teacher_like_the_student(tmp_path):
    """Two gloo ranks: the teacher takes the sharded load and FSDP2 as the student does; at step 1 the two
    score the same weights, so distill/kl is 0 exactly on the whole batch."""
    from test_distributed import torchrun
    r = torchrun(str(ROOT / "train.py"), "--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "1",
                 "--distill-estimator", "exact", "--steps", "2", "--prompts-per-step", "4", "--group-size", "4",
                 "--eval-every", "0", "--out-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert [row["step"] for row in got] == [1, 2]
    assert got[0]["distill/kl"] == 0.0 and got[1]["distill/kl"] > 0


def test_lora_distills_from_its_own_base_with_no_second_copy(tmp_path):
    """--teacher base: the student with its adapters off. B = 0 at the start, so step 1's KL is 0 exactly;
    the plan adds no teacher; and with the adapters off the model is its base, bit for bit."""
    from layers import lora
    from run import hfdir, memplan
    from run.planreport import plan_setup
    base = hfdir.load(ROOT / "checkpoints/reverse-tiny")
    student = hfdir.load(ROOT / "checkpoints/reverse-tiny")
    lora.add(student, lora.spec_of(C.Config(lora_rank=4)), "fp32", "cpu")
    for m in lora.adapted(student).values():
        torch.nn.init.normal_(m.lora_B.weight)
    x = torch.randint(32, (12,))
    pos, docs = torch.arange(12), torch.zeros(12, dtype=torch.long)
    with torch.no_grad(), lora.adapters_off(student):
        assert torch.equal(student(x, pos, docs), base(x, pos, docs))
    with torch.no_grad():
        assert not torch.equal(student(x, pos, docs), base(x, pos, docs))  # on again after the block
    cfg = C.Config(lora_rank=4, teacher="base", distill_coeff=1.0).resolve(cuda_available=False)
    assert plan_setup(cfg, 0).teacher is None
    r = train(["--lora-rank", "4", "--teacher", "base", "--distill-coeff", "1.0", *SMALL], tmp_path / "run")
    assert r.returncode == 0, r.stderr
    got = [row for row in rows(tmp_path / "run") if "distill/kl" in row]
    assert got[0]["distill/kl"] == 0.0 and got[-1]["distill/kl"] != 0.0


def test_an_episode_run_distills(tmp_path):
    """Multi-turn episodes: the teacher scores the same packed episode (the replies in it, untrained);
    teacher = student gives 0 at step 1 over the model's own tokens."""
    r = train(["--task", "jsonl:examples/guess.jsonl", "--env", "guess-letter", "--model", "checkpoints/guess-tiny",
               "--teacher", "checkpoints/guess-tiny", "--distill-coeff", "1", "--distill-estimator", "exact",
               "--steps", "2", "--prompts-per-step", "4", "--group-size", "4"], tmp_path / "run")
    assert r.returncode == 0, r.stderr
    got = [row for row in rows(tmp_path / "run") if "distill/kl" in row]
    assert got[0]["distill/kl"] == 0.0 and got[1]["distill/kl"] != 0.0


# ----------------------------------------------------------------------------- Monte Carlo: what each estimator estimates

T_LOGITS = torch.tensor([0.2, 1.1, -0.4, 0.3, -1.5], dtype=F64)


def mc_distill(kind: str, estimator: str, q_logits, seed: int):
    """N tokens at one context, labels and draws from q, pure distillation: each token's -d KL_t/d logits
    and distill/kl, and the dense KL(p || t) with its gradient."""
    from loss_reference import head
    from test_loss import P_LOGITS, mc_batch
    mb, logits = mc_batch(20000, P_LOGITS, q_logits, kind, k=8, seed=seed)
    cfg = distill_cfg("reinforce", estimator, adv_tau=0.0)
    logp, slogp, ent = head(logits, mb, temperature=1.0)
    teacher = tuple(x.detach() for x in head(T_LOGITS.repeat(len(logits), 1), mb, temperature=1.0)[:2])
    loss, m = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP, teacher=teacher)
    ascent = -torch.autograd.grad(loss, logits)[0] * len(logits) / cfg.distill_coeff
    z = P_LOGITS.clone().requires_grad_()
    kl = (z.softmax(-1) * (z.log_softmax(-1) - T_LOGITS.log_softmax(-1))).sum()
    return ascent, reduce_metrics({k: m[k] for k in ("distill/kl",)})["distill/kl"], kl.item(), torch.autograd.grad(kl, z)[0]


def test_monte_carlo_exact_on_a_replayed_row_is_the_kl_itself():
    """The whole vocabulary kept: every token's value and gradient are KL(p || t)'s, no estimate."""
    from test_loss import Q_LOGITS
    ascent, value, kl, grad = mc_distill("replayed", "exact", Q_LOGITS, seed=3)
    assert value == pytest.approx(kl, rel=1e-9)
    assert torch.allclose(ascent, -grad.expand_as(ascent), atol=1e-9)


def test_monte_carlo_exact_on_draws_is_unbiased_whatever_the_sampler():
    from test_loss import Q_LOGITS, within
    ascent, value, kl, grad = mc_distill("draws", "exact", Q_LOGITS, seed=4)
    assert within(ascent, -grad) and value == pytest.approx(kl, rel=0.05)


def test_monte_carlo_k1_is_unbiased_on_policy_and_biased_off_it():
    from test_loss import P_LOGITS, Q_LOGITS, within
    ascent, value, kl, grad = mc_distill("draws", "k1", P_LOGITS, seed=5)  # q = p
    assert within(ascent, -grad) and value == pytest.approx(kl, rel=0.05)
    ascent, value, kl, grad = mc_distill("draws", "k1", Q_LOGITS, seed=6)  # a ~ q: no correction weighs it
    assert not within(ascent, -grad)


def test_monte_carlo_trls_k3_follows_the_forward_kl_not_the_reverse():
    """docs/design.md's comparison: k3 = exp(t - s) - (t - s) - 1 on a ~ p, differentiated directly (TRL's beta
    term), has E[k3] = KL(p || t) = E[k1] but an expected gradient of KL(t || p), not of KL(p || t)."""
    from test_loss import P_LOGITS, within
    g = torch.Generator().manual_seed(8)
    z = P_LOGITS.repeat(20000, 1).requires_grad_()
    lp, lt = z.log_softmax(-1), T_LOGITS.log_softmax(-1)
    a = torch.multinomial(P_LOGITS.softmax(-1), 20000, replacement=True, generator=g)
    d = lt[a] - lp.gather(1, a[:, None])[:, 0]
    k3 = d.exp() - d - 1
    ascent = -torch.autograd.grad(k3.sum(), z)[0]
    p, t = P_LOGITS.softmax(-1), T_LOGITS.softmax(-1)
    assert k3.mean().item() == pytest.approx((p * (p.log() - lt)).sum().item(), rel=0.05)
    w = P_LOGITS.clone().requires_grad_()
    forward = torch.autograd.grad((t * (lt - w.log_softmax(-1))).sum(), w)[0]
    reverse = torch.autograd.grad((w.softmax(-1) * (w.log_softmax(-1) - lt)).sum(), w)[0]
    assert within(ascent, -forward) and not within(ascent, -reverse)


def test_a_distilled_run_resumes_exactly_and_keeps_its_teacher(tmp_path):
    out = tmp_path / "run"
    args = ["--teacher", "checkpoints/guess-tiny", "--distill-coeff", "1", "--steps", "2", "--save-every", "1",
            "--prompts-per-step", "4", "--group-size", "4"]
    assert train(args, out).returncode == 0
    want = rows(out)
    shutil.rmtree(out / "step_000002")  # step 2 again from step 1's checkpoint
    r = train([*args, "--resume"], out)
    assert r.returncode == 0, r.stderr

    def untimed(rs):
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rs]
    assert untimed(rows(out)) == untimed(want) and want[1]["distill/kl"] > 0
    other = [a if a != "checkpoints/guess-tiny" else "checkpoints/reverse-tiny" for a in args]
    r = train([*other, "--resume"], out)
    assert r.returncode == 2 and "--resume: --teacher is 'checkpoints/reverse-tiny'" in r.stderr, r.stderr
