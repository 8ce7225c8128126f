"""Split inference (--inference-gpus k): the last k torchrun ranks only sample; the trainers
reach them through `RemoteEngine`, which keeps the `Engine` contract, so the loop, the async
pipeline and checkpoints are the ones colocated runs use.

    torchrun --nproc_per_node 3 train.py --inference-gpus 1 --steps 6   # CPU: 2 trainers, 1 sampler (gloo)
    torchrun --nproc_per_node 8 train.py --inference-gpus 2 --model /path/to/Qwen3-8B --engine vllm

Simplifications:
1. Trainer rank 0 is the only client. It draws the whole batch's prompts and splits them into
   k contiguous chunks, one per inference rank, which sample them at once; the other trainer
   ranks sample nothing and get their share of the batch through train.py's usual gather.
2. Each call carries a seed drawn from the trainer's `gen` (chunk j gets seed + j), so the sampling
   RNG that a checkpoint saves lives on the trainer and the inference ranks keep no state worth
   saving. With one inference rank a call with a fixed seed (eval) draws what a local engine would.
3. A weight push is the trainer's state dict, one full tensor at a time cast to --engine-dtype
   (under FSDP2 every trainer rank joins the gather; rank 0 casts and broadcasts), received on each
   inference rank one tensor at a time straight into its engine (`load_tensors`), so an inference
   rank holds one copy of the weights, its engine's: the built-in engine's, built from the files one
   tensor at a time, or vLLM's. Both engines round fp32 to their dtype the same way, so this is the
   colocated push bit for bit, at half the bytes for bf16. NCCL on GPUs, gloo on the CPU; requests
   and replies are host tensors over gloo.
4. The inference ranks are outside torch.distributed's default group (parallel.setup_distributed):
   an in-process vLLM makes that group its own. The link's groups are built on torchrun's store.
5. Messages are lists of 1-D tensors with a small header (dtype codes and lengths): no pickle
   (parallel.Link).
6. Under LoRA (--lora-rank) only what changes travels: the adapter's shape (rank, alpha, targets)
   once, with the directory, and its fp32 tensors on each push, in PEFT-name order. Each inference
   rank keeps the base it loaded untouched: vLLM serves the adapter on it (no floe copy of the
   base at all, only the adapter's tensors), a merging engine (the built-in one, or vLLM with
   --lora-merged) holds the fp32 base the trainers hold and merges W + (alpha / r) B A from it on
   every push, as a colocated engine does, bit for bit (the fp8 engine requantizes the merge).
7. Partial rollouts (--max-staleness): a push lands between two of an inference rank's decode steps.
   Rank 0 reads a call's replies on a thread and calls the pipeline's `between` meanwhile; each call
   replies on a tag of its own (an eval's may be served inside a sampler's call); an inference rank
   receives into an inbox that its engine's `between` serves (`Server`; docs/engines.md "The wire
   under partial rollouts").
"""

from __future__ import annotations

import itertools
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from data import RunError, TokenSupport
from model import Transformer
from engines.precision import DTYPES
from engines.torch_engine import Completion, Sampling
from engines.vllm_engine import make_engine, serves_adapter
from layers import lora
from layers.parallel import Link, full
from run import hfdir
from tasks.textcodec import TextCodec

GEN, PUSH, STOP, IDLE = 1, 2, 3, 4


def wire_dtype(engine_dtype: str) -> torch.dtype:
    """What a push carries: the engine's dtype (the colocated push's rounding), but fp32 for fp8,
    whose engine quantizes from the trainer's weights as a colocated one does."""
    return torch.float32 if engine_dtype == "fp8" else DTYPES[engine_dtype]


# ----------------------------------------------------------------------------- the wire format

def _request(prompts: list[list[int]], n: int, s: Sampling, seed: int, version: int,
             budgets: list[int] | None = None, keep: bool = True, tag: int = 1) -> list[torch.Tensor]:
    """A call: its sampling, the prompts' lengths and ids, each prompt's own budget of new tokens
    (a turn of a multi-turn episode: the room its episode has left), whether to keep the rows, and
    the tag its reply goes back on."""
    ints = [GEN, version, n, s.max_new_tokens, s.top_k, s.support, s.draws, seed, keep, tag]
    caps = budgets if budgets is not None else [s.max_new_tokens] * len(prompts)
    return [torch.tensor(ints), torch.tensor([s.temperature, s.top_p, s.noise], dtype=torch.float64),
            torch.tensor([len(p) for p in prompts]), torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
            torch.tensor(caps, dtype=torch.int64)]


