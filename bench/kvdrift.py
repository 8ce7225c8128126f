"""The KV drift of a partial rollout: a push mid-decode keeps the keys and values the old weights
wrote (engines/pipeline.py, --max-staleness). How far does that move what the engine samples
from, against the weights that drew each token?

    python bench/kvdrift.py                  # trains 18 steps of the main job, then three lags: ~1 min on 2 cores
    python bench/kvdrift.py --lags 1 --prompts 4 --train-steps 2 --out runs/kvdrift-smoke --png ""   # smoke test

1. The weights: the README's main job from the shipped reverse-tiny, saved every step
   (`<out>/train/step_<k>`); version A is step --from, version B is step --from + lag, for each
   of --lags (optimizer steps apart: a stale sampler's lag).
2. The spanning rollout: the built-in engine (bf16, the default) holds A; --prompts prompts x
   --group samples from the reverse-text task; B is pushed between two decode steps, before token
   --push-at (0-based) of every row (TorchEngine.between, as the pipeline's push lands), so the
   tokens from there on are drawn by B on top of a cache A wrote.
3. The controls, with the same seed: the same push with --recompute-kv-on-push (each in-flight row
   prefilled again under B), the engine holding B from the start (no push), and A alone.
4. Per token, |log p_v(x_t) - log q(x_t)|: q the engine's log-prob of the token it drew, p_v the
   fp32 full forward (no cache) of the version v that drew it, the trainer's view of that version.
   Before the push both hold only the engine's precision mismatch (bf16 against fp32); after it,
   the spanning rows add the drift of the old keys and values. The table gives the mean before and
   after the push point in each; the figure the mean by position. For scale, the lag's own change:
   |log p_A - log p_B| on the spanning rows' tokens after the push (what a stale token's ratio
   carries).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.experiment import run_one  # noqa: E402
from engines.torch_engine import Sampling, TorchEngine  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.task import ReverseText  # noqa: E402
from tasks.textcodec import TextCodec  # noqa: E402

MAIN = ["--loss", "icepop", "--icepop-beta", "2.0"]  # the README's main job


def logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The fp32 full forward's log-prob of each completion token (temperature 1, untruncated)."""
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        h = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        lp = (h @ model.head_weight.T).double().log_softmax(-1)
    at = torch.arange(len(prompt) - 1, len(ids) - 1)
    return lp[at, torch.tensor(completion)]


