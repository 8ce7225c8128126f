"""floe beside Hugging Face TRL's GRPOTrainer on the same CPU work: seconds per RL step, its
rollout and train parts, peak memory, and (with --learn) the held-out reward each reaches in
the same wall time.

    python bench/peers.py --trl-python VENV/bin/python                 # timing: ~5-10 min on 2 quiet cores
    python bench/peers.py --trl-python VENV/bin/python --learn --out runs/peers.md   # + learning: ~20 min more
    python bench/peers.py --trl-python VENV/bin/python --shapes 4x4 --steps 2 --rounds 1   # smoke test: ~30 s
    python bench/peers.py --trl-python VENV/bin/python --compiled --shapes 8x4 16x8 32x16 64x16   # each at its best

(The times are estimates from smoke runs on shared cores, most of them TRL's steps and its
start-up per run; the measured figures: docs/experiments.md "2026-12-01: floe beside TRL's
GRPOTrainer on the same CPU work".)

TRL is an optional bench dependency: `--trl-python` (default: this interpreter) must import
trl (tested with 1.16.0: `pip install trl==1.16.0` in a venv made with
--system-site-packages, so it shares floe's torch and transformers); without it the script
says so in one line and exits 0 having run nothing. floe runs with this interpreter.

The same work on both sides:
- the model: checkpoints/reverse-tiny (a Qwen3-shaped HF directory), fp32; TRL loads it
  with AutoModelForCausalLM and AutoTokenizer (its logits equal floe's to 0.0 on a prompt);
- the prompts: floe's reverse-text task, `task.sample(P * steps, random.Random(seed))`, in
  the order floe draws them (a datasets.Dataset of the chat messages, TRL's shuffle off), so
  step k of both sees the same P prompts; TRL's chat-template ids are checked against
  floe's rendered ids before a step runs;
- the reward: floe's own scorer (`task.score`, difflib's ratio to the reversed text) on
  TRL's completion ids, cut at the first stop id as floe cuts them;
- the batch: P prompts x G completions per optimizer step (`--shapes PxG`; floe's default
  32x16, and 16x8), 24 new tokens at most, temperature 1, both stop ids [2, 0];
- the optimizer: AdamW lr 5e-4, betas (0.9, 0.99), no weight decay, a 5-step linear warm-up
  then constant (floe's train.optimizer_step; TRL gets the same LambdaLR), grad clip 1.0,
  one optimizer step per batch (TRL: num_iterations 1, steps_per_generation =
  gradient_accumulation_steps, so one step consumes the whole generation batch);
- advantages r - mean(group), no std division (TRL scale_rewards="none"), no KL (beta 0);
- fp32 (TRL bf16=False), no gradient checkpointing (TRL's default is on), no compile (--compiled: each
  side also compiled, floe's --compile on beside TRL's torch_compile, and the ratio at each one's best),
  no vLLM, no eval, no checkpoint while timed, torch's default CPU threads (--threads N).

What could not be made equal is in DIFFERENT below; the script prints it under the tables.

Timing: the two trainers alternate in short runs (--rounds x, per shape: floe, TRL, floe,
TRL, --steps each), every run in a fresh subprocess and a fresh temporary directory. Per
step: floe's metrics.jsonl (time/step, time/rollout); TRL's wall time between consecutive
on_step_end callbacks, with its rollout (`_generate_and_score_completions`: generate, decode,
reward, advantages) and its `model.generate` calls timed by wrappers. train = step - rollout
on both sides (backward, optimizer step, weight push, logging). The table shows medians over
steps --skip+1.. of every run, pooled over rounds; peak RSS is each child's high-water mark
(os.wait4's ru_maxrss), the largest over its runs.

Learning (--learn): per seed, floe's default 80-step job (`python train.py --seed S`), then
TRL for floe's summed time/step (its loop without the held-out evals and start-up; TRL stops
at the step end nearest that budget, so it is off by under half a step), saved with
save_pretrained and floe's tokenizer files beside it. Both final models (and the start model)
are then scored by floe's own evaluator (rollout.evaluate: the 64 held-out prompts, 4 samples
each, sampling seed S + 1, floe's bf16 engine), so the number is the one floe logs as
eval/reward; floe's own logged final eval is checked against the re-scored one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from config import Config  # noqa: E402  (floe's modules: the task, the defaults, the evaluator)
from tasks.textcodec import TextCodec  # noqa: E402
from tasks.task import build  # noqa: E402

MODEL = ROOT / "checkpoints" / "reverse-tiny"
FLOE = Config().resolve(cuda_available=False)  # floe's defaults: lr, max_new_tokens, temperature, ...
WARMUP, BETAS = 5, (0.9, 0.99)  # hard-coded in train.optimizer_step and train.build
ID_CHECKS = 512  # prompts whose TRL ids are compared with floe's

DIFFERENT = [
    f"loss: floe's default --loss {FLOE.loss} (tokens whose p/q leaves [{FLOE.icepop_alpha}, {FLOE.icepop_beta}] are "
    f"masked, and each token's score is centered over K={FLOE.score_centering_k} sampler draws; floe has no switch "
    "for the centering, --loss reinforce keeps it) against TRL's loss_type='dapo', which with num_iterations=1 is "
    "the plain policy gradient (ratio 1, the clip never acts); both divide by the batch's token count",
    f"sampler: floe samples from a {FLOE.engine_dtype} copy of the weights with its own engine (one prefill per "
    "prompt, the KV cache copied for the group, one batched decode) and trains the fp32 weights; TRL samples the "
    "fp32 policy itself with transformers' generate (each prompt repeated G times, left-padded)",
    f"micro-batches: floe packs the batch into {FLOE.micro_batch_tokens}-token micro-batches (no padding between "
    "sequences); TRL pads each micro-batch (--trl-micro-batch completions, default the whole batch: "
    "gradient_accumulation_steps 1) to its longest prompt and completion",
    "random streams: the prompts are the same, step by step; the sampled completions are not (each side has its "
    "own generator)",
    "step time: floe's time/step is its loop body (log writing excluded); TRL's runs from one on_step_end to the "
    "next (its logging and dataloader included); the first --skip steps of each run are left out of the medians",
    "memory: TRL's process also imports datasets, pandas, pyarrow and accelerate",
    "learning: TRL trains for floe's summed time/step, stopping at the step end nearest it (under half a step "
    "off; the table shows both times); "
    "both are scored by floe's evaluator, which samples from a bf16 copy of the weights",
    "precision of the advantages: float64 in floe, float32 in TRL",
]


# ----------------------------------------------------------------------------- children

def run_child(cmd: list[str], log: Path, threads: int) -> tuple[float, float]:
    """Run cmd from the repo root, its output to log; (wall s, peak RSS MiB). A failure stops
    the bench with the log's tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN is a max over all)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        sys.exit(f"peers: `{shlex.join(cmd)}` exited {p.returncode}; the end of {log}:\n{tail}")
    return wall, usage.ru_maxrss / 1024  # KiB on Linux


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def floe_run(shape: tuple[int, int], steps: int, seed: int, out: Path, threads: int, extra: list[str]) -> dict:
    """`python train.py` for `steps` steps without eval; its per-step times from metrics.jsonl."""
    p, g = shape
    cmd = [sys.executable, "train.py", "--steps", str(steps), "--eval-every", "0", "--seed", str(seed),
           "--prompts-per-step", str(p), "--group-size", str(g), "--out-dir", str(out), *extra]
    wall, rss = run_child(cmd, out.with_suffix(".log"), threads)
    rows = [r for r in read_rows(out / "metrics.jsonl") if "time/step" in r]
    return {"rows": [{"step": r["step"], "time/step": r["time/step"], "time/rollout": r["time/rollout"],
                      "reward": r["reward"]} for r in rows], "rss": rss, "wall": wall}


