"""torchrun: two gloo ranks give the one-process step, and a 2-rank run's checkpoint loads in one process."""

import datetime
import json
import pickle
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import config as C
from layers import parallel
from tasks.textcodec import TextCodec
from tasks import task as T
from layers import lora
from layers.masks import accumulate, reduce_metrics
import model as M
from run import hfdir
import data
import rollout
import train
from engines.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parent.parent


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    with socket.socket() as s:  # a free port for this launch's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(port), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


WORKER = """
import os, pickle, sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch, train
from layers import parallel
from test_distributed import one_step, only_on_rank1
train.setup_distributed("cpu")
cases = pickle.loads(open(sys.argv[1] + "/cases.pkl", "rb").read())
n = len(cases[0][2]) // parallel.world()  # each rank gets its contiguous share of the samples
out = [one_step(cfg, state, samples[train.RANK * n:(train.RANK + 1) * n]) for cfg, state, samples in cases]
torch.save({{"steps": out, "names": only_on_rank1()}}, f"{{sys.argv[1]}}/rank{{train.RANK}}.pt")
torch.distributed.destroy_process_group()
os._exit(0)  # as parallel.leave ends a run: FSDP2's caches keep gloo threads that can abort finalization
"""


def one_step(cfg, state, samples):
    """This rank's share of the samples -> (metrics, full gradients, full weights after the step, micro-batches run)."""
    runs = []
    for phase in ("grads", "step"):
        model = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
        if cfg.lora_rank:  # the frozen base sharded like full fine-tuning's weights, the adapters with it
            lora.add(model, lora.spec_of(cfg), cfg.base_dtype)
        model.load_state_dict(state)
        model.checkpointing = cfg.activation_checkpointing == "blocks"  # as start.build sets it
        parallel.shard(model)
        assert isinstance(model.head_weight, DTensor) == (parallel.world() > 1)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        batch = train.gather(samples)
        scale = train.LossScale.for_dtype(cfg.train_dtype)  # fp16: 2^16, unscaled in optimizer_step
        if phase == "grads":
            mbs, denom, _ = train.prepare(cfg, batch, 32, "cpu")
            old = train.old_logprobs(cfg, model, model, mbs, denom)  # --m2po-threshold: the bound over both ranks
            train.backward_pass(cfg, model, model, mbs, denom, step=0, old=old, scale=scale.value)
            runs.append(({n: train.full(p.grad) / scale.value for n, p in model.named_parameters() if p.requires_grad},
                         len(mbs)))
        else:
            mbs, denom, total = train.prepare(cfg, batch, 32, "cpu")
            old = train.old_logprobs(cfg, model, model, mbs, denom)
            accumulate(total, train.backward_pass(cfg, model, model, mbs, denom, step=0, old=old, scale=scale.value))
            accumulate(total, train.optimizer_step(cfg, model, opt, step=1, scale=scale, loss=total["loss"][0]))
            metrics = reduce_metrics(train.sum_over_ranks(total, "cpu"))
            weights = {n: train.full(p.detach()) for n, p in model.named_parameters()}
            if cfg.lora_rank:  # the adapter as the engines and checkpoints get it (a collective)
                assert all(torch.equal(v, weights[k.removeprefix(lora.PREFIX)]) for k, v in lora.adapter_state(model).items())
            runs.append((metrics, weights))
    (grads, n_mb), (metrics, weights) = runs
    return metrics, grads, weights, n_mb


def only_on_rank1():
    t = torch.tensor
    total = {"a": (t(1.0), t(1.0)), **({"b": (t(3.0), t(2.0))} if train.RANK == 1 else {}), "c": (t(2.0), t(1.0))}
    return reduce_metrics(train.sum_over_ranks(total, "cpu"))


