"""Bad input: each gets one clear line (exit 2 for a bad model directory, 1 for a step that
cannot go on) or a counted skip, and nothing written earlier is lost."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from tasks.textcodec import TextCodec
import model as M
from run import hfdir
from tasks import rewards
from tasks import task as T
import train
from engines.torch_engine import TorchEngine
from conftest import one_line

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "reverse-tiny"
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-every", "0"]


def _copy(tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(TINY, d)
    return d


def _run(model_dir, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(model_dir), "--steps", "1",
                           "--out-dir", str(tmp_path / "run"), *SMALL], capture_output=True, text=True, timeout=120)



def test_corrupt_weights(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 64 + b"not a safetensors file")
    one_line(_run(d, tmp_path), 2, "model.safetensors", "unreadable")


def test_truncated_weights(tmp_path):
    d = _copy(tmp_path)
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    one_line(_run(d, tmp_path), 2, "model.safetensors")


def test_missing_tokenizer(tmp_path):
    d = _copy(tmp_path)
    (d / "tokenizer.json").unlink()
    one_line(_run(d, tmp_path), 2, "tokenizer.json", "missing")


def test_config_that_does_not_match_the_weights(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (d / "config.json").write_text(json.dumps(cfg))
    one_line(_run(d, tmp_path), 2, "do not match config.json")


def test_a_reward_that_raises_skips_and_counts(tmp_path, monkeypatch):
    real, calls = rewards.similarity, [0]

    def flaky(prompts, completions, target, **kwargs):
        calls[0] += 1
        if calls[0] % 3 == 0:  # one group in three: its samples are skipped
            raise RuntimeError("reward server down")
        return real(prompts, completions, target)

    monkeypatch.setitem(rewards.BUILTIN, "similarity", flaky)
    train.main(["--steps", "2", "--out-dir", str(tmp_path), *SMALL, "--group-size", "4", "--prompts-per-step", "3",
                "--reward", "similarity"])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["skipped/reward_error"] for r in rows) > 0
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows)


def test_prompts_longer_than_the_context(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 45  # some prompts (33 to 47 tokens) + 8 new tokens no longer fit
    (d / "config.json").write_text(json.dumps(cfg))
    train.main(["--model", str(d), "--steps", "2", "--out-dir", str(tmp_path / "a"), *SMALL, "--prompts-per-step", "8"])
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < sum(r["skipped/too_long"] for r in rows) / len(rows) < 1
    cfg["max_position_embeddings"] = 20  # nothing fits: one line, exit 1
    (d / "config.json").write_text(json.dumps(cfg))
    r = _run(d, tmp_path)
    one_line(r, 1, "longer than the context")


def _nan_on_step(monkeypatch, step: int):
    real, calls = TorchEngine.generate, [0]

    def broken(self, prompts, n, sampling, *args, **kwargs):
        out = real(self, prompts, n, sampling, *args, **kwargs)
        if sampling.seed is None:  # not an eval
            calls[0] += 1
            if calls[0] == step:
                out[1].logq[0] = float("nan")
        return out

    monkeypatch.setattr(TorchEngine, "generate", broken)


def test_nan_logprobs_stop_the_step_and_keep_what_was_written(tmp_path, monkeypatch, capsys):
    _nan_on_step(monkeypatch, step=2)
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "3", "--out-dir", str(tmp_path), *SMALL])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 1" in err[0] and "logq" in err[0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 1 stays on disk


def test_nan_logprobs_dropped_and_counted(tmp_path, monkeypatch):
    _nan_on_step(monkeypatch, step=1)
    train.main(["--steps", "2", "--out-dir", str(tmp_path), "--bad-evidence", "drop", *SMALL])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["bad_evidence/dropped"] == pytest.approx(1 / 4) and rows[1]["bad_evidence/dropped"] == 0


def _reward(monkeypatch, fn):
    """The run's reward (--reward similarity) replaced by fn(call number, target) -> rewards."""
    calls = [0]

    def patched(prompts, completions, target, **kwargs):
        calls[0] += 1
        return fn(calls[0], target)

    monkeypatch.setitem(rewards.BUILTIN, "similarity", patched)


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("async_level", ["0", "1"])  # a skipped step still publishes its version: no hang
def test_an_overflowing_reward_skips_the_step_and_never_reaches_the_weights(tmp_path, monkeypatch, capsys, async_level):
    """A reward of 1e308 is finite, but the group mean overflows: the advantages are NaN. The step is
    skipped before the optimizer and counted; three in a row stop the run with one line naming the
    cause; every checkpoint written stays finite, and `final` loads."""
    calls_per_step = 2  # --prompts-per-step 2: one reward call per prompt group
    _reward(monkeypatch, lambda n, target: [1e308 if n > calls_per_step else 0.1 * i for i in range(len(target))])
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "6", "--save-every", "1", "--out-dir", str(out), *SMALL, "--reward", "similarity",
                    "--async-level", async_level])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 steps in a row" in err[0] and "non-finite advantages" in err[0], err
    rows = _metrics(out)
    assert [r["skipped/nonfinite_step"] for r in rows] == [0, 1, 1, 1]
    assert os.readlink(out / "final") == "step_000003"
    for ckpt in sorted(out.glob("step_*")):
        m = hfdir.load(ckpt)  # refuses non-finite weights
        assert all(torch.isfinite(p).all() for p in m.parameters())


