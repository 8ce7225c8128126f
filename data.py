"""Tokenizers and chat templates, and the records every module passes around (packing.py packs
them into micro-batches).

Simplifications:
1. One loading path for the tiny models and real HF checkpoints: `tokenizers` reads
   tokenizer.json, a chat template (tokenizer_config.json or chat_template.jinja) renders
   `messages` prompts with jinja2 the way transformers does, and generation stops at the
   directory's own stop ids (generation_config.json eos_token_id, else the tokenizer's eos).
   The tiny models' tokenizers are one token per character with the ChatML specials; a
   character outside a tokenizer is an error, never a silent unknown id.
2. `TokenSupport` is CSR: per-token rows of ids and sampler log-probs, never padded. Its
   offsets live on the device and on the host, so slicing a micro-batch needs no sync.

Tasks (prompts, rewards, the held-out set) live in tasks.py.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the tiny tokenizers' ids 0, 1, 2
# The tiny models' chat template: ChatML, the format Qwen checkpoints use. A real model directory
# brings its own (tokenizer_config.json or chat_template.jinja), rendered the same way.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LETTERS = "abcdefghijklmnopqrstuvwxyz :\n"  # reverse-tiny's alphabet (the role names need the letters)


class RunError(ValueError):
    """Input the step cannot go on with (bad sampler evidence, a sample or prompt that does
    not fit): train.py prints the message as one line and exits 1."""


# ----------------------------------------------------------------------------- tokenizer and chat

def char_tokenizer(alphabet: str = LETTERS) -> Tokenizer:
    """A tiny model's tokenizer: one token per character of `alphabet`, after the ChatML specials."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_tokenizer(out_dir: str | Path, alphabet: str = LETTERS) -> None:
    """A tiny model's tokenizer files: tokenizer.json, tokenizer_config.json (with the ChatML
    template) and generation_config.json (generation stops at <|im_end|> or <|endoftext|>)."""
    out = Path(out_dir)
    char_tokenizer(alphabet).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "unk_token": "<|endoftext|>", "model_max_length": 512, "chat_template": CHATML}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}, indent=2))


def _read_json(path: Path) -> dict:
    """An optional JSON-object file ({} when absent; a FIFO or a directory is no file)."""
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: not a JSON object")
    return out


def _stop_ids(d: Path, tok: Tokenizer, specials: dict) -> tuple[list[int], str]:
    """generation_config.json's eos_token_id (an id or a non-empty list of ids), else the id of
    tokenizer_config.json's eos_token; with the file and key they came from. Whether each lies in
    the vocabulary is start.check_start's to say (config.json holds its size)."""
    gen = d / "generation_config.json"
    stop = _read_json(gen).get("eos_token_id")
    if stop is not None:
        ids = stop if isinstance(stop, list) else [stop]
        if not ids or not all(type(i) is int for i in ids):  # JSON true and 2.0 are no ids; bool is an int
            raise ValueError(f"{gen}: eos_token_id must be a token id (an integer) or a non-empty list of them, "
                             f"got {json.dumps(stop)}")
        return ids, f"{gen} eos_token_id"
    eos = specials.get("eos_token")
    if eos is None:
        raise ValueError(f"{d}: no stop token: generation_config.json has no eos_token_id and "
                         "tokenizer_config.json no eos_token")
    if not isinstance(eos, str) or tok.token_to_id(eos) is None:
        raise ValueError(f"{d / 'tokenizer_config.json'}: eos_token {json.dumps(eos)} is not a token of tokenizer.json")
    return [tok.token_to_id(eos)], f"{d / 'tokenizer_config.json'} eos_token"


def _token(x) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return x.get("content") if isinstance(x, dict) else x


