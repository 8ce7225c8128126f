"""--async-level: the version rule, overlap, exact repeats, the synchronous loop kept, ages in the metrics.
--max-staleness: the bound held (pipeline and whole runs, one process and gloo), a resume, the refusals."""

import json
import math
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import config as C
import data as D
from tasks.textcodec import TextCodec
from tasks import task as T
import loss as L
from layers import masks as M_
import model as M
from run import start
import rollout
import train
from engines.pipeline import AsyncRollouts
from engines.torch_engine import Sampling, TorchEngine
from test_distributed import _rows

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--engine", "torch", "--prompts-per-step", "3", "--group-size", "3", "--max-new-tokens", "10",
         "--eval-prompts", "4"]


def _main(*args: str) -> str:
    """train.py in its own process: a threaded run sets torch's thread count (engines/pipeline.py, AsyncRollouts
    6), which would change the last bits of every later run in this pytest process."""
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


class FakeEngine:
    """Counts versions and fails loudly if a weight push ever lands during a generate."""

    def __init__(self):
        self.version, self.gen, self.busy = 0, torch.Generator(), False

    def generate(self, seconds):
        assert not self.busy
        self.busy = True
        time.sleep(seconds)  # sleeping needs no core: the overlap shows on a loaded machine too
        self.busy = False

    def load_weights(self, model, version):
        assert not self.busy, "a weight push during a generate"
        self.version = version


def _pipeline(level, steps=6, seconds=0.1, fail_at=None):
    """A loop of `steps` with rollouts and training that each take `seconds`; (versions, draws, wall)."""
    engine, rng, versions = FakeEngine(), random.Random(0), []

    def produce(step):
        if step == fail_at:
            raise D.RunError(f"no batch {step}")
        versions.append(engine.version)
        engine.generate(seconds)
        return [rng.random()], {}  # the prompt RNG, drawn on the rollout side only

    threads, draws, t0 = torch.get_num_threads(), [], time.perf_counter()
    with AsyncRollouts(produce, engine, rng, level, 0, steps) as pipe:
        for step in range(1, steps + 1):
            samples, _, took = pipe.get(step)
            assert took >= seconds
            time.sleep(seconds)  # training
            pipe.publish(None, step, hold=step == 2)  # an eval at step 2 holds the next batch
            assert engine.version == step
            if step == 2:
                time.sleep(seconds / 2)
                pipe.release()
            draws.append((samples[0], pipe.rng_after(step).rng.random()))
    assert torch.get_num_threads() == threads  # the CPU split is undone at close
    return versions, draws, time.perf_counter() - t0


@pytest.mark.parametrize("level", [0, 1, 2])
def test_each_batch_samples_with_exactly_its_version(level):
    versions, draws, _ = _pipeline(level)
    assert versions == [max(0, s - 1 - level) for s in range(1, 7)]
    want = random.Random(0)
    seq = [want.random() for _ in range(7)]
    # batch s drew the s-th number; a checkpoint at step s resumes with the (s+1)-th
    assert draws == [(seq[s - 1], seq[s]) for s in range(1, 7)]


def test_level_1_overlaps_rollout_and_training():
    _, _, sync = _pipeline(0)
    _, _, overlapped = _pipeline(1)
    assert sync > 6 * 2 * 0.1  # one rollout then one training step, six times
    assert overlapped < 0.75 * sync  # ~ 7 * 0.1 + the eval hold, against 12 * 0.1


@pytest.mark.parametrize("level", [0, 1])
def test_a_rollout_error_reaches_the_trainer(level):
    with pytest.raises(D.RunError, match="no batch 3"):
        _pipeline(level, fail_at=3)


def test_two_async_runs_give_the_same_metrics_and_record_ages(tmp_path):
    args = [*SMALL, "--steps", "3", "--eval-every", "2", "--async-level", "1"]
    log = _main(*args, "--out-dir", str(tmp_path / "a"))
    _main(*args, "--out-dir", str(tmp_path / "b"))
    assert log.count("  async | rollout ") == 3  # the timeline, one line per step
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a == b  # every metric of every step, whatever the thread timing
    assert [r["step"] for r in a] == [0, 1, 2, 3] and "eval/reward" in a[2] and "eval/reward" in a[3]
    assert [r["staleness/mean"] for r in a[1:]] == [0.0, 1.0, 1.0]  # step 1 from version 0, then a step behind
    assert a[1]["kl/age0"] == pytest.approx(a[1]["mismatch/kl"])  # every token is fresh
    assert "kl/age0" not in a[2] and "kl/age0" not in a[3]  # none is
    raw = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert all({"time/rollout", "time/train", "time/step"} <= r.keys() for r in raw)


