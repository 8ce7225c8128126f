"""A checkpoint's tensors written without holding them all: safetensors files streamed a tensor at a
time, the HF weights in HF's sharded layout, and each trainer rank's optimizer state in its own file.

Why by hand: safetensors' own writers take the whole dict of one file and serialize it into one
buffer first (the tensors, then their bytes again), so a save that used them would hold a file's
tensors twice, up to 5 GB each, and for a model under 5 GB the whole model. The format is small
enough to write directly: 8 bytes (little-endian u64) giving the header's length, the header (JSON:
each tensor's dtype, shape and [begin, end) byte offsets into the data that follows, plus
`__metadata__`; padded with spaces to a multiple of 8), then the tensors' raw bytes back to back.
Every name, shape and dtype is known before the first tensor is gathered (from the model's
parameters, which FSDP2 keeps as DTensors of the full shape), so the header goes first and each
tensor's bytes follow as it arrives: the writer holds one tensor, never a file's worth.

Layout, as `save_pretrained` writes it (transformers and vLLM read it as it is):
- weights: one `model.safetensors` when the model fits in MAX_SHARD_BYTES, else
  `model-00001-of-0000N.safetensors`... filled in state_dict order up to MAX_SHARD_BYTES each, and
  `model.safetensors.index.json` (tensor name -> file);
- `trainer_state/optim_rng-0000R-of-0000W.safetensors`: rank R's rows of every AdamW tensor (its
  FSDP2 shard: dim 0 cut as torch.chunk cuts it), AdamW's step, and its engine's sampling generator.

    python -m pytest -q tests/test_checkpoint_files.py
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from layers import lora, parallel
from layers.parallel import RANK, full
from run import hfdir
from run.rundir import STATE

MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB"); tests set it small
INDEX = "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
MERGED = "merged"  # a LoRA run's last checkpoint: W + (alpha / r) B A as a HF directory, loaded with no peft
ADAM = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}  # AdamW's state per parameter
Spec = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor's name, dtype and shape, as its header states them


def header(specs: list[Spec]) -> bytes:
    """The file's first bytes: the header's length, then the header, for tensors laid out in `specs`' order."""
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        end = offset + math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned, as safetensors' own writer pads it
    return struct.pack("<Q", len(blob)) + blob


