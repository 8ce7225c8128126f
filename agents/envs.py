"""Environments for multi-turn episodes: the contract you write to, and the one floe ships.

An environment plays one episode: floe makes one instance per episode (with no arguments),
starts it from a row of `--task jsonl:FILE`, and then alternates the model's turn and the
environment's reply until the environment says it is done, the turn cap (--max-turns) or the
token budget is reached. The reward comes at the end. Four methods, three of them optional, and
the row columns `reset` reads:

    class MyEnv:
        columns = ("secret",)  # checked in every row at start-up (optional; `prompt` always is)
        def reset(self, row: dict, seed: int) -> str | list[dict] | None:
            # row: every column of the jsonl row, `prompt` included; seed: for any randomness.
            # Return the first prompt (a string or chat messages), or None for the row's prompt.
        def step(self, text: str, ids: list[int]) -> tuple[list[dict], bool]:
            # The model's turn: its text (cut at the stop token) and the ids it sampled.
            # Return the reply, a list of messages ({"role": "user" | "tool" | ..., "content": str};
            # [] for none), and whether the episode is done.
        def reward(self) -> float:
            # Once the episode ended: its reward. Leave it out to score with --reward functions.
        def tools(self) -> list:
            # Typed, documented functions the model may call (bound methods: per-episode state),
            # read after reset; floe parses the calls, runs them and replies with their results
            # (docs/agents.md "Tools"). With tools, `step` is optional: a turn that is no call is
            # the answer, and without `step` it ends the episode.

    python train.py --task jsonl:data.jsonl --env my_env.py:MyEnv --max-turns 4

Every episode of a group starts from the same row and the same seed (a draw of the run's seeded
RNG, so a resumed run repeats it): `reset` must give them the same first prompt. Each call runs
with a timeout (--call-timeout) on a thread of its own (tasks/usercode.py), on copies of floe's data.

Built in: `--env guess-letter` (`GuessLetter`), the environment bench/agents.py and
docs/agents.md's multi-turn job train on, and its control `--env guess-letter-blind`;
`--env calculator` (`Calculator`: one tool, `add`), and its control `--env calculator-off`, whose
`add` has the same schema and answers every call with an error. `ToolsOnly` is what `--tool`
without `--env` plays: the row's prompt, no step, no reward. A new
built-in environment is its class and its `BUILTIN` entry; the class's `rows(n, seed)` writes
its jsonl file (reference episodes for the SFT warm-up included), and `columns` names what
`reset` reads from a row.

    python -m agents.envs guess-letter examples/guess.jsonl    # the rows of a built-in environment (NAME FILE)
    python -m agents.envs calculator calc.jsonl
"""

from __future__ import annotations

import json
import random
import sys

SECRETS = "abcdefghijklmno"  # the secret is one of these 15 (2^4 - 1): bisection finds any in 4 guesses


class Environment:
    """The contract, as a base class to subclass (any class with these methods works too)."""

    columns: tuple[str, ...] = ()  # the row columns reset reads; a row without one is refused at start-up

    @classmethod
    def rows(cls, n: int, seed: int) -> list[dict]:
        """A built-in environment's n jsonl rows from `seed`, for `python -m agents.envs NAME FILE`."""
        raise NotImplementedError

    def reset(self, row: dict, seed: int) -> str | list[dict] | None:
        return None

    # step(self, text, ids) -> (messages, done): the model's turn judged (optional with tools)
    # reward(self) -> float: define it to give the episode's reward; without it --reward scores
    # tools(self) -> list: the functions the model may call in this episode


class ToolsOnly(Environment):
    """`--tool` without `--env`: the row's prompt, the --tool functions, no step and no reward (the
    --reward functions score): an episode ends at the model's first turn that is not a tool call."""