def _cases():
    """Token and sequence normalization; the second under top-p (replayed rows, the sparse head backward)."""
    codec = TextCodec.tiny()
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.1, seed=0)
    cases = []
    for agg, top_p in (("token", 1.0), ("sequence", 0.9)):
        cfg = C.Config(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25, prompts_per_step=4, group_size=3,
                       max_new_tokens=10, lr=1e-2, grad_clip=0.05, bad_evidence="drop", loss_agg=agg, top_p=top_p)
        engine = TorchEngine(m, "bf16", codec.stop_ids, seed=1)
        samples, _ = rollout.rollout_phase(cfg, T.ReverseText(codec, eval_size=4), engine, random.Random(0), 0, 512)
        g = torch.Generator().manual_seed(5)
        for s in samples:  # a sampler far from the trainer (the mask fires), and no group ties
            s.logq = [lq + float(torch.randn((), generator=g)) * 0.3 for lq in s.logq]
            s.advantage += float(torch.randn((), generator=g))
        samples[7].logq[0] = 0.5  # bad evidence: dropped on every rank, counted once
        longest = max(len(s.ids) - 1 for s in samples)  # three micro-batches: one rank runs a masked copy
        budget = next(b for b in range(longest, 4096) if len(data.pack(samples, b)) == 3)
        cases.append((C.dataclasses.replace(cfg, micro_batch_tokens=budget).resolve(False), m.state_dict(), samples))
    cfg, state, samples = cases[0]  # --train-dtype bf16/fp16: autocast around FSDP2's fp32 weights, as in 1 process
    cases += [(C.dataclasses.replace(cfg, train_dtype=d), state, samples) for d in ("bf16", "fp16")]
    cases.append((C.dataclasses.replace(cfg, m2po_threshold=0.02), state, samples))  # M2PO's bound: the step's, both ranks' tokens
    lcfg = C.dataclasses.replace(cfg, lora_rank=4, lora_alpha=8.0)  # LoRA: rank-4 adapters, B non-zero
    torch.manual_seed(0)
    lora.add(m, lora.spec_of(lcfg))
    with torch.no_grad():
        for layer in lora.adapted(m).values():
            layer.lora_B.weight.normal_(0, 0.1)
    cases.append((lcfg, m.state_dict(), samples))
    # blocks recomputed inside FSDP2's gathers: the ranks against one process that keeps them (full and LoRA);
    # a bf16 LoRA base: FSDP2 gathers bf16 weights beside fp32 norms and adapters
    return cases + [(C.dataclasses.replace(c, activation_checkpointing="blocks"), st, sa) for c, st, sa in (cases[0], cases[-1])] \
        + [(C.dataclasses.replace(lcfg, base_dtype="bf16"), m.state_dict(), samples)]


