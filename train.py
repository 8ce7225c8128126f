"""floe's training loop: a supervised warm-up stage and the RL stage, on one file.

One RL step (`rl_step`, read top to bottom): the task (tasks/task.py) draws prompts -> the engine
generates a group of completions per prompt, with the sampler's evidence for every token ->
the task's rewards and group-centered advantages -> pack into micro-batches -> validate the
evidence once -> per micro-batch: forward, fused head, loss, backward -> clip, AdamW step
(skipped when the gradient is not finite) -> push the weights to the engine (version + 1)
-> one log line, one metrics.jsonl row.

Simplifications:
1. The trainer and the built-in engine share the process; the engine keeps its own copy
   of the weights in --engine-dtype, refreshed after every optimizer step.
2. The loss is normalized over the global batch before the micro-batch loop starts
   (loss.denominators), so any split into micro-batches gives the same gradient.
3. Metrics stay on the device as (sum, count) pairs and are read once per step.
4. torch.compile wraps a micro-batch's forward, head and loss as one region (`micro_loss`), the pi_old
   forward, the engine's decode step and flex attention; off by default on a CPU, where it is a wash
   (docs/experiments.md "2026-11-30: torch.compile on the CPU") and needs a C++ compiler. Under it each
   row counts the graphs built (compile/*), and a graph built after warm-up is a warning line naming
   the guard that failed (runlog.Graphs).
5. Under torchrun (FSDP2) every rank samples its share; the ranks swap samples and each packs the
   whole batch, so the denominators are global with no all_reduce. Rank 0 evals and writes the
   files; --inference-gpus, --async-level, --max-staleness and --plan: docs/scale.md.

    python train.py --loss icepop --icepop-beta 2.0                 # CPU, the tiny model
    python train.py --task arithmetic --model checkpoints/arith-tiny --lr 2e-4 --eval-prompts 256  # a 0/1 reward
    python train.py --task jsonl:prompts.jsonl --reward my_rewards.py:score --model /path/to/model   # your own
    python train.py --model /path/to/Qwen3-0.6B --device cuda        # one GPU
    torchrun --nproc_per_node 2 train.py --loss icepop --steps 6     # two CPU processes (gloo)
    torchrun --nproc_per_node 8 train.py --model /path/to/Qwen3-8B   # 8 GPUs (NCCL); --plan first: does it fit?
    torchrun --nproc_per_node 3 train.py --inference-gpus 1 --steps 6 # 2 CPU trainers + 1 sampler
    python train.py --stage sft --model scratch --steps 100 --prompts-per-step 64 --micro-batch-tokens 2048  # the tiny model (docs/models.md)
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from config import Config, ConfigError, parse
from data import RunError, my_share, pack
from model import Transformer
from loss import denominators, rl_loss, sft_loss, sparse_ok, trained
from layers.masks import accumulate, m2po_bound, reduce_metrics
from kernels import head
from rollout import eval_line, evaluate, make_batch, rl_sampling
from agents.episodes import Play
from engines.pipeline import AsyncRollouts, RolloutRNG, spanning
from engines.torch_engine import TorchEngine
from engines.precision import DTYPES, LossScale
from layers import lora
from layers.parallel import (CollectiveTimeout, LAUNCHED, Link, RANK, collective, full, gather, leave,
    pin_inference_gpu, print0, serving, setup_distributed, sum_over_ranks, teardown, world)
from run import evidence, runlog
from run.runlog import Interrupted, fail, interrupted
from run.checkpoint import NothingToDo, load_training_state, note_changed_rewards, resumed_config, save_checkpoint
from run.remote import RemoteEngine, dismiss, serve
from run.rundir import check_shared, claimed, write_file
from run.planreport import plan_text
from run.start import Start, build, check_start, close_compiler, settled, trainer_step, write_scratch
from run.teacher import Clock, Teacher
from tasks import usercode
from tasks.rewards import reward_hashes
from tasks.task import Task


# ----------------------------------------------------------------------------- the trainer's side

def prepare(cfg, samples, vocab_size, device):
    """Pack the global batch into micro-batches, validate the evidence, count the denominators;
    keep this rank's share of the micro-batches. On CUDA every buffer is [T] (one shape: flex's
    BlockMask, CUDA graphs); a CPU cuts each buffer's padding to a multiple of 64, eager or compiled
    (one graph with a symbolic length: run/start.py `build`)."""
    trim = 64 if torch.device(device).type == "cpu" else None
    mbs = [mb.to(device) for mb in pack(samples, cfg.micro_batch_tokens, trim=trim)]
    checks = evidence.validate(mbs, vocab_size, cfg) if cfg.stage == "rl" else {}
    if RANK:  # every rank checked the whole batch; rank 0 alone counts it
        checks = {k: (s * 0, c * 0) for k, (s, c) in checks.items()}
    return my_share(mbs, RANK, world()), denominators(mbs), checks


def _head(cfg, model, fwd, mb):
    """--train-dtype bf16/fp16: the forward's matmuls under autocast, and the head on bf16/fp16 copies
    of the hidden states and the weight (the cast is differentiable: the fp32 weight gets the gradient)."""
    low = None if cfg.train_dtype == "fp32" else DTYPES[cfg.train_dtype]
    # fp32: no autocast at all; even a disabled one is a node in the compiled trainer step's graph,
    # for which AOTAutograd's on-disk cache is bypassed (a second start traces it again)
    with torch.autocast(mb.tokens.device.type, low) if low is not None else contextlib.nullcontext():
        hidden = fwd(mb.tokens, mb.positions, mb.doc_ids, mb.parents)
    weight = model.head_weight
    if low is not None:
        hidden, weight = hidden.to(low), weight.to(low)
    if cfg.stage == "sft":
        return head(hidden, weight, mb.labels)
    sparse = sparse_ok(cfg, mb.support)  # the gradient lies on label and support rows only
    return head(hidden, weight, mb.labels, mb.support, cfg.temperature, sparse=sparse)


@torch.no_grad()
def old_logprobs(cfg, model, fwd, mbs, denom):
    """pi_old, the weights before the batch's first step, where a loss reads it: a clipped loss (ppo, cispo,
    gspo, sapo) with --epochs > 1, and --m2po-threshold, whose bound on (log pi_old/q)^2 covers every rank's
    micro-batches (one gather) and goes into `denom` before the first backward; else None."""
    m2po = cfg.stage == "rl" and cfg.m2po_threshold > 0
    if not (cfg.stage == "rl" and trained(cfg).clipped and cfg.epochs > 1 or m2po):
        return None
    old = [_head(cfg, model, fwd, mb)[0] for mb in mbs]
    if m2po:
        denom.m2_max = m2po_bound(old, mbs, cfg.m2po_threshold, lambda x: torch.cat(gather([x])))
    return old


@torch.no_grad()
def teacher_logprobs(cfg, teacher, mbs):
    """--teacher: its (logp [T], support_logp [nnz]) on each of the student's own packed micro-batches (the
    same tokens, positions, documents and support rows, the same head and autocast), for terms.distill_term;
    computed once a batch, like pi_old, and read by every --epochs pass."""
    with teacher.off():  # --teacher base: the student's adapters off
        return [_head(cfg, teacher.model, teacher.model, mb)[::2] for mb in mbs]


def micro_loss(cfg, model, fwd, mb, denom, step, old=None, taught=None):
    """One micro-batch's forward, head and loss -> (loss, metrics): under --compile on the region
    `trainer step`, compiled whole (run/start.py `trainer_step`); the backward runs outside it."""
    logp, entropy, support_logp = _head(cfg, model, fwd, mb)
    if cfg.stage == "rl":
        return rl_loss(logp, support_logp, entropy, mb, cfg, denom, step, old, taught)
    return sft_loss(logp, mb, denom)


def backward_pass(cfg, model, fwd, mbs, denom, step, old=None, scale: float = 1.0, taught=None, region=None):
    """Forward, head, loss, backward per micro-batch; gradients accumulate (times `scale`, the fp16
    loss scale); returns metrics. `taught`: the teacher's log-probs per micro-batch (--teacher);
    `region`: micro_loss compiled (--compile on), which takes the model whole and the host numbers as tensors."""
    total: dict = {}
    if region is not None and mbs:  # a Python number's value would guard the compiled graph: one graph per step
        denom, step = denom.tensors(mbs[0].tokens.device), torch.tensor(step, device=mbs[0].tokens.device)
    for i, mb in enumerate(mbs):
        loss, metrics = (region or micro_loss)(cfg, model, fwd, mb, denom, step, None if old is None else old[i],
                                               None if taught is None else taught[i])
        (loss * scale if scale != 1.0 else loss).backward()
        accumulate(total, metrics)
    return total


def optimizer_step(cfg, model, opt, step, scale: LossScale | None = None, loss=None):
    """Unscale, clip and step. A non-finite gradient norm (NaN advantages, an overflowing loss) skips
    the update, so no NaN ever reaches the weights, the optimizer state or a checkpoint; the norm is
    global over FSDP2 ranks, so every rank skips the same steps (and halves the same loss scale).
    With fp16 a non-finite gradient from a finite `loss` is the loss scale's overflow
    (`skipped/overflow`, the scale halves and the run goes on), not a broken step."""
    scale = scale or LossScale()
    lr = cfg.lr * min(1.0, step / 5)  # a 5-step linear warm-up
    for g in opt.param_groups:
        g["lr"] = lr
    if scale.value != 1.0:
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], 1.0 / scale.value)
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).detach().double()
    finite = bool(torch.isfinite(norm))  # the step's one extra host sync
    overflow = not finite and scale.dynamic and scale.value > 1 and (loss is None or bool(torch.isfinite(loss)))
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    scale.update(finite)
    one = torch.tensor(1.0, dtype=torch.float64)
    m = {"grad_norm": (norm if finite else one * 0, one if finite else one * 0),
         "skipped/nonfinite_step": (one * (not finite and not overflow), one)}
    if scale.dynamic:
        m.update({"skipped/overflow": (one * overflow, one), "loss_scale": (one * scale.value, one)})
    return m


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> dict:
    cfg = parse(argv)
    pin_inference_gpu(cfg.inference_gpus)
    link = None
    try:
        # --plan --device cuda reads no device: a laptop plans a GPU job
        cfg = settled(cfg.resolve(torch.cuda.is_available() or (cfg.plan and cfg.device == "cuda")))
        if cfg.plan:
            print0(plan_text(cfg))
            return {}
        link = setup_distributed(cfg.device, cfg.inference_gpus, cfg.dist_timeout)
        if serving(cfg.inference_gpus):  # an --inference-gpus rank: it samples for the trainers until they stop it
            serve(cfg, link)
            teardown(link, cfg.inference_gpus)
            return {}
        with collective("the start-up checks", cfg.dist_timeout):
            s = check_start(cfg)
    except NothingToDo as e:  # a resume of a run at --steps already: the directory stays as it was
        print0(f"floe: {e}")
        if link is not None:
            dismiss(link)
        teardown(link, cfg.inference_gpus)
        return {}
    except (ConfigError, FileNotFoundError, ValueError) as e:  # bad flags, run directory, model, task or reward
        fail(e, 2)
    except CollectiveTimeout as e:
        fail(e, 1, every_rank=True)
    except KeyboardInterrupt:
        interrupted(Path(cfg.out_dir), None)
    try:
        return launch(cfg, s, link)
    except ConfigError as e:  # the run directory, once locked: another run holds it, or changed it meanwhile
        fail(e, 2)
    except OSError as e:  # a read-only or full disk: one line, and what was written before stays
        fail(f"cannot write the run in {s.out}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""), 1)
    except CollectiveTimeout as e:
        fail(e, 1, every_rank=True)
    except Interrupted as e:
        interrupted(s.out, e.step)
    except KeyboardInterrupt:  # before the loop: what the start wrote is taken back (rundir.claimed)
        interrupted(s.out, None)


def launch(cfg: Config, s: Start, link: Link | None = None) -> dict:
    """Lock the run directory, build the engine and optimizer, write the run's config, resume if
    asked, loop, summarize. A start that fails before the loop (the engine refuses, a full disk)
    leaves --out-dir as it was; the lock is held until the run ends, however it ends."""
    hashes = reward_hashes(s.task.rewards)
    if s.resume_from:
        note_changed_rewards(s.out, hashes)
    print0(cfg.changed())  # the flags that differ from their defaults; config.json gets them all
    with claimed(s.out, s.seen) as lock:  # everything was checked: rank 0 holds the directory, the run may write
        with collective("the start (the ranks' shared --out-dir)", cfg.dist_timeout):
            check_shared(s.out)
        src = s.src or write_scratch(cfg, s.out, s.model, s.task)  # the engine loads from a directory
        try:
            with collective("the start (the engine, the sharded model)", cfg.dist_timeout):
                fwd, engine, opt = build(cfg, src, s.model, s.codec, link)
        except (FileNotFoundError, ValueError, ConfigError) as e:  # flags the engine can't serve
            fail(e, 2)
        if RANK == 0:  # the engine started: now the config, which a resume checks its flags against
            record = (resumed_config(s.out, cfg) if s.resume_from  # the run's own record; None: unchanged
                      else {**json.loads(cfg.to_json()), "reward_sha256": hashes, **lora.base_record(s.model, src),
                            **({"repeatable": False} if cfg.max_staleness and not cfg.push_at_decode_step and cfg.stage == "rl" else {})})
            if record is not None:
                write_file(s.out / "config.json", json.dumps(record, indent=2))
    log = run = None
    try:
        rng, scale = random.Random(cfg.seed), LossScale.for_dtype(cfg.train_dtype)
        with collective("the resume", cfg.dist_timeout):
            start, queue = load_training_state(s.resume_from, s.model, opt, rng, engine, scale) if s.resume_from else (0, {})
        n_trained = sum(p.numel() for p in s.model.parameters() if p.requires_grad)
        print0(f"model {src}: {sum(p.numel() for p in s.model.parameters()) / 1e6:.2f}M params on {cfg.device}"
               + (f" x {world()} ranks (FSDP2)" if world() > 1 else "")
               + (f", LoRA rank {cfg.lora_rank}: {n_trained / 1e6:.3f}M trained" if cfg.lora_rank else "")
               + (f", sampling on {cfg.inference_gpus} more" if cfg.inference_gpus else "")
               + (f" | resuming at step {start}" if start else "") + (" | compiling, ~1 min" if cfg.compile == "on" else ""))
        log = runlog.Logger(cfg, start, s.kept)  # an OSError here (a full disk) reaches main's one line
        stop = threading.Event()  # set at shutdown: a reward or environment call still running is abandoned
        for r in s.task.rewards:
            r.stop = stop
        play = None if s.env is None else Play(
            s.env, s.codec, engine, rl_sampling(cfg), min(s.model.args.max_position_embeddings, cfg.micro_batch_tokens + 1),
            cfg.max_turns, cfg.call_timeout, s.task.template_kwargs, stop=stop, tools=s.tools)
        graphs = runlog.Graphs(cfg, {"trainer step": micro_loss, "trainer forward": Transformer.forward,
                                     "engine decode step": TorchEngine._step, "flex attention": flex_attention})
        run = Run(cfg, s.task, s.model, fwd, opt, engine, rng, log, s.out, src, scale, graphs, play, stop,
                  teacher=s.teacher, clock=Clock(cfg.device), region=trainer_step(cfg, micro_loss))
        # start-up's objects (torch, the tokenizer, the model: hundreds of thousands) leave the cyclic
        # collector's reach, so a full collection during a step scans only what the steps made
        gc.freeze()
        loop(run, start, queue)
    except RunError as e:
        fail(e, 1)  # what was logged and saved so far stays
    except KeyboardInterrupt:
        if run is None:  # at start-up: main's line
            raise
        raise Interrupted(run.step) from None
    finally:
        gc.unfreeze()  # the interpreter finalizes them at exit as usual
        if log is not None:
            log.close()
        if isinstance(engine, RemoteEngine):
            engine.stop()
        if cfg.compile == "on":
            close_compiler()
        if lock is not None:
            lock.release()
    summary = log.summary(run.graphs.summary() if run is not None else {})
    teardown(link, cfg.inference_gpus)
    return summary


@dataclass
class Run:
    """One run's parts, built once by `launch`; every step reads them from here."""

    cfg: Config
    task: Task
    model: Transformer  # the trainer's fp32 weights (FSDP2-sharded under torchrun)
    fwd: object  # the model, or model.compiled(model)
    opt: torch.optim.Optimizer
    engine: object  # an torch_engine.Engine (or a remote.RemoteEngine): samples with a copy of the weights
    rng: random.Random  # draws the prompts
    log: runlog.Logger
    out: Path  # --out-dir
    src: Path  # the model directory the engine loaded; checkpoints copy its tokenizer
    scale: LossScale  # --train-dtype fp16's dynamic loss scale (1.0 otherwise)
    graphs: runlog.Graphs  # what torch.compile built: each row's compile/* (--compile on)
    play: Play | None = None  # --env: the environment, engine and limits episodes are played with
    stop: threading.Event | None = None  # set at shutdown (AsyncRollouts.close): user code is abandoned
    step: int = 0  # the step in progress (a Ctrl-C's line names it)
    teacher: Teacher | None = None  # --teacher: frozen (run/teacher.py), scored on every micro-batch
    clock: Clock | None = None  # times the teacher's forwards (time/teacher)
    region: object = None  # --compile on: micro_loss compiled whole (start.trainer_step); None: eager


