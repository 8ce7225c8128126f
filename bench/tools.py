"""Does a tool raise the ceiling? The calculator against its two controls, 3 seeds.

The task: the sum of two numbers up to 999 (`python -m agents.envs calculator FILE`), scored by
`numeric_match` on the final answer turn. Three arms, one RL budget (the same steps, rows x
episodes and learning rate):
- A `--env calculator` on checkpoints/calc-tiny: `add` answers with the sum;
- B `--env calculator-off` on calc-tiny: the same prompt and schema, every call answered
  `error: the calculator is off` (only the information differs);
- C checkpoints/direct-tiny on the single-turn task: the same user turn, no tools, the sum in one turn.
calc-tiny and direct-tiny come from one starting directory (`python bench/tools.py scratch DIR`: a
tokenizer with the four hermes tags as single ids, a chat template that renders tools, random
weights) and one SFT budget, on the rows' `episode` and `completion` columns (docs/models.md).
Printed: held-out pass@1 at step 0 and at the end (mean ± std over seeds, and per seed), tokens per
episode, the tool calls and each error kind's share over training, and the wall time per run. Runs
go one after another in this process (on 2 cores parallel runs would only slow each other).

    python bench/tools.py                             # 3 arms x 3 seeds (docs/experiments.md)
    python bench/tools.py --seeds 1 --steps 2 --out /tmp/tools    # smoke test
    python bench/tools.py rows                        # examples/calc.jsonl and calc-direct.jsonl
    python bench/tools.py scratch runs/calc-scratch   # the starting directory of both checkpoints
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

from agents import envs  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.task import PRINTABLE  # noqa: E402
from experiment import run_one  # noqa: E402  (train.main in this process, a finished run reused)
from tasks.textcodec import CHATML_TOOLS, TOOL_TAGS  # noqa: E402

ROWS = "examples/calc.jsonl"  # the tool arms' rows; the direct arm's are the same rows without `episode`
DIRECT = "examples/calc-direct.jsonl"
FLAGS = ("--reward numeric_match --max-new-tokens 64 --prompts-per-step 16 --group-size 8 "
         "--lr 5e-4 --eval-prompts 128")
ARMS = {"A calculator": f"--task jsonl:{ROWS} --model checkpoints/calc-tiny --env calculator --max-turns 3",
        "B calculator-off": f"--task jsonl:{ROWS} --model checkpoints/calc-tiny --env calculator-off --max-turns 3",
        "C direct": f"--task jsonl:{DIRECT} --model checkpoints/direct-tiny"}
SHOWN = ("tools/calls", "tools/errors/parse", "tools/errors/args", "tools/errors/unknown", "tools/errors/limit")


def scratch(out: str, seed: int = 0) -> None:
    """calc-tiny's and direct-tiny's starting directory: every printable ASCII character (digits, the
    JSON characters, and what the prompts and error lines need), the hermes tags, the tool template."""
    hfdir.write_tiny(out, PRINTABLE, CHATML_TOOLS, TOOL_TAGS, seed)


def rows() -> None:
    """examples/calc.jsonl (`python -m agents.envs calculator`, seed 0) and calc-direct.jsonl, the same rows in
    the same order without the `episode` column: an SFT row with one trains on it, not on its
    `completion`. The same order holds out the same rows (--eval-prompts picks rows by index)."""
    envs.write_rows("calculator", str(ROOT / ROWS))
    with open(ROOT / ROWS) as f, open(ROOT / DIRECT, "w") as out:
        out.writelines(json.dumps({k: v for k, v in json.loads(x).items() if k != "episode"}) + "\n" for x in f)


def windows(rows: list[dict], key: str, parts: int = 3) -> list[float | None]:
    """A training metric's mean over the first, middle and last third of the steps (None: not logged)."""
    xs = [r[key] for r in rows if key in r]
    if not xs:
        return [None] * parts
    cut = [len(xs) * i // parts for i in range(parts + 1)]
    return [statistics.mean(xs[a:max(b, a + 1)]) for a, b in zip(cut, cut[1:])]


def run(arm: str, seed: int, steps: int, out: Path, extra: str) -> dict:
    """One run, or its saved result when a run with the same flags finished before (an interrupted
    bench picks up where it stopped)."""
    d = out / f"{arm.split()[0]}-s{seed}"
    wall = run_one(shlex.split(f"{FLAGS} {ARMS[arm]} --seed {seed} --steps {steps} --eval-every {steps} --out-dir {d} {extra}"),
                   d)["wall_s"]
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    evals, steps_rows = [r for r in rows if "eval/pass@1" in r], [r for r in rows if "length" in r]
    return {"start": evals[0]["eval/pass@1"], "end": evals[-1]["eval/pass@1"],
            "tokens": statistics.mean(r["length"] for r in steps_rows),  # after the first prompt: turns and replies
            "steps": len(steps_rows), "wall": wall, **{k: windows(steps_rows, k) for k in SHOWN}}


def ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def thirds(rs: list[dict], key: str) -> str:
    """A metric's three windows, each the mean over seeds: "first → middle → last"."""
    if rs[0][key][0] is None:
        return "-"
    return " → ".join(f"{statistics.mean(r[key][i] for r in rs):.2f}" for i in range(3))


def table(results: dict[str, list[dict]], steps: int) -> str:
    lines = [f"{FLAGS} --steps {steps} --eval-every {steps} (--seed 0..{len(next(iter(results.values()))) - 1})", ""]
    for arm, extra in ARMS.items():
        lines.append(f"    {arm}: {extra}")
    head = ("| arm | pass@1, step 0 | at the end | per seed (end) | gain (end − start) | tokens per episode after the prompt "
            "| steps | wall per run |")
    lines += ["", head, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, rs in results.items():
        per = " / ".join(f"{r['end']:.3f}" for r in rs)
        tokens = f"{statistics.mean(r['tokens'] for r in rs):.0f}"
        walls = " / ".join(f"{r['wall']:.0f}" for r in rs)
        lines.append(f"| {arm} | {ms([r['start'] for r in rs])} | {ms([r['end'] for r in rs])} | {per} | "
                     f"{ms([r['end'] - r['start'] for r in rs])} | {tokens} | {rs[0]['steps']} | {walls} s |")
    lines += ["", "Over training (mean per third of the steps, first → middle → last, over seeds):", "",
              "| arm | " + " | ".join(SHOWN) + " |", "| --- |" + " --- |" * len(SHOWN)]
    for arm, rs in results.items():
        lines.append(f"| {arm} | " + " | ".join(thirds(rs, k) for k in SHOWN) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["scratch"]:
        if len(sys.argv) != 3:
            print("bench/tools.py: usage: python bench/tools.py scratch DIR", file=sys.stderr)
            raise SystemExit(2)
        scratch(sys.argv[2])
        return
    if sys.argv[1:] == ["rows"]:
        rows()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/tools")
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (ROOT / DIRECT).is_file():
        rows()
    results = {arm: [] for arm in ARMS}
    for s in range(a.seeds):  # seed by seed: an interrupted bench has every arm at the seeds it finished
        for arm in ARMS:
            results[arm].append(run(arm, s, a.steps, out, a.extra))
    print(table(results, a.steps))
    (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
