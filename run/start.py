"""A run's start: every flag, the run directory, the checkpoint, the model, tokenizer, task and
rewards checked before the first byte is written (`check_start`), then the parts the loop
runs on built around the loaded model (`build`: engine, sharded model, optimizer, compiled
forward). train.py's `main` calls both; nothing here runs a step.

Simplifications:
1. `--model scratch` builds the tiny model in memory; `write_scratch` saves it into the run
   (the engine, vLLM included, loads a directory, and checkpoints copy its tokenizer).
2. Under torchrun the model is built on the meta device and sharded at the start checks, each rank
   reading only its rows of the files (hfdir.fill_shards); the built-in engine builds its own copy
   and fills it tensor by tensor from the gathered shards. One process loads whole.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config import Config, ConfigError, dataclasses, shown
from model import ModelArgs, TINY, Transformer, compiled, init_weights
from loss import LOSSES, check_flags, reads, reads_support, trained
from agents import envcheck, toolrun
from agents.episodes import EnvSpec, reference
from engines.torch_engine import Sampling
from engines.vllm_engine import make_engine, serves_adapter, vllm_logprobs, vllm_lora_rank
from layers import lora, parallel
from layers.parallel import Link, RANK, first_other, print0, shard
from run import hfdir
from run.checkpoint import check_resumable
from run.remote import RemoteEngine
from run.planreport import device_memory, fit_memory
from run.teacher import Teacher, load_teacher
from run.rundir import check_fresh, snapshot
from tasks.task import Task, alphabet
from tasks.textcodec import TextCodec, write_tokenizer
import tasks.task


@dataclass
class Start:
    """What a run starts from, every part of it checked before the run writes its first byte."""

    out: Path  # --out-dir
    src: Path | None  # the model directory (a checkpoint on resume); None: --model scratch
    resume_from: Path | None  # the checkpoint --resume continues
    kept: list[dict] | None  # on resume, the metrics rows up to that checkpoint
    seen: tuple  # the run directory as the checks saw it (checkpoint.snapshot), checked again under its lock
    codec: TextCodec
    task: Task
    model: Transformer
    env: EnvSpec | None = None  # --env (or the built-in `tools` one, for --tool without it)
    tools: toolrun.Tools | None = None  # declared tools: --tool, an environment's tools()
    teacher: Teacher | None = None  # --teacher: frozen, sharded like the model under torchrun (run/teacher.py)


def check_start(cfg: Config) -> Start:
    """Flags, run directory, checkpoint, model directory, tokenizer, task and rewards, engine choice."""
    check_same_flags(cfg)  # first: under torchrun every rank then refuses what follows alike
    check_flags(cfg)  # the loss's own flags, from its LOSSES row (config.py cannot see the table)
    tasks.task.check_flags(cfg)  # --task and its flags, from tasks.TASKS
    check_read(cfg)
    if cfg.lora_rank and serves_adapter(cfg):  # a rank vLLM's LoRA path cannot serve, before the model loads
        vllm_lora_rank(cfg.lora_rank)
    if cfg.prompts_per_step % parallel.world() and not cfg.inference_gpus:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} must be divisible by the {parallel.world()} "
                            "torchrun processes (each rank samples its own share)")
    out = Path(cfg.out_dir)
    seen = snapshot(out)
    if cfg.resume:  # the checkpoint, checked whole: its model and tokenizer come with it (LoRA: with its base)
        resume_from, kept, model, codec, src = check_resumable(cfg, out)
    else:
        if note := check_fresh(out, cfg.model):
            print0(note)
        resume_from, kept, src = None, None, None if cfg.model == "scratch" else Path(cfg.model)
        codec = TextCodec.load(src) if src else TextCodec.tiny(alphabet(cfg))
    fns = envcheck.load_tools(cfg)
    task = tasks.task.build(cfg, codec, [t.schema for t in fns.values()])
    env = envcheck.load_env(cfg, task, fns)
    tools = envcheck.check_tools(cfg, codec, task, env, fns)
    if cfg.stage == "sft":  # a multi-turn reference must follow the token rule before anything is written
        for p in getattr(task, "train", []):
            if "episode" in p.columns:
                try:
                    reference(codec, p, p.columns["episode"], task.template_kwargs, task.tool_format)
                except (ValueError, AttributeError, TypeError) as e:
                    raise ConfigError(f"{p.where or cfg.task}: `episode` is not a multi-turn reference ({e})") from None
    torch.manual_seed(cfg.seed)
    model = model.to(cfg.device) if cfg.resume else load_model(cfg, src, codec)
    if not cfg.resume and cfg.lora_rank:
        add_adapters(cfg, model, src)
    if model.inv_freq.is_meta:  # under torchrun: each rank reads its own shard of the files
        whole = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}  # the adapters
        shard(model)
        hfdir.fill_shards(model, src, whole, cfg.device)
    task.fit_eval_set(cfg.max_new_tokens, model.args.max_position_embeddings, cfg.eval_every > 0,
                      envcheck.eval_prompt_length(cfg, codec, task, env, tools) if cfg.eval_every > 0 else None)
    if cfg.engine == "vllm":  # can vLLM report the support this loss needs? Ask before starting it
        vllm_logprobs(Sampling(top_k=cfg.top_k, support=reads_support(cfg)), model.args.vocab_size)
    if (n := codec.tok.get_vocab_size()) > model.args.vocab_size:
        raise ConfigError(f"{src}: tokenizer.json has {n} tokens, more than config.json's vocab_size "
                            f"{model.args.vocab_size} (ids past it would index outside the embedding)")
    if bad := [i for i in codec.stop_ids if not 0 <= i < model.args.vocab_size]:  # no sample could ever be one
        raise ConfigError(f"{codec.stop_source} {bad[0]} is outside the vocabulary [0, {model.args.vocab_size}) "
                            "of config.json: generation would never stop")
    if src is not None:
        check_copied(src)
    teacher = load_teacher(cfg, codec, model)  # its tokenizer must be the student's
    if cfg.epochs > 1 and not trained(cfg).clipped:  # (plain reinforce: refused by Config)
        print0(f"note: --epochs {cfg.epochs} with --loss {cfg.loss}: the later passes reweight by p/q against the "
               "sampler; nothing clips them against pi_old (ppo, cispo and gspo do)")
    return Start(out, src, resume_from, kept, seen, codec, task, model, env, tools, teacher)


def settled(cfg: Config) -> Config:
    """The derived values the flags alone cannot decide (Config.resolve settles those), settled once
    before anything is built, so every part of the run reads the same config: --adapter's rank, alpha
    and targets, --compile on turned off on a CPU with no C++ compiler (saying so), and
    --activation-checkpointing auto made off or blocks from the memory plan (`fit_memory`, which
    also stops a CUDA run whose plan exceeds its device). --plan settles no memory: it prints."""
    cfg = adapter_flags(cfg)
    if cfg.compile == "on" and not can_compile(cfg.device):
        cfg = dataclasses.replace(cfg, compile="off")
    if cfg.plan:
        return cfg
    return fit_memory(cfg, device_memory(cfg.device))


def adapter_flags(cfg: Config) -> Config:
    """--adapter DIR: the adapter's rank, alpha and targets become --lora-rank, --lora-alpha and
    --lora-targets (a value given that differs is refused); without it, `cfg` as it is."""
    if not cfg.adapter:
        return cfg
    try:
        spec, _, _ = lora.read_adapter(cfg.adapter)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"--adapter {cfg.adapter}: {e}") from None
    default = Config()
    given = {"lora_rank": (cfg.lora_rank, 0, spec.rank), "lora_alpha": (cfg.lora_alpha, default.lora_alpha, spec.alpha),
             "lora_targets": (tuple(sorted(cfg.lora_targets)), tuple(sorted(default.lora_targets)), spec.targets)}
    for k, (value, unset, theirs) in given.items():
        if value != unset and value != theirs:
            raise ConfigError(f"--{k.replace('_', '-')} {shown(value)} is not --adapter {cfg.adapter}'s "
                                f"{shown(theirs)} (its {lora.CONFIG}); leave the flag out")
    return dataclasses.replace(cfg, lora_rank=spec.rank, lora_alpha=spec.alpha, lora_targets=spec.targets)


def add_adapters(cfg: Config, model: Transformer, src: Path | None) -> None:
    """--lora-rank: adapters on `model` (lora.add refuses a rank above a layer's width, a target that
    names no layer); --adapter DIR: its tensors, once they fit the model and its base is --model's."""
    lora.add(model, lora.spec_of(cfg), cfg.base_dtype, cfg.device)
    if not cfg.adapter:
        return
    if src is None:
        raise ValueError(f"--adapter {cfg.adapter} needs the base it was trained on as --model (--model scratch is a "
                         "new random model)")
    spec, tensors, base = lora.read_adapter(cfg.adapter)
    try:
        lora.check_adapter(model, tensors, lora.WEIGHTS)
    except ValueError as e:
        raise ValueError(f"--adapter {cfg.adapter} does not fit --model {cfg.model}: {e}") from None
    named = Path(base)  # a local directory (floe writes the absolute path) is compared; a hub id cannot be
    if base and (named / "config.json").is_file() and named.resolve() != src.resolve():
        try:
            theirs = lora.weights_sha256(named)
        except ValueError as e:
            raise ValueError(f"--adapter {cfg.adapter}: its base {base}: {e}") from None
        if theirs != lora.weights_sha256(src):
            raise ValueError(f"--adapter {cfg.adapter} was trained on {base}, whose weights differ from --model "
                             f"{cfg.model}'s; give that base as --model")
    lora.load_adapter(model, tensors)


