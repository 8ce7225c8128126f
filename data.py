"""The records every module passes around, and how samples become micro-batches: a task's
`Prompt`, a scored `Sample`, the sampler's `TokenSupport`, the packed `MicroBatch`, and `RunError`,
the one line a step that cannot go on stops with; `pack` (samples into fixed-size micro-batches)
and `my_share` (each rank's share of them).

Simplifications:
1. `TokenSupport` is CSR: per-token rows of ids and sampler log-probs, never padded. Its
   offsets live on the device and on the host, so slicing a micro-batch needs no sync.
2. Packing is greedy first-fit-decreasing into buffers of a fixed size; the packing section
   below says why and how a group's prompt is shared.

Tokenizers and chat templates live in tasks/textcodec.py; tasks (prompts, rewards, the held-out
set) in tasks/task.py.

    python -m pytest -q tests/test_packing.py   # against the unshared packing and a dense reference
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

class RunError(ValueError):
    """Input the step cannot go on with (bad sampler evidence, a sample or prompt that does
    not fit): train.py prints the message as one line and exits 1."""


# ----------------------------------------------------------------------------- records

@dataclass
class Prompt:
    """One prompt of a task (tasks/task.py), rendered to token ids."""

    ids: list[int]  # the rendered prompt's tokens
    prompt: str | list[dict]  # as the task gave it (a string or chat messages): what a reward function receives
    columns: dict = field(default_factory=dict)  # the row's other columns (answer, target, ...), for the reward
    reference: str | None = None  # the reference completion (--stage sft); None where the task has none
    where: str = ""  # a file's row as FILE:LINE, for a line that refuses it


def is_messages(x) -> bool:
    """A list of chat messages: dicts with a string `role` and a string `content` (empty: none)."""
    return isinstance(x, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in x)


def truncated(top_p: float, top_k: int) -> bool:
    """Whether sampling keeps only a top-p/top-k set: its support rows are that set (replayed),
    else K draws from the whole distribution."""
    return top_p < 1.0 or top_k > 0


def entry_rows(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """The row of each of a CSR's nnz entries, from its offsets, without a host sync; cummax keeps
    it in range on broken offsets (the evidence checks read it before they reject them)."""
    mono, at = torch.cummax(offsets, 0).values, torch.arange(nnz, device=offsets.device)
    return (torch.searchsorted(mono, at, right=True) - 1).clamp(0, offsets.numel() - 2)


@dataclass
class TokenSupport:
    """Ragged per-token support (docs/design.md "TokenSupport"): row t is ids[offsets[t]:offsets[t+1]]."""

    ids: torch.Tensor  # int32 [nnz]
    offsets: torch.Tensor  # int64 [N+1], on the device
    logq: torch.Tensor  # float32 [nnz] sampler log-prob of each entry
    replayed: torch.Tensor  # bool [N]: truncated support (u = q), else K draws (u = 1/K)
    host_offsets: np.ndarray  # int64 [N+1], the same offsets on the host

    @property
    def num_rows(self) -> int:
        return len(self.host_offsets) - 1

    @property
    def nnz(self) -> int:
        return int(self.host_offsets[-1])

    @staticmethod
    def empty(n: int, device: torch.device | str = "cpu") -> TokenSupport:
        return TokenSupport(torch.zeros(0, dtype=torch.int32, device=device),
                            torch.zeros(n + 1, dtype=torch.int64, device=device),
                            torch.zeros(0, dtype=torch.float32, device=device),
                            torch.zeros(n, dtype=torch.bool, device=device),
                            np.zeros(n + 1, dtype=np.int64))

    @staticmethod
    def from_counts(ids: torch.Tensor, counts: np.ndarray, logq: torch.Tensor, replayed: torch.Tensor) -> TokenSupport:
        """Rows of counts[t] entries each, on the CPU; the offsets are their running sum."""
        host = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return TokenSupport(ids, torch.from_numpy(host.copy()), logq, replayed, host)

    @staticmethod
    def cat(parts: list[TokenSupport]) -> TokenSupport:
        host = [np.zeros(1, dtype=np.int64)]
        base = 0
        for p in parts:
            host.append(p.host_offsets[1:] + base)
            base += p.nnz
        host_offsets = np.concatenate(host)
        device = parts[0].ids.device
        return TokenSupport(torch.cat([p.ids for p in parts]),
                            torch.from_numpy(host_offsets).to(device),
                            torch.cat([p.logq for p in parts]),
                            torch.cat([p.replayed for p in parts]),
                            host_offsets)

    def slice(self, start: int, stop: int) -> TokenSupport:
        """Rows [start, stop); uses the host offsets only, so no device sync."""
        a, b = int(self.host_offsets[start]), int(self.host_offsets[stop])
        host = self.host_offsets[start:stop + 1] - a
        return TokenSupport(self.ids[a:b], self.offsets[start:stop + 1] - a, self.logq[a:b],
                            self.replayed[start:stop], host)

    def to(self, device: torch.device | str) -> TokenSupport:
        return TokenSupport(self.ids.to(device), self.offsets.to(device), self.logq.to(device),
                            self.replayed.to(device), self.host_offsets)

    def __reduce__(self):
        """Pickles (torchrun's sample exchange) as numpy, back on the CPU: a sample's rows are a view
        of the engine's whole step, and a pickled tensor view carries its whole storage."""
        arrays = tuple(t.cpu().numpy() for t in (self.ids, self.offsets, self.logq, self.replayed))
        return _support_from_numpy, (*arrays, self.host_offsets)


def _support_from_numpy(ids, offsets, logq, replayed, host_offsets) -> TokenSupport:
    return TokenSupport(*(torch.from_numpy(a) for a in (ids, offsets, logq, replayed)), host_offsets)


@dataclass
class Sample:
    """One prompt plus one completion, with the sampler's evidence for every token."""

    prompt: Prompt
    completion: list[int]  # sampled ids, the stop token included when there was one
    logq: list[float]  # sampler log-prob of each completion token
    versions: list[int]  # policy version of the weights that sampled each token
    finish_reason: str  # "stop" or "length"
    support: TokenSupport | None = None  # one row per completion token
    reward: float = 0.0
    advantage: float = 0.0
    # a multi-turn episode (agents/episodes.py): `completion` is everything after the prompt, the model's
    # turns and the environment's replies; per token, whether the model sampled it (only those are
    # trained: the replies' logq, versions and support rows are placeholders nothing reads) and its
    # model turn (-1 on a reply). None: every completion token is the model's, turn 0.
    mask: list[bool] | None = None
    turns: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt.ids + self.completion


@dataclass
class MicroBatch:
    """A packed token buffer; every tensor is [T]: T = --micro-batch-tokens, or less where
    `pack` trims the padding (an eager CPU forward)."""

    tokens: torch.Tensor  # int64 input ids
    positions: torch.Tensor  # int64 position inside its document (RoPE)
    doc_ids: torch.Tensor  # int64 document index in this buffer; each padding token is one more
    labels: torch.Tensor  # int64 the next token, scored at this position (0 where unused)
    loss_mask: torch.Tensor  # bool: this position's label is a trained completion token
    advantages: torch.Tensor  # float32 per token (the sample's advantage)
    logq: torch.Tensor  # float32 sampler log-prob of the label
    versions: torch.Tensor  # int64 policy version that sampled the label
    sample_idx: torch.Tensor  # int64 index of the sample in the step's list; -1 on padding and shared prompts
    support: TokenSupport | None  # T rows; empty rows where nothing is centered
    num_loss_tokens: int  # host-side count, for global normalization
    samples: list[int] = field(default_factory=list)  # the samples packed here, in order
    parents: torch.Tensor | None = None  # int64 the document (a shared prompt) each token's document continues, else -1
    turns: torch.Tensor | None = None  # int64 the model turn of each loss token's label (0 single-turn), -1 elsewhere

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        if self.support is not None:
            moved["support"] = self.support.to(device)
        return MicroBatch(**moved)


# ----------------------------------------------------------------------------- packing

# Packing: samples into fixed-size micro-batches (`pack`), and each rank's share of them (`my_share`).
#
# Simplifications:
# 1. Packing is greedy first-fit-decreasing into fixed-size buffers of
#    `--micro-batch-tokens` tokens: every micro-batch has the same shape, so a compiled
#    forward never recompiles. Attention stays inside a document (`doc_ids`).
#    Samples with the same prompt (an RL group) share one copy of it: the buffer holds the
#    prompt but its last token once, as its own document, then per sample a document of
#    [last prompt token] + completion, whose `parents` entry names the prompt's document, so it
#    attends to the prompt and to itself (a tree, not a block-diagonal mask). Exact, and on the
#    default job several times fewer tokens (docs/experiments.md "2026-12-01: the CPU step,
#    before and after four changes").


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