def _read_request(msg: list[torch.Tensor]):
    (_, version, n, max_new, top_k, support, draws, seed, keep, tag), (temperature, top_p, noise) = msg[0].tolist(), msg[1].tolist()
    prompts = [p.tolist() for p in msg[3].split(msg[2].tolist())]
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new,
                        seed=seed, support=bool(support), draws=draws, noise=noise)
    return prompts, n, sampling, version, msg[4].tolist(), bool(keep), tag


def _reply(done: list[Completion]) -> list[torch.Tensor]:
    """Completions as flat tensors; logq in float64, so nothing is rounded on the way."""
    sup = [c.support for c in done if c.support is not None]
    if sup and len(sup) < len(done):
        raise ValueError("some completions carry a support and some do not")
    out = [torch.tensor([len(c.ids) for c in done]), torch.tensor([c.finish_reason == "stop" for c in done]),
           torch.tensor([t for c in done for t in c.ids], dtype=torch.int64),
           torch.tensor([x for c in done for x in c.logq], dtype=torch.float64),
           torch.tensor([v for c in done for v in c.versions], dtype=torch.int64)]
    if sup:
        rows = TokenSupport.cat(sup)
        out += [torch.from_numpy(np.diff(rows.host_offsets)), rows.ids.int(), rows.logq.float(), rows.replayed]
    return out


def _read_reply(msg: list[torch.Tensor]) -> list[Completion]:
    lens = msg[0].tolist()
    ids, logq, versions = (t.split(lens) for t in msg[2:5])
    supports = [None] * len(lens)
    if len(msg) > 5:
        rows = TokenSupport.from_counts(msg[6], msg[5].numpy(), msg[7], msg[8])
        ends = np.cumsum([0] + lens)
        supports = [rows.slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]
    return [Completion(i.tolist(), q.tolist(), v.tolist(), "stop" if stop else "length", sup)
            for i, q, v, stop, sup in zip(ids, logq, versions, msg[1].tolist(), supports)]


# ----------------------------------------------------------------------------- both sides

class RemoteEngine:
    """The `Engine` on the trainer ranks: rank 0 (which holds `link`) sends the calls; every trainer
    rank joins the weight gathers of a push. `gen` seeds the calls (simplification 2)."""

    def __init__(self, link: Link | None, seed: int, dtype: str, spec: lora.LoRASpec | None = None):
        self.link, self.version, self.dtype, self.spec = link, 0, wire_dtype(dtype), spec
        self.gen = torch.Generator().manual_seed(seed)
        self.between = None  # a partial rollout's hook (pipeline.py): called while a call waits for its replies
        self.tags = itertools.count(1)  # each call's replies come back on a tag of its own

    def start(self, model_dir) -> None:
        """Tell the inference ranks which directory to load (after rank 0 wrote it, for --model scratch)
        and, under LoRA, the adapter's shape."""
        for j in range(1, self.link.size):
            self.link.send(_start(model_dir, self.spec), j)

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 budgets: list[int] | None = None, keep: bool = True) -> list[Completion]:
        if not prompts:
            return []
        assert self.link is not None, "only trainer rank 0 samples under --inference-gpus"
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**31 - 1, (1,), generator=self.gen))
        chunks = [c for c in np.array_split(np.arange(len(prompts)), self.link.size - 1) if len(c)]
        tag = next(self.tags)
        for j, c in enumerate(chunks, 1):  # every inference rank starts on its chunk before any reply is read
            caps = None if budgets is None else [budgets[i] for i in c]
            self.link.send(_request([prompts[i] for i in c], n, sampling, seed + j - 1, self.version, caps, keep, tag), j)
        # partial rollouts: a push (and an eval) may go out while this call waits (`between`); each
        # inference rank takes it between two of its decode steps and labels the tokens after it
        replies = self._replies(len(chunks), tag)
        for r in replies:
            if r[0].dtype == torch.uint8:  # an inference rank could not serve the call (serve)
                raise RunError(bytes(r[0].tolist()).decode())
        return [x for r in replies for x in _read_reply(r)]

    def _replies(self, k: int, tag: int) -> list[list[torch.Tensor]]:
        """The k inference ranks' replies to the call on `tag`. With partial rollouts (`between` set) a
        thread reads them while this one calls `between`, where a push (and an eval) may go out: each
        inference rank takes it between two of its decode steps and labels the tokens after it. (gloo's
        receives make progress only in a blocking wait, so they are not polled.) A `between` that raises
        (the pipeline closed) leaves the thread to read what is still due, so no inference rank's send
        waits on a reader that left."""
        if self.between is None:
            return [self.link.recv(j, tag) for j in range(1, k + 1)]
        box = []
        reader = threading.Thread(target=lambda: box.extend(self.link.recv(j, tag) for j in range(1, k + 1)),
                                  name="floe-replies", daemon=True)
        reader.start()
        while reader.is_alive():
            self.between()
            reader.join(1e-3)
        if len(box) < k:
            raise RuntimeError(f"the replies to call {tag} were not all read (the link failed: see above)")
        return box

    def idle(self) -> None:
        """The step's rollout is over: each inference rank's engine frees what it keeps between calls."""
        if self.link is not None:
            for j in range(1, self.link.size):
                self.link.send([torch.tensor([IDLE, 0])], j)

    @torch.no_grad()
    def load_weights(self, model: Transformer, version: int) -> None:
        if self.link is not None:
            for j in range(1, self.link.size):
                self.link.send([torch.tensor([PUSH, version])], j)
        if self.spec is not None:  # the adapter alone, fp32 (a collective over the trainers under FSDP2)
            adapter = lora.adapter_state(model)
            wire = (adapter[k] for k in sorted(adapter))
        else:
            wire = (full(v).detach().to(self.dtype) for v in model.state_dict().values())  # a collective per tensor
        for t in wire:
            if self.link is not None:
                self.link.broadcast(t.contiguous())
        self.version = version

    def stop(self) -> None:
        """Let the inference ranks exit (trainer rank 0, at the end of the run, whatever ended it)."""
        if self.link is not None:
            for j in range(1, self.link.size):
                self.link.send([torch.tensor([STOP, 0])], j)