def test_async_level_0_is_the_synchronous_loop(tmp_path):
    args = [*SMALL, "--steps", "3", "--eval-every", "0", "--out-dir", str(tmp_path)]
    train.main([*args, "--async-level", "0", "--max-staleness", "0"])
    rows = _rows(tmp_path)
    assert not any(k.startswith(("staleness/", "kl/age0", "async/")) for r in rows for k in r)  # the rows of a run before either existed
    cfg = C.parse([*args[:-1], str(tmp_path / "by-hand")]).resolve(False)  # the loop before --async-level, by hand
    s = start.check_start(cfg)
    model, task = s.model, s.task
    fwd, engine, opt = start.build(cfg, s.src, model, s.codec)
    rng = random.Random(cfg.seed)
    for step in range(1, 4):
        samples, total = rollout.rollout_phase(cfg, task, engine, rng, step - 1, model.args.max_position_embeddings)
        mbs, denom, checks = train.prepare(cfg, samples, 32, "cpu")
        metrics = train.backward_pass(cfg, model, fwd, mbs, denom, step - 1)
        metrics.update(train.optimizer_step(cfg, model, opt, step))
        for part in (checks, metrics):
            M_.accumulate(total, part)
        engine.load_weights(model, version=step)
        want = M_.reduce_metrics(total)
        assert {k: rows[step - 1][k] for k in want} == want, step


def test_resume_refills_the_pipeline_from_the_checkpoint(tmp_path):
    args = [*SMALL, "--eval-every", "0", "--async-level", "1"]
    _main(*args, "--steps", "4", "--out-dir", str(tmp_path / "a"))
    _main(*args, "--steps", "2", "--out-dir", str(tmp_path / "b"))
    saved = tmp_path / "b" / "config.json"  # as a run from before --max-staleness wrote it: it still resumes
    record = json.loads(saved.read_text())
    del record["max_staleness"]
    saved.write_text(json.dumps(record))
    _main(*args, "--steps", "4", "--out-dir", str(tmp_path / "b"), "--resume")
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a[:2] == b[:2]
    assert [r["staleness/mean"] for r in b] == [0.0, 1.0, 0.0, 1.0]  # step 3 from the checkpoint's weights
    assert b[2]["length"] > 0 and b[3]["loss"] == b[3]["loss"]


def test_two_gloo_ranks_each_with_a_rollout_thread(tmp_path):
    from test_distributed import torchrun

    args = [str(ROOT / "train.py"), *SMALL, "--prompts-per-step", "2", "--steps", "3", "--eval-every", "2",
            "--async-level", "1"]
    for run in ("a", "b"):
        r = torchrun(*args, "--out-dir", str(tmp_path / run))
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert a == b and [r["staleness/mean"] for r in a[1:]] == [0.0, 1.0, 1.0]


def test_staleness_and_age0_kl_by_hand():
    codec = TextCodec.tiny()
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.1, seed=0)
    cfg = C.Config(loss="icepop", prompts_per_step=4, group_size=3, max_new_tokens=10, async_level=1)
    engine = TorchEngine(m, "bf16", codec.stop_ids, seed=1)
    samples, _ = rollout.rollout_phase(cfg, T.ReverseText(codec, eval_size=4), engine, random.Random(0), 0, 512)
    g = torch.Generator().manual_seed(5)
    for i, s in enumerate(samples):  # odd samples fresh (version 5 at step 5), even ones two steps old
        s.versions = [5 if i % 2 else 3] * len(s.completion)
        s.logq = [lq + float(torch.randn((), generator=g)) * 0.3 for lq in s.logq]

    def metrics(cfg, samples):
        mbs, denom, _ = train.prepare(cfg, samples, 32, "cpu")
        return M_.reduce_metrics(train.backward_pass(cfg, m, m, mbs, denom, step=5))

    both, fresh = metrics(cfg, samples), metrics(cfg, samples[1::2])
    old = sum(len(s.completion) for s in samples[::2])
    assert both["staleness/mean"] == pytest.approx(2 * old / sum(len(s.completion) for s in samples))
    assert both["kl/age0"] == pytest.approx(fresh["mismatch/kl"], rel=1e-5)  # k3 on the fresh tokens alone
    assert fresh["staleness/mean"] == 0 and fresh["kl/age0"] == pytest.approx(fresh["mismatch/kl"])
    sync = metrics(replace(cfg, async_level=0), samples)
    assert "staleness/mean" not in sync and "kl/age0" not in sync