def test_two_gloo_ranks_match_one_process(tmp_path):
    cases = _cases()
    (tmp_path / "cases.pkl").write_bytes(pickle.dumps(cases))
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    r = torchrun(str(script), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    for i, (cfg, state, samples) in enumerate(cases):
        metrics, grads, weights, n_mb = one_step(C.dataclasses.replace(cfg, activation_checkpointing="off"), state, samples)
        assert n_mb == 3 and metrics["bad_evidence/dropped"] == pytest.approx(1 / 12)
        assert 0.02 < metrics["icepop/masked_fraction"] < 0.9 and metrics["grad_norm"] > cfg.grad_clip  # clipped
        if cfg.m2po_threshold:  # the bound acts, and the ranks' masks agree with one process's (below)
            assert 0 < metrics["m2po/masked_fraction"] < 1
        if cfg.lora_rank:  # the step moved the adapters alone
            assert grads.keys() == {k for k in weights if lora.is_adapter_key(k)}
            assert all(torch.equal(weights[k], state[k].to(weights[k].dtype)) for k in weights if not lora.is_adapter_key(k))
        for rank in ranks:
            m2, g2, w2, n2 = rank["steps"][i]
            assert n2 == 2  # 2 + 1 micro-batches, padded to 2 + 2
            assert list(m2) == list(metrics)
            for k in metrics:
                assert m2[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k
            for name in grads:
                torch.testing.assert_close(g2[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
                # AdamW's first step is ~lr*sign(g): an entry with |g| near eps turns a rounding-level
                # gradient difference into up to a few 1e-4 of lr (seen: 2.7e-6 at lr 1e-2)
                torch.testing.assert_close(w2[name], weights[name], rtol=1e-5, atol=1e-3 * cfg.lr, msg=name)
    assert ranks[0]["names"] == ranks[1]["names"] == {"a": 1.0, "b": 1.5, "c": 2.0}


SMALL = ["--loss", "icepop", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
         "--eval-every", "1", "--eval-prompts", "4"]


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_torchrun_trains_resumes_and_its_checkpoint_loads_in_one_process(tmp_path):
    out = tmp_path / "run"
    args = [str(ROOT / "train.py"), "--steps", "2", "--save-every", "1", "--out-dir", str(out), *SMALL]
    r = torchrun(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("step 2/2 |") == 1  # rank 0 prints, rank 1 does not
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["loss"] == r["loss"] for r in rows[1:])
    assert hfdir.load(out / "final").args.vocab_size == 32
    shutil.rmtree(out / "step_000002")  # resume at step 1 on two ranks: step 2 again, exactly
    r = torchrun(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _rows(out) == rows
    with pytest.raises(SystemExit) as e:  # one process cannot resume a 2-rank run; it can start from its weights
        train.main(["--steps", "3", "--out-dir", str(out), "--resume", *SMALL])
    assert e.value.code == 2
    s = train.main(["--model", str(out / "final"), "--steps", "1", "--out-dir", str(tmp_path / "one"), *SMALL])
    assert s["steps"] == 1 and (tmp_path / "one" / "final" / "model.safetensors").is_file()


def test_torchrun_trains_and_resumes_a_lora_run_exactly(tmp_path):
    """Two ranks, rank-4 adapters on the sharded frozen base: each step's checkpoint holds the adapter, the
    last one the merged model; a resume from step 1 redoes step 2 exactly."""
    out = tmp_path / "run"
    args = [str(ROOT / "train.py"), "--steps", "2", "--save-every", "1", "--out-dir", str(out), "--lora-rank", "4",
            "--lr", "2e-2", *SMALL]
    r = torchrun(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (out / "step_000001" / lora.WEIGHTS).is_file() and not (out / "step_000001" / "model.safetensors").exists()
    merged = hfdir.load(out / "final" / "merged")
    spec, tensors, _ = lora.read_adapter(out / "final")
    base = hfdir.load(ROOT / "checkpoints" / "reverse-tiny")
    want = lora.merged(base.state_dict(), tensors, spec)  # the merged save is W + (alpha / r) B A of the saved adapter
    assert all(torch.equal(v, want[k]) for k, v in merged.state_dict().items())
    shutil.rmtree(out / "step_000002")
    r = torchrun(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _rows(out) == rows


def test_each_rank_saves_its_own_optimizer_rows_and_a_missing_rank_file_falls_back(tmp_path):
    """Two ranks: each writes its FSDP2 rows of every AdamW tensor into its own file (together the whole
    tensor, split as torch.chunk splits it), the weights are rank 0's one HF directory; rank 1's file
    of step 2 gone, a 2-rank resume warns, goes on from step 1 and redoes step 2 exactly."""
    out = tmp_path / "run"
    args = [str(ROOT / "train.py"), "--steps", "2", "--save-every", "1", "--out-dir", str(out), *SMALL]
    r = torchrun(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    state = out / "step_000002" / "trainer_state"
    assert sorted(p.name for p in state.iterdir()) == ["optim_rng-00000-of-00002.safetensors",
                                                      "optim_rng-00001-of-00002.safetensors", "state.json"]
    ranks = [load_file(str(state / f"optim_rng-{r:05d}-of-00002.safetensors")) for r in (0, 1)]
    weights = hfdir.load(out / "step_000002").state_dict()
    for key, v in ranks[0].items():
        name, _, kind = key.removeprefix("optim/").rpartition("/")
        if key.startswith("optim/") and kind != "step":
            assert [len(x) for x in torch.chunk(weights[name], 2)] == [len(ranks[0][key]), len(ranks[1][key])], key
            assert torch.cat([ranks[0][key], ranks[1][key]]).shape == weights[name].shape
    assert not torch.equal(ranks[0]["rng/engine"], ranks[1]["rng/engine"])  # each rank's own sampler
    (state / "optim_rng-00001-of-00002.safetensors").unlink()
    r = torchrun(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optim_rng-00001-of-00002.safetensors: missing" in r.stdout and "resuming from step_000001" in r.stdout
    assert _rows(out) == rows
    # a checkpoint from before the per-rank files (every AdamW tensor whole, each rank's generator under
    # its own key) resumes exactly too: each rank reads its rows of it
    old = out / "step_000001" / "trainer_state"
    parts = [load_file(str(old / f"optim_rng-{r:05d}-of-00002.safetensors")) for r in (0, 1)]
    legacy = {k: (torch.cat([parts[0][k], parts[1][k]]) if v.dim() else v) for k, v in parts[0].items() if k != "rng/engine"}
    legacy.update({"rng/engine": parts[0]["rng/engine"], "rng/engine/1": parts[1]["rng/engine"]})
    save_file(legacy, str(old / "optim_rng.safetensors"))
    for r in (0, 1):
        (old / f"optim_rng-{r:05d}-of-00002.safetensors").unlink()
    shutil.rmtree(out / "step_000002")
    r = torchrun(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at step 1" in r.stdout and _rows(out) == rows


SHARED = """
import os, sys
sys.path[:0] = [{root!r}]
import torch.distributed as dist
from pathlib import Path
import config as C
from run import rundir
dist.init_process_group("gloo")
rank = dist.get_rank()
say = lambda line: os.write(1, (line + "\\n").encode())  # one write a line: the ranks share the pipe (print writes twice unbuffered)
for where in ("shared", f"node{{rank}}"):  # one directory, then each rank its own (no shared filesystem)
    d = Path(sys.argv[1]) / where
    d.mkdir(exist_ok=True)
    try:
        rundir.check_shared(d)
        say(f"rank {{rank}} {{where}}: ok")
    except C.ConfigError as e:
        say(f"rank {{rank}} {{where}}: {{e}}")
    assert sorted(p.name for p in d.iterdir()) == []  # the token file is gone either way
dist.destroy_process_group()
"""


def test_ranks_that_cannot_see_each_others_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "shared.py").write_text(SHARED.format(root=str(ROOT)))
    r = torchrun(str(tmp_path / "shared.py"), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    for rank in (0, 1):  # one verdict, said alike by both ranks
        assert said[f"rank {rank} shared"] == "ok"
        assert said[f"rank {rank} node{rank}"].startswith(f"--out-dir {tmp_path / f'node{rank}'}: rank 1 cannot see "
                                                         "the files rank 0 writes there"), said


FULL_DISK = """
import errno, os, random, sys
sys.path[:0] = [{root!r}]
from pathlib import Path
import torch, torch.distributed as dist
from run import checkpoint
import model as M
from layers import parallel
from run import shardfiles
say = lambda line: os.write(1, (line + "\\n").encode())  # one write a line: the ranks share the pipe
dist.init_process_group("gloo")
rank, out = dist.get_rank(), Path(sys.argv[1])
ckpt = out.parent / "tok"
m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
parallel.shard(m)
opt = torch.optim.AdamW(m.parameters())
m(torch.arange(8), torch.arange(8), torch.zeros(8, dtype=torch.long)).sum().backward()
opt.step()
real = shardfiles.write_file
def full(path, tensors):  # rank 1's optimizer file meets a full disk
    if rank == 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, tensors)
shardfiles.write_file = full
try:
    checkpoint.save_checkpoint(out, 1, m, opt, random.Random(0), torch.Generator(), ckpt)
    say(f"rank {{rank}} save: saved")
except OSError as e:
    say(f"rank {{rank}} save: {{e}}")
dist.barrier()
say(f"rank {{rank}} left: {{sorted(p.name for p in out.iterdir())}}")
dist.destroy_process_group()
os._exit(0)  # as parallel.leave ends a run (its docstring): no finalization for FSDP2's gloo threads to abort
"""


def test_a_full_disk_on_one_rank_stops_every_rank_and_leaves_no_checkpoint(tmp_path):
    """Rank 1 cannot write its optimizer file: both ranks stop at the save's verdict (rank 0 naming rank 1),
    and the torn temporary directory is gone."""
    (tmp_path / "tok").mkdir()  # the source whose tokenizer files a save copies: none
    (tmp_path / "run").mkdir()
    (tmp_path / "worker.py").write_text(FULL_DISK.format(root=str(ROOT)))
    r = torchrun(str(tmp_path / "worker.py"), str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in r.stdout.splitlines() if line.startswith("rank "))
    assert said["rank 1 save"].startswith("[Errno 28] No space left on device"), said
    assert said["rank 0 save"] == f"[Errno 5] rank 1 could not write its part of the checkpoint: '{tmp_path}/run/step_000001.tmp'"
    assert said["rank 0 left"] == said["rank 1 left"] == "[]", said


REWARD = '''
import os
calls = 0

def score(prompts, completions, target, **kwargs):
    """Rank 1's group overflows from its second call (step 2) on; rank 0's never does."""
    global calls
    calls += 1
    big = os.environ["RANK"] == "1" and calls > 1
    return [1e308 if big else 0.1 * i for i in range(len(completions))]
'''


def test_a_reward_that_overflows_on_one_rank_skips_the_step_on_both(tmp_path):
    """Rank 1's advantages are -inf; the samples are gathered to every rank before the loss and the
    grad norm is all-reduced, so both ranks skip steps 2-4 (a mean of 1.0 over the two ranks: 0.5
    would mean they disagreed), stop together with one line, and the checkpoints keep step 1's weights."""
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "run"
    r = torchrun(str(ROOT / "train.py"), "--steps", "5", "--save-every", "1", "--out-dir", str(out), "--reward",
                 f"{tmp_path / 'reward.py'}:score", *SMALL, "--eval-every", "0")
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("floe: error:")]
    assert len(lines) == 1 and "3 steps in a row" in lines[0] and "non-finite advantages" in lines[0], r.stderr[-3000:]
    assert [(x["step"], x["skipped/nonfinite_step"]) for x in _rows(out)] == [(1, 0), (2, 1), (3, 1), (4, 1)]
    first = hfdir.load(out / "step_000001").state_dict()
    for step in (2, 3):
        for k, v in hfdir.load(out / f"step_{step:06d}").state_dict().items():  # hfdir.load refuses non-finite weights
            assert torch.equal(v, first[k]), (step, k)
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


RANK1 = """
import os, sys, time
sys.path.insert(0, {root!r})
import train
if os.environ["RANK"] == "1":
    {rank1}
train.main()
"""


def _with_rank1(tmp_path, rank1: str, *args: str) -> subprocess.CompletedProcess:
    """torchrun of train.py whose rank 1 first runs `rank1` (one line of Python)."""
    script = tmp_path / "rank1.py"
    script.write_text(RANK1.format(root=str(ROOT), rank1=rank1))
    return torchrun(str(script), "--out-dir", str(tmp_path / "run"), *SMALL, "--eval-every", "0", *args)


def test_ranks_given_other_flags_stop_at_start_naming_the_flag(tmp_path):
    r = _with_rank1(tmp_path, 'sys.argv += ["--max-new-tokens", "6"]', "--steps", "2")
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("floe: error:")]
    assert lines == ["floe: error: torchrun rank 1 has other flags than rank 0: --max-new-tokens is 6 there, 8 on "
                     "rank 0 (every rank must run the same command)"], r.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_hung_rank_stops_the_others_after_dist_timeout(tmp_path):
    """Rank 1 hangs in its first step (as a SIGSTOP would leave it; a sleeping rank dies at torchrun's
    SIGTERM at once, a stopped one only at its SIGKILL 30 s later): rank 0 waits --dist-timeout, not
    gloo's 30 minutes, and says where."""
    r = _with_rank1(tmp_path, "train.rl_step = lambda *a, **k: time.sleep(600)", "--steps", "2", "--dist-timeout", "3")
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("floe: error:")]
    assert len(lines) == 1 and lines[0].startswith("floe: error: rank 0 stopped waiting for the other torchrun ranks "
                                                   "in step 1 (--dist-timeout 3 s): a rank is stopped, hung or dead ("
                                                   ), r.stderr[-3000:]


def test_the_dist_timeout_reaches_init_process_group(monkeypatch):
    seen = {}

    class Joined(Exception):
        pass

    def init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Joined

    monkeypatch.setattr(train, "LAUNCHED", 2)  # train.main reads the name it imported
    monkeypatch.setattr(parallel, "LAUNCHED", 2)  # and setup_distributed its own
    monkeypatch.setattr(parallel.dist, "init_process_group", init)
    with pytest.raises(Joined):
        train.main(["--dist-timeout", "7", "--steps", "1"])
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=7)}
    seen.clear()  # NCCL keeps torch's 10 minutes (its watchdog): rank 0's eval or checkpoint can take minutes
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(train.torch.cuda, "set_device", lambda i: None)
    with pytest.raises(Joined):
        parallel.setup_distributed("cuda", 0, 7.0)
    assert seen == {"backend": "nccl"}


def test_a_lost_peer_is_one_line_naming_the_rank_and_the_wait():
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            "300000ms for recv operation to complete")
    with pytest.raises(parallel.CollectiveTimeout) as e:
        with parallel.collective("step 3", 300.0):
            raise RuntimeError(gloo)
    assert str(e.value) == ("rank 0 stopped waiting for the other torchrun ranks in step 3 (--dist-timeout 300 s): a "
                            "rank is stopped, hung or dead (Timed out waiting 300000ms for recv operation to complete)")
    with pytest.raises(RuntimeError, match="^something else$"):  # any other error stays as it was
        with parallel.collective("step 3", 300.0):
            raise RuntimeError("something else")
