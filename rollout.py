"""The rollout phase: prompts (or episodes) -> completions -> rewards -> advantages, as Samples.

One step's batch is made here (`make_batch`), inline in the synchronous loop or on a thread under
--async-level (pipeline.py); train.py only trains on it. The engines behind it (engines.py: the
`Engine` contract, the built-in `TorchEngine`; vllm_engine.py) turn prompts into completions with
the sampler's evidence; episodes.py plays whole multi-turn episodes against an environment; the
task (tasks.py) draws the prompts and scores the completions.

Simplifications:
1. Every rank draws the same prompts from the same RNG and keeps its own share (`my_prompts`), so
   the prompt order never depends on the world size; an episode group is played whole on one rank.
2. A prompt that cannot fit its completion in the context, and a sample the task could not score,
   are skipped and counted (`skipped/too_long`, `skipped/reward_error`), never trained on.
3. The eval (`evaluate`) samples as training does, from a fixed seed, so every eval of a run
   draws the same way and runs compare.

    python -m pytest -q tests/test_train.py tests/test_async.py   # the phase, inline and ahead
"""

from __future__ import annotations

import math

import torch

import data as D
import episodes as E
import loss as L
import parallel as P
import tasks as T
from engines import Sampling
from parallel import RANK


def rl_sampling(cfg) -> Sampling:
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens,
                    support=L.reads_support(cfg), draws=cfg.score_centering_k, noise=cfg.engine_noise)


def rollout_phase(cfg, task, engine, rng, step, context: int):
    """Prompts -> completions -> rewards -> advantages, as Samples.

    A prompt that cannot fit its completion in the context, and a sample the task could not
    score (tasks.py: its reward raised or gave NaN), are skipped and counted
    (`skipped/too_long`, `skipped/reward_error`)."""
    drawn = task.sample(cfg.prompts_per_step, rng)  # the same on every rank
    if all(len(p.ids) + cfg.max_new_tokens > context for p in drawn):
        raise D.RunError(f"every prompt is longer than the context: {len(drawn[0].ids)} prompt tokens "
                         f"+ --max-new-tokens {cfg.max_new_tokens} > {context}")
    drawn = my_prompts(cfg, drawn)
    prompts = [p for p in drawn if len(p.ids) + cfg.max_new_tokens <= context]
    completions = engine.generate([p.ids for p in prompts], cfg.group_size, rl_sampling(cfg), keep=False) if prompts else []
    owners = [prompts[i // cfg.group_size] for i in range(len(completions))]
    rewards = task.score(owners, [c.ids for c in completions], cfg.group_size)
    samples = [D.Sample(p, c.ids, c.logq, c.versions, c.finish_reason, c.support, reward=r)
               for p, c, r in zip(owners, completions, rewards)]
    return scored_batch(cfg, samples, len(drawn), len(prompts))


def episode_phase(cfg, task, play: E.Play, rng):
    """--env: rows -> whole episodes (episodes.play: the model's turns and the environment's
    replies) -> rewards -> advantages, as Samples, with the episodes' own metrics."""
    drawn = task.sample(cfg.prompts_per_step, rng)  # the same on every rank
    seeds = [rng.getrandbits(32) for _ in drawn]  # the environments' randomness: from the run's RNG, so a resume repeats it
    mine = my_prompts(cfg, list(range(len(drawn))))  # this rank's groups: it plays them whole, so a fault drops a group here
    rows = [drawn[i] for i in mine]
    eps = E.play(play, rows, cfg.group_size, [seeds[i] for i in mine])
    samples, stats = scored_batch(cfg, E.finish(play, task, eps, cfg.group_size), len(rows), len(rows))
    stats.update({k: (torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
                  for k, (a, b) in E.stats(eps, cfg.max_turns).items()})
    return samples, stats


def scored_batch(cfg, samples: list, drawn: int, kept: int):
    """Group advantages over the samples, then the ones that scored and the batch's metrics."""
    advs = L.group_advantages([s.reward for s in samples], cfg.group_size, cfg.adv_std_norm)
    for s, a in zip(samples, advs):
        s.advantage = a
    scored = [s for s in samples if math.isfinite(s.reward)]
    rewards = torch.tensor([s.reward for s in scored] or [0.0])
    n = float(len(scored))
    stats = {"reward": (rewards.sum(), n),  # reward/std: in `run`, over the global batch
             "length": (float(sum(len(s.completion) for s in scored)), n),
             "truncated_fraction": (float(sum(s.finish_reason == "length" for s in scored)), n),
             "skipped/too_long": (float(drawn - kept), float(drawn)),
             "skipped/reward_error": (float(len(samples) - len(scored)), float(len(samples)))}
    return scored, {k: (torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b)) for k, (a, b) in stats.items()}


def my_prompts(cfg, drawn: list) -> list:
    """This rank's share of the step's prompts; with --inference-gpus rank 0 sends them all out."""
    if cfg.inference_gpus:
        return drawn if RANK == 0 else []
    return drawn[RANK::P.world()]


def make_batch(cfg, task, engine, rng, step: int, context: int, play: E.Play | None = None):
    """The batch of `step` as (samples, stats): rl rollouts (prompts or, with `play`, episodes ->
    completions -> rewards -> advantages), or sft samples. `context`: the model's positions. Inline
    in the synchronous loop; with --async-level on a thread."""
    if cfg.stage == "sft":
        return sft_samples(cfg, task, rng)
    try:
        if play is not None:
            return episode_phase(cfg, task, play, rng)
        return rollout_phase(cfg, task, engine, rng, step - 1, context)
    finally:
        engine.idle()  # the step's rollout is over (all its turns): vLLM may sleep now, not between turns


def sft_samples(cfg, task, rng):
    """The task's reference completions; a row's `episode` column is a multi-turn reference, trained
    on its assistant turns only (episodes.reference: the token rule of the episodes themselves)."""
    samples = []
    for p in task.sample(cfg.prompts_per_step, rng)[RANK::P.world()]:
        if "episode" in p.columns:
            samples.append(E.reference(task.codec, p, p.columns["episode"], task.template_kwargs))
            continue
        ids = task.completion_ids(p)
        samples.append(D.Sample(p, ids, [0.0] * len(ids), [0] * len(ids), "stop"))
    return samples, {}


@torch.no_grad()
def evaluate(cfg, task, engine, play: E.Play | None = None, n: int = 4) -> dict[str, float]:
    """Mean reward of n samples per held-out prompt, drawn as in training from a fixed seed (and
    pass@1, pass@n for a 0/1 reward); what could not be scored is counted, not averaged in. With
    --env, n whole episodes per held-out row."""
    try:
        if play is not None:
            return E.evaluate(cfg, task, play, n)
        prompts = task.eval_set
        sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, seed=cfg.seed + 1)
        out = engine.generate([p.ids for p in prompts], n, sampling, keep=False)
        rewards = task.score([prompts[i // n] for i in range(len(out))], [c.ids for c in out], n)
        return T.eval_metrics(rewards, n)
    finally:
        engine.idle()


def eval_line(step: int, m: dict) -> str:
    passes = "".join(f" | {k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@"))
    reward = f"{m['eval/reward']:.3f}" if "eval/reward" in m else "- (nothing scored)"
    return f"eval step {step} | reward {reward}{passes}"
