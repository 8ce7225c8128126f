"""Do a turn's tool calls overlap? `time/tools` per turn for a step of 16 groups x 8 episodes, every
episode making one call each turn.

The episode loop as train.py runs it (episodes.play, toolrun.Runner with --tool-timeout on
tasks/usercode.py's threads, the calls parsed from the sampled ids and their results rendered by the
template), with an engine that samples a call every turn (a random model would not: the engine's
cost is bench/turns.py's, not this one's). `time/tools` is what the metric reports: the wall
seconds `play` spent in Runner.run, divided by the turns. Two tools, each taking --ms per call:
`wait` sleeps (I/O-bound: the calls of a turn overlap, so a turn costs about one call), `spin`
does the pure-Python work that takes as long alone (CPU-bound: under the GIL the calls run one
after another, so a turn costs about one call per episode). The character tokenizer holds the hermes markers as characters, so the parser reads
them as the Qwen tokenizer's single ids would.

    python bench/tool_overlap.py                     # 16 x 8, 100 ms calls, 2 turns (about 30 s)
    python bench/tool_overlap.py --tools wait        # the I/O-bound tool alone (a few seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data import Prompt  # noqa: E402
from agents import envs, toolrun  # noqa: E402
from agents.episodes import EnvSpec, Play, play  # noqa: E402
from agents.toolcalls import write_calls  # noqa: E402
from agents.toolschema import toolset  # noqa: E402
from engines.torch_engine import Completion, Sampling  # noqa: E402
from tasks.task import PRINTABLE  # noqa: E402
from tasks.textcodec import TextCodec  # noqa: E402

MS = 100.0  # each call's milliseconds (--ms)
WORK = 0  # spin's loop iterations: MS milliseconds of work alone on this machine (`calibrate`)


def wait() -> int:
    """Wait on I/O (a sleep), then return."""
    time.sleep(MS / 1000)
    return 1


def _loop(n: int) -> int:
    k = 0
    for _ in range(n):
        k += 1
    return k


def spin() -> int:
    """Do a fixed amount of pure-Python work (holding the GIL), then return."""
    return min(_loop(WORK), 1)


def calibrate() -> int:
    """The iterations that take MS milliseconds in one thread (the median of five tries)."""
    n, times = 1_000_000, []
    for _ in range(5):
        t = time.perf_counter()
        _loop(n)
        times.append(time.perf_counter() - t)
    return int(n * MS / 1000 / sorted(times)[2])


class Caller:
    """An engine that samples the same call every turn; the episode loop feeds it the whole ids."""

    version = 0

    def __init__(self, ids: list[int]):
        self.ids = ids

    def generate(self, prompts, n, sampling, budgets=None, keep=True):
        return [Completion(list(self.ids), [-0.5] * len(self.ids), [0] * len(self.ids), "stop")
                for _ in range(len(prompts) * n)]

    def idle(self):
        pass


def step(codec: TextCodec, fn, groups: int, group: int, turns: int) -> tuple[float, float, int]:
    """One step's episodes: (time/tools, the play's wall seconds, the calls made)."""
    tools = toolset([fn])
    kwargs = {"tools": [t.schema for t in tools.values()]}
    call = write_calls("hermes", [{"function": {"name": fn.__name__, "arguments": {}}}])
    engine = Caller(codec.encode(call) + [codec.stop_ids[0]])
    prompt = [{"role": "user", "content": "Call the tool."}]
    row = Prompt(codec.render(prompt, **kwargs), prompt, {})
    spec = EnvSpec("tools", envs.ToolsOnly, None, False, has_step=False)
    runner = toolrun.Runner(3600.0, 2000, codec.encode)  # --tool-timeout past any turn here: nothing times out
    # a call on the last turn is not run (no turn would read its result): turns + 1 turns run `turns` calls
    pl = Play(spec, codec, engine, Sampling(max_new_tokens=len(engine.ids)), 1 << 20, turns + 1, 10.0, kwargs,
                tools=toolrun.Tools(tools, "hermes", 0, turns + 1, runner))
    t = time.perf_counter()
    eps = play(pl, [row] * groups, group, list(range(groups)))
    wall = time.perf_counter() - t
    ran = [c for e in eps for c in e.calls if c.content]
    assert len(ran) == groups * group * turns and all(c.kind == "" and c.content == "1" for c in ran), {c.content for c in ran}
    return pl.tool_seconds, wall, len(ran)


def main(argv=None) -> None:
    global MS, WORK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2, help="call turns per episode (one call each)")
    ap.add_argument("--ms", type=float, default=MS, help="each call's milliseconds")
    ap.add_argument("--tools", nargs="+", default=["wait", "spin"], choices=["wait", "spin"])
    a = ap.parse_args(argv)
    MS = a.ms
    WORK = calibrate()
    codec = TextCodec.tiny(PRINTABLE)
    print(f"{a.groups} groups x {a.group_size} episodes, {a.turns} turns of one {a.ms:g} ms call each; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print("| tool | calls run | time/tools per turn | the turn's calls one after another | play, wall |")
    print("| --- | --- | --- | --- | --- |")
    for name in a.tools:
        seconds, wall, calls = step(codec, {"wait": wait, "spin": spin}[name], a.groups, a.group_size, a.turns)
        print(f"| {name} | {calls} | {seconds / a.turns:.3f} s | {a.ms / 1000 * calls / a.turns:.2f} s | {wall:.2f} s |",
              flush=True)


if __name__ == "__main__":
    main()
