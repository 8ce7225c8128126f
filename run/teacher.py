"""The teacher of on-policy distillation (--teacher DIR --distill-coeff λ): a frozen model the
student's own samples are scored by, its log-probs read by terms.distill_term.

`load_teacher` runs at the start checks, before the run writes its first byte: the directory
loads (a missing or damaged one is one line naming --teacher), its tokenizer is the student's
(token -> id, every token, not only the count: the same ids must mean the same text, or the KL
compares unrelated tokens), and its vocab_size is the student's (the head's rows). It is frozen:
eval, requires_grad False, fp32 like the trainer's weights; under --train-dtype bf16/fp16 its
matmuls run under the same autocast as the student's (train._head). Under torchrun it is
sharded like the student (layers.parallel.shard), each rank reading its own rows. `--teacher base`
under LoRA is the student itself with its adapters off: the frozen base, no extra memory.

Simplifications:
1. The teacher scores at the sampling temperature, with the same head and support rows as the
   student: on a replayed top-p/top-k row both are renormalized over the kept set.
2. Its forward is eager, also under --compile on: no second set of graphs to build and guard.
   Whether compiling it pays on a GPU is not measured yet.
3. `Clock` times the teacher's forwards (time/teacher) without a host sync of its own: on CUDA
   by events, read after the step's one sync.

    python train.py --teacher checkpoints/guess-tiny --distill-coeff 1.0 --adv-tau 0   # pure distillation
    python train.py --lora-rank 8 --teacher base --distill-coeff 0.1     # LoRA, kept near its frozen base
    python -m pytest -q tests/test_distill.py
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import Config, ConfigError
from layers import lora, parallel
from layers.parallel import shard
from model import Transformer
from run import hfdir
from tasks.textcodec import TextCodec


@dataclass
class Teacher:
    """What scores the student's samples: a frozen model of its own, or (--teacher base) LoRA's student
    itself with its adapters off (layers.lora.adapters_off): the frozen base, no second copy."""

    model: Transformer
    base: bool = False

    def off(self):
        return lora.adapters_off(self.model) if self.base else contextlib.nullcontext()


def load_teacher(cfg: Config, codec: TextCodec, student: Transformer) -> Teacher | None:
    """--teacher's model, checked against the student's tokenizer and vocabulary; None without it."""
    if not cfg.teacher:
        return None
    if cfg.teacher == "base":  # the student's own base: its tokenizer and head, sharded with it
        return Teacher(student, base=True)
    d = Path(cfg.teacher)
    if not d.is_dir():
        raise ConfigError(f"--teacher {cfg.teacher}: {'not a directory' if d.exists() else 'no such directory'}")
    try:
        theirs = TextCodec.load(d)
        same_vocabulary(codec, theirs)
        if parallel.world() > 1:  # the sharded load, as the student's (start.check_start)
            model = hfdir.load_meta(d)[0]
            check_head(model, student)
            shard(model)
            hfdir.fill_shards(model, d, {}, cfg.device)
        else:
            model = hfdir.load(d, device=cfg.device)
            check_head(model, student)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"--teacher {cfg.teacher}: {e}") from None
    model.eval().requires_grad_(False)
    model.checkpointing = False  # no backward: nothing to recompute
    return Teacher(model)


def same_vocabulary(ours: TextCodec, theirs: TextCodec) -> None:
    """The student's and the teacher's token -> id maps are equal (added tokens included)."""
    a, b = ours.tok.get_vocab(with_added_tokens=True), theirs.tok.get_vocab(with_added_tokens=True)
    if a == b:
        return
    if len(a) != len(b):
        raise ValueError(f"its tokenizer has {len(b)} tokens, the student's {len(a)}; distillation needs the same tokenizer")
    token = min((t for t in a if a[t] != b.get(t)), key=lambda t: a[t])
    where = f"id {b[token]}" if token in b else "no id"
    raise ValueError(f"its tokenizer differs from the student's: {token!r} is id {a[token]} in the student's, {where} in "
                     "the teacher's; distillation needs the same tokenizer")


def check_head(teacher: Transformer, student: Transformer) -> None:
    """The same rows in the head: a padded vocabulary of another size would put mass on ids the student lacks."""
    if teacher.args.vocab_size != student.args.vocab_size:
        raise ValueError(f"config.json's vocab_size is {teacher.args.vocab_size}, the student's "
                         f"{student.args.vocab_size}; the two heads must score the same ids")


class Clock:
    """Seconds spent in a region over a step. A CPU times it directly; CUDA records a pair of events
    around it, read by `seconds` after the step's metrics were read (their one host sync)."""

    def __init__(self, device: str):
        self.cuda, self.spans = device == "cuda", []

    @contextlib.contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - t0)

    def seconds(self) -> float:
        """The step's total, and a fresh count for the next step."""
        total = 0.0
        for s in self.spans:
            if self.cuda:
                s[1].synchronize()  # done already: the step's metrics were read after it
                total += s[0].elapsed_time(s[1]) / 1e3
            else:
                total += s
        self.spans = []
        return total