def check_same_flags(cfg: Config) -> None:
    """Under torchrun every trainer rank resolved the same config (one all_gather_object): a rank with
    its own --seed or --max-new-tokens would train on, on batches and shapes the others do not share.
    Every rank gets the same answer, so all of them stop."""
    if (other := first_other(json.loads(cfg.to_json()))) is None:
        return
    rank, ours, theirs = other
    k = next(k for k in ours if ours[k] != theirs.get(k))
    raise ConfigError(f"torchrun rank {rank} has other flags than rank 0: --{k.replace('_', '-')} is "
                        f"{json.dumps(theirs.get(k))} there, {json.dumps(ours[k])} on rank 0 (every rank must run "
                        "the same command)")


# flags of the rl stage alone: under sft nothing reads them
RL_FLAGS = ("async_level", "max_staleness", "engine_noise", "score_centering_k")
TOOL_FLAGS = ("tool_format", "max_tool_calls", "max_tool_calls_per_turn", "tool_timeout", "max_tool_result_chars")


# A mask's or the KL's flags, and the switch without which nothing reads them (--correction-metrics-only
# reports both masks, so it reads theirs)
SWITCHED = {"seq_mask_low": ("seq_mask", "--seq-mask geometric or max"),
            "seq_mask_high": ("seq_mask", "--seq-mask geometric or max"),
            "kl_mask_threshold": ("kl_mask", "--kl-mask k1, k3, binary or binary_tv"),
            "kl_estimator": ("kl_coeff", "--kl-coeff > 0"), "kl_staleness": ("kl_coeff", "--kl-coeff > 0"),
            "distill_estimator": ("distill_coeff", "--teacher DIR --distill-coeff > 0")}


