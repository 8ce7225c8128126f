"""Three decoder families with Hugging Face parameter names (reading and writing their HF directories: run/hfdir.py).

One `Transformer` serves Qwen3, Qwen2/Qwen2.5 and Llama 3.x: the same pre-norm decoder (RMSNorm,
grouped-query attention with rotate-half RoPE, SiLU-gated MLP), differing only by switches in
`ModelArgs` that `from_hf` reads from config.json (`model_type`, then):
- `qk_norm`: an RMSNorm on each query and key head before RoPE (Qwen3 only);
- `attention_bias`: a bias on q/k/v (Qwen2 always), and `o_bias` on o_proj (Qwen3 and Llama
  with attention_bias, never Qwen2); `mlp_bias` on gate/up/down (Llama's key);
- `rope_scaling`: Llama 3.x's "llama3" RoPE, which slows the low frequencies (`rope_frequencies`).
A checkpoint directory (config.json, model.safetensors, tokenizer.json) saved by transformers
loads here with no rename table (hfdir.load), and one saved here loads in transformers and vLLM.
No transformers at run time.

Simplifications:
1. Training packs documents into one row (mask: same document and causal, or the document's
   parent: a group's shared prompt, data.pack); decoding writes each row's new keys into a
   static cache at that row's own position (mask: key slot <= position), a boolean
   [B, 1, S, S_kv] mask fed to SDPA. The packed attention is `Rows` on the CPU (each
   document a row of its own queries against its parent's and its own keys, rows batched by
   length: work grows with the documents, not with [T, T]), a flex-attention BlockMask on
   CUDA (the blocks between documents are skipped), and the dense [T, T] mask as the tests'
   reference (layers/attention.py; the model's `attention` picks). Compiled, `Rows` is one op. Static shapes on
   the compiled paths, so torch.compile traces each once.
2. RoPE angles are computed from the position tensor on the fly (no table), so packed
   documents restart at position 0 and padding can have any position.
3. The forward returns the final hidden states, not logits: the LM head lives in
   kernels.py, fused with the log-softmax so [N, V] logits are never held.
4. Real checkpoints are bf16; the trainer keeps fp32 master weights and the engine casts
   its own copy (`--engine-dtype`).
5. No sliding-window attention and no RoPE scaling but llama3: configs asking for them are
   refused at load, not served wrongly.
6. Activation checkpointing is whole blocks (`checkpointing`): a block keeps its input for the
   backward and recomputes the rest, so a micro-batch's activations are one block's plus each
   layer's input (memplan.activation_bytes). Only the training forward: decoding keeps nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from layers.attention import attend, document_mask


FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "qwen3"  # a key of FAMILIES; the switches below default to the family's
    attention_bias: bool | None = None  # q, k, v projections carry a bias (always for qwen2)
    o_bias: bool | None = None  # o_proj carries one (qwen3/llama: attention_bias; qwen2: never)
    mlp_bias: bool = False  # gate/up/down carry one (llama's mlp_bias)
    qk_norm: bool | None = None  # an RMSNorm on each query and key head (qwen3 only)
    rope_scaling: dict | None = None  # {"rope_type": "llama3", **LLAMA3_KEYS}, or None

    def __post_init__(self):
        """Fill the family's switches, and refuse a mix its config.json could not say."""
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        qwen3, qwen2, llama = (self.model_type == f for f in ("qwen3", "qwen2", "llama"))
        self.attention_bias = qwen2 if self.attention_bias is None else self.attention_bias
        self.o_bias = self.attention_bias and not qwen2 if self.o_bias is None else self.o_bias
        self.qk_norm = qwen3 if self.qk_norm is None else self.qk_norm
        if (self.o_bias != (self.attention_bias and not qwen2) or self.qk_norm != qwen3
                or (qwen2 and not self.attention_bias) or (self.mlp_bias and not llama)):
            raise ValueError(f"{self.model_type}: no config.json of this family has attention_bias="
                             f"{self.attention_bias}, o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}")

    @staticmethod
    def from_hf(cfg: dict, source: str = "config.json") -> ModelArgs:
        """A parsed config.json -> ModelArgs; every refusal is one line naming `source`."""
        check_values(cfg, source)
        family = cfg.get("model_type", "qwen3")
        if family not in FAMILIES:
            raise ValueError(f"{source}: model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
        # transformers 5 writes rope_parameters (rope_theta inside); older files rope_scaling and a top-level
        # rope_theta. As transformers reads them: rope_scaling wins, then the dict's theta, then 10000
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: rope_scaling/rope_parameters must be a JSON object, got {json.dumps(rope)}")
        rope = dict(rope)
        theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10_000.0
        if not (type(theta) in (int, float) and math.isfinite(theta) and theta > 0):
            raise ValueError(f"{source}: rope_theta must be a number > 0, got {json.dumps(theta)}")
        kind, scaling = rope.get("rope_type", rope.get("type", "default")), None
        if kind not in ("default", "llama3"):
            raise ValueError(f"{source}: rope_type {kind!r} is not supported (default, llama3)")
        try:
            if kind == "llama3":  # the pretraining context: top level first, then the dict, then the model's own
                rope["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings") or rope.get(
                    "original_max_position_embeddings") or cfg["max_position_embeddings"])
                if bad := [k for k in LLAMA3_KEYS if k in rope and type(rope[k]) not in (int, float)]:
                    raise ValueError(f"{source}: rope_scaling {bad[0]} must be a number, got {json.dumps(rope[bad[0]])}")
                scaling = {"rope_type": "llama3", **{k: float(rope[k]) for k in LLAMA3_KEYS}}
                # a factor <= 0 makes the slowed frequencies inf or negative, and a band with high <= low
                # divides by zero or runs backwards: a model other than the one transformers builds
                if bad := [k for k in LLAMA3_KEYS if not (math.isfinite(scaling[k]) and scaling[k] > 0)]:
                    raise ValueError(f"{source}: rope_scaling {bad[0]} must be a number > 0, got {json.dumps(rope[bad[0]])}")
                if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                    raise ValueError(f"{source}: rope_scaling high_freq_factor {rope['high_freq_factor']} must be greater "
                                     f"than low_freq_factor {rope['low_freq_factor']}")
            # transformers gives a Qwen3 without head_dim 128, whatever its width: ask rather than guess
            width = cfg["hidden_size"] // cfg["num_attention_heads"]
            head_dim = cfg["head_dim"] if family == "qwen3" else cfg.get("head_dim") or width
            if head_dim is None:
                raise ValueError(f"{source}: head_dim must be an integer >= 1 (a Qwen3 config.json names it), got null")
            bias = None if family == "qwen2" else bool(cfg.get("attention_bias", False))
            return ModelArgs(cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                             cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim,
                             cfg.get("max_position_embeddings") or 4096, cfg.get("rms_norm_eps") or 1e-6, float(theta),
                             bool(cfg.get("tie_word_embeddings")), cfg.get("bos_token_id"), cfg.get("eos_token_id"),
                             family, bias, bias, family == "llama" and bool(cfg.get("mlp_bias")), None, scaling)
        except KeyError as e:
            raise ValueError(f"{source}: missing key {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """A config.json for a model with no source directory: the family's architecture and keys."""
        d = {k: v for k, v in asdict(self).items() if k not in ("o_bias", "mlp_bias", "qk_norm", "rope_scaling")}
        d.update(architectures=[FAMILIES[self.model_type]], hidden_act="silu", attention_dropout=0.0,
                 initializer_range=0.02, torch_dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})})
        if self.model_type == "llama":
            d.update(mlp_bias=self.mlp_bias, pretraining_tp=1)
        else:  # the Qwen families' sliding-window keys, off; Qwen2 has no attention_bias key (always on)
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
            if self.model_type == "qwen2":
                del d["attention_bias"]
        return d


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")  # integers >= 1
NULLABLE = ("head_dim", "max_position_embeddings")  # null: the family's default
SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")  # true, false or null


