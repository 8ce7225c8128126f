"""--inference-gpus: the remote engine draws exactly what a local one does, a split run trains,
resumes exactly and runs vLLM on its inference rank, and bad splits are refused."""

import json
import os
import subprocess
import sys

import pytest

import config as C
from test_distributed import ROOT, _rows, torchrun
from conftest import needs_vllm

WORKER = """
import sys
sys.path[:0] = [{root!r}]
import torch
import config as C
import data as D
import model as M
from layers import parallel as P
from tasks.textcodec import TextCodec
from run import hfdir
from run.remote import RemoteEngine, serve
from engines.torch_engine import Sampling, TorchEngine

src = {src!r}
cfg = C.Config(model=src, engine="torch", inference_gpus=2, engine_dtype={dtype!r}).resolve(False)
link = P.setup_distributed("cpu", 2)
if P.serving(2):
    plain = TorchEngine.generate
    def generate(self, prompts, n, sampling, budgets=None, keep=True):  # a call the engine refuses (as vLLM refuses a short kept set)
        if prompts == [[31]]:
            raise D.RunError("the engine refused this call")
        return plain(self, prompts, n, sampling, budgets, keep)
    TorchEngine.generate = generate
    serve(cfg, link)
    raise SystemExit
model = hfdir.load(src)
stops = TextCodec.load(src).stop_ids
remote, local = RemoteEngine(link, 0, {dtype!r}), TorchEngine(model, {dtype!r}, stops)
remote.start(src)
prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [6, 6], [7]]
cases = [Sampling(support=True, draws=4, seed=11), Sampling(top_p=0.9, support=True, seed=11),
         Sampling(top_k=5, temperature=0.7, seed=11), Sampling(temperature=0.5, max_new_tokens=6, seed=3)]
for push in (False, True):
    if push:  # different weights, version 7, into both
        torch.manual_seed(0)
        for p in model.parameters():
            p.data += 0.05 * torch.randn_like(p)
        remote.load_weights(model, 7)
        local.load_weights(model, 7)
    for s, caps in [(s, None) for s in cases] + [(cases[3], [2, 6, 1, 4, 3])]:  # per-prompt budgets: a turn's room
        got = remote.generate(prompts, 3, s, caps)
        seeds = [None, None] if s.seed is None else [s.seed, s.seed + 1]  # chunk j draws with seed + j
        parts = [(prompts[:3], caps and caps[:3]), (prompts[3:], caps and caps[3:])]
        want = [c for (part, cap), seed in zip(parts, seeds)
                for c in local.generate(part, 3, Sampling(**{{**vars(s), "seed": seed}}), cap)]
        if caps:
            assert [len(c.ids) <= cap for c, cap in zip(got, [c for c in caps for _ in range(3)])] == [True] * 15
        assert len(got) == len(want) == 15
        for g, w in zip(got, want):
            assert (g.ids, g.logq, g.versions, g.finish_reason) == (w.ids, w.logq, w.versions, w.finish_reason)
            assert (g.support is None) == (w.support is None)
            if g.support is not None:
                assert (g.support.host_offsets == w.support.host_offsets).all()
                for a in ("ids", "offsets", "logq", "replayed"):
                    assert torch.equal(getattr(g.support, a), getattr(w.support, a)), a
        assert {{v for c in got for v in c.versions}} == {{7 if push else 0}}
try:  # the inference rank's one-line error reaches the trainer, and it keeps serving
    remote.generate([[31]], 1, Sampling(seed=1))
    raise AssertionError("no error")
except D.RunError as e:
    assert str(e) == "inference rank 1: the engine refused this call", e
assert len(remote.generate(prompts, 1, Sampling(seed=1))) == 5
remote.stop()
print("REMOTE OK")
"""

SMALL = ["--engine", "torch", "--loss", "icepop", "--prompts-per-step", "4", "--group-size", "3",
         "--max-new-tokens", "8", "--eval-prompts", "4"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])  # fp8: the push travels in fp32 and is quantized there
