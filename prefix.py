"""What the built-in engine keeps between calls: the KV cache rows of its last call, so that a
call whose prompts extend them (a multi-turn episode's next turn) prefills only the new tokens.

The engine contract stays one stateless `generate` (engines.py `Engine`): a prompt is an
episode's whole ids so far, and a call's results do not depend on what was kept except through
the order of floating-point sums (a kept key was computed by a decode step, not by a prefill).
`TorchEngine` keeps every output row of its last call when the caller says a next call may
extend them (`keep`: the episode loop's turns; a single-turn rollout and an eval pass False):
its ids (prompt + completion) and its cache row, whose first len(ids) - 1 slots are valid (the
last sampled token was never fed through the model). A later prompt that starts with those ids,
token for token, gets the row's slots copied and only its suffix prefilled, at the row's own
positions (model.forward_cached).

Simplifications:
1. Only the last call's rows, and only exact token matches: memory stays one decode cache, and
   a match is a list comparison. A multi-turn step's turns are consecutive calls over the same
   episodes, which is the case this serves; vLLM's prefix cache (blocks hashed by content, any
   earlier request) is the general form.
2. The rows are dropped when the weights change (`load_weights`: keys computed by older
   weights are not the new weights' keys) and when the caller says the rollout is over
   (`idle`); TorchEngine.reuse = False turns keeping off (re-prefill every prompt).
3. Each prompt takes the one kept row that covers the most of it; prompts with no match
   prefill from the start in the same right-padded batch (a batch is as long as its longest
   suffix).

    python -m pytest -q tests/test_prefix.py     # continued calls against a full forward
    python bench/turns.py                        # what a turn costs, kept and re-prefilled
"""

from __future__ import annotations

import torch


class KeptRows:
    """The engine's last call, kept for the next: every output row's ids (prompt + completion)
    and its KV cache row. Its first len(ids) - 1 slots are valid (the last sampled token was
    never fed through the model), so a later prompt that starts with those ids, token for
    token, needs only the rest prefilled: a multi-turn episode's next turn."""

    def __init__(self, cache, ids: list[list[int]]):  # cache: a model.KVCache of len(ids) rows
        self.cache, self.ids = cache, ids
        self.valid = [len(x) - 1 for x in ids]
        self.key = min(self.valid)  # rows are looked up by their first `key` ids, then compared whole
        self.index: dict[tuple[int, ...], list[int]] = {}
        for b, x in enumerate(ids):
            self.index.setdefault(tuple(x[: self.key]), []).append(b)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """(row, m): the kept row whose valid ids are the longest start of `prompt` that leaves at
        least one token to prefill (the last position's logits come from the prefill); (0, 0): none."""
        best = (0, 0)
        for b in self.index.get(tuple(prompt[: self.key]), ()):
            m = self.valid[b]
            if best[1] < m < len(prompt) and prompt[:m] == self.ids[b][:m]:
                best = (b, m)
        return best

    def copy_into(self, cache, dest: list[int], hits: list[tuple[int, int]]) -> None:
        """Row dest[i] of `cache` gets kept row hits[i][0]'s first slots. Slots past a row's own
        m come along too: the prefill and decoding overwrite them before any query reaches them."""
        dst = torch.tensor(dest, device=cache.layers[0][0].device)
        src = torch.tensor([b for b, _ in hits], device=dst.device)
        w = max(m for _, m in hits)
        for (k, v), (kk, kv) in zip(cache.layers, self.cache.layers):
            k[dst, :, :w] = kk[src, :, :w]
            v[dst, :, :w] = kv[src, :, :w]
