"""Tasks: what train.py needs from one, the ones floe ships, and rewards you plug in by name.

A task is four things (the `Task` base class holds the shared parts):
- `sample(n, rng)`: n training prompts drawn from a seeded `random.Random` (the trainer's, so
  a checkpoint saves where the draws stand);
- `eval_set`: a fixed held-out list of prompts that training never draws;
- `score(prompts, completions, group)`: one reward per completion, from the task's reward
  functions; NaN marks a sample that could not be scored (it is skipped and counted);
- `Prompt.reference`: the reference completion for `--stage sft`, where the task has one.

Built in: `--task reverse-text` (the default: reverse a few words, scored by difflib's
similarity ratio), `--task arithmetic` (a + b or a - b, scored by numeric match: a 0/1 reward,
so eval reports pass@1 and pass@4), and `--task jsonl:PATH`, prompts from a file.

A jsonl row is a JSON object with a `prompt`: a string (used as it is) or a chat `messages`
list ([{"role": "user", "content": ...}], rendered with the model directory's chat template).
Every other column goes to the reward functions; a `completion` column is the reference for
`--stage sft`. The held-out set is `--eval-file`, or `--eval-prompts` rows of the file chosen by
a fixed seed, which training then never draws.

A reward function has TRL's shape: it gets `prompts` (as the task gave them), `completions`
(text, cut at the stop token), `completion_ids`, and each other column as a keyword argument
holding a list aligned with the completions; it returns one float per completion:

    def reward(prompts, completions, answer, **kwargs) -> list[float]

`--reward path/to/file.py:fn` or `--reward module:fn` loads one (repeat the flag for several,
`--reward-weights` to weigh them; the total is the weighted sum). Built-in names need no code:
`numeric_match` and `exact_match` against an `answer` column, `similarity` against `target`.

Simplifications:
1. A reward function is called once per prompt group (its `--group-size` completions), so a
   call that raises skips one group, not the step; the failure is printed and counted
   (`skipped/reward_error`). A None or NaN skips that sample; a wrong-length return, or a value
   that is not a real number (usercode.number), stops the run with one line naming the function.
   A step's calls run at once, each on its own thread (`score_groups`): a hung reward costs a step
   one --call-timeout, not one per group, and a function may run in several threads together.
2. Generated tasks hold out their eval set by value (training rejects those texts), so the
   split needs no bookkeeping; a file is split by row.
3. Everything is checked when the task is built, before the run writes anything: the file's
   rows, that each prompt renders and fits the tokenizer, that each reward function imports
   (its file's top-level code runs then, and again on --resume: it is an import) and that
   every row has the columns it asks for by name (a parameter with a default may be missing).

    python train.py --task arithmetic --model checkpoints/arith-tiny
    python train.py --task jsonl:examples/sums.jsonl --model checkpoints/arith-tiny --reward examples/rewards.py:close
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import inspect
import json
import math
import random
import re
import string
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import usercode
from config import Config, ConfigError
from data import Prompt, RunError
from textcodec import LETTERS, TextCodec

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

DIGITS = LETTERS + "0123456789+-="  # arith-tiny's alphabet
PRINTABLE = "".join(c for c in string.printable if c not in "\r\x0b\x0c")  # --model scratch for a jsonl task
EVAL_SEED = 10_000  # one held-out set for every --seed, so runs compare
CALL_ARGS = ("prompts", "completions", "completion_ids", "messages")


# ----------------------------------------------------------------------------- rewards

def similarity(prompts, completions, target, **kwargs) -> list[float]:
    """difflib's SequenceMatcher ratio between the completion and the `target` column."""
    return [difflib.SequenceMatcher(None, c, t).ratio() for c, t in zip(completions, target)]


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion, stripped, is the `answer` column's text, else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def numeric_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion's answer (the last \\boxed{} content, else the last number in it)
    equals the `answer` column as a number (GSM8K-style: commas dropped), else 0."""
    return [float(_same_number(final_number(c), a)) for c, a in zip(completions, answer)]


BUILTIN = {"similarity": similarity, "exact_match": exact_match, "numeric_match": numeric_match}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    found = NUMBER.findall(boxed[-1] if boxed else text)
    return found[-1] if found else None


def _same_number(x: str | None, answer) -> bool:
    if x is None or answer is None:
        return False
    try:
        a, b = float(x.replace(",", "")), float(str(answer).replace(",", "").strip())
    except ValueError:
        return False
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


@dataclass
class Reward:
    """One reward function, its weight in the total, and the file it came from (hashed with the run)."""

    name: str  # as given to --reward
    fn: Callable
    weight: float = 1.0
    source: Path | None = None  # None for the built-ins
    timeout: float = 60.0  # --call-timeout: seconds one call may take (usercode.py)
    stop: threading.Event | None = None  # set when the run shuts down: a call still running is abandoned at once

    def needs(self) -> list[str]:
        """The columns the function asks for by name (parameters without a default)."""
        params = inspect.signature(self.fn).parameters.values()
        return [p.name for p in params if p.default is p.empty and p.name not in CALL_ARGS
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def call(self, prompts: list[Prompt], texts: list[str], ids: list[list[int]],
             extra: dict[str, list] | None = None) -> Callable[[], object]:
        """One group's call, ready for usercode.call_all; the function gets copies: what it changes is
        not what floe trains on."""
        columns = {k: [p.columns.get(k) for p in prompts] for k in dict.fromkeys(k for p in prompts for k in p.columns)}
        kwargs = usercode.copied({"prompts": [p.prompt for p in prompts], "completions": texts,
                                  "completion_ids": ids, **columns, **(extra or {})})
        if inspect.iscoroutinefunction(self.fn):  # an async reward (TRL takes them too) runs to completion there
            return lambda: asyncio.run(self.fn(**kwargs))
        return lambda: self.fn(**kwargs)

    def values(self, res: usercode.Result, n: int) -> list[float]:
        """One float per completion from a call's result; NaN for each sample of a call that raised or
        timed out, and for None/NaN. A value that is not a number stops the run (usercode.number)."""
        if not res.ok and self.stop is not None and self.stop.is_set():
            return [math.nan] * n  # the run is shutting down: the batch is never trained on
        if not res.ok:  # a user's function: an outage skips its samples, loudly
            why = f"took longer than --call-timeout {self.timeout:g}s" if res.timed_out else f"raised {res.error}"
            print(f"warning: reward {self.name} {why} ({n} samples skipped, counted in skipped/reward_error)", flush=True)
            return [math.nan] * n
        out = res.value
        if not isinstance(out, (list, tuple)) and not (hasattr(out, "__len__") and hasattr(out, "__iter__")):
            raise RunError(f"reward {self.name} returned {type(out).__name__} {str(out)[:40]!r}, not a list "
                           "(it must return one float per completion)")
        out = list(out)
        if len(out) != n:
            raise RunError(f"reward {self.name} returned {len(out)} values for {n} completions "
                           "(it must return one float per completion)")
        try:
            return [math.nan if v is None else usercode.number(v) for v in out]
        except TypeError as e:
            raise RunError(f"reward {self.name} returned {e} for a completion (a real number, or None to skip it)") from None

def score_groups(rewards: list[Reward], groups: list[tuple]) -> list[list[float]]:
    """Each group's weighted reward sum per completion; `groups` holds each one's (prompts, texts, ids, extra).
    Every function's call on every group runs at once (usercode.call_all), so a step whose rewards hang
    waits one --call-timeout, not one per group; each call keeps its own thread, copies and result."""
    calls = [r.call(*g) for g in groups for r in rewards]
    results = iter(usercode.call_all(calls, max((r.timeout for r in rewards), default=0.0),
                                     rewards[0].stop if rewards else None))
    out = []
    for g in groups:
        total = [0.0] * len(g[1])
        for r in rewards:
            total = [t + r.weight * v for t, v in zip(total, r.values(next(results), len(g[1])))]
        out.append(total)
    return out


def load_reward(spec: str, weight: float = 1.0, timeout: float = 60.0) -> Reward:
    """A built-in name, `path/to/file.py:fn` or `module:fn`; ConfigError (one line) when it does not load."""
    try:
        fn, path = usercode.load(spec, "--reward", BUILTIN, "function")
    except usercode.LoadError as e:
        raise ConfigError(str(e)) from None
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {spec.rpartition(':')[0]} has no function {spec.rpartition(':')[2]!r}")
    return Reward(spec, fn, weight, path, timeout)


def load_rewards(specs: tuple[str, ...], weights: tuple[float, ...], timeout: float = 60.0) -> list[Reward]:
    if weights and len(weights) != len(specs):
        raise ConfigError(f"--reward-weights: {len(weights)} weights for {len(specs)} --reward functions")
    return [load_reward(s, w, timeout) for s, w in zip(specs, weights or [1.0] * len(specs))]


def reward_hashes(rewards: list[Reward]) -> dict[str, str]:
    """sha256 of each reward's source file, saved with the run (--resume says when one changed)."""
    return {r.name: hashlib.sha256(r.source.read_bytes()).hexdigest() for r in rewards if r.source}


