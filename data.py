"""The records every module passes around: a task's `Prompt`, a scored `Sample`, the sampler's
`TokenSupport` and the packed `MicroBatch` (packing.py packs samples into micro-batches), and
`RunError`, the one line a step that cannot go on stops with.

Simplifications:
1. `TokenSupport` is CSR: per-token rows of ids and sampler log-probs, never padded. Its
   offsets live on the device and on the host, so slicing a micro-batch needs no sync.

Tokenizers and chat templates live in textcodec.py; tasks (prompts, rewards, the held-out set)
in tasks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

class RunError(ValueError):
    """Input the step cannot go on with (bad sampler evidence, a sample or prompt that does
    not fit): train.py prints the message as one line and exits 1."""


# ----------------------------------------------------------------------------- records

@dataclass
class Prompt:
    """One prompt of a task (tasks.py), rendered to token ids."""

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
    # a multi-turn episode (episodes.py): `completion` is everything after the prompt, the model's
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
