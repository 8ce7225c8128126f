"""Sampling for the built-in engine (engines/torch_engine.py): a decode step's logits to a draw and
the sampler's evidence the loss needs, with no host sync.

1. `truncate`: top-k, then top-p over what is left (vLLM's order), as -inf logits.
2. `sample`: the exponential-race form of categorical sampling (argmax(p / Exp(1)) is a draw from
   p), returning each row's draw, its log q and the whole renormalized log q.
3. `draw`: K i.i.d. draws per row by inverse CDF, the support of untruncated sampling.
4. `SupportRecorder`: each decode step's support rows (the kept set under truncation, else K
   draws), ordered once into one CSR `TokenSupport` per sample.
`s` below is the call's engines/torch_engine.py `Sampling` (the contract's; this module sits under
it, so it names the class without importing it).

    python -m pytest -q tests/test_support.py tests/test_torch_engine.py
"""

from __future__ import annotations

import torch

from data import TokenSupport, truncated


def truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k, then outside the smallest top-p nucleus of what is left
    (vLLM's order). logits (B, V) already divided by the temperature."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = mass_before >= top_p  # keeps the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, s, gen: torch.Generator | None):
    """logits (B, V) fp32 -> sampled ids (B,), their sampler log-prob (B,), and the
    sampler's log-probs (B, V): -inf outside a truncated support."""
    logprobs = truncate(logits / s.temperature, s.top_k, s.top_p).log_softmax(-1)
    race = torch.empty_like(logprobs).exponential_(1.0, generator=gen)
    tok = (logprobs - race.log()).argmax(-1)  # argmax p / Exp(1): a draw from p
    return tok, logprobs.gather(1, tok[:, None])[:, 0], logprobs


def draw(logprobs: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    """k i.i.d. draws per row from exp(logprobs) (B, V) by inverse CDF -> ids (B, k).
    Memory stays O(B*V) where an exponential race would need O(B*k*V)."""
    cdf = logprobs.exp().cumsum(-1)
    u = torch.rand(logprobs.shape[0], k, generator=gen, device=logprobs.device) * cdf[:, -1:]
    # right=True: the first index whose cdf exceeds u, so a zero-probability token is never drawn
    return torch.searchsorted(cdf, u, right=True).clamp(max=logprobs.shape[1] - 1)


class SupportRecorder:
    """Collects each decode step's support rows; `rows(b, length)` builds a sample's CSR.

    Truncated sampling records the kept set with its renormalized log q (replayed rows);
    untruncated sampling records K draws from q (u = 1/K). Extracting a kept set is one
    nonzero per step, a host sync on CUDA: fine for the built-in engine, whose job is the
    CPU and small GPU runs (the vLLM engine is the one for scale)."""

    def __init__(self, s, batch: int, device):
        self.replayed = truncated(s.top_p, s.top_k)
        self.k, self.batch, self.device = s.draws, batch, device
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def record(self, logprobs: torch.Tensor, gen, rows: torch.Tensor) -> None:
        """One decode step: logprobs (R, V) of the output rows `rows` (R,) still being decoded."""
        if self.replayed:
            b, v = torch.isfinite(logprobs).nonzero(as_tuple=True)
            self.steps.append((rows[b], v, logprobs[b, v]))
        else:
            ids = draw(logprobs, self.k, gen)
            # every output row's slot; those of rows already done stay 0 and are never read
            all_ids = ids.new_zeros(self.batch, self.k).index_copy_(0, rows, ids)
            all_logq = logprobs.new_zeros(self.batch, self.k).index_copy_(0, rows, logprobs.gather(1, ids))
            self.steps.append((None, all_ids, all_logq))

    def finish(self) -> None:
        """Order every entry by (row, step) once; each sample's rows are then one slice."""
        T, B = len(self.steps), self.batch
        if self.replayed:
            key = torch.cat([b * T + t for t, (b, _, _) in enumerate(self.steps)])
            ids = torch.cat([v for _, v, _ in self.steps])
            logq = torch.cat([q for _, _, q in self.steps])
            order = key.argsort(stable=True)
            self.ids, self.logq = ids[order].int().cpu(), logq[order].float().cpu()
            counts = torch.bincount(key, minlength=B * T).cpu()
        else:
            self.ids = torch.stack([v for _, v, _ in self.steps], 1).flatten().int().cpu()  # (B, T, K) flat
            self.logq = torch.stack([q for _, _, q in self.steps], 1).flatten().float().cpu()
            counts = torch.full((B * T,), self.k)
        self.T, self.offsets = T, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).numpy()

    def rows(self, b: int, length: int) -> TokenSupport:
        a, z = self.offsets[b * self.T], self.offsets[b * self.T + length]
        host = self.offsets[b * self.T: b * self.T + length + 1] - a
        return TokenSupport(self.ids[a:z], torch.from_numpy(host.copy()), self.logq[a:z],
                            torch.full((length,), self.replayed), host.copy())