def unread(cfg: Config) -> list[tuple[str, str, bool]]:
    """The loss's flags this config leaves unread, as (field, why, refused). Another loss's flags get a
    note (a sweep keeps one set of flags over several --loss); the flags of a mask or of the KL that is
    off are refused: the run would lack what the user tuned, and the line names the switch."""
    if cfg.stage == "sft":
        return [(f, "is not read with --stage sft", False) for f in (*_loss_flags(), *SWITCHED)]
    audit, read = cfg.correction_metrics_only, reads(cfg)
    trains = f"by --loss {cfg.loss}" + " under --correction-metrics-only" * audit
    out = [(f, f"is not read {trains} (it is --loss {', '.join(n for n, x in LOSSES.items() if f in x.reads)}'s)", False)
           for f in _loss_flags() if f not in read]
    for f, (switch, fix) in SWITCHED.items():
        value = getattr(cfg, switch)
        if value in ("off", 0) and not (audit and switch in ("seq_mask", "kl_mask")):
            out.append((f, f"has no effect with --{switch.replace('_', '-')} {value}: add {fix}", True))
    return out


def _loss_flags() -> list[str]:
    return list(dict.fromkeys(f for loss in LOSSES.values() for f in loss.reads))


def check_read(cfg: Config) -> None:
    """A flag set away from its default that nothing reads in this combination: a note where the run
    is still what the user asked for (another loss's or task's flag, an rl flag under sft), an error
    where it would lack what the flag tunes (a mask's bounds with the mask off: `unread`)."""
    found = unread(cfg)
    found += tasks.task.unread(cfg)  # another task's flags
    found += [(f, "is not read with --stage sft (it is for rl rollouts)", False) for f in RL_FLAGS if cfg.stage == "sft"]
    found += [(f, "is not read without --tool or an --env that declares tools()", False) for f in TOOL_FLAGS
              if not (cfg.tool or cfg.env)]
    if cfg.device == "cuda":
        found.append(("dist_timeout", "is not read on CUDA (NCCL keeps torch's 10-minute watchdog)", False))
    else:
        found.append(("plan_check", "is not read on a CPU (the plan checks a CUDA device)", False))
    found.append(("plan_world", "is read only with --plan (a run plans for its own ranks)", False))
    if not (cfg.lora_rank and cfg.engine == "vllm"):
        found.append(("lora_merged", "is read only with --engine vllm and --lora-rank (the built-in engine always merges)", False))
    if not cfg.lora_rank:  # the user asked for adapters and would get full fine-tuning
        found += [(f, "has no effect with --lora-rank 0 (full fine-tuning): add --lora-rank r", True)
                  for f in ("lora_alpha", "lora_targets")]
    for field, why, refused in found:
        value = getattr(cfg, field)
        if value == Config.__dataclass_fields__[field].default:
            continue
        flag = f"--{field.replace('_', '-')}" + ("" if value is True else f" {shown(value)}")
        if refused:
            raise ConfigError(f"{flag} {why}")
        print0(f"note: {flag} {why}; the run goes on without it")