def conversation(prompt: str | list[dict]) -> list[dict]:
    """A prompt as chat messages (a string prompt is one user message)."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


# ----------------------------------------------------------------------------- tasks

class Task:
    """The shared part of every task: rendering prompts, the rewards, scoring, the eval set."""

    alphabet = PRINTABLE  # what a --model scratch tokenizer must hold for this task

    def __init__(self, codec: TextCodec, rewards: list[Reward], template_kwargs: dict | None = None):
        self.codec, self.rewards, self.template_kwargs = codec, rewards, template_kwargs or {}
        self.eval_set: list[Prompt] = []

    def prompt(self, raw, columns: dict, reference: str | None = None, where: str = "") -> Prompt:
        return Prompt(self.codec.render(raw, **self.template_kwargs), raw, columns, reference, where)

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        raise NotImplementedError

    def completion_ids(self, p: Prompt) -> list[int]:
        """The reference completion (for SFT) then the first stop id."""
        return self.codec.encode(p.reference) + [self.codec.stop_ids[0]]

    def score(self, prompts: list[Prompt], completions: list[list[int]], group: int) -> list[float]:
        """The weighted sum of the rewards per completion (prompts: one per completion); NaN: skipped."""
        texts = [self.codec.decode(c) for c in completions]
        groups = [(prompts[a:a + group], texts[a:a + group], completions[a:a + group],
                   {"messages": [conversation(p.prompt) + [{"role": "assistant", "content": t}]
                                 for p, t in zip(prompts[a:a + group], texts[a:a + group])]})
                  for a in range(0, len(texts), group)]
        return [v for total in score_groups(self.rewards, groups) for v in total]

    def fit_eval_set(self, max_new_tokens: int, context: int, needed: bool = True) -> None:
        """Leave out held-out prompts whose completion budget does not fit the context, and say so."""
        fits = [p for p in self.eval_set if len(p.ids) + max_new_tokens <= context]
        if len(fits) < len(self.eval_set):
            print(f"warning: {len(self.eval_set) - len(fits)} of {len(self.eval_set)} held-out prompts do not fit "
                  f"the context ({context} tokens, --max-new-tokens {max_new_tokens}); eval leaves them out", flush=True)
        if not fits and needed:
            raise ConfigError(f"no held-out prompt fits the context ({context} tokens with --max-new-tokens "
                              f"{max_new_tokens}); lower --max-new-tokens or use --eval-every 0")
        self.eval_set = fits

    def check(self, rows: list[Prompt], where: str) -> None:
        """Every reward finds the columns it asks for by name in every row: one row without them would
        fail its group's reward call at every step that draws it (`where`: each row's place, as it names rows)."""
        needs = [(r, r.needs()) for r in self.rewards]
        for i, p in enumerate(rows):
            self.check_row(p.columns, f"{where} row {i + 1}", needs)

    def check_row(self, columns: dict, where: str, needs: list | None = None) -> None:
        for r, cols in needs or [(r, r.needs()) for r in self.rewards]:
            if missing := [c for c in cols if c not in columns]:
                raise ConfigError(f"{where}: --reward {r.name} needs the column(s) {missing}, which this row lacks "
                                  f"(it has {sorted(columns) or 'none'})")


class Generated(Task):
    """A task whose prompts a seeded generator makes: `draw(rng)` gives a key, `make(key)` its prompt.
    The eval set is the first `eval_size` distinct keys of a fixed seed, and training rejects them."""

    def __init__(self, codec, rewards, template_kwargs, eval_size: int, distinct: int, flags: str):
        super().__init__(codec, rewards, template_kwargs)
        if 2 * eval_size > distinct:  # training must keep most prompts, or its sampler would hunt for them
            raise ConfigError(f"--eval-prompts {eval_size} would hold out more than half of the {distinct} distinct "
                              f"prompts of {flags}; lower it or widen those")
        rng, keys = random.Random(EVAL_SEED), {}
        while len(keys) < eval_size:
            keys.setdefault(self.draw(rng))
        self.held_out = set(keys)
        self.eval_set = [self.make(k) for k in keys]
        self.check(self.eval_set, type(self).__name__)

    def draw(self, rng: random.Random):
        raise NotImplementedError

    def make(self, key) -> Prompt:
        raise NotImplementedError

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        out = []
        while len(out) < n:
            key = self.draw(rng)
            if key not in self.held_out:
                out.append(self.make(key))
        return out


class ReverseText(Generated):
    """Reverse a few words character by character; the reward is difflib's ratio to the target."""

    alphabet = LETTERS

    def __init__(self, codec, rewards=None, min_words=1, max_words=3, eval_size=64, template_kwargs=None):
        self.min_words, self.max_words = min_words, max_words
        distinct = sum(len(WORDS) ** k for k in range(min_words, max_words + 1))
        super().__init__(codec, rewards or [Reward("similarity", similarity)], template_kwargs, eval_size, distinct,
                         f"--min-words {min_words} --max-words {max_words}")

    def draw(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))

    def make(self, text: str) -> Prompt:
        return self.prompt([{"role": "user", "content": f"reverse: {text}"}], {"target": text[::-1]}, text[::-1])


