"""The rollout phase: prompts (or episodes) -> completions -> rewards -> advantages, as Samples.

One step's batch is made here (`make_batch`), inline in the synchronous loop or on a thread under
--async-level (engines/pipeline.py); train.py only trains on it. The engines behind it (engines/torch_engine.py: the
`Engine` contract, the built-in `TorchEngine`; engines/vllm_engine.py) turn prompts into completions with
the sampler's evidence; agents/episodes.py plays whole multi-turn episodes against an environment; the
task (tasks/task.py) draws the prompts and scores the completions.

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

import dataclasses
import math

import torch

from data import RunError, Sample
from loss import group_advantages, reads_support
from agents import episodes, toolrun
from agents.episodes import ENDS, Episode, FAULTS, LOST, Play, reference
from engines.torch_engine import Sampling
from layers.parallel import RANK, world
from tasks.rewards import score_groups
from tasks.task import eval_metrics


def eval_sampling(cfg) -> Sampling:
    """The eval's sampling: training's settings from a fixed seed, so every eval of a run draws alike."""
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, seed=cfg.seed + 1)


def rl_sampling(cfg) -> Sampling:
    return Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens,
                    support=reads_support(cfg), draws=cfg.score_centering_k, noise=cfg.engine_noise)


def rollout_phase(cfg, task, engine, rng, step, context: int):
    """Prompts -> completions -> rewards -> advantages, as Samples.

    A prompt that cannot fit its completion in the context, and a sample the task could not
    score (tasks/task.py: its reward raised or gave NaN), are skipped and counted
    (`skipped/too_long`, `skipped/reward_error`)."""
    drawn = task.sample(cfg.prompts_per_step, rng)  # the same on every rank
    if all(len(p.ids) + cfg.max_new_tokens > context for p in drawn):
        raise RunError(f"every prompt is longer than the context: {len(drawn[0].ids)} prompt tokens "
                         f"+ --max-new-tokens {cfg.max_new_tokens} > {context}")
    drawn = my_prompts(cfg, drawn)
    prompts = [p for p in drawn if len(p.ids) + cfg.max_new_tokens <= context]
    completions = engine.generate([p.ids for p in prompts], cfg.group_size, rl_sampling(cfg), keep=False) if prompts else []
    owners = [prompts[i // cfg.group_size] for i in range(len(completions))]
    rewards = task.score(owners, [c.ids for c in completions], cfg.group_size)
    samples = [Sample(p, c.ids, c.logq, c.versions, c.finish_reason, c.support, reward=r)
               for p, c, r in zip(owners, completions, rewards)]
    return scored_batch(cfg, samples, len(drawn), len(prompts))


def episode_phase(cfg, task, play: Play, rng):
    """--env: rows -> whole episodes (episodes.play: the model's turns and the environment's
    replies) -> rewards -> advantages, as Samples, with the episodes' own metrics."""
    drawn = task.sample(cfg.prompts_per_step, rng)  # the same on every rank
    seeds = [rng.getrandbits(32) for _ in drawn]  # the environments' randomness: from the run's RNG, so a resume repeats it
    mine = my_prompts(cfg, list(range(len(drawn))))  # this rank's groups: it plays them whole, so a fault drops a group here
    rows = [drawn[i] for i in mine]
    eps = episodes.play(play, rows, cfg.group_size, [seeds[i] for i in mine])
    samples, stats = scored_batch(cfg, finish_episodes(play, task, eps, cfg.group_size), len(rows), len(rows))
    stats.update({k: (torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
                  for k, (a, b) in episode_stats(eps, cfg.max_turns, play).items()})
    return samples, stats


def score_episodes(task, eps: list[Episode], group: int) -> None:
    """--reward functions over whole episodes, added to the environment's reward: `completions` is
    the final model turn's text ("" when it was a tool call: a call never scores as an answer),
    `completion_ids` its ids, `messages` the whole conversation."""
    parts = [p for g in range(0, len(eps), group) if (p := [e for e in eps[g:g + group] if e.end not in LOST])]
    groups = [([e.prompt for e in p], ["" if e.on_call else task.codec.decode(e.last) for e in p], [list(e.last) for e in p],
               {"messages": [e.messages for e in p]}) for p in parts]
    for part, total in zip(parts, score_groups(task.rewards, groups)):
        for e, v in zip(part, total):
            e.reward += v


def episode_stats(eps: list[Episode], max_turns: int, pl: Play | None = None) -> dict[str, tuple[float, float]]:
    """(sum, count) metrics of a step's episodes: turns, tokens, the share of each end, reward by turns;
    with tools declared, the calls (toolrun.metrics)."""
    played = [e for e in eps if e.n_turns]
    n = float(len(eps))
    out = {"episode/turns": (float(sum(e.n_turns for e in played)), float(len(played))),
           "episode/model_tokens": (float(sum(sum(e.mask) for e in played)), float(len(played))),
           "episode/env_tokens": (float(sum(len(e.mask) - sum(e.mask) for e in played)), float(len(played))),
           "skipped/env_error": (float(sum(e.end in LOST for e in eps)), n),
           "skipped/too_long": (float(sum(not e.n_turns and e.end == "budget" for e in eps)), n)}  # no room for a turn
    out.update({f"episode/end/{k}": (float(sum(e.end == k for e in eps)), n) for k in ENDS})
    for k in range(1, max_turns + 1):
        scored = [e.reward for e in played if e.n_turns == k and math.isfinite(e.reward)]
        out[f"episode/reward_by_turns/{k}"] = (float(sum(scored)), float(len(scored)))
    if pl is not None and pl.tools is not None:
        out.update(toolrun.metrics([e.calls for e in played], sum(e.n_turns for e in played),
                                   sum(e.call_turns for e in played), sum(e.result_tokens for e in played),
                                   pl.tool_seconds, pl.tools.runner.abandoned()))
    return out


def finish_episodes(pl: Play, task, eps: list[Episode], group: int) -> list[Sample]:
    """Rewards, then the Samples of the episodes that count (a failed group's are left out); a step
    with failures prints one line naming the first."""
    score_episodes(task, eps, group)
    failed = [e for e in eps if e.end in FAULTS]
    if failed:
        pl.last_error = failed[0].why or failed[0].end
        counts = ", ".join(f"{sum(e.end == k for e in failed)} {k}" for k in FAULTS if any(e.end == k for e in failed))
        print(f"warning: --env {pl.spec.name}: {len(failed)} of {len(eps)} episodes failed ({counts}; their groups "
              f"skipped, counted in skipped/env_error); first: {pl.last_error}", flush=True)
    return [e.sample() for e in eps if e.end not in LOST and e.n_turns]


@torch.no_grad()
def evaluate_episodes(cfg, task, pl: Play, n: int = 4) -> dict[str, float]:
    """Whole episodes from each held-out row, n per row, at fixed sampling and environment seeds."""
    pl = dataclasses.replace(pl, sampling=eval_sampling(cfg), last_error="")
    eps = episodes.play(pl, task.eval_set, n, [cfg.seed + 1 + i for i in range(len(task.eval_set))])
    score_episodes(task, eps, n)
    out = eval_metrics([e.reward if e.end not in LOST else math.nan for e in eps], n)
    played = [e for e in eps if e.n_turns]
    out["eval/turns"] = sum(e.n_turns for e in played) / max(len(played), 1)
    out["eval/done"] = sum(e.end == "done" for e in eps) / max(len(eps), 1)
    if pl.tools is not None:
        calls = [c for e in played for c in e.calls]
        out["eval/tool_calls"] = len(calls) / max(len(played), 1)
        out["eval/tool_errors"] = sum(bool(c.kind) for c in calls) / max(len(calls), 1)
    return out


def scored_batch(cfg, samples: list, drawn: int, kept: int):
    """Group advantages over the samples, then the ones that scored and the batch's metrics."""
    advs = group_advantages([s.reward for s in samples], cfg.group_size, cfg.adv_std_norm)
    for s, a in zip(samples, advs):
        s.advantage = a
    scored = [s for s in samples if math.isfinite(s.reward)]
    rewards = torch.tensor([s.reward for s in scored] or [0.0])
    n = float(len(scored))
    stats = {"reward": (rewards.sum(), n),  # reward/std: in `run`, over the global batch
             "length": (float(sum(len(s.completion) for s in scored)), n),
             "truncated_fraction": (float(sum(s.finish_reason == "length" for s in scored)), n),
             "groups/equal_rewards": equal_groups(samples, cfg.group_size),
             "skipped/too_long": (float(drawn - kept), float(drawn)),
             "skipped/reward_error": (float(len(samples) - len(scored)), float(len(samples)))}
    return scored, {k: (torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b)) for k, (a, b) in stats.items()}