def check_values(cfg: dict, source: str) -> None:
    """Each key config.json gives, of the type and range its use needs, before anything divides by
    or allocates from it: a string "128" or a 0 would surface as a TypeError or ZeroDivisionError
    far from its cause, and a stop id outside the vocabulary never stops generation. (A missing
    key is from_hf's to name.)"""
    def refuse(key, what):
        raise ValueError(f"{source}: {key} must be {what}, got {json.dumps(cfg[key])}")

    for k in SIZES:
        if k in cfg and not _int(cfg[k], 1) and not (cfg[k] is None and k in NULLABLE):
            refuse(k, "an integer >= 1")
    eps = cfg.get("rms_norm_eps")  # (rope_theta: from_hf checks the one it resolves)
    if eps is not None and not (type(eps) in (int, float) and math.isfinite(eps) and eps > 0):
        refuse("rms_norm_eps", "a number > 0")
    for k in SWITCHES:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            refuse(k, "true or false")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{source}: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv}")
    vocab = cfg.get("vocab_size")
    for k in ("bos_token_id", "eos_token_id"):
        v = cfg.get(k)
        ids = v if isinstance(v, list) and v and k == "eos_token_id" else [v]
        if v is not None and vocab is not None and not all(_int(i, 0) and i < vocab for i in ids):
            refuse(k, f"a token id in [0, vocab_size {vocab})" + (" or a non-empty list of them" if "eos" in k else ""))


