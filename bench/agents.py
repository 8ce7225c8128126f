"""Does the model learn to use the environment's replies? The built-in multi-turn game, 3 seeds,
against its control.

`--env guess-letter` says "later"/"earlier" after each wrong guess; `--env guess-letter-blind`
says "no", which tells nothing of where the secret is (agents/envs.py). Both start from
checkpoints/guess-tiny (a short multi-turn SFT warm-up on bisection episodes, docs/models.md)
and train with the same flags. Printed: the held-out reward (the share of games won, 4 games
per held-out row) at step 0 and at the end, mean ± std over seeds, turns per episode, and the
wall time per run. Runs go one after another in this process (on 2 cores parallel runs would
only slow each other and corrupt the wall times).

    python bench/agents.py                            # 2 environments x 3 seeds (docs/experiments.md)
    python bench/agents.py --seeds 1 --steps 2 --out /tmp/agents   # smoke test
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiment import run_one  # noqa: E402  (train.main in this process, a finished run reused)

FLAGS = ("--task jsonl:examples/guess.jsonl --model checkpoints/guess-tiny --max-new-tokens 4 --max-turns 4 "
         "--prompts-per-step 16 --group-size 8 --eval-prompts 64")


def run(env: str, seed: int, steps: int, out: Path, extra: str) -> dict:
    """One run, or its saved result when a run with the same flags finished before (an interrupted
    bench picks up where it stopped)."""
    d = out / f"{env}-s{seed}"
    wall = run_one(shlex.split(f"{FLAGS} --env {env} --seed {seed} --steps {steps} --eval-every {steps} --out-dir {d} {extra}"),
                   d)["wall_s"]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    return {"start": evals[0]["eval/reward"], "end": evals[-1]["eval/reward"], "turns": evals[-1]["eval/turns"], "wall": wall}


def ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="runs/agents")
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = {}
    for env in ("guess-letter", "guess-letter-blind"):
        table[env] = [run(env, s, a.steps, out, a.extra) for s in range(a.seeds)]
    print(f"{FLAGS} --steps {a.steps} (--seed 0..{a.seeds - 1})\n")
    print("| --env | held-out reward, step 0 | at the end | per seed (end) | turns per episode (end) | wall per run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for env, rs in table.items():
        per = " / ".join(f"{r['end']:.3f}" for r in rs)
        print(f"| {env} | {ms([r['start'] for r in rs])} | {ms([r['end'] for r in rs])} | {per} | "
              f"{ms([r['turns'] for r in rs])} | {statistics.mean(r['wall'] for r in rs):.0f} s |")
    (out / "results.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