class Arithmetic(Generated):
    """a + b or a - b, a in [0, --max-operand] and b a digit; the answer is checkable, the reward 0/1.

    b is one digit so every problem is made of facts that training shows in other problems too
    (a digit sum, a carry into the tens): the held-out problems are new, their parts are not, and
    a tiny model generalizes to them (with two-digit b it needs far longer to learn the task)."""

    alphabet = DIGITS

    def __init__(self, codec, rewards=None, max_operand=99, eval_size=64, template_kwargs=None):
        self.max_operand = max_operand
        super().__init__(codec, rewards or [Reward("numeric_match", numeric_match)], template_kwargs, eval_size,
                         2 * (max_operand + 1) * 10, f"--max-operand {max_operand}")

    def draw(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(0, self.max_operand), rng.choice("+-"), rng.randint(0, 9)

    def make(self, problem: tuple[int, str, int]) -> Prompt:
        a, op, b = problem
        answer = str(a + b if op == "+" else a - b)
        return self.prompt(f"{a}{op}{b}=", {"answer": answer}, answer)  # a plain prompt: 6 tokens, not 30 of chat


class JsonlTask(Task):
    """Prompts from a JSON-lines file (the module docstring has the format)."""

    def __init__(self, codec, rewards, path, eval_file="", eval_size=64, template_kwargs=None, env=False):
        super().__init__(codec, rewards, template_kwargs)
        if not rewards and not env:  # an --env may give the reward itself (episodes.load_env checks)
            raise ConfigError(f"--task jsonl:{path} needs --reward (a built-in: {', '.join(BUILTIN)}; "
                              "or path/to/file.py:fn)")
        self.needs = [(r, r.needs()) for r in rewards]  # read() checks every row's columns against them
        rows = self.read(Path(path))
        if eval_file:
            held = self.read(Path(eval_file))
            if len(held) < eval_size:
                raise ConfigError(f"--eval-file {eval_file} has {len(held)} rows, fewer than --eval-prompts {eval_size}")
            self.train, self.eval_set = rows, held[:eval_size]
        else:
            if len(rows) <= eval_size:
                raise ConfigError(f"{path} has {len(rows)} rows: holding out --eval-prompts {eval_size} leaves none to "
                                  "train on; lower --eval-prompts or give --eval-file")
            order = random.Random(EVAL_SEED).sample(range(len(rows)), len(rows))
            self.eval_set = [rows[i] for i in order[:eval_size]]
            self.train = [rows[i] for i in sorted(order[eval_size:])]

    def read(self, path: Path) -> list[Prompt]:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file")
        out = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                out.append(self._row(line, f"{path}:{n}"))
        if not out:
            raise ConfigError(f"{path}: empty (one JSON object per line, each with a `prompt`)")
        return out

    def _row(self, line: str, where: str) -> Prompt:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict) or "prompt" not in row:
            raise ConfigError(f"{where}: a row must be a JSON object with a `prompt`")
        raw = row.pop("prompt")
        chat = isinstance(raw, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in raw)
        if not (isinstance(raw, str) or (chat and raw)):
            raise ConfigError(f"{where}: `prompt` must be a string or a list of {{\"role\", \"content\"}} messages")
        if clash := [k for k in row if k in CALL_ARGS]:
            raise ConfigError(f"{where}: column name {clash[0]!r} is taken by the reward call; rename it")
        self.check_row(row, where, self.needs)
        reference = row.get("completion")
        try:
            return self.prompt(raw, row, None if reference is None else str(reference), where)
        except ValueError as e:  # no chat template, a character the tokenizer lacks
            raise ConfigError(f"{where}: {e}") from None

    def sample(self, n: int, rng: random.Random) -> list[Prompt]:
        return [rng.choice(self.train) for _ in range(n)]