def trl_run(python: str, spec: dict, threads: int) -> dict:
    """This file under --trl-python in child mode (trl_child below); its rows and result.json."""
    out = Path(spec["out"])
    out.mkdir(parents=True)
    wall, rss = run_child([python, str(Path(__file__).resolve()), "--trl-child", json.dumps(spec)],
                          out.with_suffix(".log"), threads)
    result = json.loads((out / "result.json").read_text())
    if not result["lr_as_floe"]:
        print(f"warning: TRL's logged learning rates in {out} do not follow floe's schedule", flush=True)
    return {**result, "rows": read_rows(out / "steps.jsonl"), "rss": rss, "wall": wall}


def trl_version(python: str) -> str | None:
    """trl's version under `python`, or None when it does not import there."""
    probe = ("import trl, datasets, transformers, torch; "
             "print(trl.__version__, transformers.__version__, torch.__version__)")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


# ----------------------------------------------------------------------------- the TRL side (child mode)

def trl_child(spec: dict) -> None:
    """One GRPOTrainer run on floe's prompts and reward; writes steps.jsonl and result.json in spec["out"].
    Runs under --trl-python; trl and its dependencies are imported here only."""
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(spec["out"])
    tok = AutoTokenizer.from_pretrained(MODEL)
    dataset, reward, checked = floe_prompts(spec, tok)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    clock = step_clock(spec.get("budget_s"))
    trainer = timed_trainer(trl.GRPOTrainer, clock)(
        model=model, reward_funcs=reward, args=grpo_config(spec), train_dataset=dataset, processing_class=tok,
        callbacks=[clock], optimizers=floe_optimizer(model))
    time_generate(trainer.model, clock.timer)
    trainer.train()
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clock.rows))
    if spec.get("save"):
        save_for_floe(trainer.model, Path(spec["save"]))
    lr_ok = all(math.isclose(r["lr"], FLOE.lr * min(1.0, r["step"] / WARMUP), rel_tol=1e-6)
                for r in clock.rows if "lr" in r)
    (out / "result.json").write_text(json.dumps({
        "steps_done": len(clock.rows), "ids_checked": checked, "lr_as_floe": lr_ok, "trl": trl.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__}))