def check_copied(src: Path) -> None:
    """What a checkpoint copies from `src` as it is (model.TOKENIZER_FILES) is what its name says: each
    .json parses as JSON. A symlink to some other file would otherwise go, by content, into every checkpoint."""
    for name in hfdir.TOKENIZER_FILES:
        f = src / name
        if name.endswith(".json") and f.is_file():
            try:
                json.loads(f.read_bytes())
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
                raise ValueError(f"{f}: not valid JSON ({e}); every checkpoint would copy it as it is") from None


def load_model(cfg: Config, src: Path | None, codec: TextCodec) -> Transformer:
    """The model in `src`, or with `--model scratch` (src None) a fresh tiny one in memory. Under torchrun
    the model in `src` stays on the meta device, its headers checked (hfdir.load_meta), for check_start
    to shard and fill from the files, each rank its own rows."""
    if src is not None and parallel.world() > 1:
        return hfdir.load_meta(src)[0]
    if src is not None:
        return hfdir.load(src, device=cfg.device)
    args = ModelArgs(codec.tok.get_vocab_size(), **TINY, eos_token_id=codec.stop_ids[0])
    model = Transformer(args)
    init_weights(model, seed=cfg.seed)
    return model.to(cfg.device)


def write_scratch(cfg: Config, out: Path, model: Transformer, task: Task) -> Path:
    """`--model scratch`: the fresh model as a HF directory in the run, for the engine and checkpoints."""
    src = out / "scratch"
    if RANK == 0:
        hfdir.remove_path(src)  # a run started over makes its model anew (a symlink there is not followed)
        src.mkdir()
        write_tokenizer(src, task.alphabet)
        hfdir.save(model, src, src, state=lora.base_state(model) if model.lora else None)  # LoRA: the base it trains on
    if parallel.world() > 1:
        dist.barrier()
    return src