def equal_groups(samples: list, group: int) -> tuple[float, float]:
    """(groups whose scored rewards are all equal, groups with a scored sample): such a group's
    advantages are zero, so its samples teach the policy nothing."""
    sets = [{s.reward for s in samples[g:g + group] if math.isfinite(s.reward)} for g in range(0, len(samples), group)]
    return float(sum(len(r) == 1 for r in sets)), float(sum(len(r) > 0 for r in sets))


def my_prompts(cfg, drawn: list) -> list:
    """This rank's share of the step's prompts; with --inference-gpus rank 0 sends them all out."""
    if cfg.inference_gpus:
        return drawn if RANK == 0 else []
    return drawn[RANK::world()]


def make_batch(cfg, task, engine, rng, step: int, context: int, play: Play | None = None):
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
    for p in task.sample(cfg.prompts_per_step, rng)[RANK::world()]:
        if "episode" in p.columns:
            samples.append(reference(task.codec, p, p.columns["episode"], task.template_kwargs, task.tool_format))
            continue
        ids = task.completion_ids(p)
        samples.append(Sample(p, ids, [0.0] * len(ids), [0] * len(ids), "stop"))
    return samples, {}


@torch.no_grad()
def evaluate(cfg, task, engine, play: Play | None = None, n: int = 4) -> dict[str, float]:
    """Mean reward of n samples per held-out prompt, drawn as in training from a fixed seed (and
    pass@1, pass@n for a 0/1 reward); what could not be scored is counted, not averaged in. With
    --env, n whole episodes per held-out row."""
    try:
        if play is not None:
            return evaluate_episodes(cfg, task, play, n)
        prompts = task.eval_set
        out = engine.generate([p.ids for p in prompts], n, eval_sampling(cfg), keep=False)
        rewards = task.score([prompts[i // n] for i in range(len(out))], [c.ids for c in out], n)
        return eval_metrics(rewards, n)
    finally:
        engine.idle()


def eval_line(step: int, m: dict) -> str:
    passes = "".join(f" | {k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@"))
    reward = f"{m['eval/reward']:.3f}" if "eval/reward" in m else "- (nothing scored)"
    return f"eval step {step} | reward {reward}{passes}"
