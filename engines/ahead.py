"""The batches sampled ahead, in a checkpoint: what makes a --push-at-decode-step resume exact.

With --max-staleness S and --push-at-decode-step D (engines/pipeline.py, AsyncRollouts 13) the batches
after step k are sampled partly by weights older than version k, which no checkpoint keeps. So the
checkpoint of step k keeps the batches themselves: every batch up to k + S (the last one that needs
a version before k), once made, with the RNG states right after it; a resume puts them back in the
queue and the thread goes on from batch k + S + 1, which versions k and later sample. Each rank's
batches (its share of the prompts) go into its own optimizer file, beside its engine's generator.

As tensors, no pickle: under `ahead/<step>/` the samples' token ids, log q (float64: the engine's
values exactly as the step reads them), versions and support rows, concatenated, the stats'
(sum, count) pairs, and `meta`, one JSON document (as uint8) with the prompts and each sample's
scalars. A prompt's columns must be JSON (a task's rows are); a batch that is not gives None, and
the checkpoint falls back to refilling (`AsyncRollouts.checkpointed`).

    python -m pytest -q tests/test_async.py -k exactly
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from data import Prompt, Sample, TokenSupport

PREFIX = "ahead/"


def encode(batches: dict[int, tuple]) -> dict[str, torch.Tensor] | None:
    """{step: (samples, stats, seconds)} as tensors under `ahead/<step>/`; None if a prompt is not JSON."""
    out = {}
    for step, (samples, stats, seconds) in batches.items():
        key, prompts, rows = f"{PREFIX}{step}/", {}, []
        for s in samples:
            n = prompts.setdefault(id(s.prompt), (len(prompts), s.prompt))[0]
            rows.append({"prompt": n, "n": len(s.completion), "finish_reason": s.finish_reason, "reward": s.reward, "advantage": s.advantage,
                         "support": s.support is not None, "mask": s.mask, "turns": s.turns})
        meta = {"seconds": seconds, "samples": rows, "stats": list(stats),
                "prompts": [dataclasses.asdict(p) for _, p in prompts.values()]}
        try:
            blob = json.dumps(meta, allow_nan=False).encode()
        except (TypeError, ValueError):  # a column the task gave that JSON cannot hold
            return None
        sup = [s.support.to("cpu") for s in samples if s.support is not None]
        whole = TokenSupport.cat(sup) if sup else TokenSupport.empty(0)
        out.update({key + "meta": torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                    key + "completion": _cat([s.completion for s in samples], torch.int64),
                    key + "logq": _cat([s.logq for s in samples], torch.float64),
                    key + "versions": _cat([s.versions for s in samples], torch.int64),
                    key + "support/ids": whole.ids, key + "support/counts": torch.from_numpy(np.diff(whole.host_offsets)),
                    key + "support/logq": whole.logq, key + "support/replayed": whole.replayed})
        for k, (total, count) in stats.items():
            out[f"{key}stats/{k}/sum"], out[f"{key}stats/{k}/count"] = torch.as_tensor(total).cpu(), torch.as_tensor(count).cpu()
    return out


def decode(tensors: dict[str, torch.Tensor]) -> dict[int, tuple]:
    """encode's inverse; raises ValueError naming what does not fit (a damaged checkpoint)."""
    steps = sorted({int(k[len(PREFIX):].split("/")[0]) for k in tensors if k.startswith(PREFIX)})
    out = {}
    for step in steps:
        key = f"{PREFIX}{step}/"
        try:
            meta = json.loads(bytes(tensors[key + "meta"].numpy()).decode())
            prompts = [Prompt(**p) for p in meta["prompts"]]
            completion, logq, versions = (tensors[key + k].tolist() for k in ("completion", "logq", "versions"))
            sup = {k: tensors[f"{key}support/{k}"] for k in ("ids", "counts", "logq", "replayed")}
            whole = TokenSupport.from_counts(sup["ids"], sup["counts"].numpy(), sup["logq"], sup["replayed"])
            samples, at, row = [], 0, 0
            for r in meta["samples"]:
                n, support = r["n"], None
                if r["support"]:
                    if row + n > whole.num_rows:
                        raise ValueError("its support has fewer rows than its samples")
                    support, row = whole.slice(row, row + n), row + n
                samples.append(Sample(prompts[r["prompt"]], completion[at:at + n], logq[at:at + n], versions[at:at + n],
                                      r["finish_reason"], support, r["reward"], r["advantage"], r["mask"], r["turns"]))
                at += n
            if (at, row, whole.nnz) != (len(completion), whole.num_rows, len(whole.ids)) or len(whole.replayed) != row:
                raise ValueError("its tensors are longer than its samples")
            stats = {k: (tensors[f"{key}stats/{k}/sum"], tensors[f"{key}stats/{k}/count"]) for k in meta["stats"]}
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"the batch of step {step} sampled ahead does not read back: {type(e).__name__}: {e}") from None
        out[step] = (samples, stats, float(meta["seconds"]))
    return out


def _cat(parts: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p, dtype=dtype).reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=dtype)