def build(cfg: Config, src: Path, model: Transformer, codec: TextCodec, link: Link | None = None):
    """Engine, sharded model, optimizer and the (compiled) forward, around the loaded model; `link`
    (setup_distributed's, --inference-gpus) reaches the sampling ranks."""
    if cfg.inference_gpus:  # the last ranks sample (run/remote.py): they load `src` once rank 0 says so
        engine = RemoteEngine(link, cfg.seed + RANK, cfg.engine_dtype, model.lora)
        if RANK == 0:
            engine.start(src)
        if model.lora is not None:  # the ranks loaded LoRA's base: the adapter (an --adapter's, say) goes in now
            engine.load_weights(model, 0)
    else:
        engine = make_engine(cfg, model, src, codec.stop_ids, cfg.seed + RANK)
    model.checkpointing = cfg.activation_checkpointing == "blocks"  # settled: off or blocks
    if model.checkpointing and cfg.device == "cpu":
        map_large_buffers()
    shard(model)  # after the engine took its full copy
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    # a CPU's buffers end at a multiple of 64 past their last document (train.prepare): one graph with a
    # symbolic length serves them all; CUDA's are all [T] (flex's BlockMask, CUDA graphs), one static graph.
    # Compiled, it serves the pi_old pass (train.old_logprobs); the trained pass is `trainer_step`'s region
    cpu = torch.device(cfg.device).type == "cpu"
    fwd = compiled(model, "trainer forward", dynamic=True if cpu else None) if cfg.compile == "on" else model
    return fwd, engine, opt


def trainer_step(cfg: Config, fn):
    """--compile on: `fn` (train.micro_loss: one micro-batch's forward, head and loss) as one compiled region,
    `trainer step`, with the model whole inside it; None otherwise. Shaped as `build`'s forward: symbolic
    sizes on a CPU, static [T] on CUDA but for the support's [nnz], which varies by micro-batch on both.
    What runs eager inside it (on the CPU reference, kernels.py: the sparse backward, `_sparse_head`, and a head
    of several chunks, `_sliced`) breaks the graph there, and tracing resumes in the frame it broke in
    (model.compiled)."""
    if cfg.compile != "on":
        return None
    graph = compiled(fn, "trainer step", dynamic=True if torch.device(cfg.device).type == "cpu" else None)

    def call(cfg, model, fwd, mb, *args):
        if mb.support is not None:  # a new length is no new graph
            for t in (mb.support.ids, mb.support.logq):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return graph(cfg, model, model, mb, *args)

    return call


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAPPED_FROM, TRIM_AT = 4 << 20, 64 << 20


def map_large_buffers() -> bool:
    """On a CPU, recomputed blocks save memory only if what they free goes back to the system. glibc's
    malloc raises its mmap threshold to the largest buffer it has freed (up to 32 MiB) and from then
    serves such buffers from its heap, which keeps a freed middle: recomputing a block allocates and
    frees the same few-MB activations once a layer in the backward, and the heap grows by much of what
    checkpointing was to save. Fixed thresholds stop that: a buffer of MAPPED_FROM or more is its own
    mapping, unmapped when freed, and the heap's top is trimmed only past TRIM_AT (where the dynamic
    trim threshold would have gone). The price is a page fault per page each time a buffer is
    allocated (docs/experiments.md measures both). Not glibc (macOS, musl), or the user's own
    MALLOC_MMAP_THRESHOLD_: left as it is. True when set."""
    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_AT))


def can_compile(device: str) -> bool:
    """torch.compile on a CPU builds C++: without a compiler the run goes on eager, saying so."""
    if device != "cpu" or shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++"):
        return True
    print0("note: --compile on needs a C++ compiler on a CPU (none found: set CXX or install g++); running eager")
    return False


def close_compiler() -> None:
    """Inductor keeps a pool of compile threads for the process: it ends with the run, so the exit
    does not take those threads for ones user code left running (usercode.main_then_leave)."""
    from torch._inductor.async_compile import AsyncCompile
    if AsyncCompile.pool.cache_info().currsize:
        AsyncCompile.pool().shutdown(wait=True)
        AsyncCompile.pool.cache_clear()
