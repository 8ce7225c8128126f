"""User code (rewards here, environments in test_episodes.py) can hang, raise, exit, mutate or lie:
tasks/usercode.py runs it on a thread with a timeout, on copies, and reports each fault as one line."""

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import data as D

from tasks.textcodec import TextCodec
from tasks import rewards
from tasks import task as T
from tasks import usercode
from config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _task(fn, timeout=5.0):
    codec = TextCodec.tiny()
    return T.ReverseText(codec, [rewards.Reward("r", fn, timeout=timeout)], eval_size=4)


def _score(task, n=2, group=None):
    prompts = task.sample(n, __import__("random").Random(0))
    ids = [task.codec.encode("abc") + [2] for _ in prompts]
    return prompts, ids, task.score(prompts, ids, group or n)


def test_a_reward_that_exits_is_that_rewards_error_not_the_runs_exit(capsys):
    def exits(prompts, completions, **kw):
        sys.exit(0)

    _, _, r = _score(_task(exits))
    assert all(math.isnan(x) for x in r)
    assert "reward r raised SystemExit(0)" in capsys.readouterr().out


def test_a_reward_that_never_returns_is_abandoned_after_the_timeout(capsys):
    def hangs(prompts, completions, **kw):
        import time
        time.sleep(3600)

    _, _, r = _score(_task(hangs, timeout=0.3))
    assert all(math.isnan(x) for x in r)
    assert "took longer than --call-timeout 0.3s" in capsys.readouterr().out


def test_a_reward_that_mutates_its_arguments_changes_nothing_floe_keeps():
    def vandal(prompts, completions, completion_ids, target, **kw):
        for p, c, t in zip(prompts, completion_ids, target):
            p[0]["content"] = "changed"
            c.clear()
            c.extend([99] * 5)
            t += "x"
        return [1.0] * len(completions)

    task = _task(vandal)
    prompts, ids, r = _score(task)
    before = [([dict(m) for m in p.prompt], dict(p.columns)) for p in prompts]
    kept = [list(i) for i in ids]
    _, _, _ = (prompts, ids, task.score(prompts, ids, 2))
    assert r == [1.0, 1.0] and kept == ids
    assert [([dict(m) for m in p.prompt], dict(p.columns)) for p in prompts] == before
    assert all("changed" not in m["content"] for p in prompts for m in p.prompt)


def test_a_scalar_reward_is_one_line_and_an_async_reward_works():
    def scalar(prompts, completions, **kw):
        return 1.0

    async def later(prompts, completions, **kw):
        return [0.5] * len(completions)

    with pytest.raises(D.RunError, match="reward r returned float '1.0', not a list"):
        _score(_task(scalar))
    assert _score(_task(later))[2] == [0.5, 0.5]