def floe_prompts(spec: dict, tok):
    """floe's draws for the whole run, in floe's order, as a datasets.Dataset of chat messages (their
    ids checked against floe's), and floe's scorer as a TRL reward function."""
    from datasets import Dataset

    task = build(Config(), TextCodec.load(MODEL))
    drawn = task.sample(spec["prompts"] * spec["steps"], random.Random(spec["seed"]))
    checked = check_ids(tok, drawn[:ID_CHECKS])

    def floe_reward(prompts, completions, completion_ids, floe_index, **kwargs) -> list[float]:
        """task.score on TRL's completion ids (the stop token included: floe's decode cuts there)."""
        return task.score([drawn[i] for i in floe_index], completion_ids, spec["group"])

    rows = [{"prompt": p.prompt, "floe_index": i} for i, p in enumerate(drawn)]
    return Dataset.from_list(rows), floe_reward, checked


def grpo_config(spec: dict):
    """GRPOConfig for floe's batch and settings: one optimizer step per P x G generation batch."""
    from trl import GRPOConfig

    batch = spec["prompts"] * spec["group"]
    micro = spec["micro_batch"] or batch
    if batch % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide the batch of {batch} completions")
    return GRPOConfig(
        output_dir=str(Path(spec["out"]) / "trainer"), seed=spec["seed"], max_steps=spec["steps"], use_cpu=True,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,  # steps_per_generation: the same
        num_generations=spec["group"], max_completion_length=FLOE.max_new_tokens, temperature=FLOE.temperature,
        top_p=1.0, top_k=0, num_iterations=1, beta=0.0, loss_type="dapo", scale_rewards="none",
        learning_rate=FLOE.lr, max_grad_norm=FLOE.grad_clip,  # the optimizer itself: floe_optimizer
        bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False,  # TRL's defaults: bf16, checkpointing on
        torch_compile=bool(spec.get("compile")),  # --compiled: transformers' Trainer compiles the model it trains
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)


