"""Tasks, tokenizers, the records every module passes around, and packing.

The reverse-text task: a prompt holds a few words from a built-in list, the completion
should be that text reversed character by character, and the reward is difflib's
SequenceMatcher ratio between the completion (up to end-of-sequence) and the target.

Simplifications:
1. Prompts come from a seeded generator over a fixed word list, so a run is reproducible
   and the held-out eval set (its own seed) is disjoint from training by construction:
   the training sampler rejects any text that is in the eval set.
2. The prompt is ChatML (`<|im_start|>user ...`), the format Qwen3 checkpoints expect;
   the tiny model's character-level tokenizer has those three special tokens too, so the
   tiny model and real HF checkpoints share one loading path (`tokenizers`, tokenizer.json).
3. Packing is greedy first-fit-decreasing into fixed-size buffers of
   `--micro-batch-tokens` tokens: every micro-batch has the same shape, so a compiled
   forward never recompiles. Attention stays inside a document (`doc_ids`).
4. `TokenSupport` is CSR: per-token rows of ids and sampler log-probs, never padded. Its
   offsets live on the device and on the host, so slicing a micro-batch needs no sync.
"""

from __future__ import annotations

import difflib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STOP_TOKENS = ["<|im_end|>", "<|endoftext|>"]  # generation ends at the first of these

# fmt: off
WORDS = """
able acid aged also area army away baby back ball band bank base bath bear beat been beer
bell belt best bill bird blow blue boat body bomb bond bone book boom born boss both bowl
bulk burn bush busy call calm came camp card care case cash cast cell chat chip city club
coal coat code cold come cook cool cope copy core cost crew crop dark data date dawn days
dead deal dean dear debt deep deny desk dial diet disk done door dose down draw drew drop
drug dual duke dust duty each earn ease east easy edge else even ever evil exit face fact
fail fair fall farm fast fate fear feed feel fell felt file fill film find fine fire firm
fish five flat flow food foot form fort four free from fuel full fund gain game gate gave
gear gene gift girl give glad goal goes gold golf gone good gray grew grey grow gulf hair
half hall hand hang hard harm hate have head hear heat held hell help here hero high hill
hire hold hole holy home hope host hour huge hung hunt hurt idea inch into iron item jack
jane jean john join jump jury just keen keep kent kept kick kill kind king knee knew know
lack lady laid lake land lane last late lead left less life lift like line link list live
load loan lock logo long look lord lose loss lost love luck made mail main make male many
mark mass matt meal mean meat meet menu mere mike mile milk mill mind mine miss mode mood
moon more most move much must name navy near neck need news next nice nick nine none nose
note okay once only open oral over pace pack page paid pain pair palm park part pass past
path peak pick pink pipe plan play plot plug plus poll pool poor port post pull pure push
race rail rain rank rare rate read real rear rely rent rest rice rich ride ring rise risk
road rock role roll roof room root rose rule rush safe said sake sale salt same sand save
seat seed seek seem seen self sell send sent ship shop shot show shut sick side sign site
size skin slip slow snow soft soil sold sole some song soon sort soul spot star stay step
stop such suit sure take tale talk tall tank tape task team tech tell tend term test text
than that them then they thin this thus tide till time tiny told tone tony took tool tour
town tree trip true tune turn twin type unit upon used user vary vast very vice view vote
wage wait wake walk wall want ward warm wash wave ways weak wear week well went were west
what when whom wide wife wild will wind wine wing wire wise wish with wood word wore work
yard yeah year your zero zone
""".split()
# fmt: on


class RunError(ValueError):
    """Input the step cannot go on with (bad sampler evidence, a sample or prompt that does
    not fit): train.py prints the message as one line and exits 1."""


# ----------------------------------------------------------------------------- tokenizer

def char_tokenizer() -> Tokenizer:
    """The tiny model's tokenizer: one token per character plus the ChatML specials."""
    chars = list("abcdefghijklmnopqrstuvwxyz :\n")
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


