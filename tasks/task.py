"""Tasks: what train.py needs from one, the ones floe ships, and the table that names them.

A task is four things (the `Task` base class holds the shared parts):
- `sample(n, rng)`: n training prompts drawn from a seeded `random.Random` (the trainer's, so
  a checkpoint saves where the draws stand);
- `eval_set`: a fixed held-out list of prompts that training never draws;
- `score(prompts, completions, group)`: one reward per completion, from the task's reward
  functions (tasks/rewards.py: their contract, the built-in ones); NaN marks a sample that could not
  be scored (it is skipped and counted);
- `Prompt.reference`: the reference completion for `--stage sft`, where the task has one.

Built in: `--task reverse-text` (the default: reverse a few words, scored by difflib's
similarity ratio), `--task arithmetic` (a + b or a - b, scored by numeric match: a 0/1 reward,
so eval reports pass@1 and pass@4), and `--task jsonl:PATH`, prompts from a file. A new
built-in task is its class plus one entry in `TASKS` (its flags and their range checks) and one
Config field per flag: the `--task` check, the range checks, the "not read" note, the alphabet
of `--model scratch` and `build` all read that entry.

A jsonl row is a JSON object with a `prompt`: a string (used as it is) or a chat `messages`
list ([{"role": "user", "content": ...}], rendered with the model directory's chat template).
Every other column goes to the reward functions; a `completion` column is the reference for
`--stage sft`. The held-out set is `--eval-file`, or `--eval-prompts` rows of the file chosen by
a fixed seed, which training then never draws.

Simplifications:
1. Generated tasks hold out their eval set by value (training rejects those texts), so the
   split needs no bookkeeping; a file is split by row.
2. Everything is checked before the run writes anything: --task and the built-in tasks' flags
   (`check_flags`, at the start checks), then, when the task is built, the file's rows, that
   each prompt renders and fits the tokenizer, that each reward function (tasks/rewards.py) imports,
   and that every row has the columns it asks for by name.

    python train.py --task arithmetic --model checkpoints/arith-tiny
    python train.py --task jsonl:examples/sums.jsonl --model checkpoints/arith-tiny --reward examples/rewards.py:close
"""

from __future__ import annotations

import json
import math
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from config import Config, ConfigError
from data import Prompt, RunError
from tasks.rewards import BUILTIN, CALL_ARGS, Reward, load_rewards, numeric_match, score_groups, similarity
from tasks.textcodec import LETTERS, TextCodec

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
        self.tool_format = ""  # the declared tools' call format (envcheck.check_tools), for `tool_calls` in references

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

    def fit_eval_set(self, max_new_tokens: int, context: int, needed: bool = True,
                     length: Callable[[Prompt, int], int] | None = None) -> None:
        """Leave out held-out prompts whose completion budget does not fit the context, and say so.
        `length(p, j)`: the tokens of row p's first prompt as the eval plays it at place j of the
        fitted set (envcheck.eval_prompt_length: an environment's tools() join it after reset); by
        default its ids."""
        fits = []
        for p in self.eval_set:
            if (len(p.ids) if length is None else length(p, len(fits))) + max_new_tokens <= context:
                fits.append(p)
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
        if not rewards and not env:  # an --env may give the reward itself (envcheck.load_env checks)
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


# ----------------------------------------------------------------------------- the built-in tasks, from the flags

@dataclass(frozen=True)
class Check:
    """One range check over the flags: `ok(cfg)`, else the one line `says`, filled in from the config."""

    ok: Callable[[Config], bool]
    says: str  # names the flag and what it got, e.g. "--max-operand must be >= 1, got {max_operand}"


@dataclass(frozen=True)
class Builtin:
    """A built-in task, said once: what reads --task (check_flags, unread, alphabet, build) asks its
    entry in TASKS, never its name. A new task is its class, an entry and a Config field per flag."""

    cls: type[Task]  # takes each flag as the keyword of its name; `cls.alphabet` serves --model scratch
    flags: tuple[str, ...] = ()  # the Config fields it reads
    checks: tuple[Check, ...] = ()  # their ranges, checked whatever --task is (a typo is a typo)


TASKS = {
    "reverse-text": Builtin(ReverseText, ("min_words", "max_words"), (
        # a bound, not a range: ReverseText counts its distinct prompts as a sum of --max-words powers
        Check(lambda c: c.max_words <= 1000, "--max-words must be <= 1,000, got {max_words:,}"),
        Check(lambda c: 1 <= c.min_words <= c.max_words,
              "--min-words/--max-words need 1 <= min <= max, got {min_words}, {max_words}"))),
    "arithmetic": Builtin(Arithmetic, ("max_operand",), (
        Check(lambda c: c.max_operand >= 1, "--max-operand must be >= 1, got {max_operand}"),)),
}


def check_flags(cfg: Config) -> None:
    """--task is a built-in name or jsonl:PATH, and every built-in task's flags are in range; else
    ConfigError, one line naming the flag (the start checks run this first: config.py cannot see TASKS)."""
    if cfg.task not in TASKS and not (cfg.task.startswith("jsonl:") and len(cfg.task) > len("jsonl:")):
        raise ConfigError(f"--task must be {', '.join(TASKS)} or jsonl:PATH, got {cfg.task!r}")
    for check in (c for t in TASKS.values() for c in t.checks):
        if not check.ok(cfg):
            raise ConfigError(check.says.format_map(vars(cfg)))


def unread(cfg: Config) -> list[tuple[str, str, bool]]:
    """The built-in tasks' flags that --task leaves unread, as start.check_read takes them: a note each."""
    readers: dict[str, list[str]] = {}
    for name, t in TASKS.items():
        for f in t.flags:
            readers.setdefault(f, []).append(name)
    return [(f, f"is not read with --task {cfg.task} (it is --task {', '.join(names)}'s)", False)
            for f, names in readers.items() if cfg.task not in names]


def alphabet(cfg: Config) -> str:
    """The characters a --model scratch tokenizer needs for --task."""
    return TASKS[cfg.task].cls.alphabet if cfg.task in TASKS else JsonlTask.alphabet


def build(cfg: Config, codec: TextCodec, tools: list[dict] = ()) -> Task:
    """The task --task names, with its rewards; every check runs here, before the run writes anything.
    `tools`: --tool's schemas, the template's `tools` keyword for every prompt (so each check of a
    row's ids sees the prompt as the model will); none, and the keyword is not passed at all."""
    rewards = load_rewards(cfg.reward, cfg.reward_weights, cfg.call_timeout)
    kwargs = json.loads(cfg.chat_template_kwargs)
    if tools:
        kwargs["tools"] = list(tools)
    try:
        if builtin := TASKS.get(cfg.task):
            flags = {f: getattr(cfg, f) for f in builtin.flags}
            task = builtin.cls(codec, rewards, eval_size=cfg.eval_prompts, template_kwargs=kwargs, **flags)
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