class Stream:
    """One safetensors file at `path`, its header written at once and each tensor's bytes as `add` gets it
    (in `specs`' order, each checked against its spec). A file of the wrong length never reads: the
    reader checks the header's offsets cover the data exactly."""

    def __init__(self, path: Path, specs: list[Spec]):
        self.path, self.specs, self.n = path, specs, 0
        self.f = open(path, "xb")  # a new file: the temporary directory is this save's own
        self.f.write(header(specs))

    def add(self, t: torch.Tensor) -> None:
        name, dtype, shape = self.specs[self.n]
        t = t.detach().to("cpu", dtype).contiguous()
        assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, its header says {shape}"
        self.f.write(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own memory, no copy
        self.n += 1

    def close(self) -> None:
        self.f.close()  # (OSError: a full disk's last bytes)


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A dict of tensors (already held: one rank's optimizer state) as one file, streamed."""
    st = Stream(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for v in tensors.values():
        st.add(v)
    assert st.n == len(st.specs)
    st.close()


def weight_files(shapes: dict[str, tuple[int, ...]], itemsize: int = 4) -> list[tuple[str, list[str]]]:
    """(file name, its tensors) for HF's layout: in order, a new file whenever the next tensor would take
    the current one past MAX_SHARD_BYTES (a tensor larger than that is a file of its own)."""
    groups, size = [[]], 0
    for k, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if groups[-1] and size + n > MAX_SHARD_BYTES:
            groups, size = groups + [[]], 0
        groups[-1].append(k)
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def save_weights(d: Path, shapes: dict[str, tuple[int, ...]], tensor: Callable[[str], torch.Tensor],
                 write: bool) -> OSError | None:
    """The HF weights into `d` as fp32, `tensor(name)` giving each whole in `shapes`' order. Under torchrun every
    rank calls this (`tensor` gathers: a collective), and only `write` (rank 0) keeps what it gets, one
    tensor at a time. A failed write (a full disk) stops the writing, not the gathering, so every rank
    reaches the save's verdict: the error is returned, not raised."""
    err, where = None, {}
    for name, keys in weight_files(shapes):
        st = None
        for k in keys:
            t = tensor(k)
            if write and err is None:
                try:
                    st = st or Stream(d / name, [(k, torch.float32, tuple(shapes[k])) for k in keys])
                    st.add(t)
                except OSError as e:
                    err = e
            del t
        if st is not None:  # a file cut short by an error says so on reading (its header's offsets pass its end)
            try:
                st.close()
            except OSError as e:
                err = err or e
        where.update(dict.fromkeys(keys, name))
    if write and err is None and len(set(where.values())) > 1:
        total = sum(4 * math.prod(shape) for shape in shapes.values())
        try:
            (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": where}, indent=2))
        except OSError as e:
            err = e
    return err


# ----------------------------------------------------------------------------- each rank's optimizer file

LEGACY = "optim_rng.safetensors"  # a checkpoint before the per-rank files: every AdamW tensor whole, every rank's generator


def optim_file(rank: int, world: int) -> str:
    return f"optim_rng-{rank:05d}-of-{world:05d}.safetensors"


def rows(n: int, rank: int, world: int) -> int:
    """How many of a tensor's n rows (dim 0) rank `rank` holds under FSDP2: torch.chunk's split,
    ceil(n / world) a rank, the last ranks fewer or none."""
    size = -(-n // world)
    return max(0, min(n, (rank + 1) * size) - min(n, rank * size))


def local_shape(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    return shape if not shape or world == 1 else (rows(shape[0], rank, world), *shape[1:])


def check_optim(f: Path, shapes: dict[str, tuple], rank: int, world: int, engines: tuple[str, ...] = ("rng/engine",)) -> None:
    """Rank `rank`'s optimizer file, by its header alone: AdamW state of the trained parameters in fp32, each
    in that rank's rows of its parameter (`local_shape`), and the `engines` generators' bytes (a LEGACY
    file: every tensor whole, rank 0 of 1, and every rank's generator)."""
    name = f"{STATE}/{f.name}"
    if not f.is_file():
        raise ValueError(f"{name}: missing (rank {rank} of the run's {world})")
    with safe_open(str(f), framework="pt") as st:
        for key in st.keys():
            part = st.get_slice(key)
            if key in engines:
                if part.get_dtype() != "U8" or len(part.get_shape()) != 1:
                    raise ValueError(f"{name}: {key} is no generator state")
                continue
            if key.startswith("ahead/"):  # the batches sampled ahead (engines/ahead.py), checked by reading them back
                continue
            param, _, kind = key.removeprefix("optim/").rpartition("/")
            if not key.startswith("optim/") or param not in shapes or kind not in ADAM:
                raise ValueError(f"{name}: {key} is no optimizer state of this model")
            want = () if kind == "step" else local_shape(shapes[param], rank, world)
            if (got := tuple(part.get_shape())) != want or part.get_dtype() != "F32":
                raise ValueError(f"{name}: {key} has shape {got} ({part.get_dtype()}), its parameter's rows {want} (F32)")
        if missing := sorted(set(engines) - set(st.keys())):
            raise ValueError(f"{name}: no {missing[0]} (world_size {world if len(engines) == 1 else len(engines)})")


# ----------------------------------------------------------------------------- a checkpoint's parts

def write_parts(tmp: Path, model, opt, gen: torch.Generator, src: Path, final: bool,
                extra: dict[str, torch.Tensor] | None = None) -> OSError | None:
    """This rank's parts of a checkpoint into `tmp`, returning a failed write's error: its optimizer file
    (its shard of every AdamW tensor, its engine's generator and `extra`: the batches it sampled ahead), and
    with rank 0 writing, the weights gathered one tensor at a time (`save_weights`: every rank joins the gathers)."""
    names = {id(p): n for n, p in model.named_parameters()}
    own = {f"optim/{names[id(p)]}/{k}": v.to_local() if isinstance(v, DTensor) else v
           for p, st in opt.state.items() for k, v in st.items()}
    own["rng/engine"] = gen.get_state()
    own.update(extra or {})
    err = None
    try:
        write_file(tmp / STATE / optim_file(RANK, parallel.world()), own)
    except OSError as e:
        err = e
    del own
    state = model.state_dict()
    base = {k: tuple(v.shape) for k, v in state.items() if not lora.is_adapter_key(k)}
    if model.lora is None:
        return _weights(tmp, model, src, base, lambda k: full(state[k])) or err
    adapter = lora.adapter_state(model)  # (collectives: every rank joins, rank 0 writes)
    if RANK == 0 and err is None:
        try:
            lora.write_adapter(tmp, adapter, model.lora, str(src.resolve()))
        except OSError as e:
            err = e
    if not final:
        return err
    scale, adapted = model.lora.scale, {f"{m}.weight": m for m in {lora.module_of(k) for k in adapter}}

    def merged(k: str) -> torch.Tensor:  # W + (alpha / r) B A for an adapted layer (lora.merged's, tensor by tensor)
        w, m = full(state[k]), adapted.get(k)
        return w if m is None or RANK else lora.merge(w, adapter[lora.peft_key(m, "A")], adapter[lora.peft_key(m, "B")], scale)
    if RANK == 0 and err is None:
        try:
            (tmp / MERGED).mkdir()
        except OSError as e:
            err = e
    return _weights(tmp / MERGED, model, src, base, merged) or err


def _weights(d: Path, model, src: Path, shapes: dict, tensor) -> OSError | None:
    """A HF directory's files into `d`: the weights streamed (rank 0 writes, every rank gathers), then
    config.json and the tokenizer files."""
    err = save_weights(d, shapes, tensor, RANK == 0)
    if RANK == 0 and err is None:
        try:
            hfdir.write_files(d, hfdir.saved_config(model.args, src), src)
        except OSError as e:
            err = e
    return err
