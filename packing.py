"""Packing: samples into fixed-size micro-batches (`pack`), and each rank's share of them (`my_share`).

Simplifications:
1. Packing is greedy first-fit-decreasing into fixed-size buffers of
   `--micro-batch-tokens` tokens: every micro-batch has the same shape, so a compiled
   forward never recompiles. Attention stays inside a document (`doc_ids`).
   Samples with the same prompt (an RL group) share one copy of it: the buffer holds the
   prompt but its last token once, as its own document, then per sample a document of
   [last prompt token] + completion, whose `parents` entry names the prompt's document, so it
   attends to the prompt and to itself (a tree, not a block-diagonal mask). Exact, and on the
   default job several times fewer tokens (docs/experiments.md "2026-12-01: the CPU step,
   before and after four changes").

    python -m pytest -q tests/test_packing.py   # against the unshared packing and a dense reference
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from data import MicroBatch, RunError, Sample, TokenSupport

def pack(samples: list[Sample], micro_batch_tokens: int, share_prompts: bool = True,
         trim: int | None = None) -> list[MicroBatch]:
    """First-fit-decreasing of prompt groups into [T] buffers; a sample never straddles two, and
    a group that does not fit one buffer is split, each part with its own prompt copy.

    Buffers are all [T] (fixed shapes: what torch.compile and flex attention want), or with
    `trim` each ends at the first multiple of `trim` past its last document: eager, the padding
    would be computed like any token (the default job's last buffer is often mostly padding)."""
    T = micro_batch_tokens
    for i, s in enumerate(samples):
        if len(s.ids) - 1 > T:  # the last token is only ever a label
            raise RunError(f"sample {i} has {len(s.ids)} tokens, more than --micro-batch-tokens {T}")
    units = _units(samples, T) if share_prompts else [[i] for i in range(len(samples))]
    bins: list[list[list[int]]] = []
    room: list[int] = []
    for u in sorted(units, key=lambda u: -_size(samples, u)):
        n = _size(samples, u)
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([])
            room.append(T)
            j = len(bins) - 1
        bins[j].append(u)
        room[j] -= n
    return [_fill(samples, sorted(b), T if trim is None else min(T, -(-(T - r) // trim) * trim))
            for b, r in zip(bins, room)]


def _size(samples: list[Sample], unit: list[int]) -> int:
    """Buffer tokens of a unit: one sample alone, or a shared prompt (but its last token) and
    each completion after that token."""
    if len(unit) == 1:
        return len(samples[unit[0]].ids) - 1
    return len(samples[unit[0]].prompt.ids) - 1 + sum(len(samples[i].completion) for i in unit)


def _units(samples: list[Sample], T: int) -> list[list[int]]:
    """Samples with equal prompt ids, in order, cut where the next one would not fit one buffer."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt.ids), []).append(i)
    units = []
    for idx in groups.values():
        units.append([])
        for i in idx:
            if units[-1] and _size(samples, units[-1] + [i]) > T:
                units.append([])
            units[-1].append(i)
    return units


def _fill(samples: list[Sample], units: list[list[int]], T: int) -> MicroBatch:
    cols = {k: np.zeros(T, dtype=np.int64) for k in ("tokens", "positions", "doc_ids", "labels", "versions")}
    parents = np.full(T, -1, dtype=np.int64)
    mask = np.zeros(T, dtype=bool)
    adv, logq = np.zeros(T, dtype=np.float32), np.zeros(T, dtype=np.float32)
    sample_idx, turns = np.full(T, -1, dtype=np.int64), np.full(T, -1, dtype=np.int64)
    flat = [i for u in units for i in u]
    has_support = any(samples[i].support is not None for i in flat)
    rows: list[TokenSupport] = []
    at = d = 0

    def put(ids, labels, start, parent, i=None):  # one document at the next slots
        nonlocal at, d
        sl = slice(at, at + len(ids))
        cols["tokens"][sl], cols["labels"][sl], cols["doc_ids"][sl] = ids, labels, d
        cols["positions"][sl], parents[sl] = np.arange(start, start + len(ids)), parent
        if i is not None:  # a sample: its completion tokens are the labels from `c` on
            s = samples[i]
            c = slice(sl.stop - len(s.completion), sl.stop)
            sample_idx[sl], adv[c], logq[c], cols["versions"][c] = i, s.advantage, s.logq, s.versions
            mask[c] = True if s.mask is None else s.mask  # an episode trains its model tokens only
            turns[c] = 0 if s.turns is None else s.turns
            turns[c] = np.where(mask[c], turns[c], -1)
            if has_support:
                rows.append(TokenSupport.empty(c.start - at))
                rows.append(s.support if s.support is not None else TokenSupport.empty(len(s.completion)))
        elif has_support:
            rows.append(TokenSupport.empty(len(ids)))
        at, d = sl.stop, d + 1
        return d - 1

    for u in units:
        if len(u) == 1:
            ids = samples[u[0]].ids
            put(ids[:-1], ids[1:], 0, -1, u[0])
            continue
        prompt = samples[u[0]].prompt.ids
        P = len(prompt)
        shared = put(prompt[:-1], prompt[1:], 0, -1) if P > 1 else -1
        for i in u:
            c = samples[i].completion
            if c:
                put([prompt[-1]] + c[:-1], c, P - 1, shared, i)
    pad = T - at
    cols["doc_ids"][at:] = d + np.arange(pad)  # padding: one-token documents, never trained
    if has_support:
        rows.append(TokenSupport.empty(pad))
    t = {k: torch.from_numpy(v) for k, v in cols.items()}
    return MicroBatch(t["tokens"], t["positions"], t["doc_ids"], t["labels"], torch.from_numpy(mask), torch.from_numpy(adv), torch.from_numpy(logq), t["versions"],
                      torch.from_numpy(sample_idx), TokenSupport.cat(rows) if has_support else None,
                      int(mask.sum()), flat, torch.from_numpy(parents), torch.from_numpy(turns))


# ----------------------------------------------------------------------------- each rank's share

def my_share(mbs: list[MicroBatch], rank: int, world: int) -> list[MicroBatch]:
    """The micro-batches that rank `rank` of `world` trains on, dealt round-robin fullest first:
    loss tokens balance within one micro-batch, and every rank runs the same number (each FSDP
    forward and backward is a collective), a rank left one short running an all-masked copy,
    which adds exactly zero."""
    order = sorted(range(len(mbs)), key=lambda i: -mbs[i].num_loss_tokens)
    mine = [mbs[i] for i in sorted(order[rank::world])]
    pad = [replace(mb, loss_mask=torch.zeros_like(mb.loss_mask), num_loss_tokens=0) for mb in mbs[:1]]
    return mine + pad * (-(-len(mbs) // world) - len(mine))