def test_a_negative_level_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(["--async-level", "-1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--async-level" in err and err.count("\n") == 0


def test_closing_abandons_a_hung_environment_call_at_once():
    """The thread waits on user code (an environment that never returns, --call-timeout 60): close()
    sets the episodes' stop event, the wait ends, and the pipeline closes in well under the timeout."""
    import threading

    from tasks import usercode

    stop, started = threading.Event(), threading.Event()

    def produce(step):
        started.set()
        res = usercode.call_all([lambda: time.sleep(3600)], 60.0, stop)
        return [res[0].timed_out], {}

    pipe = AsyncRollouts(produce, FakeEngine(), random.Random(0), 1, 0, 3, stop=stop)
    assert started.wait(10)
    t0 = time.perf_counter()
    pipe.close()
    assert time.perf_counter() - t0 < 5 and not pipe.thread.is_alive()


# ----------------------------------------------------------------------------- --max-staleness: a bound, not a fixed lag

def _bounded(bound, sample, trains, steps=6):
    """AsyncRollouts' bounded rule with rollouts of `sample` seconds and training steps of `trains`; an
    eval at step 2 generates on the trainer's side while the push is held. (versions, idle rows)."""
    engine, versions, idle = FakeEngine(), {}, []

    def produce(step):
        versions[step] = engine.version
        engine.generate(sample)
        return [step], {}

    with AsyncRollouts(produce, engine, random.Random(0), bound, 0, steps, bounded=True) as pipe:
        for step in range(1, steps + 1):
            assert pipe.get(step)[0] == [step]
            time.sleep(trains)
            pipe.publish(None, step, hold=step == 2)
            if step == 2:  # an eval: FakeEngine fails if the thread generates meanwhile
                engine.generate(trains)
                pipe.release()
            idle.append(pipe.idle())
    return versions, idle


@pytest.mark.parametrize("bound", [1, 2])
def test_a_fast_sampler_runs_ahead_to_the_bound_and_pauses_there(bound):
    versions, idle = _bounded(bound, sample=0.01, trains=0.15)
    # the age of step s's tokens is (s - 1) - version; the sampler fills the queue to S batches, so each is S old
    assert {s: s - 1 - v for s, v in versions.items()} == {s: min(s - 1, bound) for s in range(1, 7)}
    assert all(r["async/sampler_idle"] > 0.5 and r["async/trainer_idle"] < 0.5 for r in idle[1:])


def test_a_slow_sampler_gets_each_push_between_batches():
    versions, idle = _bounded(2, sample=0.15, trains=0.01)
    ages = [s - 1 - versions[s] for s in range(1, 7)]
    assert ages[0] == 0 and all(0 <= a <= 2 for a in ages) and max(ages) > 0
    # the trainer waits for rollouts; the sampler hardly at all (never at the bound: it is behind)
    assert sum(r["async/trainer_idle"] for r in idle) > sum(r["async/sampler_idle"] for r in idle)


def _ages_hold(rows, bound):
    """Each step row: staleness/max <= S, the shares of ages 0..S cover every token and agree with staleness/mean
    (counted separately, from each token's version), and the idle fractions are fractions."""
    for r in rows:
        frac = [r[f"staleness/frac/{k}"] for k in range(bound + 1)]
        assert sum(frac) == pytest.approx(1) and f"staleness/frac/{bound + 1}" not in r
        assert r["staleness/max"] == max(k for k, f in enumerate(frac) if f > 0) <= bound
        assert r["staleness/mean"] == pytest.approx(sum(k * f for k, f in enumerate(frac)))
        assert 0 <= r["async/sampler_idle"] <= 1 and 0 <= r["async/trainer_idle"] <= 1
        assert 0 <= r["async/spanning_push"] <= 1


@pytest.mark.parametrize("bound", [1, 2])
def test_max_staleness_trains_within_the_bound_with_stale_tokens(tmp_path, bound):
    _main(*SMALL, "--steps", "4", "--eval-every", "2", "--max-staleness", str(bound), "--out-dir", str(tmp_path))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "eval/reward" in rows[4]
    _ages_hold(rows[1:], bound)
    assert rows[1]["staleness/max"] == 0  # from the start's weights, trained by them
    assert max(r["staleness/max"] for r in rows[1:]) > 0  # the sampler ran ahead
    assert json.loads((tmp_path / "config.json").read_text())["repeatable"] is False


def test_a_resumed_bounded_run_counts_ages_from_the_checkpoint(tmp_path):
    """The queue is not saved: a resume at step k samples it again from version k (the RNGs as step k
    left them), so step k + 1's tokens are all of age 0, and every later age stays within the bound."""
    args = [*SMALL, "--eval-every", "0", "--max-staleness", "2", "--out-dir", str(tmp_path)]
    _main(*args, "--steps", "3")
    _main(*args, "--steps", "6", "--resume")
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    _ages_hold(rows, 2)
    assert rows[3]["staleness/frac/0"] == 1  # version 3 sampled it and trains on it
    assert max(r["staleness/max"] for r in rows[4:]) > 0
    assert json.loads((tmp_path / "config.json").read_text())["repeatable"] is False


@pytest.mark.parametrize("flags,says", [
    (["--max-staleness", "-1"], "--max-staleness must be >= 0 (0: synchronous), got -1"),
    (["--max-staleness", "1001"], "--max-staleness must be <= 1,000, got 1,001"),
    (["--max-staleness", "1", "--async-level", "1"], "--async-level/--max-staleness give one"),
    (["--max-staleness", "1", "--push-at-decode-step", "2", "--inference-gpus", "1"], "counts the decode steps of a colocated engine, not --inference-gpus"),
    (["--push-at-decode-step", "3"], "--push-at-decode-step acts on a push mid-rollout: it needs --max-staleness S"),
    (["--push-at-decode-step", "-1"], "--push-at-decode-step must be >= 0 (0: wherever the push finds the sampler), got -1"),
])
def test_max_staleness_refusals_are_one_line(capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        C.parse(flags)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and err.count("\n") == 0


def test_two_gloo_ranks_each_with_a_bounded_sampler(tmp_path):
    from test_distributed import torchrun

    r = torchrun(str(ROOT / "train.py"), *SMALL, "--prompts-per-step", "2", "--steps", "3", "--eval-every", "2",
                 "--max-staleness", "1", "--out-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path)
    _ages_hold(rows[1:], 1)  # the shares sum over both ranks' tokens
    assert max(r["staleness/max"] for r in rows[1:]) == 1


def test_two_gloo_ranks_resume_a_fixed_landing_point_exactly(tmp_path):
    """--max-staleness 2 --push-at-decode-step 3 on two gloo ranks: each rank's optimizer file of step 2 keeps
    the batches 3 and 4 it sampled ahead, and a run whose ranks are SIGKILLed at step 4's save (a true mid-run
    stop: --steps stays 6, so the sampler had run ahead as in the uninterrupted run) resumes from step 2 and
    repeats the uninterrupted run metric for metric, its ages within the bound."""
    from safetensors import safe_open
    from test_distributed import torchrun
    from test_train import KILLER

    args = [*SMALL, "--prompts-per-step", "2", "--steps", "6", "--save-every", "2", "--eval-every", "3",
            "--max-staleness", "2", "--push-at-decode-step", "3"]
    r = torchrun(str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-3000:]
    b, killer = tmp_path / "b", tmp_path / "killer.py"  # train.py as KILLER runs it: every rank dies at its 2nd save
    killer.write_text(KILLER.format(root=str(ROOT)))
    r = torchrun(str(killer), *args, "--out-dir", str(b))
    assert r.returncode != 0 and (b / "step_000004.tmp").is_dir() and not (b / "step_000004").exists(), r.stderr[-3000:]
    assert [r["step"] for r in _rows(b)] == [0, 1, 2, 3, 4]  # it stopped mid-run, steps 3 and 4 trained
    for rank in (0, 1):
        with safe_open(str(b / "step_000002" / "trainer_state" / f"optim_rng-{rank:05d}-of-00002.safetensors"), "pt") as st:
            assert {k.split("/")[1] for k in st.keys() if k.startswith("ahead/")} == {"3", "4"}, rank
    r = torchrun(str(ROOT / "train.py"), *args, "--out-dir", str(b), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]

    def numbers(d):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/sampler_idle", "async/trainer_idle"))
                 and "tok/s" not in k} for r in _rows(d)]
    assert numbers(tmp_path / "a") == numbers(b) and len(numbers(b)) == 7
    _ages_hold(_rows(b)[1:], 2)
    assert sum(r["async/spanning_push"] > 0 for r in numbers(b)[3:]) >= 2  # the resumed steps span pushes too


# ----------------------------------------------------------------------------- partial rollouts: a push between decode steps

@pytest.mark.parametrize("dtype,compiled", [("fp32", False), ("bf16", False), ("fp8", False), ("fp32", True)])
def test_a_push_between_decode_steps_samples_the_rest_from_the_new_weights(dtype, compiled):
    """Tokens before the push carry version 0 and the old weights' log q (their full forward); from the
    push on, version 1 and the pushed weights': a zero tied embedding makes every logit 0, so log q and
    every support row's log q are -log V exactly, compiled decode step included (it holds the very
    tensors a push overwrites)."""
    from test_engines import PROMPTS, STOPS, _model, _probs, _pushing_at

    torch._dynamo.reset()
    old, zero = _model(), _model()
    with torch.no_grad():
        zero.model.embed_tokens.weight.zero_()
    s = Sampling(max_new_tokens=8, seed=3, support=True, draws=8)
    plain = TorchEngine(old, dtype, STOPS).generate(PROMPTS, 4, s)
    engine = TorchEngine(old, dtype, STOPS, compile_step=compiled)
    _pushing_at(engine, 3, lambda: engine.load_weights(zero, version=1))
    out = engine.generate(PROMPTS, 4, s)
    assert any(len(c.ids) > 3 for c in out)  # rows decoded on past the push
    for i, (c, p) in enumerate(zip(out, plain)):
        assert c.versions == [0, 0, 0, 1, 1, 1, 1, 1][: len(c.ids)]
        assert c.ids[:3] == p.ids[:3]  # the same draws as without the push, up to it
        torch.testing.assert_close(torch.tensor(c.logq[:3]), torch.tensor(p.logq[:3]), atol=1e-4 if compiled else 0, rtol=0)
        ref = _probs(old, PROMPTS[i // 4], c.ids, 1.0, dtype == "fp8")
        for t, (v, lq) in enumerate(zip(c.ids, c.logq)):
            a, b = int(c.support.host_offsets[t]), int(c.support.host_offsets[t + 1])
            if t < 3:  # and the old weights' full forward (bf16's in another rounding: held to the run without a push)
                assert dtype == "bf16" or abs(lq - math.log(ref[t, v].item())) < 1e-5
            else:
                assert lq == pytest.approx(-math.log(32), abs=1e-6)
                assert torch.allclose(c.support.logq[a:b].double(), torch.full((b - a,), -math.log(32), dtype=torch.float64), atol=1e-6)
    assert engine.kept is None  # rows that spanned a push are not kept for a next call
    torch._dynamo.reset()


def test_a_push_of_the_same_weights_mid_decode_changes_versions_and_nothing_else():
    """The rows go on from the same KV cache and the same random stream: a push of unchanged
    weights at decode step 4 gives the very completions of a run without one, bit for bit."""
    from test_engines import PROMPTS, STOPS, _model, _pushing_at

    model = _model()
    s = Sampling(temperature=1.3, max_new_tokens=8, seed=11)
    plain = TorchEngine(model, "bf16", STOPS).generate(PROMPTS, 3, s)
    engine = TorchEngine(model, "bf16", STOPS)
    _pushing_at(engine, 4, lambda: engine.load_weights(model, version=5))
    pushed = engine.generate(PROMPTS, 3, s)
    assert [(c.ids, c.logq) for c in pushed] == [(c.ids, c.logq) for c in plain]
    assert all(c.versions == ([0] * 4 + [5] * 4)[: len(c.ids)] for c in pushed)
    assert any(len(c.ids) > 4 for c in pushed)


class SteppedEngine(FakeEngine):
    """A FakeEngine whose generate is `steps` decode steps, calling `between` before each after the
    first, as TorchEngine does; a push may land there and nowhere else. Records each step's version."""

    def __init__(self, steps=10):
        super().__init__()
        self.between, self.steps = None, steps

    def generate(self, seconds):
        assert not self.busy
        self.busy, drawn = True, []
        for t in range(self.steps):
            if t and self.between is not None:
                self.busy = False
                self.between()
                self.busy = True
            drawn.append(self.version)
            time.sleep(seconds / self.steps)
        self.busy = False
        return drawn


def _partial(bound, sample, trains, partial=True, steps=6):
    engine, drawn = SteppedEngine(), {}

    def produce(step):
        drawn[step] = engine.generate(sample)
        return [step], {}

    with AsyncRollouts(produce, engine, random.Random(0), bound, 0, steps, bounded=True, partial=partial) as pipe:
        for step in range(1, steps + 1):
            assert pipe.get(step)[0] == [step]
            time.sleep(trains)
            pipe.publish(None, step, hold=step == 2)
            if step == 2:  # an eval on the trainer's thread, the sampler parked mid-batch: SteppedEngine fails if both run
                engine.generate(trains)
                pipe.release()
    assert engine.between is None  # close() takes the hook back
    return drawn


@pytest.mark.parametrize("bound", [1, 2])
def test_a_slow_sampler_takes_each_push_mid_batch_within_the_bound(bound):
    drawn = _partial(bound, sample=0.3, trains=0.02)
    for step, versions in drawn.items():
        assert versions == sorted(versions) and step - 1 - versions[0] <= bound  # admission: by the first version
    assert sum(len(set(v)) > 1 for v in drawn.values()) >= 3  # most batches spanned a push
    whole = _partial(bound, sample=0.3, trains=0.02, partial=False)
    assert all(len(set(v)) == 1 for v in whole.values())  # --no-partial-rollouts: pushes wait for the batch


def test_closing_mid_push_leaves_the_batch_at_once():
    engine = SteppedEngine(steps=1000)

    def produce(step):  # a batch of 100 s
        return engine.generate(100.0), {}
    pipe = AsyncRollouts(produce, engine, random.Random(0), 1, 0, 4, bounded=True, partial=True)
    time.sleep(0.2)  # the thread is in its first batch's decode
    with pipe.cv:
        pipe.pushing = True  # a push waits: the thread parks at its next decode step
    time.sleep(0.3)
    t0 = time.perf_counter()
    pipe.close()
    assert time.perf_counter() - t0 < 5 and not pipe.thread.is_alive() and pipe.error is None


def test_spanning_counts_the_models_own_tokens():
    from engines.pipeline import spanning

    def s(versions, mask=None):
        return D.Sample(None, [0] * len(versions), [0.0] * len(versions), versions, "stop", mask=mask)
    # an episode's reply tokens carry a placeholder 0: not a second version
    batch = [s([3, 3, 4]), s([3, 3]), s([5, 0, 0, 5], mask=[True, False, False, True]), s([2, 0, 3], [True, False, True])]
    assert spanning(batch) == 0.5 and spanning([]) == 0


SLOW_SAMPLER = [*SMALL[:2], "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "64", "--temperature", "3",
                "--eval-prompts", "4"]  # few rows, long rambling ones: the sampler is the slower side


def test_pushes_land_mid_rollout_in_a_whole_run_and_wait_for_it_without_partial(tmp_path):
    args = [*SLOW_SAMPLER, "--steps", "8", "--eval-every", "4", "--max-staleness", "1"]
    _main(*args, "--out-dir", str(tmp_path / "partial"))
    _main(*args, "--no-partial-rollouts", "--out-dir", str(tmp_path / "whole"))
    partial, whole = _rows(tmp_path / "partial")[1:], _rows(tmp_path / "whole")[1:]
    _ages_hold(partial, 1)
    _ages_hold(whole, 1)
    # a sampler slower than the trainer is mid-batch at nearly every push (seen: 6 of 7 steps)
    assert sum(r["async/spanning_push"] > 0 for r in partial) >= 2
    assert all(r["async/spanning_push"] == 0 for r in whole)
    assert json.loads((tmp_path / "partial" / "config.json").read_text())["partial_rollouts"] is True


def test_recompute_kv_on_push_samples_the_rest_exactly_from_the_new_weights():
    """Without it the rows after a push attend to keys and values the old weights wrote (the drift
    bench/kvdrift.py measures); with it each in-flight row is prefilled again, so every token the new
    weights draw has their full forward's log q (fp32 engine, to the decode loop's summation order)."""
    from test_engines import PROMPTS, STOPS, _model, _probs, _pushing_at

    old, new = _model(), M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(new, std=0.15, seed=1)
    s = Sampling(temperature=1.0, max_new_tokens=10, seed=2)
    worst = {}
    for recompute in (False, True):
        engine = TorchEngine(old, "fp32", STOPS, recompute_kv=recompute)
        _pushing_at(engine, 4, lambda: engine.load_weights(new, version=1))
        out = engine.generate(PROMPTS, 4, s)
        gaps = [abs(lq - math.log(_probs(new if v else old, PROMPTS[i // 4], c.ids, 1.0)[t, x].item()))
                for i, c in enumerate(out) for t, (x, lq, v) in enumerate(zip(c.ids, c.logq, c.versions))]
        assert sum(v for c in out for v in c.versions) > 10  # tokens the new weights drew
        worst[recompute] = max(gaps)
    assert worst[True] < 2e-5 < 1e-2 < worst[False], worst


def test_recompute_kv_on_push_needs_partial_rollouts(capsys):
    for flags in (["--recompute-kv-on-push"], ["--recompute-kv-on-push", "--max-staleness", "1", "--no-partial-rollouts"]):
        with pytest.raises(SystemExit) as e:
            C.parse(flags)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and "--recompute-kv-on-push acts on a push mid-rollout" in err
    assert C.parse(["--recompute-kv-on-push", "--max-staleness", "1"]).recompute_kv_on_push


def _landing(bound, land_at, sample, trains, steps=6):
    engine, drawn = SteppedEngine(), {}

    def produce(step):
        drawn[step] = engine.generate(sample)
        return [step], {}

    with AsyncRollouts(produce, engine, random.Random(0), bound, 0, steps, bounded=True, partial=True,
                       land_at=land_at) as pipe:
        for step in range(1, steps + 1):
            pipe.get(step)
            time.sleep(trains)
            pipe.publish(None, step, hold=step == 2)
            if step == 2:
                engine.generate(trains)
                pipe.release()
    return drawn


@pytest.mark.parametrize("bound", [1, 2])
def test_a_fixed_landing_point_gives_every_batch_its_versions_whatever_the_timing(bound):
    """--push-at-decode-step D: batch b starts with version b - 1 - S and takes b - S at its D-th decode
    step, with a fast sampler (parked there) and a slow one (the trainer waits for it) alike."""
    D = 4
    want = {b: [max(0, b - 1 - bound)] * D + [max(0, b - bound)] * (10 - D) for b in range(1, 7)}
    assert _landing(bound, D, sample=0.02, trains=0.1) == want
    assert _landing(bound, D, sample=0.3, trains=0.01) == want
    assert _landing(bound, 11, sample=0.02, trains=0.05) == {b: [max(0, b - 1 - bound)] * 10 for b in range(1, 7)}  # past its end: after it


def test_a_fixed_landing_point_repeats_a_run_exactly(tmp_path):
    args = [*SLOW_SAMPLER, "--steps", "6", "--eval-every", "3", "--max-staleness", "1", "--push-at-decode-step", "3"]
    _main(*args, "--out-dir", str(tmp_path / "a"))
    _main(*args, "--out-dir", str(tmp_path / "b"))

    def numbers(d):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/sampler_idle", "async/trainer_idle"))
                 and "tok/s" not in k} for r in _rows(d)]
    a, b = numbers(tmp_path / "a"), numbers(tmp_path / "b")
    assert a == b and len(a) == 7
    _ages_hold(_rows(tmp_path / "a")[1:], 1)
    assert sum(r["async/spanning_push"] > 0 for r in a[2:]) >= 3  # steps 2.. each span the push at token 3
    assert "repeatable" not in json.loads((tmp_path / "a" / "config.json").read_text())


def test_a_fixed_landing_point_resumes_exactly_from_the_batches_it_sampled_ahead(tmp_path):
    """--push-at-decode-step: the checkpoint of step k keeps batches k+1..k+S (older weights than k's
    sampled them) and the RNGs after them, so a run SIGKILLed at step 4's save and resumed from step 2
    repeats the uninterrupted one, metric for metric."""
    from test_train import KILLER

    args = [*SLOW_SAMPLER, "--steps", "6", "--save-every", "2", "--eval-every", "3", "--max-staleness", "2",
            "--push-at-decode-step", "3"]
    _main(*args, "--out-dir", str(tmp_path / "a"))
    b = tmp_path / "b"
    r = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), *args, "--out-dir", str(b)],
                       capture_output=True, timeout=300)
    assert r.returncode == -9 and not (b / "step_000004").exists(), r.stderr[-2000:]
    from safetensors import safe_open
    with safe_open(str(b / "step_000002" / "trainer_state" / "optim_rng-00000-of-00001.safetensors"), "pt") as st:
        assert {k.split("/")[1] for k in st.keys() if k.startswith("ahead/")} == {"3", "4"}
    _main(*args, "--out-dir", str(b), "--resume")

    def numbers(d):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/sampler_idle", "async/trainer_idle"))}
                for r in _rows(d)]
    assert numbers(tmp_path / "a") == numbers(b) and len(numbers(b)) == 7
    assert sum(r["async/spanning_push"] > 0 for r in numbers(b)[4:]) >= 2  # the resumed steps span pushes too


def test_the_batches_sampled_ahead_read_back_as_they_were_and_refuse_what_json_cannot_hold():
    """engines/ahead.py: samples with and without support rows, an episode's mask and turns, shared prompts
    and the stats' (sum, count) tensors come back equal; a prompt column JSON cannot hold gives None (the
    checkpoint refills instead), and a damaged batch is a ValueError naming its step."""
    from engines import ahead

    sup = D.TokenSupport.from_counts(torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32), [2, 0, 3],
                                     torch.tensor([-0.5, -1.0, -0.1, -0.2, -2.5]), torch.tensor([True, False, False]))
    sup2 = D.TokenSupport.from_counts(torch.tensor([9, 2, 6], dtype=torch.int32), [1, 0, 2],
                                      torch.tensor([-0.3, -0.7, -1.1]), torch.tensor([False, True, False]))
    p = D.Prompt([5, 6], "dlrow", {"target": "world"}, None, "x.jsonl:3")
    q = D.Prompt([7], [{"role": "user", "content": "hi"}])
    samples = [D.Sample(p, [1, 2, 3], [-0.1, -0.2, -0.30000001192092896], [0, 0, 1], "stop", sup, 1.0, 0.5),
               D.Sample(p, [4], [-1.5], [1], "length", None, 0.0, -0.5),
               D.Sample(q, [8, 9, 2], [-0.7, 0.0, -0.9], [1, 1, 1], "stop", sup2, 0.25, 0.0, [True, False, True], [0, -1, 1])]
    stats = {"reward": (torch.tensor(1.25, dtype=torch.float64), torch.tensor(3.0)), "length": (torch.tensor(7.0), torch.tensor(3))}
    back = ahead.decode(ahead.encode({5: (samples, stats, 1.5), 6: ([], {}, 0.0)}))
    assert set(back) == {5, 6} and back[6] == ([], {}, 0.0)
    got, got_stats, seconds = back[5]
    assert seconds == 1.5 and got[0].prompt is got[1].prompt and got[0].prompt == p and got[2].prompt == q
    for a, b in zip(samples, got):
        assert (a.completion, a.logq, a.versions, a.finish_reason, a.reward, a.advantage, a.mask, a.turns) == \
               (b.completion, b.logq, b.versions, b.finish_reason, b.reward, b.advantage, b.mask, b.turns)
    assert got[1].support is None
    for s0, want in ((got[0].support, sup), (got[2].support, sup2)):  # the second's rows rebased to 0
        assert torch.equal(s0.ids, want.ids) and torch.equal(s0.logq, want.logq) and torch.equal(s0.replayed, want.replayed)
        assert torch.equal(s0.offsets, want.offsets) and list(s0.host_offsets) == list(want.host_offsets)
    assert all(torch.equal(got_stats[k][i], stats[k][i]) and got_stats[k][i].dtype == stats[k][i].dtype
               for k in stats for i in (0, 1))
    odd = D.Sample(D.Prompt([1], "x", {"when": object()}), [1], [-1.0], [0], "stop")
    assert ahead.encode({1: ([odd], {}, 0.0)}) is None
    damaged = ahead.encode({5: (samples, stats, 1.5)})
    damaged["ahead/5/completion"] = damaged["ahead/5/completion"][:-1]
    with pytest.raises(ValueError, match="the batch of step 5 sampled ahead does not read back"):
        ahead.decode(damaged)