def gaps(out, prompts: list[list[int]], group: int, models: dict) -> list[list[float]]:
    """Per completion, per token: |log p_v - log q| with v the version that drew the token."""
    rows = []
    for i, c in enumerate(out):
        by_version = {v: logp(models[v], prompts[i // group], c.ids) for v in set(c.versions)}
        rows.append([abs(by_version[v][t].item() - q) for t, (v, q) in enumerate(zip(c.versions, c.logq))])
    return rows


def rollout(weights: list, prompts, group: int, s: Sampling, stops, push_at: int, recompute: bool = False):
    """weights[0] sampled from the start; weights[1], when given, pushed before token push_at of every row
    (recompute: the rows' cache prefilled again under it, --recompute-kv-on-push)."""
    engine = TorchEngine(weights[0], "bf16", stops, seed=0, recompute_kv=recompute)
    if len(weights) > 1:
        calls = [0]

        def between():  # called before the logits of token calls[0] (the first: before token 1)
            calls[0] += 1
            if calls[0] == push_at:
                engine.load_weights(weights[1], version=1)
        engine.between = between
    return engine.generate(prompts, group, s)


def split(rows: list[list[float]], at: int) -> tuple[list[float], list[float]]:
    return [x for r in rows for x in r[:at]], [x for r in rows for x in r[at:]]


def mean(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2e}" if xs else "-"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/kvdrift")
    ap.add_argument("--train-steps", type=int, default=18)
    ap.add_argument("--from", dest="start", type=int, default=2, help="version A: this step's checkpoint")
    ap.add_argument("--lags", default="1,4,16", help="version B is --from + lag, for each")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--push-at", type=int, default=6, help="the first token B draws (0-based)")
    ap.add_argument("--png", default="docs/kvdrift.png")
    a = ap.parse_args(argv)
    lags = [int(x) for x in a.lags.split(",")]
    if a.push_at < 1:
        ap.error(f"--push-at must be >= 1 (token 0 comes from the prefill, before any decode step), got {a.push_at}")
    if a.start < 1 or a.start + max(lags) > a.train_steps:
        ap.error(f"--from {a.start} + the largest lag {max(lags)} must be a saved step in 1..--train-steps {a.train_steps}")
    out = Path(a.out)
    run_one([*MAIN, "--steps", str(a.train_steps), "--save-every", "1", "--eval-every", "0",
             "--out-dir", str(out / "train")], out / "train")
    load = lambda k: hfdir.load(out / "train" / f"step_{k:06d}")  # noqa: E731
    codec = TextCodec.load(out / "train" / f"step_{a.start:06d}")
    prompts = [p.ids for p in ReverseText(codec).sample(a.prompts, random.Random(0))]
    s = Sampling(max_new_tokens=24, seed=1)
    A = load(a.start)
    lines = ["| lag (steps) | rows spanning | spanning: before the push | spanning: after | recomputed: after | "
             "B alone: before | B alone: after | A alone: after | the lag's own change, after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    curves = {}
    alone_a = gaps(rollout([A], prompts, a.group, s, codec.stop_ids, 0), prompts, a.group, {0: A})
    for lag in lags:
        B = load(a.start + lag)
        spans = rollout([A, B], prompts, a.group, s, codec.stop_ids, a.push_at)
        span = gaps(spans, prompts, a.group, {0: A, 1: B})
        redone = gaps(rollout([A, B], prompts, a.group, s, codec.stop_ids, a.push_at, recompute=True), prompts, a.group,
                      {0: A, 1: B})
        alone_b = gaps(rollout([B], prompts, a.group, s, codec.stop_ids, 0), prompts, a.group, {0: B})
        n = sum(len(c.ids) > a.push_at for c in spans)
        (sb, sa), (bb, ba), (_, aa) = split(span, a.push_at), split(alone_b, a.push_at), split(alone_a, a.push_at)
        ra = split(redone, a.push_at)[1]
        change = [abs(x) for i, c in enumerate(spans) if len(c.ids) > a.push_at
                  for x in (logp(A, prompts[i // a.group], c.ids) - logp(B, prompts[i // a.group], c.ids))[a.push_at:].tolist()]
        lines.append(f"| {lag} | {n} of {len(spans)} | {mean(sb)} | {mean(sa)} | {mean(ra)} | {mean(bb)} | {mean(ba)} | {mean(aa)} "
                     f"| {mean(change)} |")
        curves[lag] = (span, redone, alone_b)
    text = "\n".join(lines)
    print(f"# {datetime.date.today()}: |log p_v - log q| per token, mean; A = step {a.start}, push before token "
          f"{a.push_at}; {a.prompts} prompts x {a.group}\n{text}")
    if a.png:
        figure(curves, alone_a, a.push_at, a.png)
    return text


def figure(curves: dict, alone_a, push_at: int, png: str) -> None:
    from matplotlib.figure import Figure

    def by_position(rows):
        T = max(map(len, rows))
        return [statistics.fmean(r[t] for r in rows if len(r) > t) for t in range(T)]
    fig = Figure(figsize=(4 * len(curves), 3.2))
    axes = fig.subplots(1, len(curves), sharey=True, squeeze=False)[0]
    for ax, (lag, (span, redone, alone_b)) in zip(axes, curves.items()):
        ax.plot(by_position(span), label="A, then B pushed (spanning)")
        ax.plot(by_position(redone), label="the same, --recompute-kv-on-push", linestyle=":")
        ax.plot(by_position(alone_b), label="B alone")
        ax.plot(by_position(alone_a), label="A alone", alpha=0.6)
        ax.axvline(push_at - 0.5, color="gray", linestyle="--")
        ax.set_title(f"B = A + {lag} step{'s' * (lag > 1)}")
        ax.set_xlabel("completion token")
        ax.set_yscale("log")
    axes[0].set_ylabel("mean |log p_v - log q|")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"# figure: {png}")


if __name__ == "__main__":
    main()
