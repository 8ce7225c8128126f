"""Episodes on every path floe runs: vLLM, --async-level 1, torchrun, torchrun with --inference-gpus,
LoRA (merged into the built-in engine, or served by vLLM's LoRA path).

Each path plays the built-in guess-letter game for a few steps and must train them with the
one-process run's metrics keys; every model token of every episode it trained on must carry the
version the path's rule names and the logq of a full fp32 forward of its episode under exactly
those weights (the checkpoint of that version; --save-every 1). A hung environment under
--async-level 1 and under torchrun is counted and the run exits cleanly; a SIGKILL mid-episode
then --resume repeats the uninterrupted run (one process) or completes it validly (async).

The game with a tool runs on the same paths (one process, --async-level 1, torchrun, --inference-gpus,
LoRA, vLLM) on a tiny model that calls: its episodes hold call turns answered by the template's
tool-result turns, and the same check holds for every model token.

    python -m pytest -q tests/test_episode_paths.py     # ~5 min on 2 cores, vLLM included
"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layers import lora
import model as M
from run import hfdir
from tasks.textcodec import TextCodec
from conftest import needs_vllm

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "checkpoints" / "guess-tiny"
FLAGS = ["--task", "jsonl:examples/guess.jsonl", "--model", str(BASE), "--steps", "3",
         "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4", "--max-turns", "3",
         "--eval-every", "0", "--engine-dtype", "fp32", "--save-every", "1", "--lr", "2e-3"]
GAME = [*FLAGS, "--env", "guess-letter"]

# train.main with the global batch of every step written out by rank 0 (prepare sees it on every rank)
DRIVER = """
import json, os, sys
sys.path.insert(0, {root!r})
from layers import parallel as P
import train
real, calls = train.prepare, [0]
def prepare(cfg, samples, vocab_size, device):
    calls[0] += 1
    if P.RANK == 0:
        with open(os.environ["FLOE_TEST_DUMP"], "a") as f:
            for s in samples:
                f.write(json.dumps({{"step": calls[0], "prompt": s.prompt.ids, "completion": s.completion,
                                     "mask": s.mask, "logq": s.logq, "versions": s.versions}}) + "\\n")
    return real(cfg, samples, vocab_size, device)