def dismiss(link: Link) -> None:
    """Trainer rank 0, with nothing to do (a resume at --steps already): the inference ranks exit
    before they load anything (an empty directory name)."""
    for j in range(1, link.size):
        link.send([torch.tensor([], dtype=torch.uint8)], j)


def serve(cfg, link: Link) -> None:
    """An inference rank: load the directory trainer rank 0 names, then generate and take weight
    pushes in the order it sends them, until STOP. No directory named: the trainers have nothing to do."""
    src, spec = _read_start(link.recv(0))
    if not src:
        return
    model, weights = _inference_model(cfg, src, spec)  # full fine-tuning: a skeleton, no weights (simplification 3)
    seed = cfg.seed + 1000 * link.rank  # unused by sampling (each call brings its seed); vLLM's init takes one
    engine = make_engine(cfg, model, src, TextCodec.load(src).stop_ids, seed, weights)
    Server(cfg, link, engine, model).run()


class _Stopped(Exception):
    """STOP arrived while a call decoded (the trainers' run ended mid-rollout)."""


class Server:
    """An inference rank's loop: each message from trainer rank 0, in order. With partial rollouts
    (--max-staleness) a thread receives them into `inbox` while a call decodes, and `between` (before
    each of the engine's decode steps) serves what has arrived: a push lands there and the rows go on
    under it, exactly as in a colocated engine; an eval's call is served inside it; STOP ends the
    call, which still replies (one line), so that trainer rank 0 reads every reply it waits for."""

    def __init__(self, cfg, link: Link, engine, model: Transformer):
        self.cfg, self.link, self.engine, self.model = cfg, link, engine, model
        self.wire, self.inbox = wire_dtype(cfg.engine_dtype), None
        if cfg.max_staleness and cfg.partial_rollouts:
            self.inbox = queue.Queue()
            engine.between = self.between
            threading.Thread(target=self._receive, name="floe-inbox", daemon=True).start()

    def run(self) -> None:
        try:
            while self.serve(self.link.recv(0) if self.inbox is None else self.inbox.get()):
                pass
        except _Stopped:
            return

    def between(self) -> None:
        while not self.inbox.empty():
            if not self.serve(self.inbox.get()):
                raise _Stopped

    def _receive(self) -> None:
        while True:  # nothing is received after STOP: the link closes next
            msg = self.link.recv(0)
            self.inbox.put(msg)
            if int(msg[0][0]) == STOP:
                return

    def serve(self, msg: list[torch.Tensor]) -> bool:
        """One message; False for STOP."""
        cmd, engine = int(msg[0][0]), self.engine
        if cmd == STOP:
            return False
        if cmd == IDLE:
            engine.idle()
        elif cmd == PUSH:
            if self.model.lora is None:  # each tensor from the wire straight into the engine's copy
                engine.load_tensors(_pushed(self.link, self.model, self.wire, self.cfg.device), version=int(msg[0][1]))
            else:
                _receive_adapter(self.link, self.model)
                engine.load_weights(self.model, version=int(msg[0][1]))
        else:
            prompts, n, sampling, version, budgets, keep, tag = _read_request(msg)
            if version != engine.version:
                raise RuntimeError(f"inference rank {self.link.rank}: asked for version {version}, holds {engine.version}")
            try:
                reply = _reply(engine.generate(prompts, n, sampling, budgets, keep))
            except RunError as e:  # the trainer stops with this one line (runlog.fail)
                reply = _line(f"inference rank {self.link.rank}: {e}")
            except _Stopped:
                self.link.send(_line(f"inference rank {self.link.rank}: stopped mid-call"), 0, tag)
                raise
            self.link.send(reply, 0, tag)
        return True