def floe_optimizer(model):
    """train.build's AdamW and train.optimizer_step's schedule: step k (1-based) at lr * min(1, k / 5). HF's
    scheduler steps after the optimizer, so step k reads the lambda at k - 1 (transformers'
    constant_with_warmup would run step 1 at lr 0)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=FLOE.lr, betas=BETAS, weight_decay=FLOE.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))


def check_ids(tok, prompts: list) -> int:
    """TRL renders a chat prompt with tokenizer.apply_chat_template: it must give floe's ids."""
    rendered = tok.apply_chat_template([p.prompt for p in prompts], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    for p, ids in zip(prompts, rendered):
        if list(ids) != p.ids:
            raise SystemExit(f"TRL's prompt ids differ from floe's for {p.prompt}: {list(ids)} vs {p.ids}")
    return len(prompts)


def step_clock(budget_s: float | None):
    """A TrainerCallback recording each optimizer step's wall time and its timed parts; with a
    budget it stops at the step end nearest budget_s seconds of training (the next step is
    taken to last as long as this one)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.rows, self.timer = [], {"rollout": 0.0, "generate": 0.0}

        def on_train_begin(self, args, state, control, **kwargs):
            self.t_begin = self.t_last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step = now - self.t_last
            self.rows.append({"step": state.global_step, "time/step": step, "time/rollout": self.timer["rollout"],
                              "time/generate": self.timer["generate"]})
            self.t_last, self.timer["rollout"], self.timer["generate"] = now, 0.0, 0.0
            if budget_s is not None and now - self.t_begin + step / 2 >= budget_s:
                control.should_training_stop = True  # this step end is nearer the budget than the next one

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.rows:
                self.rows[-1].update(reward=logs["reward"], lr=logs["learning_rate"])

    return StepClock()


def timed_trainer(base, clock):
    """GRPOTrainer with its rollout (generate, decode, reward, advantages) timed into clock.timer."""

    class TimedGRPOTrainer(base):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                clock.timer["rollout"] += time.perf_counter() - t0

    return TimedGRPOTrainer


def time_generate(model, timer: dict) -> None:
    """Wrap the model's own generate (what TRL calls without vLLM) to add its time to timer."""
    generate = model.generate

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            timer["generate"] += time.perf_counter() - t0

    model.generate = timed


def save_for_floe(model, path: Path) -> None:
    """save_pretrained, then the start model's tokenizer and generation files over what transformers wrote."""
    model.save_pretrained(path)
    for f in MODEL.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)


# ----------------------------------------------------------------------------- timing

def step_stats(runs: list[dict], skip: int) -> dict:
    """Medians over the steps after `skip` of every run, pooled (all steps when a run is shorter)."""
    rows = [r for run in runs for r in (run["rows"][skip:] or run["rows"])]
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"step": med("time/step"), "rollout": med("time/rollout"),
           "train": statistics.median(r["time/step"] - r["time/rollout"] for r in rows),
           "rss": max(run["rss"] for run in runs), "n": len(rows)}
    if all("time/generate" in r for r in rows):  # TRL's rows
        out["generate"] = med("time/generate")
    return out