train.prepare = prepare
P.leave(train.main) if P.LAUNCHED > 1 else train.main()
"""


def _launch(tmp_path: Path, args: list[str], nproc: int = 1, timeout: int = 400) -> subprocess.CompletedProcess:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        head = [sys.executable]
    env = {**os.environ, "FLOE_TEST_DUMP": str(tmp_path / "dump.jsonl")}
    return subprocess.run([*head, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _keys(out: Path) -> list[set]:
    """Each row's metric names, a by-turn family as one name (which turns appear depends on the draws)."""
    return [{re.sub(r"/\d+$", "/k", k) for k in r if not k.startswith("time/")} for r in _rows(out)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, the built-in engine, synchronous."""
    d = tmp_path_factory.mktemp("plain")
    r = _launch(d, [*GAME, "--out-dir", str(d / "run")])
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def _version(d: Path, v: int, base: Path = BASE) -> M.Transformer:
    """The weights of version v: the base, a step's full weights, or (LoRA) the base with the step's
    adapter applied on the fly (fp32, x W + s B A x: not the engines' merged copy)."""
    step = d / "run" / f"step_{v:06d}"
    if v == 0 or not (step / lora.CONFIG).is_file():
        return hfdir.load(base if v == 0 else step)
    spec, tensors, _ = lora.read_adapter(step)
    m = hfdir.load(base)
    lora.add(m, spec)
    lora.load_adapter(m, tensors)
    return m


def _check_tokens(d: Path, version_of, tol: float, base: Path = BASE) -> int:
    """Every model token's version and logq against the full fp32 forward of its version's weights."""
    models, checked = {}, 0
    for line in (d / "dump.jsonl").read_text().splitlines():
        s = json.loads(line)
        ids, P = s["prompt"] + s["completion"], len(s["prompt"])
        versions = {v for v, on in zip(s["versions"], s["mask"]) if on}
        assert versions == {version_of(s["step"])}, (s["step"], versions)
        v = versions.pop()
        if v not in models:
            models[v] = _version(d, v, base)
        m = models[v]
        with torch.no_grad():
            h = m(torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
            logp = (h @ m.head_weight.T).double().log_softmax(-1)
        for j, on in enumerate(s["mask"]):
            if on:
                assert abs(s["logq"][j] - logp[P + j - 1, ids[P + j]].item()) < tol, (s["step"], j)
                checked += 1
    return checked


PATHS = {  # name -> (extra flags, processes, the version that samples step s, logq tolerance)
    "async": (["--async-level", "1"], 1, lambda s: max(0, s - 2), 1e-5),
    "vllm": (["--engine", "vllm"], 1, lambda s: s - 1, 1e-4),
    "torchrun": ([], 2, lambda s: s - 1, 1e-5),
    "inference_gpus": (["--inference-gpus", "1"], 3, lambda s: s - 1, 1e-5),
    # LoRA (a larger lr, so each version's adapter moves the log-probs well past the tolerance: asserted)
    "lora": (["--lora-rank", "4", "--lr", "2e-2"], 1, lambda s: s - 1, 1e-5),
    "lora_vllm": (["--engine", "vllm", "--lora-rank", "4", "--lr", "2e-2"], 1, lambda s: s - 1, 1e-4),
    "lora_async": (["--async-level", "1", "--lora-rank", "4", "--lr", "2e-2"], 1, lambda s: max(0, s - 2), 1e-5),
}


@pytest.mark.parametrize("path", [p if "vllm" not in p else pytest.param(p, marks=[pytest.mark.vllm, needs_vllm])
                                  for p in PATHS])
def test_each_path_trains_episodes_whose_every_token_is_its_versions_full_forward(one_process, tmp_path, path):
    extra, nproc, version_of, tol = PATHS[path]
    r = _launch(tmp_path, [*GAME, *extra, "--out-dir", str(tmp_path / "run")], nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    for got, want in zip(_keys(tmp_path / "run"), _keys(one_process / "run"), strict=True):
        extra_keys = {"kl/age0", "staleness/mean"} if "async" in path else set()  # a stale batch's own metrics
        assert got - extra_keys == want, (sorted(got - want), sorted(want - got))
    rows = _rows(tmp_path / "run")
    assert [x["step"] for x in rows] == [1, 2, 3] and all(x["episode/turns"] >= 1 for x in rows)
    assert any(x["episode/turns"] > 1 for x in rows)
    assert _check_tokens(tmp_path, version_of, tol) > 50
    if "lora" in path:  # the adapters moved: version 2's forward is not version 0's
        assert (tmp_path / "run" / "step_000002" / lora.CONFIG).is_file()
        ids = torch.tensor(json.loads((tmp_path / "dump.jsonl").read_text().splitlines()[-1])["prompt"])
        pos, seg = torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)
        with torch.no_grad():
            a, b = (m(ids, pos, seg) @ m.head_weight.T for m in (_version(tmp_path, 0), _version(tmp_path, 2)))
        assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max() > 100 * tol


def test_the_one_process_reference_is_exact_too(one_process):
    assert _check_tokens(one_process, lambda s: s - 1, 1e-5) > 50


GUESS_TOOLS = """
from agents.envs import GuessLetter
class GuessWithTools(GuessLetter):
    answers = 0

    def tools(self):
        return [self.add]

    def add(self, a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first
            b: the second
        \"\"\"
        return a + b

    def step(self, text, ids):
        self.answers += 1
        return super().step(text, ids)

    def reward(self):  # a group's episodes differ in how many turns were answers: the weights move every step
        return super().reward() + 0.1 * self.answers
"""
LETTERS = "abcdefghijklmno"


@pytest.fixture(scope="module")
def caller(tmp_path_factory) -> Path:
    """A tiny Qwen3-shaped model that calls, on test_toolcalls' tool template and tokenizer: random,
    untied, its embeddings near one-hot and its LM head near a bigram table, so that after the
    assistant header ("\\n") it opens a call (<tool_call>) or guesses a letter, and either is followed
    by <|im_end|>. Its calls are malformed (no JSON), so each is answered with an error result in the
    template's <tool_response> turn; its guesses with the game's replies. The blocks stay random
    (each token's log-prob depends on its context) and every weight trains."""
    from test_toolcalls import _model_dir

    d = tmp_path_factory.mktemp("caller")
    src = _model_dir(d, "qwen3")
    codec = TextCodec.load(src)
    V, ids = codec.tok.get_vocab_size(), codec.tok.token_to_id
    m = M.Transformer(M.ModelArgs(V, **{**M.TINY, "max_position_embeddings": 1024}, tie_word_embeddings=False,
                                  eos_token_id=codec.stop_ids[0]))
    M.init_weights(m, seed=0)
    logits = torch.zeros(V, V)  # [from, to], as far as the blocks leave them: the normed one-hot is ~sqrt(hidden)
    logits[ids("\n"), ids("<tool_call>")] = 6.0
    for c in LETTERS:
        logits[ids("\n"), ids(c)] = 4.0
        logits[ids(c), ids("<|im_end|>")] = 6.0
    logits[ids("<tool_call>"), ids("<|im_end|>")] = 6.0
    with torch.no_grad():
        m.model.embed_tokens.weight[:, :V] += 10 * torch.eye(V)
        m.lm_head.weight[:, :V] += logits.T / m.args.hidden_size ** 0.5
    hfdir.save(m, d / "caller", src)
    return d / "caller"


TOOL_PATHS = {  # name -> (extra flags, processes, the version that samples step s, logq tolerance, steps)
    "one_process": ([], 1, lambda s: s - 1, 1e-5, 2),
    **{p: (*PATHS[p], 3 if "async" in p else 2) for p in ("async", "torchrun", "inference_gpus", "lora", "vllm")}}


@pytest.mark.parametrize("path", [p if "vllm" not in p else pytest.param(p, marks=[pytest.mark.vllm, needs_vllm])
                                  for p in TOOL_PATHS])
def test_episodes_with_tools_are_exact_on_each_path(caller, tmp_path, path):
    """The guessing game with a tool (its schema in every first prompt and reply, every turn parsed
    for calls, each call answered with its result) on each path: every model token's logq is its
    version's full forward, and version 1 is not version 0 (the weights moved). Steps: enough for a
    token of version 1 (--async-level 1: step 3)."""
    extra, nproc, version_of, tol, steps = TOOL_PATHS[path]
    f = tmp_path / "guess_tools.py"
    f.write_text(GUESS_TOOLS)
    flags = [*FLAGS, "--model", str(caller), "--env", f"{f}:GuessWithTools", "--prompts-per-step", "2",
             "--steps", str(steps), *extra, "--out-dir", str(tmp_path / "run")]
    r = _launch(tmp_path, flags, nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [x["step"] for x in rows] == list(range(1, steps + 1)) and any(x["episode/turns"] > 1 for x in rows)
    assert all(x["tools/calls"] > 0 and x["tools/errors/parse"] > 0 for x in rows)  # malformed calls, answered
    response = TextCodec.load(caller).tok.token_to_id("<tool_response>")  # a result's turn inside a checked episode
    assert any(response in json.loads(x)["completion"] for x in (tmp_path / "dump.jsonl").read_text().splitlines())
    assert _check_tokens(tmp_path, version_of, tol, caller) > 40
    ids = torch.tensor(json.loads((tmp_path / "dump.jsonl").read_text().splitlines()[-1])["prompt"])
    pos, seg = torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)
    with torch.no_grad():
        a, b = (m(ids, pos, seg) @ m.head_weight.T for m in (_version(tmp_path, 0, caller), _version(tmp_path, 1, caller)))
    assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max() > 100 * tol


SLEEPY = """
import time
from agents.envs import GuessLetter
class Sleepy(GuessLetter):
    def step(self, text, ids):
        if self.secret < "i":
            time.sleep(3600)
        return super().step(text, ids)
"""


@pytest.mark.parametrize("extra,nproc", [(["--async-level", "1"], 1), ([], 2)], ids=["async", "torchrun"])
def test_a_hung_environment_is_counted_and_the_run_exits_cleanly(tmp_path, extra, nproc):
    f = tmp_path / "sleepy.py"
    f.write_text(SLEEPY)
    r = _launch(tmp_path, [*FLAGS, "--env", f"{f}:Sleepy", *extra, "--call-timeout", "0.5", "--out-dir", str(tmp_path / "run")], nproc, 200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step timed out" in r.stdout + r.stderr
    rows = _rows(tmp_path / "run")
    assert sum(x["episode/end/timeout"] for x in rows) > 0 and sum(x["skipped/env_error"] for x in rows) > 0
    assert (tmp_path / "run" / "final").exists()


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from agents import episodes as E
import rollout
import train
phases, real_phase, real_turn = [0], rollout.episode_phase, E._environment_turn
def episode_phase(*a):
    phases[0] += 1
    return real_phase(*a)
def environment_turn(pl, eps, turn):
    if phases[0] == 4 and turn == 1:  # step 4's episodes, mid-way (with a thread: after step 1's checkpoint)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_turn(pl, eps, turn)
rollout.episode_phase, E._environment_turn = episode_phase, environment_turn
train.main(sys.argv[1:])
"""


@pytest.mark.parametrize("extra", [[], ["--async-level", "1"]], ids=["sync", "async"])
def test_a_sigkill_mid_episode_then_resume(tmp_path, extra):
    """Synchronous: the resumed run's rows are the uninterrupted run's. --async-level 1: every step
    once, in order, the last checkpoint whole (a resume refills the pipeline from the checkpoint's
    weights, so its batches are valid but not the uninterrupted ones: AsyncRollouts.rng_after)."""
    flags = [*GAME, "--steps", "4", *extra]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), *flags, "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (out / "step_000004").exists()
    r = subprocess.run([sys.executable, "train.py", *flags, "--out-dir", str(out), "--resume"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(x["loss"]) and x["episode/turns"] >= 1 for x in rows)
    if not extra:
        clean = tmp_path / "clean"
        subprocess.run([sys.executable, "train.py", *flags, "--out-dir", str(clean)], check=True,
                       capture_output=True, timeout=300, cwd=ROOT)
        _same_rows_across_processes(rows, _rows(clean))


# Fields measured from the engine's log-probs against the trainer's: in two processes of one machine
# the CPU's sgemm may pick another kernel for another buffer alignment, so these float-noise
# measures (~1e-7) may differ in their last digits while every sampled token, loss and gradient
# agrees. A real divergence (other weights, another batch) moves them by orders of magnitude more.
SAMPLER_NOISE = ("mismatch/", "score_centering/support_mass")


def _same_rows_across_processes(rows, clean):
    assert len(rows) == len(clean)
    for got, want in zip(rows, clean):
        assert got.keys() == want.keys()
        for k in got:
            if k.startswith("time/"):
                continue
            if k.startswith(SAMPLER_NOISE):
                assert got[k] == pytest.approx(want[k], abs=1e-6), (got["step"], k)
            else:
                assert got[k] == want[k], (got["step"], k)