@dataclass
class TextCodec:
    """A model directory's text side: its `tokenizers.Tokenizer`, the ids generation stops at, and
    its chat template (rendered with jinja2 as transformers renders it)."""

    tok: Tokenizer
    stop_ids: list[int]  # the first is the end of a reference completion (--stage sft)
    template: str | None = None  # the jinja chat template; None: the directory has none
    specials: dict = field(default_factory=dict)  # bos_token, eos_token, ...: what the template may read
    stop_source: str = "the tiny tokenizer"  # where stop_ids came from, for the line that refuses one
    template_source: str = "the ChatML template"  # where the template came from, for the line a bad one gets

    @staticmethod
    def load(model_dir: str | Path) -> TextCodec:
        """tokenizer.json; stop ids from generation_config.json's eos_token_id, else the tokenizer's
        eos token; the chat template from chat_template.jinja, else tokenizer_config.json (transformers' order)."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: {'not a regular file' if path.exists() else 'missing'}; "
                                    "a model directory needs tokenizer.json")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a damaged file
            raise ValueError(f"{path}: unreadable tokenizer ({e})") from None
        tc = _read_json(d / "tokenizer_config.json")
        specials = {k: _token(v) for k, v in tc.items() if k.endswith("_token") and _token(v) is not None}
        stop_ids, stop_source = _stop_ids(d, tok, specials)
        template, source = tc.get("chat_template"), d / "tokenizer_config.json"
        if isinstance(template, list):  # named templates: transformers takes "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():  # transformers reads it over tokenizer_config.json's, as vLLM then does
            template, source = (d / "chat_template.jinja").read_text(), d / "chat_template.jinja"
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{source}: chat_template must be a string (or a list of named ones), got {type(template).__name__}")
        return TextCodec(tok, stop_ids, template, specials, stop_source, str(source))

    @staticmethod
    def tiny(alphabet: str = LETTERS) -> TextCodec:
        """The codec a tiny model's directory loads to (write_tokenizer), built in memory."""
        specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        return TextCodec(char_tokenizer(alphabet), [2, 0], CHATML, specials)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`; special: let the tokenizer add its own (a BOS, for a plain-string
        prompt). A character the tokenizer cannot represent is an error, not a silent unknown id."""
        enc = self.tok.encode(text, add_special_tokens=special)
        unk = self.specials.get("unk_token") or getattr(self.tok.model, "unk_token", None)
        unk_id = self.tok.token_to_id(unk) if unk else None
        if unk_id is not None:
            for i, (a, b) in zip(enc.ids, enc.offsets):
                if i == unk_id and text[a:b] != unk:
                    raise ValueError(f"{text[a:b]!r} is not in the tokenizer (it would become {unk})")
        return enc.ids

    def render(self, prompt: str | list[dict], **template_kwargs) -> list[int]:
        """A prompt's ids: a string as it is (with the tokenizer's own BOS, if it adds one), a chat
        `messages` list through the chat template with the generation prompt (BOS as the
        template writes it)."""
        if isinstance(prompt, str):
            return self._some(self.encode(prompt, special=True), "the prompt")
        return self._some(self.encode(self.render_text(prompt, **template_kwargs)),
                          f"chat template {self.template_source}")

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """A `messages` list through the chat template, as text; ValueError (one line naming the
        template) for any error the template raises."""
        if self.template is None:
            raise ValueError("a chat `messages` prompt needs a chat template, and the model directory has none "
                             "(tokenizer_config.json chat_template or chat_template.jinja); give the prompt as a string")
        import jinja2

        try:  # the template is the model directory's code: any error it raises is its own, in one line
            return _jinja(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **{**self.specials, **template_kwargs})
        except jinja2.TemplateSyntaxError as e:  # a syntax error, an unknown filter (found when compiled)
            raise ValueError(f"chat template {self.template_source}: {type(e).__name__}: {e.message} "
                             f"(template line {e.lineno})") from None
        except Exception as e:  # raise_exception, the sandbox's SecurityError, a ZeroDivisionError, ...
            message = " ".join(str(e).split()) or "(no message)"
            raise ValueError(f"chat template {self.template_source}: {type(e).__name__}: {message}") from None

    @staticmethod
    def _some(ids: list[int], what: str) -> list[int]:
        """A prompt of no tokens has no last position to sample from: refused where it is made."""
        if not ids:
            raise ValueError(f"{what} renders to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Decode up to (not including) the first stop token."""
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                ids = ids[:i]
                break
        return self.tok.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=8)
def _jinja(source: str):
    """A chat template compiled as transformers compiles it: a sandbox, trim_blocks and lstrip_blocks,
    loop controls, and the helpers templates call (raise_exception, tojson, strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)


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