def timing(a, tmp: Path) -> list[tuple[tuple[int, int], dict]]:
    """Per shape: floe and TRL alternating, --rounds times each (--compiled: each also compiled, floe's
    --compile on and TRL's torch_compile, in the same rounds); the pooled stats of each side."""
    sides = ("floe", "trl", "floe compiled", "trl compiled") if a.compiled else ("floe", "trl")
    runs = {(s, side): [] for s in a.shapes for side in sides}
    for rnd in range(1, a.rounds + 1):
        for shape in a.shapes:
            for side in sides:
                name = f"{shape[0]}x{shape[1]}-r{rnd}{'-compiled' if 'compiled' in side else ''}"
                if side.startswith("floe"):
                    compile_on = ["--compile", "on"] if "compiled" in side else []
                    run = floe_run(shape, a.steps, a.seed, tmp / f"floe-{name}", a.threads,
                                   shlex.split(a.floe_args) + compile_on)
                else:
                    spec = {"prompts": shape[0], "group": shape[1], "steps": a.steps, "seed": a.seed,
                            "out": str(tmp / f"trl-{name}"), "micro_batch": a.trl_micro_batch, "compile": "compiled" in side}
                    run = trl_run(a.trl_python, spec, a.threads)
                runs[shape, side].append(run)
                progress(f"{side} {name}", run)
    return [(s, {side: step_stats(runs[s, side], a.skip) for side in sides}) for s in a.shapes]


def progress(name: str, run: dict) -> None:
    steps = [r["time/step"] for r in run["rows"]]
    rewards = [r["reward"] for r in run["rows"] if "reward" in r]
    reward = f", train reward {statistics.fmean(rewards):.3f}" if rewards else ""
    print(f"{name}: {len(steps)} steps, median {statistics.median(steps):.2f} s/step{reward}, "
          f"peak RSS {run['rss']:.0f} MiB, {run['wall']:.0f} s in all", flush=True)


def timing_table(results, skip: int) -> str:
    lines = ["| prompts × group | floe s/step | TRL s/step | TRL / floe | floe rollout | floe train | TRL rollout "
             "| TRL generate | TRL train | floe peak RSS | TRL peak RSS |", "|" + " --- |" * 11]
    for (p, g), sides in results:
        f, t = sides["floe"], sides["trl"]
        lines.append(f"| {p} × {g} | {f['step']:.2f} | {t['step']:.2f} | {t['step'] / f['step']:.2f} "
                     f"| {f['rollout']:.2f} | {f['train']:.2f} | {t['rollout']:.2f} | {t['generate']:.2f} "
                     f"| {t['train']:.2f} | {f['rss']:.0f} MiB | {t['rss']:.0f} MiB |")
    n = ", ".join(f"{p}×{g}: {sides['floe']['n']} floe / {sides['trl']['n']} TRL steps" for (p, g), sides in results)
    text = ("\n".join(lines) + f"\n\nSeconds: medians over steps {skip + 1}.. of every run (all of a run no "
            f"longer than {skip} steps), pooled over rounds ({n}); train = step − rollout; TRL generate is the "
            "model.generate part of TRL rollout.")
    if "floe compiled" in results[0][1]:
        text += "\n\n" + best_table(results)
    return text