def _int(v, low: int) -> bool:
    """An integer >= low; JSON's true and 2.0 are not (Python's bool is an int, so test the type)."""
    return type(v) is int and v >= low


# the shipped reverse-tiny model (about 0.8M parameters; vocab_size comes from its tokenizer)
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 like HF's Qwen3RMSNorm, so bf16 activations round once
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF's convention). x (B, n, S, hd); cos, sin (B, 1, S, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.n_head * self.hd, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * self.hd, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * self.hd, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, a.hidden_size, bias=a.o_bias)
        # Qwen3 normalizes each head's query and key before RoPE; Identity holds no weights, so no names
        self.q_norm = RMSNorm(self.hd, a.rms_norm_eps) if a.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, a.rms_norm_eps) if a.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, mask, cache=None, positions=None):
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.n_head, self.hd)).transpose(1, 2)  # (B, n_head, S, hd)
        k = self.k_norm(self.k_proj(x).view(B, S, self.n_kv, self.hd)).transpose(1, 2)  # (B, n_kv, S, hd)
        v = self.v_proj(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:  # write this step's keys at each row's own slots, attend over the whole cache
            k_cache, v_cache = cache
            idx = positions[:, None, :, None].expand(B, self.n_kv, S, self.hd)
            k, v = k_cache.scatter_(2, idx, k), v_cache.scatter_(2, idx, v)
        y = attend(q, k, v, mask)  # (B, n_head, S, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.n_head * self.hd))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, mask, cache=None, positions=None, recompute=False):
        """recompute (--activation-checkpointing blocks): keep only x for the backward and run the block
        again there. Inside the block's own call, so FSDP2's hooks around it gather the weights once for
        the recomputation too (they skip the forward's gather during the backward), as torchtitan wraps it."""
        if recompute:
            return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask, cache, positions)

    def _forward(self, x, cos, sin, mask, cache=None, positions=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """HF's `Qwen3Model` / `Qwen2Model` / `LlamaModel`: the `model.` prefix of every parameter name."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


def rope_frequencies(a: ModelArgs) -> torch.Tensor:
    """RoPE's inverse frequencies (hd/2,), fp32, with Llama 3.x's scaling when asked.

    llama3 measures each frequency by how many of its wavelengths fit in the context the model
    was pretrained on (r = original_max_position_embeddings / wavelength): those that fit more
    than high_freq_factor times already resolve local order and stay; those that fit fewer than
    low_freq_factor times would meet angles never seen in pretraining at long range, so they
    slow down by `factor`; in between it blends the two linearly in r. The attention scale is 1."""
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
    s = a.rope_scaling
    if s is None:
        return inv
    r = s["original_max_position_embeddings"] / (2 * math.pi / inv)
    keep = ((r - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
    return (1 - keep) * inv / s["factor"] + keep * inv


class Transformer(nn.Module):
    """The decoder and its head, for every family in FAMILIES (the switches live in ModelArgs)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.model = Decoder(a)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(a), persistent=False)
        self.attention = "auto"  # the packed forward's attention (attention.document_mask): auto | flex | rows | dense
        self.checkpointing = False  # recompute each block in the backward (--activation-checkpointing blocks); never when decoding
        self.lora = None  # lora.LoRASpec once lora.add gave the linear layers adapters; None: full fine-tuning

    @property
    def head_weight(self) -> torch.Tensor:  # (V, H)
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq  # (B, S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, tokens, positions, mask, caches=None):
        x = self.model.embed_tokens(tokens)  # (B, S, H)
        cos, sin = self._rope(positions, x.dtype)
        recompute = self.checkpointing and caches is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if caches is None else caches[i], positions, recompute)
        return self.model.norm(x)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """Packed documents: tokens, positions, doc_ids, parents (T,) -> hidden (T, H)."""
        return self._run(tokens[None], positions[None], document_mask(doc_ids, parents, self.attention))[0]

    def forward_cached(self, tokens, positions, cache) -> torch.Tensor:
        """Rows with their own positions: tokens, positions (B, S) -> hidden (B, S, H).

        `cache`: the engine's static key/value buffers (engines/kvcache.py `KVCache`). Keys go to cache
        slot = position; a query at position p sees slots <= p."""
        slots = torch.arange(cache.max_len, device=tokens.device)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, S, max_len)
        return self._run(tokens, positions, mask, cache.layers)