# ----------------------------------------------------------------------------- from the flags

def alphabet(cfg: Config) -> str:
    """The characters a --model scratch tokenizer needs for --task."""
    return {"reverse-text": ReverseText, "arithmetic": Arithmetic}.get(cfg.task, Task).alphabet


def build(cfg: Config, codec: TextCodec) -> Task:
    """The task --task names, with its rewards; every check runs here, before the run writes anything."""
    rewards = load_rewards(cfg.reward, cfg.reward_weights, cfg.call_timeout)
    kwargs = json.loads(cfg.chat_template_kwargs)
    try:
        if cfg.task == "reverse-text":
            task = ReverseText(codec, rewards, cfg.min_words, cfg.max_words, cfg.eval_prompts, kwargs)
        elif cfg.task == "arithmetic":
            task = Arithmetic(codec, rewards, cfg.max_operand, cfg.eval_prompts, kwargs)
        else:
            task = JsonlTask(codec, rewards, cfg.task.removeprefix("jsonl:"), cfg.eval_file, cfg.eval_prompts, kwargs,
                             env=bool(cfg.env))
    except ValueError as e:  # a built-in prompt the model directory cannot render (no template, unknown chars)
        if isinstance(e, (ConfigError, RunError)):
            raise
        raise ConfigError(f"--task {cfg.task}: {e}") from None
    if cfg.stage == "sft" and isinstance(task, JsonlTask) and any(
            p.reference is None and "episode" not in p.columns for p in task.train):
        raise ConfigError(f"--stage sft needs a reference completion: {cfg.task} has rows with neither a `completion` "
                          "nor an `episode` (a multi-turn reference)")
    return task


def eval_metrics(rewards: list[float], n: int) -> dict[str, float]:
    """eval/reward over what scored, eval/reward_error; for 0/1 rewards pass@1 and pass@n (n samples
    per prompt: the share of prompts with at least one right)."""
    ok = [r for r in rewards if math.isfinite(r)]
    out = {"eval/reward_error": (len(rewards) - len(ok)) / max(len(rewards), 1)}
    if ok:
        out["eval/reward"] = sum(ok) / len(ok)
    if ok and all(r in (0.0, 1.0) for r in ok):
        groups = [[r for r in rewards[i:i + n] if math.isfinite(r)] for i in range(0, len(rewards), n)]
        groups = [g for g in groups if g]
        out["eval/pass@1"] = sum(sum(g) / len(g) for g in groups) / len(groups)
        out[f"eval/pass@{n}"] = sum(max(g) for g in groups) / len(groups)
    return out
