"""torchrun: the ranks, FSDP2 sharding, the few collectives train.py makes per step, the
`Link` to the --inference-gpus ranks, and a process's end (`teardown`, then `leave`).

Under `torchrun --nproc_per_node N train.py ...` every process runs the same file; RANK and
LAUNCHED come from torchrun's environment and never change; `world()`, the trainer ranks, is
the default process group's size (1 process: RANK 0, world() 1, and every function here is
the identity). Nothing here is set at run time: setup_distributed returns the `Link`. gloo on the CPU (the tests), NCCL on GPUs. This is the bottom layer: it
imports torch and the standard library alone, so every floe module may use it.

    python -m pytest -q tests/test_distributed.py     # 2 gloo ranks checked against one process
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

RANK, LAUNCHED = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets both


def world() -> int:
    """The trainer ranks: the default group's size once setup_distributed made it (with
    --inference-gpus k, LAUNCHED - k; the inference ranks are outside it), else 1."""
    return dist.get_world_size() if dist.is_initialized() else 1


def print0(*a, **k):
    if RANK == 0:
        print(*a, **k, flush=True)


def setup_distributed(device: str, inference: int = 0, timeout: float = 300.0) -> Link | None:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): gloo on the CPU, NCCL on GPUs.
    `timeout` (--dist-timeout, seconds) bounds every gloo wait at a collective: gloo's own is 30
    minutes, which a stopped or hung rank would hold the others for in silence (`collective` names
    the wait). NCCL keeps torch's 10 minutes: its watchdog aborts the process, and on GPUs rank 0
    alone evaluating or writing a large checkpoint can hold the others for minutes.

    With `inference` = k > 0 the last k ranks only sample (run/remote.py). The trainers' default
    group then holds the first LAUNCHED - k ranks alone (`world()`); the inference ranks join
    no default group, because an in-process vLLM takes that over. The returned `Link`, trainer
    rank 0 plus the k, is built on torchrun's store directly (None on the other trainer ranks
    and without --inference-gpus)."""
    if LAUNCHED == 1 or dist.is_initialized():
        return None
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if device == "cuda" else "gloo"
    wait = {"timeout": timedelta(seconds=timeout)} if backend == "gloo" else {}
    if not inference:
        dist.init_process_group(backend, **wait)
        return None
    trainers = LAUNCHED - inference
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=RANK == 0 and not agent)
    if RANK < trainers:
        dist.init_process_group(backend, store=dist.PrefixStore("floe/train", store), rank=RANK, world_size=trainers,
                                **wait)
    if RANK == 0 or RANK >= trainers:
        return Link(store, max(0, RANK - trainers + 1), inference + 1, device)
    return None


