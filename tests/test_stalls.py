"""A run that cannot learn says so while it runs (run/runlog.py `Stalls`): a step whose completions
mostly end at --max-new-tokens, and steps on which every group's rewards are equal. The README's tool
command at the default --max-new-tokens 24 is the case it was built for (calc-tiny's hermes calls
are about 60 tokens); the default job never warns."""

import json
import math
import random
import types

import pytest

import rollout
import train
from run.runlog import Stalls
from test_readme import COMMANDS, train_args

CFG = types.SimpleNamespace(max_new_tokens=24, group_size=4, env="", tool=[])


def _warnings(rows, cfg=CFG):
    stalls = Stalls(cfg)
    return [(step, line) for step, m in enumerate(rows, 1) for line in stalls.check(step, m)]


def test_a_cut_step_warns_when_it_starts_and_again_only_after_it_cleared():
    rows = [{"truncated_fraction": f} for f in (0.2, 0.9, 0.8, 0.5, 0.51, 1.0)]
    found = _warnings(rows)
    assert [s for s, _ in found] == [2, 5]  # 0.5 is not most; 0.51 is, after a step that cleared
    assert found[0][1] == ("warning: step 2: 90% of the completions were cut at --max-new-tokens 24 "
                           "(truncated_fraction), so their rewards score cut-off text; raise --max-new-tokens")
    episodes = types.SimpleNamespace(**{**vars(CFG), "tool": ["examples/calculator.py:add"]})
    assert "of the episodes ended on a turn cut at --max-new-tokens 24" in _warnings(rows, episodes)[0][1]


def test_equal_groups_warn_on_the_third_step_in_a_row():
    eq = lambda f, r=0.0: {"groups/equal_rewards": f, "reward": r}  # noqa: E731
    rows = [eq(1.0), eq(1.0), eq(0.99), eq(1.0), eq(1.0), eq(1.0, 1.0), eq(1.0), eq(0.0), eq(1.0), eq(1.0), eq(1.0)]
    found = _warnings(rows)
    assert [s for s, _ in found] == [6, 11]  # never twice for one stretch; two in a row are not yet a stall
    assert found[0][1] == ("warning: steps 4-6: every group's 4 rewards were equal (reward 1.000, groups/equal_rewards "
                           "1.00), so every advantage is zero and nothing is learned from them; give the groups a "
                           "spread: a task the model sometimes solves, a reward with partial credit, a larger "
                           "--group-size or --temperature")
    cut = [{**eq(1.0), "truncated_fraction": 0.99}] * 3
    assert _warnings(cut)[-1][1].endswith("the cut completions above are the likely cause")


def test_equal_groups_counts_groups_as_their_advantages_see_them():
    """Against the advantages themselves: a group whose finite rewards are all equal gets A = 0
    everywhere; one with every reward NaN (a dropped group) is not counted at all."""
    rng = random.Random(0)
    for _ in range(50):
        g = rng.randint(1, 5)
        rewards = [rng.choice([0.0, 1.0, 0.5, math.nan]) for _ in range(g * rng.randint(1, 6))]
        samples = [types.SimpleNamespace(reward=r) for r in rewards]
        equal, groups = rollout.equal_groups(samples, g)
        adv = rollout.group_advantages(rewards, g)
        blocks = [range(i, i + g) for i in range(0, len(rewards), g)]
        live = [b for b in blocks if any(math.isfinite(rewards[i]) for i in b)]
        assert groups == len(live)
        assert equal == sum(all(adv[i] == 0.0 for i in b) for b in live)


def _readme_tool_command():
    tool = [train_args(w) for w in COMMANDS if train_args(w) and "--tool" in train_args(w)][0]
    i = tool.index("--max-new-tokens")
    return tool[:i] + tool[i + 2:]  # at the default, 24


def test_the_readme_tool_command_at_24_tokens_warns_for_both(tmp_path, capsys):
    args = _readme_tool_command()
    assert "--max-new-tokens" not in args and "checkpoints/calc-tiny" in args
    train.main([*args, "--steps", "3", "--eval-every", "0", "--out-dir", str(tmp_path / "run")])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(said) == 2, said
    assert said[0].startswith("warning: step 1: ") and "at --max-new-tokens 24" in said[0]
    assert said[1].startswith("warning: steps 1-3: every group's 16 rewards were equal (reward 0.000")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["groups/equal_rewards"] == 1.0 and r["truncated_fraction"] > 0.5 for r in rows)


@pytest.mark.parametrize("flags", [[], ["--task", "arithmetic", "--model", "checkpoints/arith-tiny"]],
                         ids=["default", "arithmetic"])
def test_jobs_that_learn_never_warn(tmp_path, capsys, flags):
    train.main([*flags, "--steps", "4", "--eval-every", "0", "--out-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "warning:" not in out, out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["groups/equal_rewards"] < 1.0 and r["truncated_fraction"] < 0.5 for r in rows)
