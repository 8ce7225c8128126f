"""The Qwen3 decoder, with Hugging Face parameter names, and its HF-directory I/O.

A checkpoint directory (config.json, model.safetensors, tokenizer.json) saved by
transformers loads here with no rename table, and one saved here loads in transformers
and vLLM. No transformers at run time.

Simplifications:
1. Training packs documents into one row (mask: same document and causal); decoding writes
   each row's new keys into a static cache at that row's own position (mask: key slot <=
   position), a boolean [B, 1, S, S_kv] mask fed to SDPA. The packed mask is dense [T, T] on
   the CPU; on CUDA it is a flex-attention BlockMask, so the blocks between documents are
   skipped (RL documents are short: at T = 8192 a dense mask would spend more FLOPs on
   attention than on the linear layers). `ATTENTION` picks; the CPU tests run flex eagerly
   against the dense path. Static shapes throughout, so torch.compile traces each path once.
2. RoPE angles are computed from the position tensor on the fly (no table), so packed
   documents restart at position 0 and padding can have any position.
3. The forward returns the final hidden states, not logits: the LM head lives in
   kernels.py, fused with the log-softmax so [N, V] logits are never held.
4. Real Qwen3 checkpoints are bf16; the trainer keeps fp32 master weights and the engine
   casts its own copy (`--engine-dtype`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn


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

    @staticmethod
    def from_hf(cfg: dict) -> ModelArgs:
        if cfg.get("model_type") not in (None, "qwen3"):
            raise ValueError(f"config.json: model_type {cfg.get('model_type')!r} is not qwen3")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return ModelArgs(cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                         cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim,
                         cfg.get("max_position_embeddings", 4096), cfg.get("rms_norm_eps", 1e-6), float(theta),
                         cfg.get("tie_word_embeddings", True), cfg.get("bos_token_id"), cfg.get("eos_token_id"))

    def to_hf(self) -> dict:
        d = asdict(self)
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
                 attention_dropout=0.0, use_sliding_window=False, sliding_window=None, initializer_range=0.02,
                 torch_dtype="float32", rope_scaling=None,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        return d


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


ATTENTION = "auto"  # the packed forward's attention: auto (flex on CUDA, dense on the CPU) | flex | dense
_compiled_flex = None


def document_mask(doc_ids: torch.Tensor):
    """Same document and not the future, for packed rows: a dense [1, 1, T, T] bool mask, or a BlockMask."""
    T = doc_ids.shape[0]
    if ATTENTION == "flex" or (ATTENTION == "auto" and doc_ids.is_cuda):
        def causal_same_doc(b, h, q, k):
            return (doc_ids[q] == doc_ids[k]) & (k <= q)

        return create_block_mask(causal_same_doc, None, None, T, T, device=doc_ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, None] == doc_ids[None, :]) & causal)[None, None]


def attend(q, k, v, mask) -> torch.Tensor:
    """SDPA under a bool mask, or flex attention under a BlockMask (compiled on CUDA, eager on the CPU)."""
    global _compiled_flex
    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF's convention). x (B, n, S, hd); cos, sin (B, 1, S, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.hd, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, a.rms_norm_eps)

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
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, mask, cache=None, positions=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """HF's `Qwen3Model`: the `model.` prefix of every parameter name."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Qwen3(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.model = Decoder(a)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

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
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if caches is None else caches[i], positions)
        return self.model.norm(x)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        """Packed documents: tokens, positions, doc_ids (T,) -> hidden (T, H)."""
        return self._run(tokens[None], positions[None], document_mask(doc_ids))[0]

    def forward_cached(self, tokens, positions, cache: KVCache) -> torch.Tensor:
        """Rows with their own positions: tokens, positions (B, S) -> hidden (B, S, H).

        Keys go to cache slot = position; a query at position p sees slots <= p."""
        slots = torch.arange(cache.max_len, device=tokens.device)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # (B, 1, S, max_len)
        return self._run(tokens, positions, mask, cache.layers)


class KVCache:
    """Static per-layer key/value buffers (B, n_kv, max_len, hd), as gpt-fast keeps them."""

    def __init__(self, a: ModelArgs, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (batch, a.num_key_value_heads, max_len, a.head_dim)
        self.max_len = max_len
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(a.num_hidden_layers)]

    def repeat(self, n: int) -> KVCache:
        """Each row n times in a row: prefill a prompt once, decode its group of n."""
        out = object.__new__(KVCache)
        out.max_len = self.max_len
        out.layers = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in self.layers]
        return out


def init_weights(model: Qwen3, std: float = 0.02, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def load(model_dir: str | Path, device="cpu", dtype=torch.float32) -> Qwen3:
    """A HF Qwen3 directory -> Qwen3 with every key and shape checked."""
    d = Path(model_dir)
    for f in ("config.json", "tokenizer.json"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f}: missing; --model must be a HF directory with config.json, "
                                    "model.safetensors and tokenizer.json")
    args = ModelArgs.from_hf(json.loads((d / "config.json").read_text()))
    with torch.device("meta"):
        model = Qwen3(args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    if k == "lm_head.weight" and args.tie_word_embeddings:
                        continue  # some tied checkpoints store the head anyway
                    state[k] = st.get_tensor(k).to(dtype)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ValueError(f"{f}: unreadable safetensors file ({e})") from None
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{d}: weights do not match config.json: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, shape in expected.items():
        if state[k].shape != shape:
            raise ValueError(f"{d}: {k} has shape {tuple(state[k].shape)}, config.json implies {tuple(shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = (1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim)))
    return model.to(device)


def save(model: Qwen3, out_dir: str | Path, tokenizer_dir: str | Path, extra: dict[str, bytes] | None = None,
         state: dict[str, torch.Tensor] | None = None) -> None:
    """Write a HF directory (plus `extra` files) under a temporary name, then rename it into place.
    `state` replaces model.state_dict(): the full weights gathered from FSDP shards (train.py)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in (state or model.state_dict()).items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model.args.to_hf(), indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(tokenizer_dir) / f).is_file():
            shutil.copy(Path(tokenizer_dir) / f, tmp / f)
    for name, blob in (extra or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(blob)
    for f in tmp.rglob("*"):  # data on disk before the rename makes it visible
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if out.exists():  # replace: move the old one aside first, so a crash leaves one readable copy
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