def best_table(results) -> str:
    """--compiled: each side eager and compiled (compile time excluded: steps --skip+1 on), and TRL / floe at
    each side's best."""
    lines = ["| prompts × group | floe eager | floe compiled | TRL eager | TRL torch_compile | TRL best / floe best "
             "| floe compiled rollout, train | TRL compiled peak RSS |", "|" + " --- |" * 8]
    for (p, g), sides in results:
        fb = min(sides["floe"]["step"], sides["floe compiled"]["step"])
        tb = min(sides["trl"]["step"], sides["trl compiled"]["step"])
        fc = sides["floe compiled"]
        lines.append(f"| {p} × {g} | {sides['floe']['step']:.3f} | {fc['step']:.3f} | {sides['trl']['step']:.3f} "
                     f"| {sides['trl compiled']['step']:.3f} | {tb / fb:.2f} | {fc['rollout']:.3f}, {fc['train']:.3f} "
                     f"| {sides['trl compiled']['rss']:.0f} MiB |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- learning

def evaluate_dir(model_dir: Path, seed: int) -> float:
    """floe's own held-out eval of a HF directory (rollout.evaluate at floe's defaults, seed + 1 sampling)."""
    from run import hfdir
    import rollout
    from engines.vllm_engine import make_engine

    cfg = Config(seed=seed, model=str(model_dir)).resolve(cuda_available=False)
    codec = TextCodec.load(model_dir)
    task = build(cfg, codec)
    m = hfdir.load(model_dir)
    task.fit_eval_set(cfg.max_new_tokens, m.args.max_position_embeddings)
    engine = make_engine(cfg, m, model_dir, codec.stop_ids, cfg.seed)
    return rollout.evaluate(cfg, task, engine)["eval/reward"]


def learn_seed(a, seed: int, tmp: Path) -> dict:
    """floe's default job, then TRL for floe's training time; both final models scored by floe."""
    out = tmp / f"learn-floe-s{seed}"
    extra = ["--steps", str(a.learn_steps)] if a.learn_steps else []
    job, _ = run_child([sys.executable, "train.py", "--seed", str(seed), "--out-dir", str(out), *extra,
                        *shlex.split(a.floe_args)], out.with_suffix(".log"), a.threads)
    rows = read_rows(out / "metrics.jsonl")
    budget = sum(r["time/step"] for r in rows if "time/step" in r)
    floe_steps = max(r["step"] for r in rows)
    logged = [r["eval/reward"] for r in rows if "eval/reward" in r][-1]
    cap = (a.learn_steps or FLOE.steps) * 10  # TRL's dataset (and max_steps): ten times floe's steps
    spec = {"prompts": FLOE.prompts_per_step, "group": FLOE.group_size, "steps": cap, "seed": seed,
            "out": str(tmp / f"learn-trl-s{seed}"), "micro_batch": a.trl_micro_batch, "budget_s": budget,
            "save": str(tmp / f"learn-trl-s{seed}-final")}
    trl = trl_run(a.trl_python, spec, a.threads)
    res = {"seed": seed, "floe_steps": floe_steps, "floe_s": budget,
           "trl_steps": trl["steps_done"], "trl_s": sum(r["time/step"] for r in trl["rows"]),
           "start": evaluate_dir(MODEL, seed), "floe": evaluate_dir(out / "final", seed),
           "trl": evaluate_dir(Path(spec["save"]), seed), "floe_logged": logged}
    if trl["steps_done"] >= cap:
        print(f"note: seed {seed}: TRL reached its cap of {cap} steps before the time budget", flush=True)
    print(f"learn seed {seed}: floe {floe_steps} steps in {budget:.0f} s ({job:.0f} s with its evals and start-up) "
          f"-> eval {res['floe']:.3f} (its log: {logged:.3f}); TRL {res['trl_steps']} steps in {res['trl_s']:.0f} s "
          f"-> eval {res['trl']:.3f}; start {res['start']:.3f}", flush=True)
    return res


def mean_std(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def learn_table(results: list[dict]) -> str:
    lines = ["| seed | floe steps | floe train s | TRL steps | TRL train s | eval reward, start | floe final "
             "| TRL final |", "|" + " --- |" * 8]
    for r in results:
        lines.append(f"| {r['seed']} | {r['floe_steps']} | {r['floe_s']:.0f} | {r['trl_steps']} | {r['trl_s']:.0f} "
                     f"| {r['start']:.3f} | {r['floe']:.3f} | {r['trl']:.3f} |")
    col = lambda k: [r[k] for r in results]  # noqa: E731
    lines.append(f"| mean ± std | {statistics.fmean(col('floe_steps')):.0f} | {statistics.fmean(col('floe_s')):.0f} "
                 f"| {statistics.fmean(col('trl_steps')):.0f} | {statistics.fmean(col('trl_s')):.0f} "
                 f"| {mean_std(col('start'))} | {mean_std(col('floe'))} | {mean_std(col('trl'))} |")
    same = all(abs(r["floe"] - r["floe_logged"]) < 1e-9 for r in results)
    return ("\n".join(lines) + "\n\nEval reward: floe's evaluator on each final model (64 held-out prompts × 4 "
            "samples, sampling seed + 1; std over seeds, n − 1). floe's re-scored final eval "
            + ("equals" if same else "DIFFERS from") + " the eval/reward its run logged.")


# ----------------------------------------------------------------------------- main

def shape(s: str) -> tuple[int, int]:
    p, _, g = s.partition("x")
    if not (p.isdigit() and g.isdigit() and int(p) >= 1 and int(g) >= 2):
        raise argparse.ArgumentTypeError(f"{s!r}: want PROMPTSxGROUP, e.g. 32x16 (group >= 2: TRL's minimum)")
    return int(p), int(g)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="floe beside TRL's GRPOTrainer on the same CPU work "
                                 "(bench/peers.py's docstring has the details)")
    ap.add_argument("--trl-python", default=sys.executable, help="the interpreter that imports trl (a venv's python)")
    ap.add_argument("--shapes", type=shape, nargs="+", default=[(32, 16), (16, 8)], help="PROMPTSxGROUP per step")
    ap.add_argument("--steps", type=int, default=8, help="steps per timed run")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per side and shape, alternating (0: no timing)")
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run left out of the medians")
    ap.add_argument("--seed", type=int, default=0, help="seed of the timed runs")
    ap.add_argument("--learn", action="store_true", help="also the equal-wall-time learning comparison (slow)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--learn: one pair of runs per seed")
    ap.add_argument("--trl-micro-batch", type=int, default=0,
                    help="TRL completions per forward/backward (0: the whole batch, gradient_accumulation_steps 1)")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both sides (0: torch's default)")
    ap.add_argument("--compiled", action="store_true", help="also each side compiled (floe --compile on, TRL "
                    "torch_compile=True) in the same rounds, and TRL / floe at each side's best")
    ap.add_argument("--floe-args", default="",
                    help='more train.py flags for floe that leave the work alone, e.g. "--loss reinforce"')
    ap.add_argument("--out", default="", help="also write the tables to this markdown file")
    ap.add_argument("--keep", default="", help="keep the run directories here (default: a removed temporary one)")
    ap.add_argument("--learn-steps", type=int, default=0, help=argparse.SUPPRESS)  # smoke: a shorter floe job
    ap.add_argument("--trl-child", default="", help=argparse.SUPPRESS)  # internal: one TRL run
    return ap.parse_args(argv)


def report(a, argv: list[str], versions: str, load: float, timed, learned) -> str:
    parts = [f"# floe and TRL's GRPOTrainer on the same CPU work\n\n{time.strftime('%Y-%m-%d %H:%M %Z')}, "
             f"{os.cpu_count()} CPUs (load average {load:.2f} at the start), "
             f"trl / transformers / torch {versions.replace(' ', ' / ')}\n\n"
             f"    python bench/peers.py {shlex.join(argv)}"]
    if timed:
        parts.append(timing_table(timed, a.skip))
    if learned:
        parts.append(learn_table(learned))
    parts.append("Not the same on both sides:\n\n" + "\n".join(f"- {d}" for d in DIFFERENT)
                 + (f"\n- floe ran with the extra flags {a.floe_args}" if a.floe_args else ""))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.trl_child:
        return trl_child(json.loads(a.trl_child))
    versions = trl_version(a.trl_python)
    if versions is None:
        print(f"peers: trl does not import under {a.trl_python}; install it there (pip install trl==1.16.0) or "
              "pass --trl-python /path/to/venv/bin/python. Nothing was run.")
        return
    if a.keep and Path(a.keep).is_dir() and any(Path(a.keep).iterdir()):
        sys.exit(f"peers: --keep {a.keep} is not empty (each run needs a fresh directory); give another")
    load = os.getloadavg()[0]  # the timing wants quiet cores: the report says how quiet they were
    if load > 0.5:
        print(f"note: load average {load:.2f} on {os.cpu_count()} CPUs: other work shares the cores, so the "
              "times will be noisy", flush=True)
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="floe-peers-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        timed = timing(a, tmp) if a.rounds else []
        learned = [learn_seed(a, s, tmp) for s in a.seeds] if a.learn else []
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report(a, argv, versions, load, timed, learned)
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
