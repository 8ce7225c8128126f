"""What the built-in engine holds of keys and values: the decode cache (`KVCache`), a call's rows kept
for the next call (`KeptRows`), and the fixed-shape caches a static decode reuses (`Slots`).

    python -m pytest -q tests/test_prefix.py tests/test_torch_engine.py
"""

from __future__ import annotations

import torch

from model import ModelArgs


class KVCache:
    """Static per-layer key/value buffers (B, n_kv, max_len, hd), as gpt-fast keeps them."""

    def __init__(self, a: ModelArgs, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (batch, a.num_key_value_heads, max_len, a.head_dim)
        self.max_len, self.whole = max_len, None  # whole: the cache this one is the first rows of (`rows`)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(a.num_hidden_layers)]

    @property
    def batch(self) -> int:
        return self.layers[0][0].shape[0]

    def _of(self, layers: list) -> KVCache:
        out = object.__new__(KVCache)
        out.max_len, out.whole, out.layers = self.max_len, None, layers
        return out

    def repeat(self, n: int) -> KVCache:
        """Each row n times in a row: prefill a prompt once, decode its group of n."""
        return self._of([(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in self.layers])

    def select(self, rows: torch.Tensor) -> KVCache:
        """Only these rows (R,), in this order: decoding drops the rows that have finished."""
        return self._of([(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.layers])

    def rows(self, batch: int) -> KVCache:
        """A view of the first `batch` rows (its writes land in these buffers), `whole` = this cache."""
        out = self._of([(k[:batch], v[:batch]) for k, v in self.layers])
        out.whole = self
        return out

    def put(self, rows: torch.Tensor, part: KVCache) -> None:
        """Write `part`'s rows into these rows (R,): the engine keeps each row's cache as it leaves."""
        for (k, v), (pk, pv) in zip(self.layers, part.layers):
            k.index_copy_(0, rows, pk)
            v.index_copy_(0, rows, pv)


# ----------------------------------------------------------------------------- static slots

# gpt-fast's decode, which CUDA graphs need: every call decodes into a cache the engine keeps for the
# run, so the decode step sees the same buffers at the same addresses call after call (a captured graph
# replays its kernels on the addresses it was captured with) and a few fixed shapes.
#
# 1. One cache per batch size, rounded up to a power of two (the call's rows first, the padding rows
#    after them decode position 0 and are dropped), as long as a power of two, at least 64, that
#    covers the call's prompts and budget. Slots past a row's position are masked (forward_cached),
#    so a cache longer than a call needs, and what an earlier call left in it, change nothing.
# 2. A longer call replaces its batch's cache with a longer one: a new graph, and the lengths
#    double, so a run builds a few graphs, counted by compile/graphs.
# 3. A call made while another decodes (an eval inside a partial rollout's `between`) takes a cache
#    of its own (`depth`): it never writes the rows the waiting call will go on with.
# 4. The caches stay between calls and steps (the memory plan does not count the engine's caches):
#    freeing them would give the next call new addresses, and so a new graph.


class Slots:
    """The static decode's caches, by (batch, depth): `take` one for a call, `give` it back."""

    def __init__(self, a: ModelArgs, dtype: torch.dtype, device):
        self.args, self.dtype, self.device = a, dtype, device
        self.caches: dict[tuple[int, int], KVCache] = {}
        self.busy: set[tuple[int, int]] = set()

    def take(self, part: KVCache, n: int) -> KVCache:
        """A prefill's cache `part`, each row n times in a row, into the first rows of a cache this call
        alone uses -> a view of those rows (`whole`: the cache the decode step is given)."""
        B = part.batch * n
        width, length = 1 << (B - 1).bit_length(), max(64, 1 << (part.max_len - 1).bit_length())
        depth = next(d for d in range(len(self.busy) + 1) if (width, d) not in self.busy)
        key, whole = (width, depth), self.caches.get((width, depth))
        if whole is None or whole.max_len < length:
            self.caches.pop(key, None)  # its memory goes before the longer one's comes
            whole = self.caches[key] = KVCache(self.args, width, length, self.dtype, self.device)
            for k, v in whole.layers:  # a CUDA graph may write them in place (guarded: a new cache, a new graph)
                torch._dynamo.mark_static_address(k, guard=True)
                torch._dynamo.mark_static_address(v, guard=True)
        self.busy.add(key)
        view = whole.rows(B)
        for (k, v), (pk, pv) in zip(view.layers, part.layers):
            L = pk.shape[2]
            k.unflatten(0, (-1, n))[:, :, :, :L].copy_(pk[:, None])
            v.unflatten(0, (-1, n))[:, :, :, :L].copy_(pv[:, None])
        return view

    def give(self, view: KVCache) -> None:
        """The call is over: its cache may serve the next (its rows stay, for the kept rows to read)."""
        self.busy -= {k for k, c in self.caches.items() if c is view.whole}


# ----------------------------------------------------------------------------- kept rows

# What the built-in engine keeps between calls: the KV cache rows of its last call, so that a
# call whose prompts extend them (a multi-turn episode's next turn) prefills only the new tokens.
#
# The engine contract stays one stateless `generate` (engines/torch_engine.py `Engine`): a prompt is an
# episode's whole ids so far, and a call's results do not depend on what was kept except through
# the order of floating-point sums (a kept key was computed by a decode step, not by a prefill).
# `TorchEngine` keeps every output row of its last call when the caller says a next call may
# extend them (`keep`: the episode loop's turns; a single-turn rollout and an eval pass False):
# its ids (prompt + completion) and its cache row, whose first len(ids) - 1 slots are valid (the
# last sampled token was never fed through the model). A later prompt that starts with those ids,
# token for token, gets the row's slots copied and only its suffix prefilled, at the row's own
# positions (model.forward_cached).
#
# Simplifications:
# 1. Only the last call's rows, and only exact token matches: memory stays one decode cache, and
#    a match is a list comparison. A multi-turn step's turns are consecutive calls over the same
#    episodes, which is the case this serves; vLLM's prefix cache (blocks hashed by content, any
#    earlier request) is the general form.
# 2. The rows are dropped when the weights change (`load_weights`: keys computed by older
#    weights are not the new weights' keys; a call a push landed in keeps none) and when the
#    caller says the rollout is over (`idle`); TorchEngine.reuse = False turns keeping off
#    (re-prefill every prompt). Within one call a push keeps the cache (a partial rollout).
# 3. Each prompt takes the one kept row that covers the most of it; prompts with no match
#    prefill from the start in the same right-padded batch (a batch is as long as its longest
#    suffix).


class KeptRows:
    """The engine's last call, kept for the next: every output row's ids (prompt + completion)
    and its KV cache row. Its first len(ids) - 1 slots are valid (the last sampled token was
    never fed through the model), so a later prompt that starts with those ids, token for
    token, needs only the rest prefilled: a multi-turn episode's next turn."""

    def __init__(self, cache, ids: list[list[int]]):  # cache: a KVCache of len(ids) rows
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