def test_a_step_with_no_scorable_sample_is_skipped_and_counted(tmp_path, monkeypatch):
    def down(n, target):
        if n <= 3:  # the eval at step 0 (call 1) and both prompt groups of step 1 (calls 2 and 3)
            raise RuntimeError("reward server down")
        return [0.5 + 0.1 * i for i in range(len(target))]

    _reward(monkeypatch, down)
    out = tmp_path / "run"
    train.main(["--steps", "2", "--out-dir", str(out), *SMALL, "--reward", "similarity", "--eval-every", "2",
                "--eval-prompts", "1"])
    rows = _metrics(out)
    assert rows[0]["eval/reward_error"] == 1.0 and "eval/reward" not in rows[0]  # counted, nothing averaged
    assert rows[1]["skipped/empty_step"] == 1.0 and rows[1]["skipped/reward_error"] == 1.0
    assert rows[2]["skipped/empty_step"] == 0.0 and math.isfinite(rows[2]["loss"]) and "eval/reward" in rows[2]


def test_three_empty_steps_in_a_row_stop_the_run(tmp_path, monkeypatch, capsys):
    """A reward that always raises skips every group: the run would end "done" with its start weights."""
    def down(n, target):
        raise RuntimeError("reward server down")

    _reward(monkeypatch, down)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "5", "--out-dir", str(out), *SMALL, "--reward", "similarity"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 steps in a row had no sample to train on" in err[0], err
    assert [r["skipped/empty_step"] for r in _metrics(out)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("steps", ["1", "2"])
def test_a_run_that_trained_nothing_exits_1_whatever_its_step_count(tmp_path, monkeypatch, capsys, steps):
    """Under three steps the in-a-row rule never fires: the run still ends with one line and exit 1, not a
    summary, exit 0 and a final checkpoint equal to its start; each such step's line says skipped, not loss +nan."""
    def down(n, target):
        raise RuntimeError("reward server down")

    _reward(monkeypatch, down)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", steps, "--out-dir", str(out), *SMALL, "--reward", "similarity"])
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert f"no step of this run trained (steps 1..{steps}; the last: every reward call raised" in err[0], err[0]
    lines = [x for x in said.out.splitlines() if x.startswith("step ")]
    assert len(lines) == int(steps) and all("| skipped (nothing to train) |" in x and "nan" not in x for x in lines)
    assert "summary" not in said.out and not (out / "final").exists()


def _refused(argv, capsys) -> str:
    """train.main in this process: exit 2 and the one stderr line, returned."""
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("floe: error: "), err
    return err[0]


def _edit_json(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("stop,words", [
    (99999, "eos_token_id 99999 is outside the vocabulary [0, 32) of config.json"),
    (-1, "eos_token_id -1 is outside the vocabulary [0, 32)"),
    ([2, 40], "eos_token_id 40 is outside the vocabulary"),
])
def test_a_stop_id_outside_the_vocabulary_is_refused(tmp_path, capsys, stop, words):
    d = _copy(tmp_path)
    _edit_json(d / "generation_config.json", eos_token_id=stop)
    line = _refused(["--model", str(d), "--steps", "1", "--out-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert str(d / "generation_config.json") in line and words in line and "never stop" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stop", [[[2]], 2.0, "2", [], True, {"id": 2}])
def test_a_stop_id_of_the_wrong_type_names_generation_config(tmp_path, stop):
    d = _copy(tmp_path)
    _edit_json(d / "generation_config.json", eos_token_id=stop)
    with pytest.raises(ValueError) as e:
        TextCodec.load(d)
    assert str(e.value) == (f"{d / 'generation_config.json'}: eos_token_id must be a token id (an integer) or a "
                            f"non-empty list of them, got {json.dumps(stop)}")


@pytest.mark.parametrize("key,value,what", [
    ("eos_token_id", [[2]], "a token id in [0, vocab_size 32)"),
    ("eos_token_id", 2.0, "a token id in [0, vocab_size 32)"),
    ("eos_token_id", "2", "a token id in [0, vocab_size 32)"),
    ("eos_token_id", [], "a token id in [0, vocab_size 32)"),
    ("eos_token_id", 32, "a token id in [0, vocab_size 32)"),
    ("bos_token_id", -1, "a token id in [0, vocab_size 32)"),
    ("num_attention_heads", 0, "an integer >= 1"),
    ("hidden_size", "128", "an integer >= 1"),
    ("num_hidden_layers", True, "an integer >= 1"),
    ("vocab_size", 32.0, "an integer >= 1"),
    ("max_position_embeddings", -5, "an integer >= 1"),
    ("rms_norm_eps", "1e-6", "a number > 0"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e6"}, "rope_theta"),
    ("tie_word_embeddings", "yes", "true or false"),
])
def test_config_values_of_the_wrong_type_or_range_are_one_line(tmp_path, key, value, what):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", **{key: value})
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    what += " or a non-empty list of them" if key == "eos_token_id" else ""
    if key == "rope_parameters":  # the theta it resolves: the dict's wins over a top-level rope_theta
        key, what, value = "rope_theta", "a number > 0", value["rope_theta"]
    assert str(e.value) == f"{d / 'config.json'}: {key} must be {what}, got {json.dumps(value)}"


def test_heads_that_do_not_group_are_one_line(tmp_path):
    d = _copy(tmp_path)
    _edit_json(d / "config.json", num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads 4 must be a multiple of num_key_value_heads 3"):
        hfdir.load(d)


def test_a_layer_count_the_weights_lack_is_refused_before_building(tmp_path, monkeypatch):
    """10^7 layers would build (on the meta device) for minutes before the weights were read."""
    d = _copy(tmp_path)
    _edit_json(d / "config.json", num_hidden_layers=10**7)
    real = M.Transformer

    def guarded(args):
        assert args.num_hidden_layers <= 4, "built the model before checking the weights"
        return real(args)

    monkeypatch.setattr(M, "Transformer", guarded)
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert str(e.value) == (f"{d}: weights do not match config.json: num_hidden_layers 10000000, "
                            "the weights hold 4 layers")


def test_a_fifo_named_like_weights_is_refused_not_read(tmp_path):
    d = _copy(tmp_path)
    os.mkfifo(d / "extra.safetensors")  # opening it would block until a writer came
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert str(e.value) == f"{d / 'extra.safetensors'}: not a regular file"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool, torch.float16])
def test_a_weight_stored_as_integers_is_refused_not_cast(tmp_path, dtype):
    """An int or bool tensor of the right shape once cast to float and loaded as other weights, silently."""
    from safetensors.torch import load_file, save_file
    d, key = _copy(tmp_path), "model.layers.2.self_attn.q_proj.weight"
    state = load_file(str(d / "model.safetensors"))
    state[key] = (state[key] * 100).to(dtype)
    save_file(state, str(d / "model.safetensors"))
    if dtype is torch.float16:  # a float weight in any precision loads, as its value
        assert torch.equal(hfdir.load(d).state_dict()[key], state[key].float())
        return
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    stored = {torch.int64: "I64", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}[dtype]
    assert str(e.value).startswith(f"{d / 'model.safetensors'}: {key} is stored as {stored}, not as a weight (F32, "), e.value


@pytest.mark.parametrize("name", ["../elsewhere/model.safetensors", "/abs/model.safetensors", "sub/model.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path, name):
    """The index's file names were joined to the directory as given: weights loaded from another
    directory, which the LoRA base's hash (the directory's *.safetensors) never covered."""
    d = _copy(tmp_path)
    keys = list(json.loads((d / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (d / "model.safetensors").read_bytes()[:8], "little")]))
    weight_map = {k: "model.safetensors" for k in keys if k != "__metadata__"}
    weight_map["model.embed_tokens.weight"] = name
    (d / hfdir.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert str(e.value) == f"{d / hfdir.INDEX}: names {name}, which is not a file name in {d}"


@pytest.mark.parametrize("scaling,why", [
    ({"factor": 0.0}, "rope_scaling factor must be a number > 0, got 0.0"),
    ({"factor": -2.0}, "rope_scaling factor must be a number > 0, got -2.0"),
    ({"low_freq_factor": 4.0, "high_freq_factor": 1.0}, "rope_scaling high_freq_factor 1.0 must be greater than low_freq_factor 4.0"),
    ({"low_freq_factor": 1.0, "high_freq_factor": 1.0}, "rope_scaling high_freq_factor 1.0 must be greater than low_freq_factor 1.0"),
])
def test_llama3_rope_numbers_that_break_its_frequencies_are_one_line(tmp_path, scaling, why):
    """factor 0 once made inf frequencies (the run stopped at step 1 on a NaN far from its cause); a band
    with high <= low divided by zero or scaled the wrong frequencies, silently."""
    d = _copy(tmp_path)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512, **scaling}
    _edit_json(d / "config.json", rope_scaling=rope)
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert str(e.value) == f"{d / 'config.json'}: {why}"


@pytest.mark.parametrize("template,error", [
    ("{{ raise_exception('no system role here') }}", "TemplateError: no system role here"),
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError: unexpected '}' (template line 1)"),
    ("{{ messages | nosuch }}", "TemplateAssertionError: No filter named 'nosuch'. (template line 1)"),
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{{ ''.__class__.__subclasses__() }}", "SecurityError: access to attribute '__class__' of 'str' object is unsafe."),
    ("{{ messages.__class__ }}", "renders to no tokens"),  # the sandbox's undefined prints as nothing
])
def test_a_chat_template_that_fails_is_one_line_naming_it(tmp_path, capsys, template, error):
    d = _copy(tmp_path)
    _edit_json(d / "tokenizer_config.json", chat_template=template)
    line = _refused(["--model", str(d), "--steps", "1", "--out-dir", str(tmp_path / "run"), *SMALL], capsys)
    sep = " " if error.startswith("renders") else ": "
    assert line == f"floe: error: --task reverse-text: chat template {d / 'tokenizer_config.json'}{sep}{error}"


def test_a_tokenizer_file_that_is_not_json_is_refused_before_it_is_copied(tmp_path, capsys):
    d = _copy(tmp_path)
    (tmp_path / "notes.txt").write_text("not json\n")
    (d / "special_tokens_map.json").symlink_to(tmp_path / "notes.txt")  # checkpoints copy by content
    line = _refused(["--model", str(d), "--steps", "1", "--out-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert f"{d / 'special_tokens_map.json'}: not valid JSON" in line and "every checkpoint would copy it" in line


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_column_missing_from_some_rows_or_the_eval_file_is_refused(tmp_path):
    """The union of the rows' columns hid a row without one: its reward call failed at every draw."""
    codec, fns = TextCodec.load(ROOT / "checkpoints" / "arith-tiny"), rewards.load_rewards(("numeric_match",), ())
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} if i % 3 else {"prompt": f"{i}+1="} for i in range(1, 10)]
    train_file = _jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(T.ConfigError) as e:
        T.JsonlTask(codec, fns, train_file, eval_size=2)
    assert str(e.value) == (f"{train_file}:3: --reward numeric_match needs the column(s) ['answer'], which this row "
                            "lacks (it has none)")
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)])
    held = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "target": "2"}] * 2)
    with pytest.raises(T.ConfigError, match=f"{held}:1: --reward numeric_match needs the column"):
        T.JsonlTask(codec, fns, good, eval_file=held, eval_size=2)