def _line(text: str) -> list[torch.Tensor]:
    """A reply that is one line (uint8): the call failed, and the trainer stops with it."""
    return [torch.tensor(list(text.encode()), dtype=torch.uint8)]


# ----------------------------------------------------------------------------- LoRA on the wire

def _start(model_dir, spec: lora.LoRASpec | None) -> list[torch.Tensor]:
    """The start message: the directory, then under LoRA its rank, alpha and targets."""
    out = [torch.tensor(list(str(model_dir).encode()), dtype=torch.uint8)]
    if spec is not None:
        out += [torch.tensor([spec.rank]), torch.tensor([spec.alpha], dtype=torch.float64),
                torch.tensor(list(" ".join(spec.targets).encode()), dtype=torch.uint8)]
    return out


def _read_start(msg: list[torch.Tensor]) -> tuple[str, lora.LoRASpec | None]:
    src = bytes(msg[0].tolist()).decode()
    if len(msg) == 1:
        return src, None
    return src, lora.LoRASpec(int(msg[1]), float(msg[2]), tuple(bytes(msg[3].tolist()).decode().split()))


def _inference_model(cfg, src: str, spec: lora.LoRASpec | None):
    """What an inference rank keeps beside its engine, and the weights a built-in engine starts from
    (read from the files one tensor at a time; vLLM loads its own). Full fine-tuning: a skeleton on the
    meta device (names and shapes; every push streams into the engine's copy). LoRA served by vLLM: the
    adapter's tensors alone, on a model whose base stays on the meta device. LoRA merged on this rank:
    the base in fp32, as the trainers hold it, with adapters each push fills (a merge needs the
    untouched base, which the engine's rounded copy is not)."""
    if spec is not None and not serves_adapter(cfg):
        model = hfdir.load(src, device=cfg.device)
        lora.add(model, spec)
        return model, None
    model, where = hfdir.load_meta(Path(src))  # every key and shape checked against config.json
    if spec is None:
        return model, hfdir.tensors(where, wire_dtype(cfg.engine_dtype))
    lora.add(model, spec)
    for m in lora.adapted(model).values():
        for part in (m.lora_A, m.lora_B):
            part.to_empty(device=cfg.device).requires_grad_(False).weight.zero_()
    return model, None


def _pushed(link: Link, skeleton: Transformer, dtype: torch.dtype, device):
    """One full fine-tuning push, tensor by tensor in the order RemoteEngine.load_weights sends them
    (the state dict's): (name, tensor), each received into its own buffer as the engine asks for it."""
    for k, v in skeleton.state_dict().items():
        t = torch.empty(v.shape, dtype=dtype, device=device)
        link.broadcast(t)
        yield k, t


@torch.no_grad()
def _receive_adapter(link: Link, model: Transformer) -> None:
    """One LoRA push into `model`'s adapters, in the order RemoteEngine.load_weights sends them."""
    adapter = {k: torch.empty_like(v) for k, v in lora.adapter_state(model).items()}
    for k in sorted(adapter):
        link.broadcast(adapter[k])
    lora.load_adapter(model, adapter)