@dataclass
class TextCodec:
    """A `tokenizers.Tokenizer` plus the ids generation stops at."""

    tok: Tokenizer
    stop_ids: list[int]

    @staticmethod
    def load(model_dir: str | Path) -> TextCodec:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; a model directory needs tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        stop_ids = [i for s in STOP_TOKENS if (i := tok.token_to_id(s)) is not None]
        if not stop_ids:
            raise ValueError(f"{path}: has none of the stop tokens {STOP_TOKENS}")
        return TextCodec(tok, stop_ids)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Decode up to (not including) the first stop token."""
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                ids = ids[:i]
                break
        return self.tok.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- the task

@dataclass
class Prompt:
    ids: list[int]  # chat-formatted prompt tokens
    text: str  # the words to reverse
    target: str  # text[::-1]


class ReverseText:
    """Reverse a few words character by character; reward = SequenceMatcher ratio."""

    def __init__(self, codec: TextCodec, min_words: int = 1, max_words: int = 3, eval_size: int = 64):
        self.codec, self.min_words, self.max_words = codec, min_words, max_words
        rng = random.Random(10_000)  # one held-out set for every --seed, so runs compare
        texts: list[str] = []
        while len(texts) < eval_size:
            t = self._text(rng)
            if t not in texts:
                texts.append(t)
        self.eval_texts = set(texts)
        self.eval_set = [self.prompt(t) for t in texts]

    def _text(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))

    def prompt(self, text: str) -> Prompt:
        chat = f"<|im_start|>user\nreverse: {text}<|im_end|>\n<|im_start|>assistant\n"
        return Prompt(self.codec.encode(chat), text, text[::-1])

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            t = self._text(rng)
            if t not in self.eval_texts:
                out.append(self.prompt(t))
        return out

    def completion_ids(self, p: Prompt) -> list[int]:
        """The reference completion (for SFT): the target then end-of-turn."""
        return self.codec.encode(p.target) + [self.codec.stop_ids[0]]

    def reward(self, p: Prompt, completion: list[int]) -> float:
        text = self.codec.decode(completion)
        return difflib.SequenceMatcher(None, text, p.target).ratio()


# ----------------------------------------------------------------------------- records

@dataclass
class TokenSupport:
    """Ragged per-token support (DESIGN.md): row t is ids[offsets[t]:offsets[t+1]]."""

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
    group: int = 0  # index of its prompt group in the step

    @property
    def ids(self) -> list[int]:
        return self.prompt.ids + self.completion


@dataclass
class MicroBatch:
    """A fixed-shape packed token buffer; every tensor is [T] (T = --micro-batch-tokens)."""

    tokens: torch.Tensor  # int64 input ids
    positions: torch.Tensor  # int64 position inside its document (RoPE)
    doc_ids: torch.Tensor  # int64 document index in this buffer; padding is one more document
    labels: torch.Tensor  # int64 the next token, scored at this position (0 where unused)
    loss_mask: torch.Tensor  # bool: this position's label is a trained completion token
    advantages: torch.Tensor  # float32 per token (the sample's advantage)
    logq: torch.Tensor  # float32 sampler log-prob of the label
    versions: torch.Tensor  # int64 policy version that sampled the label
    sample_idx: torch.Tensor  # int64 index of the sample in the step's list; -1 on padding
    support: TokenSupport | None  # T rows; empty rows where nothing is centered
    num_loss_tokens: int  # host-side counts, for global normalization
    num_docs: int
    samples: list[int] = field(default_factory=list)  # the samples packed here, in order

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items()}
        if self.support is not None:
            moved["support"] = self.support.to(device)
        return MicroBatch(**moved)


# ----------------------------------------------------------------------------- packing

def pack(samples: list[Sample], micro_batch_tokens: int) -> list[MicroBatch]:
    """First-fit-decreasing into fixed [T] buffers; a sample never straddles two."""
    T = micro_batch_tokens
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i].ids)):
        n = len(samples[i].ids) - 1  # the last token is only ever a label
        if n > T:
            raise RunError(f"sample {i} has {n + 1} tokens, more than --micro-batch-tokens {T}")
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([])
            room.append(T)
            j = len(bins) - 1
        bins[j].append(i)
        room[j] -= n
    return [_fill(samples, sorted(b), T) for b in bins]


def _fill(samples: list[Sample], idx: list[int], T: int) -> MicroBatch:
    cols = {k: np.zeros(T, dtype=np.int64) for k in ("tokens", "positions", "doc_ids", "labels", "versions")}
    mask = np.zeros(T, dtype=bool)
    adv, logq = np.zeros(T, dtype=np.float32), np.zeros(T, dtype=np.float32)
    sample_idx = np.full(T, -1, dtype=np.int64)
    has_support = any(samples[i].support is not None for i in idx)
    rows: list[TokenSupport] = []
    at = 0
    for d, i in enumerate(idx):
        s = samples[i]
        ids, P, C = s.ids, len(s.prompt.ids), len(s.completion)
        n = len(ids) - 1
        sl = slice(at, at + n)
        cols["tokens"][sl], cols["labels"][sl] = ids[:-1], ids[1:]
        cols["positions"][sl], cols["doc_ids"][sl] = np.arange(n), d
        sample_idx[sl] = i
        c = slice(at + P - 1, at + n)  # positions whose label is a completion token
        mask[c], adv[c], logq[c], cols["versions"][c] = True, s.advantage, s.logq, s.versions
        if has_support:
            sup = s.support if s.support is not None else TokenSupport.empty(C)
            rows += [TokenSupport.empty(P - 1), sup]
        at += n
    cols["doc_ids"][at:] = len(idx)  # padding: one extra document, never trained
    cols["positions"][at:] = np.arange(T - at)
    if has_support:
        rows.append(TokenSupport.empty(T - at))
    t = {k: torch.from_numpy(v) for k, v in cols.items()}
    return MicroBatch(t["tokens"], t["positions"], t["doc_ids"], t["labels"], torch.from_numpy(mask),
                      torch.from_numpy(adv), torch.from_numpy(logq), t["versions"], torch.from_numpy(sample_idx),
                      TokenSupport.cat(rows) if has_support else None,
                      int(mask.sum()), len(idx), list(idx))


def write_tokenizer(out_dir: str | Path) -> None:
    """Save the character tokenizer as tokenizer.json (and the ids a config.json needs)."""
    tok = char_tokenizer()
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "unk_token": "<|endoftext|>", "model_max_length": 512}, indent=2))