def test_a_reward_file_that_exits_at_import_is_refused_in_one_line(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import sys\nsys.exit(3)\ndef score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError, match=r"importing .* raised SystemExit\(3\)"):
        rewards.load_reward(f"{f}:score")
    r = subprocess.run([sys.executable, "train.py", "--task", "jsonl:examples/sums.jsonl", "--model", "checkpoints/arith-tiny",
                        "--reward", f"{f}:score", "--out-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "SystemExit(3)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_call_all_runs_each_call_on_its_own_thread_and_reports_each_fault():
    out = usercode.call_all([lambda: 1, lambda: 1 / 0, lambda: sys.exit(2), lambda: __import__("time").sleep(60)], 0.3)
    assert out[0].ok and out[0].value == 1
    assert out[1].error == "ZeroDivisionError: division by zero"
    assert "SystemExit(2)" in out[2].error and out[3].timed_out and not out[3].ok


def test_a_hung_call_does_not_keep_the_process_alive():
    code = textwrap.dedent("""
        import time
        from tasks import usercode
        r = usercode.call(lambda: time.sleep(3600), 0.2)
        print("timed out" if r.timed_out else "returned")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "timed out"


def test_a_set_stop_event_ends_the_wait_before_the_timeout():
    import threading
    import time

    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.perf_counter()
    res = usercode.call_all([lambda: time.sleep(3600), lambda: 7], 60.0, stop)
    assert time.perf_counter() - t0 < 5
    assert res[0].timed_out and res[1].value == 7


def test_a_hung_call_holds_its_worker_and_later_calls_never_wait_behind_it():
    """Workers are kept between batches, but one still inside an abandoned call takes no new call."""
    import threading
    import time

    release = threading.Event()
    first = usercode.call_all([release.wait, lambda: 1], 0.2)
    assert first[0].timed_out and first[1].value == 1
    t0 = time.perf_counter()
    again = usercode.call_all([lambda: 2, lambda: 3, lambda: 4], 5.0)
    assert [r.value for r in again] == [2, 3, 4] and time.perf_counter() - t0 < 2
    release.set()


def test_copied_arguments_share_nothing_user_code_could_change():
    """`copied` equals deepcopy's result, and no list, dict or other mutable object is shared."""
    import copy

    class Box:
        def __init__(self):
            self.items = [1]

    x = {"ids": [[1, 2], [3]], "t": ("a", [1.5]), "messages": [[{"role": "user", "content": "hi"}]], "box": Box(), "n": None}
    y = usercode.copied(x)
    assert y.keys() == x.keys() and y["ids"] == copy.deepcopy(x)["ids"] and y["messages"] == x["messages"]
    y["ids"][0].append(9), y["t"][1].append(9), y["messages"][0][0].update(role="x"), y["box"].items.append(9)
    assert x["ids"] == [[1, 2], [3]] and x["t"] == ("a", [1.5]) and x["messages"][0][0]["role"] == "user"
    assert x["box"].items == [1]


def test_every_real_number_is_a_reward_and_anything_else_is_one_line_naming_its_type():
    """numpy's scalars, 0-d tensors and bools (as 0 or 1) are rewards; a string is not, though float()
    would take it."""
    import numpy as np
    import torch

    def typed(prompts, completions, **kw):
        return [np.float32(1.0), np.int64(1)] if len(completions) == 2 else [torch.tensor(0.5)]

    assert _score(_task(typed))[2] == [1.0, 1.0]
    assert _score(_task(lambda prompts, completions, **kw: [True, torch.tensor(0.25)]))[2] == [1.0, 0.25]
    with pytest.raises(D.RunError, match=r"reward r returned str '1.0' is not a number for a completion"):
        _score(_task(lambda prompts, completions, **kw: ["1.0", 0.0]))


def test_a_steps_reward_calls_run_at_once_and_keep_each_groups_result():
    """Eight groups whose reward hangs wait about one --call-timeout in all, not eight; a reward that
    answers gives each group its own values in order, as one call per group would."""
    import time

    def hangs(prompts, completions, **kw):
        time.sleep(3600)

    task, t0 = _task(hangs, timeout=0.5), time.perf_counter()
    prompts, ids, r = _score(task, n=16, group=2)  # 8 groups of 2
    assert all(math.isnan(x) for x in r) and time.perf_counter() - t0 < 2.5

    def own(prompts, completions, target, **kw):
        time.sleep(0.2)
        return [len(t) + i / 10 for i, t in enumerate(target)]

    task, t0 = _task(own), time.perf_counter()
    prompts, ids, r = _score(task, n=16, group=2)
    assert time.perf_counter() - t0 < 1.2  # 8 x 0.2 s one after another
    each = [v for a in range(0, 16, 2) for v in own(None, [0, 0], [p.columns["target"] for p in prompts[a:a + 2]])]
    assert r == each


@pytest.mark.parametrize("flag", ["--reward", "--tool"])
def test_a_user_file_that_hangs_at_import_stops_the_start_in_one_line(tmp_path, flag):
    """Importing a reward or tool file had no timeout: one that hung at import hung the start, with no line."""
    f = tmp_path / "slow.py"
    f.write_text(textwrap.dedent('''\
        import time
        time.sleep(10 ** 6)
        def fn(a: int) -> int:
            """A tool.

            Args:
                a: a number
            """
            return a
        '''))
    root = Path(__file__).resolve().parent.parent
    user = ["--reward", f"{f}:fn"] if flag == "--reward" else [
        "--model", str(root / "checkpoints" / "calc-tiny"), "--task", f"jsonl:{root / 'examples' / 'calc.jsonl'}",
        "--reward", "numeric_match", "--tool", f"{f}:fn"]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(root / "train.py"), *user, "--call-timeout", "2", "--steps", "1",
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (f"floe: error: {flag} {f}:fn: importing {f} did not finish within "
                                                      "--call-timeout 2 s (a file that hangs at import)"), r.stderr
    assert not out.exists()