def next_batch(run: Run, step: int):
    """The batch `step` trains on: the rollout phase (rollout.py) with this run's parts."""
    return make_batch(run.cfg, run.task, run.engine, run.rng, step, run.model.args.max_position_embeddings, run.play)


def loop(run: Run, start: int, queue: dict | None = None) -> None:
    """Steps start+1..--steps, then a checkpoint at --save-every and at the end. With --async-level
    or --max-staleness a thread samples each batch ahead (pipeline.AsyncRollouts) and hands it to the step."""
    cfg, run.step = run.cfg, start + 1
    if cfg.eval_every and not start and RANK == 0:
        run.log.row(0, evaluate(cfg, run.task, run.engine, run.play))
        print0(eval_line(0, run.log.rows[-1]))
    ahead = None
    if (cfg.async_level > 0 or cfg.max_staleness > 0) and cfg.stage == "rl":
        threads = max(1, torch.get_num_threads() // 2) if cfg.device == "cpu" else 0  # half the cores each
        ahead = AsyncRollouts(lambda step: next_batch(run, step), run.engine, run.rng, cfg.max_staleness or cfg.async_level,
                              start, cfg.steps, threads, run.stop, bounded=cfg.max_staleness > 0,
                              partial=cfg.partial_rollouts, land_at=cfg.push_at_decode_step, queue=queue)
    skipped = empty = failed = 0  # non-finite steps in a row, empty ones, ones whose episodes all failed
    stepped = False  # whether a step of this run took an optimizer step
    stalls = runlog.Stalls(cfg)  # the warnings of a run that cannot learn
    with ahead or contextlib.nullcontext():
        for step in range(start + 1, cfg.steps + 1):
            run.step = step
            with collective(f"step {step}", cfg.dist_timeout):
                m, batch = rl_step(run, step, ahead)
            for line in stalls.check(step, m) + run.graphs.check(step, m):
                print0(line)
            skipped = skipped + 1 if m.get("skipped/nonfinite_step") else 0
            if skipped == 3:
                raise RunError(f"3 steps in a row skipped for {runlog.nonfinite_cause(batch, m)}; "
                                 "none of them was applied or saved")
            failed = failed + 1 if m.get("skipped/env_error") == 1.0 else 0
            if failed == 3:  # before the empty-step rule, which such steps also meet: this names the cause
                last = run.play.last_error or "on another rank: see its warnings above"
                raise RunError(f"--env {run.play.spec.name}: every episode failed 3 steps in a row (the last: {last})")
            empty = empty + 1 if m.get("skipped/empty_step") else 0
            if empty == 3:  # a run of such steps would end "done" with its start weights
                raise RunError(f"3 steps in a row had no sample to train on: {runlog.idle_cause(batch, m)}; nothing trained "
                                 f"since step {step - 3}")
            stepped = stepped or bool(batch) and not m.get("skipped/nonfinite_step") and not m.get("skipped/overflow")
            if step == cfg.steps and not stepped:  # whatever the step count: a run that trained nothing fails
                raise RunError(f"no step of this run trained (steps {start + 1}..{step}; the last: "
                                 f"{runlog.idle_cause(batch, m)}); its weights are the ones it started from")
            if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                # the RNGs as the next batch finds them (with a thread: as this one's left them, and with
                # --push-at-decode-step the batches sampled ahead: AsyncRollouts.checkpointed)
                st, queued = (RolloutRNG(run.rng, run.engine.gen), {}) if ahead is None else ahead.checkpointed(step)
                run.log.sync()  # the rows on disk before the checkpoint that covers them
                with collective(f"the checkpoint of step {step}", cfg.dist_timeout):
                    save_checkpoint(run.out, step, run.model, run.opt, st.rng, st.gen, run.src, run.scale,
                                    final=step == cfg.steps, queued=queued)


def rl_step(run: Run, step: int, ahead: AsyncRollouts | None = None) -> tuple[dict, list]:
    """One step (1-based: the trainer has made step - 1 optimizer steps), top to bottom; returns
    its metrics row and the global batch. `ahead` (--async-level) hands over a batch sampled
    ahead on a thread; without it the step samples its own."""
    cfg, model, t0 = run.cfg, run.model, time.time()
    # 1-3. prompts -> completions with the sampler's evidence -> rewards -> group advantages
    if ahead is None:
        samples, stats = next_batch(run, step)
        t_rollout = time.time() - t0
    else:
        samples, stats, t_rollout = ahead.get(step)
    t1 = time.time()
    # 4. gather, pack into micro-batches, check the sampler's evidence, count the loss's denominators;
    # pi_old where the loss reads it (and M2PO's bound, over the whole step)
    batch = gather(samples)  # every rank's samples: the global batch
    mbs, denom, checks = prepare(cfg, batch, model.args.vocab_size, cfg.device)
    accumulate(stats, checks)
    old = old_logprobs(cfg, model, run.fwd, mbs, denom)
    taught = None
    if run.teacher is not None:  # --teacher: its log-probs on the same micro-batches, timed (time/teacher)
        with run.clock():
            taught = teacher_logprobs(cfg, run.teacher, mbs)
    for epoch in range(cfg.epochs):
        # 5. per micro-batch: forward, fused head, loss, backward (gradients accumulate)
        metrics = backward_pass(cfg, model, run.fwd, mbs, denom, step - 1, old, run.scale.value, taught, run.region)
        # 6. unscale (fp16), clip the gradient and step AdamW, or skip a non-finite update
        metrics.update(optimizer_step(cfg, model, run.opt, step, run.scale, metrics.get("loss", (None,))[0]))
        if epoch == 0:  # the metrics of the sampled policy
            accumulate(stats, metrics)
    t_train = time.time() - t1
    # 7. push the weights to the engine as version `step` (held for an eval first)
    due = bool(cfg.eval_every) and RANK == 0 and (step % cfg.eval_every == 0 or step == cfg.steps)
    if ahead is None:
        run.engine.load_weights(model, version=step)
    else:
        ahead.publish(model, step, hold=due)
    # 8. metrics (one all_reduce, one host read), the eval, the log line and metrics.jsonl row
    m = reduce_metrics(sum_over_ranks(stats, cfg.device))
    m["skipped/empty_step"] = float(not batch)  # nothing scored: the step trained nothing
    if cfg.stage == "rl" and batch:  # a std does not sum over ranks
        m["reward/std"] = torch.tensor([s.reward for s in batch], dtype=torch.float64).std(unbiased=False).item()
    n_tok = sum(len(mb.tokens) for mb in mbs) * world()  # micro-batch slots: the work done, padding included
    t2 = time.time()
    m.update({"time/rollout": t_rollout, "time/train": t_train, "time/step": t2 - t0,
              "tokens/train": denom.tokens, "tokens/packed": n_tok})
    if run.teacher is not None:
        m["time/teacher"] = run.clock.seconds()  # read after the step's sync (reduce_metrics)
    if due:
        m.update(evaluate(cfg, run.task, run.engine, run.play))  # this step's weights
        if ahead is not None:
            ahead.release()
        print0(eval_line(step, m))
    if ahead is not None and ahead.bounded:
        m.update({**ahead.ages(m), **ahead.idle(), "async/spanning_push": spanning(batch)})
    m.update(run.graphs.row())  # the step's graphs, its eval's included
    run.log.row(step, m)
    run.log.line(step, m, n_tok, t2 - t0)
    return m, batch


if __name__ == "__main__":
    if LAUNCHED > 1:
        leave(main)  # no interpreter finalization under torchrun (parallel.leave says why)
    else:
        usercode.main_then_leave(main)  # threads user code left running do not keep the process alive
