"""torchrun: the ranks, FSDP2 sharding, and the few collectives train.py makes per step.

Under `torchrun --nproc_per_node N train.py ...` every process runs the same file; RANK and
WORLD come from torchrun's environment (1 process: RANK 0, WORLD 1, and every function here
is the identity). gloo on the CPU (the tests), NCCL on GPUs.

    python -m pytest -q tests/test_distributed.py     # 2 gloo ranks against 1 process
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import config as C
import data as D
import loss as L
import model as M

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets both
LINK = None  # with --inference-gpus k: trainer rank 0 and the k inference ranks (remote.Link)


def print0(*a, **k):
    if RANK == 0:
        print(*a, **k, flush=True)


def setup_distributed(device: str, inference: int = 0) -> None:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): gloo on the CPU, NCCL on GPUs.

    With `inference` = k > 0 the last k ranks only sample (remote.py). The trainers' default
    group then holds the first WORLD - k ranks alone, and WORLD becomes that count (read it as
    `parallel.WORLD`); the inference ranks join no default group, because an in-process vLLM
    takes that over. LINK, trainer rank 0 plus the k, is built on torchrun's store directly."""
    global WORLD, LINK
    if WORLD == 1 or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if device == "cuda" else "gloo"
    if not inference:
        dist.init_process_group(backend)
        return
    from remote import Link

    trainers = WORLD - inference
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=RANK == 0 and not agent)
    if RANK < trainers:
        dist.init_process_group(backend, store=dist.PrefixStore("floe/train", store), rank=RANK, world_size=trainers)
    if RANK == 0 or RANK >= trainers:
        LINK = Link(store, max(0, RANK - trainers + 1), inference + 1, device)
    WORLD = trainers


def pin_inference_gpu(inference: int) -> None:
    """Before CUDA starts: an --inference-gpus rank sees only its own GPU, as cuda:0. An in-process
    vLLM puts its engine on cuda:0 of what the process sees (its uniproc executor's local rank is
    0), so without this every inference rank's engine would land on the first GPU."""
    if not inference or not 0 < WORLD - inference <= RANK:  # (a bad split is Config.resolve's to refuse)
        return
    local = int(os.environ.get("LOCAL_RANK", 0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(local + 1)]
    if local < len(ids):
        os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"] = ids[local], "0"


def serving() -> bool:
    """An --inference-gpus rank: it runs remote.serve, not the trainer."""
    return RANK >= WORLD


def shard(model: M.Transformer) -> M.Transformer:
    """FSDP2: one all-gather/reduce-scatter group per decoder block, then the root (embedding,
    tied head, final norm; it stays gathered from forward to backward, so the head outside the
    forward reads the full weight). Gradients are summed over ranks, not averaged: every rank's
    loss is already divided by the global count (loss.denominators)."""
    if WORLD == 1:
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


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather(items: list) -> list:
    """Every rank's items, concatenated in rank order (pickled: host-side records only)."""
    if WORLD == 1:
        return items
    parts = [None] * WORLD
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def my_share(mbs: list[D.MicroBatch]) -> list[D.MicroBatch]:
    """This rank's micro-batches, dealt round-robin fullest first: loss tokens balance within one
    micro-batch, and every rank runs the same number (each FSDP forward and backward is a
    collective), a rank left one short running an all-masked copy, which adds exactly zero."""
    order = sorted(range(len(mbs)), key=lambda i: -mbs[i].num_loss_tokens)
    mine = [mbs[i] for i in sorted(order[RANK::WORLD])]
    pad = [C.dataclasses.replace(mb, loss_mask=torch.zeros_like(mb.loss_mask), num_loss_tokens=0) for mb in mbs[:1]]
    return mine + pad * (-(-len(mbs) // WORLD) - len(mine))


def sum_over_ranks(total: L.Metrics, device) -> L.Metrics:
    """Each (sum, count) pair summed over ranks in one all_reduce; a name missing on a rank counts 0 there."""
    if WORLD == 1:
        return total
    names = list(dict.fromkeys(gather(list(total))))
    pairs = [total.get(k, (0.0, 0.0)) for k in names]  # stats from the host, metrics from the device
    flat = torch.stack([torch.stack([torch.as_tensor(x).to(device, torch.float64) for x in p]) for p in pairs])
    dist.all_reduce(flat)
    return {k: (s, c) for k, (s, c) in zip(names, flat)}