class GuessLetter(Environment):
    """Guess a secret letter from a to o. After each wrong guess the environment says whether the
    secret comes "later" or "earlier" in the alphabet; a right guess ends the episode with reward 1,
    and the turn cap with 0. Bisection needs at most 4 guesses, so with --max-turns 4 a player that
    uses the replies can always win, and one that cannot read them at most 4 times in 15."""

    informative = True
    columns = ("secret",)

    @classmethod
    def rows(cls, n: int = 1024, seed: int = 0) -> list[dict]:
        """n rows: a secret letter each, and a reference episode (the `episode` column, which
        `--stage sft` trains on: the model turns only). The blind control plays the same rows."""
        rng = random.Random(seed)
        secrets = [rng.choice(SECRETS) for _ in range(n)]
        return [{"prompt": [{"role": "user", "content": PROMPT}], "secret": s, "episode": bisection(s)} for s in secrets]

    def reset(self, row: dict, seed: int) -> None:
        self.secret, self.won = row["secret"], False
        return None  # the row's prompt

    def step(self, text: str, ids: list[int]) -> tuple[list[dict], bool]:
        guess = text.strip()
        if guess == self.secret:
            self.won = True
            return [], True
        return [{"role": "user", "content": self.hint(guess)}], False

    def hint(self, guess: str) -> str:
        if len(guess) != 1 or guess not in SECRETS:
            return "one letter"
        if not self.informative:
            return "no"
        return "later" if guess < self.secret else "earlier"

    def reward(self) -> float:
        return float(self.won)


class GuessLetterBlind(GuessLetter):
    """The control: the same game, but every wrong guess gets "no", which says nothing of where
    the secret is. The gap between the two measures what the model gains from reading the replies."""

    informative = False


class Calculator(Environment):
    """The sum of two three-digit numbers with one tool, `add`; no step (the first turn that is no call
    is the answer) and no reward (`--reward numeric_match` scores the answer against the row's
    `answer`). The same as `--tool examples/calculator.py:add` without --env."""

    columns = ("answer",)
    on = True
    # three digits each: a tiny model cannot add them in its head (the point of the tool), and a
    # prompt of one length puts every digit it copies into the call at one distance from its source
    operands = (100, 999)

    @classmethod
    def rows(cls, n: int = 1024, seed: int = 0) -> list[dict]:
        """n rows: the prompt, the `answer`, an `episode` reference (the call, its result, the answer)
        for the SFT warm-up of the tool arm and a `completion` (the bare sum) for a model without tools."""
        rng, out = random.Random(seed), []
        for _ in range(n):
            a, b = rng.randint(*cls.operands), rng.randint(*cls.operands)
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
            episode = [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
            out.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "episode": episode,
                        "completion": str(a + b)})
        return out

    def tools(self) -> list:
        return [self.add]

    def add(self, a: int, b: int) -> int:  # the schema of examples/calculator.py's add, in both arms
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b if self.on else "error: the calculator is off"


class CalculatorOff(Calculator):
    """The control: the same prompt and the same schema, and every call answered "error: the
    calculator is off": only the information differs."""

    on = False


BUILTIN = {"guess-letter": GuessLetter, "guess-letter-blind": GuessLetterBlind, "calculator": Calculator,
           "calculator-off": CalculatorOff}
PROMPT = "guess a letter from a to o"


def bisection(secret: str) -> list[dict]:
    """A reference episode: guess the middle of what is left (15, 7, 3, 1 letters: always one middle)."""
    lo, hi, out = 0, len(SECRETS) - 1, []
    while True:
        mid = (lo + hi) // 2
        out.append({"role": "assistant", "content": SECRETS[mid]})
        if SECRETS[mid] == secret:
            return out
        later = SECRETS[mid] < secret
        out.append({"role": "user", "content": "later" if later else "earlier"})
        lo, hi = (mid + 1, hi) if later else (lo, mid - 1)


def write_rows(name: str, path: str, n: int = 1024, seed: int = 0) -> None:
    """The built-in environment `name`'s rows, one JSON object a line."""
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in BUILTIN[name].rows(n, seed))


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in BUILTIN:  # one line and exit status 2, as train.py's bad flags
        why = f"no built-in environment {argv[0]!r}" if len(argv) == 2 else f"2 arguments, got {len(argv)}"
        print(f"agents/envs.py: {why}; usage: python -m agents.envs NAME FILE, NAME one of {', '.join(BUILTIN)}", file=sys.stderr)
        raise SystemExit(2)
    write_rows(*argv)


if __name__ == "__main__":
    main(sys.argv[1:])