def init_weights(model: Transformer, std: float = 0.02, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()  # as transformers initializes them
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def compiled(fn, region: str, options: dict | None = None, dynamic: bool | None = None):
    """torch.compile(fn) (`options`: Inductor's settings for this region; `dynamic`: torch.compile's,
    True for one graph with symbolic input sizes), that falls back to `fn`
    itself, with one line naming the region and the error, when Dynamo or Inductor fails to compile
    it (at its first call or at a recompile): the run goes on eager there, and the summary's
    compile/regions leaves the region out. An error of the function's own (a wrong shape, say) is
    raised as it is."""
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, Unsupported

    graph, eager = torch.compile(fn, options=options, dynamic=dynamic), False

    def call(*args, **kwargs):
        nonlocal eager
        if eager:
            return fn(*args, **kwargs)
        try:
            # a run's float settings (temperature, the loss's clips) are constants: as symbols (torch's
            # default under dynamic=True) they make Dynamo restart its analysis at every compile, and the
            # first attempt's work, cache lookups included, is thrown away. A graph break (code that runs
            # eager inside a region: kernels.py's sparse backward) resumes tracing in the frame it broke in,
            # so the frames around it are never compiled apart, with static shapes
            with torch._dynamo.config.patch(specialize_float=True, nested_graph_breaks=True):
                return graph(*args, **kwargs)
        except (BackendCompilerFailed, InternalTorchDynamoError, Unsupported) as e:
            cause = getattr(e, "inner_exception", None) or e  # the backend's own error
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            print(f"note: torch.compile failed on the {region} ({type(e).__name__}: {type(cause).__name__}: {first}); "
                  "it runs eager", flush=True)
            eager = True
            return fn(*args, **kwargs)  # compiling fails before the graph runs: nothing was half done

    return call
