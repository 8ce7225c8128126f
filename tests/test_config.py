"""Bad flag values stop the program with one line naming the flag, and exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

import config as C
from run import start
import train

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args,flag", [
    (["--icepop-alpha", "3", "--icepop-beta", "2"], "--icepop-alpha/--icepop-beta"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "0"], "--temperature"),
    (["--steps", "-1"], "--steps"),
    (["--task", "nope"], "--task must be reverse-text, arithmetic or jsonl:PATH, got 'nope'"),  # at the start checks
    (["--plan-world", "-1"], "--plan-world"),
    (["--plan", "--plan-world", "0"], "--plan-world must be in [1, 65,536]"),
    (["--base-dtype", "bf16"], "--base-dtype"),
    (["--activation-checkpointing", "layers"], "--activation-checkpointing"),
])
def test_bad_flag_exits_2_with_one_line(args, flag, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_defaults_are_valid_and_resolve():
    cfg = C.parse([]).resolve(cuda_available=False)
    assert (cfg.device, cfg.compile, cfg.loss) == ("cpu", "off", "icepop")
    assert cfg.lr > 0


@pytest.mark.parametrize("args,lr", [([], 5e-4), (["--stage", "sft"], 3e-3), (["--lora-rank", "8"], 3e-3),
                                     (["--adapter", "some/adapter"], 3e-3), (["--stage", "sft", "--lora-rank", "8"], 3e-3),
                                     (["--lora-rank", "8", "--lr", "1e-4"], 1e-4)])
def test_the_default_learning_rate_is_the_default_jobs_best_and_lora_gets_its_own(args, lr):
    """LoRA's default lr is its own (the default job's best for rank 8 in a sweep, docs/experiments.md
    "2026-12-02: LoRA against full fine-tuning, and its learning rate"), --adapter included (it sets
    the rank after resolve); --lr wins."""
    assert C.parse(args).resolve(cuda_available=False).lr == lr


@pytest.mark.parametrize("args,words", [
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--adv-tau", "inf"], "--adv-tau must be a finite number"),
    (["--kl-coeff", "inf"], "--kl-coeff must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--stage", "sft", "--loss", "ppo"], "--loss ppo has no effect with --stage sft"),
    (["--epochs", "2", "--loss", "reinforce"], "--epochs 2 with plain reinforce"),
    (["--epochs", "2", "--correction-metrics-only"], "--epochs 2 with plain reinforce"),
    (["--eval-file", "x.jsonl"], "--eval-file is for --task jsonl:PATH"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
])
def test_flags_without_a_finite_value_or_an_effect_are_refused(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


def test_caps_whose_inf_means_no_cap_stay_accepted():
    cfg = C.parse(["--tis-cap", "inf", "--grad-clip", "inf", "--max-importance-ratio", "inf"])
    assert cfg.tis_cap == cfg.grad_clip == float("inf")
    C.parse(["--epochs", "2", "--loss", "icepop"])  # p/q-weighted: allowed, with a note at start-up


@pytest.mark.parametrize("args,words", [
    (["--reward-weights", "nan", "0.5"], "--reward-weights must be finite numbers, got nan 0.5"),
    (["--reward-weights", "inf", "0.5"], "--reward-weights must be finite numbers"),
    (["--reward-weights", "0", "0"], "--reward-weights are all 0"),
    (["--group-size", "1"], "--group-size 1 trains nothing"),
    (["--lr", "1e39"], "--lr must be a finite number in float32"),
    (["--lr", "2"], "--lr must be <= 1"),
    (["--adv-tau", "1e39"], "--adv-tau must be a finite number in float32"),
    (["--seed", str(2**70)], "--seed must be in [0, 2^32)"),
    (["--seed", "-1"], "--seed must be in [0, 2^32)"),
    (["--group-size", str(10**12)], "--prompts-per-step x --group-size asks for 32,000,000,000,000 samples"),
    (["--prompts-per-step", str(10**12)], "--prompts-per-step x --group-size asks for"),
    (["--stage", "sft", "--prompts-per-step", str(10**12)], "--prompts-per-step asks for"),
    (["--score-centering-k", str(10**12)], "--score-centering-k must be <= 1,024"),
    (["--eval-prompts", str(10**12)], "--eval-prompts must be <= 65,536"),
    (["--micro-batch-tokens", str(10**12)], "--micro-batch-tokens must be <= 1,048,576"),
    (["--dist-timeout", "0"], "--dist-timeout must be > 0"),
])
def test_meaningless_or_unbounded_values_are_refused(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


@pytest.mark.parametrize("args,words", [
    (["--task", "nope"], "--task must be reverse-text, arithmetic or jsonl:PATH, got 'nope'"),
    (["--task", "jsonl:"], "--task must be reverse-text, arithmetic or jsonl:PATH, got 'jsonl:'"),
    (["--max-words", str(10**12)], "--max-words must be <= 1,000, got 1,000,000,000,000"),
    (["--min-words", "3", "--max-words", "2"], "--min-words/--max-words need 1 <= min <= max, got 3, 2"),
    (["--min-words", "0"], "--min-words/--max-words need 1 <= min <= max, got 0, 3"),
    (["--task", "arithmetic", "--max-operand", "0"], "--max-operand must be >= 1, got 0"),
    (["--task", "arithmetic", "--min-words", "3", "--max-words", "2"], "--min-words/--max-words need"),  # a typo whatever --task
])
def test_a_bad_task_or_task_flag_is_refused_at_the_start_checks(args, words, tmp_path, capsys):
    """tasks/task.py's table holds the task names and their flags' checks, and tasks/task.py imports config.py: so
    they run first at the start checks (task.check_flags), not at parse time; the same one line, exit
    status 2, and nothing written."""
    C.parse(args)  # parses: config.py cannot see the table
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"floe: error: {words}"), err
    assert not out.exists()


@pytest.mark.parametrize("args,words", [
    (["--steps", "x"], "Error parsing --steps: invalid literal for int() with base 10: 'x'"),
    (["--loss", "foo"], "invalid choice 'foo' for argument '--loss'. Expected one of ('reinforce',"),
    (["--bogus"], "Unrecognized options: --bogus"),
    (["--seed"], "Missing value for argument '--seed'"),
])
def test_tyro_parse_errors_are_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("floe: error: ") and words in err[0], err
    assert "--help" in err[0]


def test_help_still_prints(capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(["--help"])
    assert e.value.code == 0 and "--reward-weights" in capsys.readouterr().out


@pytest.mark.parametrize("args,note", [
    (["--icepop-beta", "2", "--loss", "reinforce"], "--icepop-beta 2 is not read by --loss reinforce (it is --loss icepop's)"),
    (["--tis-cap", "3"], "--tis-cap 3 is not read by --loss icepop (it is --loss tis's)"),
    (["--clip-low", "0.1"], "--clip-low 0.1 is not read by --loss icepop (it is --loss ppo, cispo, gspo's)"),
    (["--icepop"], "--icepop-mask is not read by --loss icepop (it is --loss ppo, cispo, gspo, sapo's)"),
    (["--stage", "sft", "--async-level", "1"], "--async-level 1 is not read with --stage sft (it is for rl rollouts)"),
    (["--stage", "sft", "--engine-noise", "0.5"], "--engine-noise 0.5 is not read with --stage sft (it is for rl rollouts)"),
    (["--task", "arithmetic", "--min-words", "2"], "--min-words 2 is not read with --task arithmetic (it is --task reverse-text's)"),
    (["--stage", "sft", "--seq-mask-low", "0.9"], "--seq-mask-low 0.9 is not read with --stage sft"),
])
def test_a_flag_nothing_reads_gets_a_note(args, note, capsys):
    start.check_read(C.parse(args))
    assert capsys.readouterr().out.strip().splitlines() == [f"note: {note}; the run goes on without it"]


@pytest.mark.parametrize("args,words", [
    (["--seq-mask-low", "0.9"], "--seq-mask-low 0.9 has no effect with --seq-mask off: add --seq-mask geometric or max"),
    (["--seq-mask-high", "1.5"], "--seq-mask-high 1.5 has no effect with --seq-mask off"),
    (["--kl-mask-threshold", "0.1"], "--kl-mask-threshold 0.1 has no effect with --kl-mask off: add --kl-mask k1, k3"),
    (["--kl-estimator", "k1"], "--kl-estimator k1 has no effect with --kl-coeff 0.0: add --kl-coeff > 0"),
    (["--kl-staleness", "inv_sqrt"], "--kl-staleness inv_sqrt has no effect with --kl-coeff 0.0"),
])
def test_a_flag_whose_switch_is_off_is_refused(args, words):
    with pytest.raises(C.ConfigError) as e:
        start.check_read(C.parse(args))
    assert str(e.value).startswith(words), e.value


def test_the_dist_timeout_on_cuda_gets_a_note(capsys):
    start.check_read(C.dataclasses.replace(C.parse(["--dist-timeout", "60"]), device="cuda"))
    assert capsys.readouterr().out.strip() == ("note: --dist-timeout 60 is not read on CUDA (NCCL keeps torch's "
                                               "10-minute watchdog); the run goes on without it")


def test_every_flag_read_is_silent(capsys):
    for args in (["--loss", "ppo", "--icepop", "--icepop-beta", "3", "--clip-low", "0.1"],
                 ["--correction-metrics-only", "--seq-mask-low", "0.9", "--tis-cap", "3", "--kl-mask-threshold", "0.1"],
                 ["--seq-mask", "max", "--seq-mask-low", "0.9", "--kl-coeff", "0.1", "--kl-estimator", "k1"],
                 ["--task", "arithmetic", "--max-operand", "50"], []):
        start.check_read(C.parse(args))
    assert capsys.readouterr().out == ""


def test_under_torchrun_an_environment_raises_the_wait_at_collectives(monkeypatch):
    """A rank's environment may keep the others waiting at the step's gather for its calls'
    timeouts (resets, each turn, rewards, each tool call): --dist-timeout covers that under torchrun."""
    flags = dict(env="guess-letter", task="jsonl:examples/guess.jsonl", call_timeout=30.0, max_turns=3)
    assert C.Config(**flags).resolve(False).dist_timeout == 300.0  # one process: no collectives
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert C.Config(**flags).resolve(False).dist_timeout == 300.0  # 30 x 5 + 60 = 210: the flag's is longer
    assert C.Config(**{**flags, "call_timeout": 60.0}).resolve(False).dist_timeout == 60 * 5 + 10 * 8 + 60  # and the tools'
    assert C.Config(call_timeout=600.0).resolve(False).dist_timeout == 300.0  # no --env
    tools = dict(tool=("examples/calculator.py:add",), task="jsonl:x", tool_timeout=40.0, max_tool_calls=5)
    assert C.Config(**tools).resolve(False).dist_timeout == 60 * 6 + 40 * 5 + 60  # --tool plays episodes too