def pin_inference_gpu(inference: int) -> None:
    """Before CUDA starts: an --inference-gpus rank sees only its own GPU, as cuda:0. An in-process
    vLLM puts its engine on cuda:0 of what the process sees (its uniproc executor's local rank is
    0), so without this every inference rank's engine would land on the first GPU."""
    if not serving(inference):
        return
    local = int(os.environ.get("LOCAL_RANK", 0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(local + 1)]
    if local < len(ids):
        os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"] = ids[local], "0"


def serving(inference: int) -> bool:
    """An --inference-gpus rank: it runs remote.serve, not the trainer. (A bad split, k >= LAUNCHED,
    is Config.resolve's to refuse.)"""
    return inference > 0 and 0 < LAUNCHED - inference <= RANK


def shard(model: nn.Module) -> nn.Module:
    """FSDP2 on a model.Transformer (its decoder blocks are `model.model.layers`): one
    all-gather/reduce-scatter group per block, then the root (embedding, tied head, final norm;
    it stays gathered from forward to backward, so the head outside the forward reads the full
    weight). Gradients are summed over ranks, not averaged: every rank's loss is already divided
    by the global count (loss.denominators)."""
    if world() == 1 or isinstance(model, FSDPModule):  # FSDPModule: sharded already (the sharded load)
        return model
    # the forward returns hidden[0], a view that nothing edits in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # a plain SUM (gloo has no PREMUL_SUM)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


class CollectiveTimeout(RuntimeError):
    """A rank waited --dist-timeout at a collective, or lost a peer: the message names the rank and the wait."""


# gloo's words for a wait that ran out, and for the peer it lost (raised as a plain RuntimeError)
LOST = re.compile(r"Timed out waiting|Application timeout|Connection closed by peer|Connection reset by peer")


@contextlib.contextmanager
def collective(what: str, timeout: float):
    """Name the collectives inside (`what`: "step 3") for the one line a timed-out wait gets. Under NCCL
    a timeout is the watchdog's, which aborts the process itself."""
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as e:
        if not LOST.search(str(e)):
            raise
        cause = re.sub(r"^\[[^\]]*\] ", "", str(e).splitlines()[0])  # gloo's message, without its source path
        raise CollectiveTimeout(f"rank {RANK} stopped waiting for the other torchrun ranks in {what} (--dist-timeout "
                                f"{timeout:g} s): a rank is stopped, hung or dead ({cause})") from None


def first_other(item) -> tuple[int, object, object] | None:
    """(rank, rank 0's item, that rank's) for the first rank whose `item` differs from rank 0's; None
    when every rank's is the same (one all_gather_object; every rank gets the same answer)."""
    if world() == 1:
        return None
    items = [None] * world()
    dist.all_gather_object(items, item)
    return next(((r, items[0], x) for r, x in enumerate(items) if x != items[0]), None)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather(items: list) -> list:
    """Every rank's items, concatenated in rank order (pickled: host-side records only)."""
    if world() == 1:
        return items
    parts = [None] * world()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def sum_over_ranks(total: dict[str, tuple], device) -> dict[str, tuple]:
    """Each (sum, count) pair (loss.Metrics) summed over ranks in one all_reduce; a name missing
    on a rank counts 0 there."""
    if world() == 1:
        return total
    names = list(dict.fromkeys(gather(list(total))))
    pairs = [total.get(k, (0.0, 0.0)) for k in names]  # stats from the host, metrics from the device
    flat = torch.stack([torch.stack([torch.as_tensor(x).to(device, torch.float64) for x in p]) for p in pairs])
    dist.all_reduce(flat)
    return {k: (s, c) for k, (s, c) in zip(names, flat)}


# ----------------------------------------------------------------------------- the link

CODES = [torch.int64, torch.float64, torch.int32, torch.float32, torch.bool, torch.uint8]  # a message's dtypes


class Link:
    """Trainer rank 0 (link rank 0) and the k inference ranks (1..k), on torchrun's store:
    messages of host tensors over gloo (`send`, `recv`) and weights by `broadcast` (NCCL on
    GPUs). setup_distributed builds it; run/remote.py speaks its protocol over it."""

    def __init__(self, store, rank: int, size: int, device: str):
        self.rank, self.size, self.device = rank, size, device
        wait = timedelta(hours=6)  # an inference rank waits through whole training steps
        self.host = dist.ProcessGroupGloo(dist.PrefixStore("floe/link", store), rank, size, wait)
        self.fast = self.host
        if device == "cuda":  # weights go GPU to GPU
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = wait
            self.fast = dist.ProcessGroupNCCL(dist.PrefixStore("floe/link-nccl", store), rank, size, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> None:
        """A message: the tensor count, then each one's dtype code and length, then the tensors. `tag`
        keeps apart the replies to calls in flight at once (a partial rollout's and an eval's)."""
        head = torch.tensor([x for t in tensors for x in (CODES.index(t.dtype), t.numel())], dtype=torch.int64)
        for t in [torch.tensor([len(tensors)]), head] + [t.detach().cpu().contiguous().view(-1) for t in tensors]:
            if t.numel():  # an empty tensor is all header
                self.host.send([t], dst, tag).wait()

    def recv(self, src: int, tag: int = 0) -> list[torch.Tensor]:
        n = torch.zeros(1, dtype=torch.int64)
        self.host.recv([n], src, tag).wait()
        head = torch.zeros(2 * int(n), dtype=torch.int64)
        self.host.recv([head], src, tag).wait()
        out = []
        for code, numel in head.view(-1, 2).tolist():
            out.append(torch.empty(numel, dtype=CODES[code]))
            if numel:
                self.host.recv([out[-1]], src, tag).wait()
        return out

    def broadcast(self, t: torch.Tensor) -> None:
        """Link rank 0's `t` into every inference rank's `t`, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.fast.broadcast([t], opts).wait()

    def close(self) -> None:
        """The link's end, on each of its ranks once the run ended: a barrier, so no rank lets go of
        its end while a peer may still use it, then its groups are shut down and let go. Nothing else
        holds them, so their destructors run here and join their worker threads while the
        interpreter is alive (a gloo worker left running at exit can abort the process: `leave`)."""
        self.host.barrier().wait()
        for group in [self.host] if self.fast is self.host else [self.fast, self.host]:
            group.shutdown()  # NCCL: ends its communicator and watchdog; gloo: the destructor does it
        self.host = self.fast = None


def teardown(link: Link | None, inference: int = 0) -> None:
    """The end of a torchrun process that ran to completion, on every rank (trainers and inference
    ranks): the link closed first (it spans both sides), then the default group that
    setup_distributed made on the trainers destroyed (not one an in-process vLLM made for itself).
    Only after a normal end: a rank that failed may leave peers inside a collective, and a barrier
    there would wait on them (torchtitan#1342)."""
    if link is not None:
        link.close()
    if LAUNCHED > 1 and not serving(inference) and dist.is_initialized():
        dist.destroy_process_group()


def leave(main: Callable[[], object]) -> NoReturn:
    """Run a torchrun process's `main`, then end the process with its exit status without Python's
    finalization: os._exit, after flushing stdout and stderr. What `main` held is freed as it
    returns (the run's files closed, wandb finished by Logger.close); what is skipped is the
    clean-up of module globals and caches and the atexit hooks.

    Why: destroy_process_group drops the default group from torch.distributed, but torch's
    DTensor caches (sharding propagation, the redistribute planner) still hold it under FSDP2, so its
    gloo worker threads outlive the interpreter. A worker that drops the last reference to a tensor
    once finalization began asks for the GIL, is made to exit, and the unwinding aborts the process:
    "terminate called without an active exception", SIGABRT, a non-zero exit after a finished run
    (bench/teardown.py loops it). os._exit ends every thread at once."""
    try:
        main()
        code = 0
    except SystemExit as e:  # fail()'s status, argparse's 2, --help's 0
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # a crash keeps its traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
