"""A Hugging Face model directory, read and written: config.json, the safetensors weights, the
tokenizer files. `load` builds the model (model.py) on the meta device and fills it from the files,
every key, shape and value checked, each problem one line naming the file; under torchrun
`load_meta` and `fill_shards` do the same with each rank reading only its FSDP2 rows (the sharded
load). model.safetensors.index.json, when present, says which files hold the weights; `save` writes a
directory that transformers and vLLM load as it is, with the source's own config.json, under a
temporary name renamed into place (`write_dir`), so a crash never leaves half a directory.

    python -m pytest -q tests/test_model.py     # against transformers, on random tiny checkpoints
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import ModelArgs, TINY, Transformer, init_weights, rope_frequencies


def read_config(path: Path) -> dict:
    """config.json as a dict, or one line naming the file."""
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map: tensor name -> file
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")  # what a weight may be stored as: each casts to fp32 exactly


def load(model_dir: str | Path, device="cpu", dtype=torch.float32) -> Transformer:
    """A HF directory of a family in model.FAMILIES -> Transformer, every key, shape and value checked."""
    model, where = load_meta(Path(model_dir))
    model.load_state_dict(dict(tensors(where, dtype)), strict=True, assign=True)
    model.inv_freq = rope_frequencies(model.args)  # buffers are not in the file: made on meta, made again here
    return model.to(device)


def tensors(where: dict[str, tuple[Path, tuple]], dtype=torch.float32):
    """Each tensor `load_meta` found, read one at a time in file order and cast to `dtype`: (name, tensor);
    a damaged file, or a NaN or inf weight, is one line naming the file. A caller that keeps only its
    own copy (an inference rank's engine) holds one tensor of the files at a time."""
    for f in dict.fromkeys(f for f, _ in where.values()):
        try:
            st = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ValueError(f"{f}: unreadable safetensors file ({e})") from None
        with st:
            for k in (k for k, (g, _) in where.items() if g == f):
                try:
                    t = st.get_tensor(k).to(dtype)
                except Exception as e:
                    raise ValueError(f"{f}: unreadable safetensors file ({e})") from None
                # a NaN or inf weight would surface as a NaN loss at step 1, far from its cause
                if not torch.isfinite(t).all():
                    raise ValueError(f"{f}: {k} holds NaN or inf")
                yield k, t


def load_meta(d: Path) -> tuple[Transformer, dict[str, tuple[Path, tuple]]]:
    """The model on the meta device, and where each of its tensors lies (file, shape), from config.json and
    the weights' headers alone: every key and shape checked, no tensor read."""
    for f in ("config.json", "tokenizer.json"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f}: " + ("not a regular file" if (d / f).exists() else "missing") +
                                    "; --model must be a HF directory with config.json, model.safetensors and tokenizer.json")
    args = ModelArgs.from_hf(read_config(d / "config.json"), str(d / "config.json"))
    where = headers(weight_files(d), args)
    layers = {int(m.group(1)) for k in where if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if len(layers) != args.num_hidden_layers:  # before building: a typo of 10^7 layers would build for minutes
        raise ValueError(f"{d}: weights do not match config.json: num_hidden_layers {args.num_hidden_layers}, "
                         f"the weights hold {len(layers)} layers")
    with torch.device("meta"):
        model = Transformer(args)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
    if missing or extra:
        raise ValueError(f"{d}: weights do not match config.json: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, shape in expected.items():
        if where[k][1] != shape:
            raise ValueError(f"{d}: {k} has shape {where[k][1]}, config.json implies {shape}")
    return model, where


def weight_files(d: Path) -> list[Path]:
    """The directory's weight files: those model.safetensors.index.json names when it is there (it is
    authoritative: a file it names that is absent, or a *.safetensors it does not name, is refused, so
    a consolidated copy beside the shards never loads twice), else every *.safetensors."""
    files = sorted(d.glob("*.safetensors"))
    if (d / INDEX).exists():
        named = read_config(d / INDEX).get("weight_map")
        if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
            raise ValueError(f"{d / INDEX}: weight_map must map each tensor name to a file name")
        names = sorted(set(named.values()))
        # a path out of the directory would load weights that the LoRA base's hash (its *.safetensors) never reads
        if odd := [n for n in names if n != Path(n).name or n in (".", "..")]:
            raise ValueError(f"{d / INDEX}: names {odd[0]}, which is not a file name in {d}")
        if gone := [n for n in names if not (d / n).exists()]:
            raise ValueError(f"{d / INDEX}: names {gone[0]}, which is missing from {d}")
        if stray := [f for f in files if f.name not in names]:
            raise ValueError(f"{stray[0]}: a weight file {INDEX} does not name; move it out of {d}")
        files = [d / n for n in names]
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    if odd := [f for f in files if not f.is_file()]:  # a FIFO would block the read forever
        raise ValueError(f"{odd[0]}: not a regular file")
    return files


def headers(files: list[Path], args: ModelArgs) -> dict[str, tuple[Path, tuple]]:
    """Each tensor's file and shape, read from the headers (a tied model's stored head is dropped); a
    tensor in two files is refused, not overwritten by whichever file comes last."""
    where = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                found = {k: (tuple(st.get_slice(k).get_shape()), st.get_slice(k).get_dtype()) for k in st.keys()}
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ValueError(f"{f}: unreadable safetensors file ({e})") from None
        for k, (shape, dtype) in found.items():
            if k == "lm_head.weight" and args.tie_word_embeddings:
                continue
            if dtype not in WEIGHT_DTYPES:  # an int or bool tensor would be cast to float and load as other weights
                raise ValueError(f"{f}: {k} is stored as {dtype}, not as a weight ({', '.join(WEIGHT_DTYPES)}); "
                                 "a quantized checkpoint needs its full-precision original")
            if k in where:
                raise ValueError(f"{f}: {k} is also in {where[k][0]}; a tensor must be in one file")
            where[k] = (f, shape)
    return where


def fill_shards(model: Transformer, model_dir: Path, whole: dict[str, torch.Tensor], device) -> None:
    """The sharded load: `model` sharded by FSDP2 on the meta device; each rank gives every parameter its
    storage on `device` and reads only its own rows (FSDP2's dim-0 chunk) from the file with get_slice,
    as fp32, then into the parameter's dtype; `whole` (the adapters, made whole before sharding) gives
    its rows the same way. Every rank checks its rows are readable and finite, and the ranks reach one
    verdict by an all-reduce (the first bad tensor in file order), so every rank stops with the same line."""
    where = headers(weight_files(Path(model_dir)), model.args)  # checked whole by load_meta
    model.to_empty(device=device)
    model.inv_freq = rope_frequencies(model.args).to(device)  # not in the files: made again
    params = dict(model.named_parameters())
    order = sorted(where, key=lambda k: (str(where[k][0]), k))
    bad = len(order), 0  # this rank's first bad tensor (its index in `order`), and why: 0 unreadable, 1 not finite
    with torch.no_grad():
        for k in whole:
            params[k].to_local().copy_(whole[k][rows(params[k])])
        for f in dict.fromkeys(where[k][0] for k in order):
            names = [k for k in order if where[k][0] == f]
            k = names[0]
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for k in names:
                        part = st.get_slice(k)[rows(params[k])].to(torch.float32)
                        if not torch.isfinite(part).all():
                            bad = order.index(k), 1
                            break
                        params[k].to_local().copy_(part)
            except Exception:  # safetensors raises several types for a damaged file
                bad = order.index(k), 0
            if bad[0] < len(order):
                break
    code = torch.tensor([2 * bad[0] + bad[1]], device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MIN)
    if (i := int(code) // 2) < len(order):
        f, k = where[order[i]][0], order[i]
        raise ValueError(f"{f}: {k} holds NaN or inf" if int(code) % 2 else f"{f}: unreadable safetensors file (at {k})")


def rows(p: torch.Tensor) -> slice:
    """This rank's rows of a parameter FSDP2 sharded on dim 0 (torch.chunk's split: ceil(n / ranks) a rank)."""
    n, ranks, local = p.shape[0], dist.get_world_size(), p.to_local().shape[0]
    start = min(n, dist.get_rank() * -(-n // ranks))
    return slice(start, start + local)


# what a HF directory holds besides weights and config.json, copied as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json")


def saved_config(args: ModelArgs, src_dir: Path) -> dict:
    """The source's config.json with what training changed (fp32 weights now), every other key
    as it was. A source without one, or whose config describes another model (a fresh model
    saved where an old one stood), gets `args.to_hf()`."""
    f = src_dir / "config.json"
    try:
        cfg = read_config(f) if f.is_file() else None
        same = cfg is not None and ModelArgs.from_hf(cfg, str(f)) == args
    except ValueError:
        same = False
    if not same:
        return args.to_hf()
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
    return {**cfg, **dict.fromkeys(keys, "float32")}


def remove_path(path: Path) -> None:
    """Whatever stands at `path`, gone: a directory tree, or a file or symlink (the link itself,
    never what it points at); nothing when absent. A stale temporary name is cleared this way."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """model.safetensors: safetensors reports a full disk as its own SafetensorError, turned here into
    the OSError (errno, path) that every other failed write raises, so callers catch one type."""
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        n = int(code.group(1)) if code else errno.EIO
        raise OSError(n, os.strerror(n) if code else str(e), str(path)) from None


def save(model: Transformer, out_dir: str | Path, src_dir: str | Path, extra: dict[str, bytes] | None = None,
         state: dict[str, torch.Tensor] | None = None) -> None:
    """Write a HF directory (plus `extra` files) under a temporary name, then rename it into place.
    `src_dir` is where the model came from: its config.json, tokenizer and generation files.
    `state` replaces model.state_dict(): the full weights gathered from FSDP shards (train.py), or a
    LoRA model's merged or base weights."""
    src = Path(src_dir)
    assert state is not None or model.lora is None, "a LoRA model's HF directory is its merged or base weights (state=)"
    config = saved_config(model.args, src)  # read before anything is written: src may be out

    def fill(tmp: Path) -> None:
        write_hf(tmp, config, src, state or model.state_dict())
        write_extra(tmp, extra or {})
    write_dir(out_dir, fill)


def write_tiny(out_dir: str | Path, alphabet: str, template: str, tags: list[str] = (), seed: int = 0) -> None:
    """A fresh tiny model's directory (model.TINY's shape, random weights from `seed`) with a one-character
    tokenizer of `alphabet` and `tags` and the chat template `template` (textcodec.write_tokenizer): a
    starting point that `--model scratch` cannot make, since that one writes the letters' ChatML tokenizer."""
    from tasks.textcodec import char_tokenizer, write_tokenizer

    model = Transformer(ModelArgs(char_tokenizer(alphabet, tags).get_vocab_size(), **TINY, eos_token_id=2))
    init_weights(model, seed=seed)  # eos: <|im_end|>, id 2 in every tiny tokenizer

    def fill(tmp: Path) -> None:
        write_tokenizer(tmp, alphabet, template, tags)
        write_weights(model.state_dict(), tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(model.args.to_hf(), indent=2))
    write_dir(out_dir, fill)


def write_hf(d: Path, config: dict, src: Path, state: dict[str, torch.Tensor]) -> None:
    """A HF directory's files into the existing directory `d`: fp32 weights, `config`, and the
    tokenizer and generation files of `src`."""
    write_weights({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}, d / "model.safetensors")
    write_files(d, config, src)


def write_files(d: Path, config: dict, src: Path) -> None:
    """A HF directory's files besides the weights: `config`, and the tokenizer and generation files of `src`."""
    (d / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, d / f)


def write_extra(d: Path, files: dict[str, bytes]) -> None:
    for name, blob in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(blob)


def write_dir(out_dir: str | Path, fill) -> None:
    """A directory whose files `fill(tmp)` writes, made under a temporary name, fsynced, then renamed
    into place. The temporary directory is made new (mkdir fails on anything left there, which is
    removed first, a planted symlink included, never followed), so every file in it is this call's."""
    out = Path(out_dir)
    tmp = new_tmp(out)
    fill(tmp)
    publish_dir(tmp, out)


def new_tmp(out: Path) -> Path:
    """`out`'s temporary name (out.tmp), made new: whatever stood there removed first, never followed."""
    tmp = out.with_name(out.name + ".tmp")
    remove_path(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, out: Path) -> None:
    """A finished temporary directory renamed into place at `out`, every file fsynced first (under
    torchrun, files other ranks wrote too: on a shared filesystem an fsync reaches them wherever they came from)."""
    for f in tmp.rglob("*"):  # data on disk before the rename makes it visible
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if out.exists() or out.is_symlink():  # replace: move the old one aside first, so a crash leaves one readable copy
        old = out.with_name(out.name + ".old")
        remove_path(old)
        out.rename(old)
        tmp.rename(out)
        remove_path(old)
    else:
        tmp.rename(out)