def test_remote_engine_draws_what_a_local_engine_draws(tmp_path, dtype):
    """Two inference ranks each sample their chunk of a call; every id, logq, version and support
    row equals a local engine's with the chunk's seed, before and after a push of other weights.
    An engine's refusal comes back as the trainer's one-line RunError."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), src=str(ROOT / "checkpoints" / "reverse-tiny"), dtype=dtype))
    r = torchrun(str(script), nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REMOTE OK" in r.stdout


def test_split_run_trains_and_resumes_exactly(tmp_path):
    """2 trainer ranks + 1 inference rank; a run stopped at step 2 and resumed gives the
    uninterrupted run's rows (the sampling RNG lives on the trainer)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    base = [str(ROOT / "train.py"), "--inference-gpus", "1", "--eval-every", "2", "--save-every", "2", *SMALL]
    r = torchrun(*base, "--steps", "4", "--out-dir", str(whole), nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x 2 ranks (FSDP2), sampling on 1 more" in r.stdout
    rows = _rows(whole)
    assert [x["step"] for x in rows] == [0, 1, 2, 3, 4] and "eval/reward" in rows[-1]
    assert all(0 < x["mismatch/kl"] < 1e-3 for x in rows[1:])
    assert json.loads((whole / "final" / "trainer_state" / "state.json").read_text())["world_size"] == 2
    for steps, more in (("2", []), ("4", ["--resume"])):
        r = torchrun(*base, "--steps", steps, "--out-dir", str(cut), *more, nproc=3)
        assert r.returncode == 0, r.stderr[-3000:]
    assert _rows(cut) == rows
    r = torchrun(*base, "--steps", "4", "--out-dir", str(cut), "--resume", nproc=3)  # the inference rank is let go
    assert r.returncode == 0 and "floe: nothing to do" in r.stdout, r.stderr[-3000:]
    assert _rows(cut) == rows


TEARDOWN = """
import atexit, os, sys
sys.path[:0] = [{root!r}]
import torch
import model as M
from layers import parallel as P


def gloo_workers():
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{{t}}/comm").read().strip() == "pt_gloo_runloop" for t in tasks)


def main():
    atexit.register(print, "FINALIZED")  # P.leave ends the process before Python's finalization runs it
    link = P.setup_distributed("cpu", 1)
    if P.serving(1):
        msg = link.recv(0)
        link.broadcast(torch.zeros(8))
        link.send([msg[0] + 1], 0)
    else:  # FSDP2 and a gather, as a push does: torch's DTensor caches then hold the default group
        model = P.shard(M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY)))
        for v in model.state_dict().values():
            P.full(v)
        if link is not None:
            link.send([torch.tensor([1, 2])], 1)
            link.broadcast(torch.ones(8))
            assert link.recv(1)[0].tolist() == [2, 3]
    P.teardown(link, 1)
    assert link is None or (link.host, link.fast) == (None, None)
    if P.serving(1):  # its only groups were the link's: their worker threads were joined
        assert gloo_workers() == 0, gloo_workers()
    print(f"rank {{P.RANK}} torn down")  # not flushed here: P.leave flushes before os._exit


P.leave(main)
"""


def test_teardown_closes_the_link_on_every_rank_and_leaves_without_finalization(tmp_path):
    """A SIGABRT as a split run ended (parallel.leave says why): parallel.teardown closes the link on its ranks
    (a barrier, then its groups let go, their worker threads joined) and destroys the trainers'
    group; parallel.leave ends each process before Python's finalization, where a gloo worker
    still held by torch's caches could abort it. Every rank gets there, and no atexit hook runs."""
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN.format(root=str(ROOT)))
    r = torchrun(str(script), nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(line for line in r.stdout.splitlines() if "torn down" in line) == [
        f"rank {i} torn down" for i in range(3)]
    assert "FINALIZED" not in r.stdout


def test_leave_keeps_the_exit_status_and_flushes(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(f"import atexit, sys\nsys.path[:0] = [{str(ROOT)!r}]\nfrom layers import parallel as P\n"
                      "atexit.register(print, 'FINALIZED')\n"
                      "def main():\n    print('buffered')\n    print('floe: error: x', file=sys.stderr)\n"
                      "    raise SystemExit(3)\nP.leave(main)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (3, "buffered\n", "floe: error: x\n")


PARTIAL = ["--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "64", "--temperature", "2",
           "--eval-prompts", "4", "--steps", "8", "--eval-every", "4", "--max-staleness", "1"]  # the sampler: the slower side


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, needs_vllm])])
def test_split_run_pushes_land_between_the_inference_ranks_decode_steps(tmp_path, engine):
    """--max-staleness 1 under --inference-gpus 1: a push goes out while trainer rank 0 waits for the
    inference rank's replies, lands between two of its decode steps, and the tokens after it carry the
    new version (async/spanning_push > 0); the evals at steps 4 and 8 are served while a batch decodes;
    every age is within the bound; with --no-partial-rollouts no push lands mid-rollout."""
    spans = {}
    for partial in ("--partial-rollouts", "--no-partial-rollouts"):
        out = tmp_path / partial
        r = torchrun(str(ROOT / "train.py"), "--engine", engine, "--inference-gpus", "1", *PARTIAL, partial,
                     "--out-dir", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = _rows(out)
        assert [x["step"] for x in rows] == list(range(9)) and "eval/reward" in rows[4] and "eval/reward" in rows[8]
        assert all(x["staleness/max"] <= 1 for x in rows[1:])
        spans[partial] = [x["async/spanning_push"] for x in rows[1:]]
    assert sum(x > 0 for x in spans["--partial-rollouts"]) >= 1, spans  # seen: 5 of 8 steps
    assert not any(spans["--no-partial-rollouts"]), spans


@pytest.mark.vllm
@needs_vllm
def test_split_run_samples_with_vllm_a_step_ahead(tmp_path):
    """vLLM under torchrun, on the inference rank, with --async-level 1: the run trains, its sampler
    agrees with the trainer on fresh tokens, and step 2 trains on tokens one version old."""
    out = tmp_path / "run"
    args = [str(ROOT / "train.py"), "--inference-gpus", "1", "--async-level", "1", "--steps", "2",
            "--eval-every", "2", "--out-dir", str(out), *SMALL[2:], "--engine", "vllm"]
    r = torchrun(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    assert [x["step"] for x in rows] == [0, 1, 2] and rows[-1]["eval/reward"] > 0
    assert 0 < rows[1]["mismatch/kl"] < 1e-3 and rows[1]["staleness/mean"] == 0
    assert rows[2]["staleness/mean"] == 1


@pytest.mark.parametrize("world,flags,says", [
    ("2", ["--inference-gpus", "2"], "--inference-gpus 2 needs torchrun with more processes"),
    ("1", ["--inference-gpus", "1"], "--inference-gpus 1 needs torchrun"),
    pytest.param("2", ["--engine", "vllm"], "--engine vllm under torchrun needs --inference-gpus",
                 marks=[pytest.mark.vllm, needs_vllm]),  # without vllm, --engine vllm is refused first for that
])
def test_bad_splits_are_refused(monkeypatch, world, flags, says):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(C.ConfigError, match=says):
        C.parse(flags).resolve(False)


@pytest.mark.parametrize("rank,visible,want", [(2, "4,5,6", ("6", "0")), (2, None, ("2", "0")), (1, "4,5,6", (None, "1"))])
def test_an_inference_rank_sees_only_its_own_gpu(monkeypatch, rank, visible, want):
    """Set before CUDA starts: vLLM in-process takes cuda:0 of what the process sees."""
    from layers import parallel as P

    monkeypatch.setattr(P, "RANK", rank)
    monkeypatch.setattr(P, "LAUNCHED", 3)
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    P.pin_inference_gpu(1)
    got = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ["LOCAL_RANK"])
    assert got == (want[0] or visible, want[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_an_inference_rank_holds_one_copy_its_engines(dtype, device):
    """Full fine-tuning under --inference-gpus: beside its engine an inference rank keeps a skeleton on
    the meta device and nothing else; the engine built from the files one tensor at a time equals one
    built from a loaded model, and a push streamed from the wire lands as a model's push does."""
    import torch

    from run import hfdir
    from engines.torch_engine import TorchEngine
    from run.remote import _inference_model, _pushed, wire_dtype
    from tasks.textcodec import TextCodec
    from engines.vllm_engine import make_engine

    src = str(ROOT / "checkpoints" / "reverse-tiny")
    cfg = C.Config(model=src, engine="torch", engine_dtype=dtype, device=device).resolve(device == "cuda")
    stops = TextCodec.load(src).stop_ids
    skeleton, weights = _inference_model(cfg, src, None)
    assert all(t.is_meta for t in skeleton.state_dict().values())
    streamed = make_engine(cfg, skeleton, src, stops, 0, weights)
    trainer = hfdir.load(src, device=device)
    loaded = TorchEngine(hfdir.load(src, device=device, dtype=wire_dtype(dtype)), dtype, stops)

    def same():
        a, b = streamed.model.state_dict(), loaded.model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for m, n in zip(streamed.quantized.values(), loaded.quantized.values()):
            assert torch.equal(m.scale, n.scale)
        if dtype == "fp8":
            a, b = streamed.head8, loaded.head8
            assert torch.equal(a.weight, b.weight) and torch.equal(a.scale, b.scale)

    same()
    torch.manual_seed(0)
    for p in trainer.parameters():
        p.data += 0.05 * torch.randn_like(p)
    wire = [v.to(wire_dtype(dtype)) for v in trainer.state_dict().values()]  # what RemoteEngine.load_weights sends

    class Wire:  # the link's receiving end: each broadcast fills the next tensor sent
        def broadcast(self, t):
            t.copy_(wire.pop(0))

    streamed.load_tensors(_pushed(Wire(), skeleton, wire_dtype(dtype), device), 7)
    loaded.load_weights(trainer, 7)
    assert not wire and streamed.version == loaded.version == 7
    same()
