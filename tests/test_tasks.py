"""tasks/task.py and the text side of data.py: chat templates against transformers' rendering, stop ids
from the model directory, prompts from a file, rewards by import path, and each bad input's one line."""

import hashlib
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import config as C
import data as D
from tasks.textcodec import TextCodec, char_tokenizer
from tasks import rewards
from run import start
from tasks import task as T
from conftest import one_line

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "reverse-tiny"
ARITH = ROOT / "checkpoints" / "arith-tiny"

# written here for the test: a Qwen3-like template (the thinking switch) and a Llama-3-like one (BOS, trim)
QWEN_LIKE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
             "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
             "{%- endif %}{%- endif %}")
LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  what is 2+3?  "}]


def _model_dir(tmp_path, template=None, generation=None, name="m", **tok_config) -> Path:
    d = tmp_path / name
    d.mkdir()
    char_tokenizer(T.PRINTABLE).save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
           **tok_config}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


@pytest.mark.parametrize("template,kwargs", [(QWEN_LIKE, {}), (QWEN_LIKE, {"enable_thinking": False}),
                                             (LLAMA_LIKE, {})])
def test_chat_template_renders_as_transformers_does(tmp_path, template, kwargs):
    transformers = pytest.importorskip("transformers")
    d = _model_dir(tmp_path, template, bos_token="<|endoftext|>")
    ours = TextCodec.load(d)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ("<think>" in text) == (kwargs == {"enable_thinking": False})
    assert ours.render(MESSAGES, **kwargs) == hf.encode(text, add_special_tokens=False)
    assert ours.render(MESSAGES, **kwargs) == ours.encode(text)


def test_a_directory_with_two_chat_templates_renders_the_one_transformers_loads(tmp_path):
    """tokenizer_config.json's chat_template and a chat_template.jinja both present: training renders what
    transformers (and so vLLM) serves."""
    transformers = pytest.importorskip("transformers")
    d = _model_dir(tmp_path, LLAMA_LIKE, bos_token="<|endoftext|>")
    (d / "chat_template.jinja").write_text(QWEN_LIKE)
    ours = TextCodec.load(d)
    text = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(MESSAGES, tokenize=False,
                                                                            add_generation_prompt=True)
    assert ours.render(MESSAGES) == ours.encode(text) and ours.template_source == str(d / "chat_template.jinja")


def test_the_tiny_models_render_their_old_chatml_prompt():
    codec = TextCodec.load(TINY)
    ids = codec.render([{"role": "user", "content": "reverse: cold fish"}])
    assert ids == codec.encode("<|im_start|>user\nreverse: cold fish<|im_end|>\n<|im_start|>assistant\n")


def test_stop_ids_come_from_the_model_directory(tmp_path):
    assert TextCodec.load(TINY).stop_ids == [2, 0]  # generation_config.json: <|im_end|>, <|endoftext|>
    assert TextCodec.load(_model_dir(tmp_path, generation={"eos_token_id": 7}, name="a")).stop_ids == [7]
    assert TextCodec.load(_model_dir(tmp_path, name="b")).stop_ids == [2]  # the tokenizer's eos_token
    with pytest.raises(ValueError, match="no stop token"):
        TextCodec.load(_model_dir(tmp_path, name="c", eos_token=None))


def test_a_character_the_tokenizer_lacks_is_an_error():
    codec = TextCodec.load(TINY)
    with pytest.raises(ValueError, match="'7' is not in the tokenizer"):
        codec.encode("abc7")
    assert codec.encode("<|endoftext|>") == [0]  # the unknown token itself, written out, is fine


def test_a_messages_prompt_without_a_template_is_refused(tmp_path):
    codec = TextCodec.load(_model_dir(tmp_path))
    assert codec.render("plain text") == codec.encode("plain text")
    with pytest.raises(ValueError, match="chat template"):
        codec.render(MESSAGES)


def test_numeric_and_exact_match():
    out = rewards.numeric_match(None, ["so 12", "3 then 4", "\\boxed{1,234} and 9", "none", "-5"],
                          ["12", 4, "1234", "1", "-5.0"])
    assert out == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert rewards.exact_match(None, [" 42 ", "42."], ["42", "42"]) == [1.0, 0.0]


def _rows(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _sums(n: int) -> list[dict]:
    pairs = random.Random(0).sample([(a, b) for a in range(10) for b in range(10)], n)  # distinct rows
    out = []
    for a, b in pairs:
        out.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
                    "completion": str(a + b), "level": a % 3})
    return out


def _cfg(**kw) -> C.Config:
    return C.Config(**{"eval_prompts": 4, **kw})


def test_jsonl_task_splits_renders_and_passes_columns(tmp_path):
    path = _rows(tmp_path / "t.jsonl", _sums(30) + [{"prompt": "1+1=", "answer": "2"}])
    seen = {}

    def spy(prompts, completions, answer, level=None, **kwargs):  # a default: rows may lack it
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level, ids=kwargs["completion_ids"])
        return [float(c == a) for c, a in zip(completions, answer)]

    codec = TextCodec.load(ARITH)
    task = T.JsonlTask(codec, [rewards.Reward("spy", spy)], path, eval_size=4)
    again = T.JsonlTask(codec, [rewards.Reward("spy", spy)], path, eval_size=4)
    assert [p.prompt for p in task.eval_set] == [p.prompt for p in again.eval_set]  # a fixed split
    held = {json.dumps(p.prompt) + json.dumps(p.columns) for p in task.eval_set}
    assert len(task.train) == 27 and not held & {json.dumps(p.prompt) + json.dumps(p.columns) for p in task.train}
    plain = next(p for p in task.train + task.eval_set if p.prompt == "1+1=")
    assert plain.ids == codec.encode("1+1=") and plain.reference is None
    chat = next(p for p in task.train if isinstance(p.prompt, list))
    assert chat.ids == codec.render(chat.prompt) and chat.reference == chat.columns["answer"]
    drawn = task.sample(2, random.Random(1))
    right = codec.encode(drawn[0].columns["answer"]) + [2]
    scores = task.score([drawn[0]] * 2 + [drawn[1]] * 2, [right, [5, 6, 2], right, [2]], group=2)
    assert scores[0] == 1.0 and scores[1] == 0.0 and scores[3] == 0.0
    assert seen["prompts"] == [drawn[1].prompt] * 2 and seen["answer"] == [drawn[1].columns["answer"]] * 2
    assert seen["level"] == [drawn[1].columns.get("level")] * 2 and seen["completions"][1] == ""
    assert seen["ids"] == [right, [2]]


def test_eval_file_is_the_held_out_set(tmp_path):
    train, held = _rows(tmp_path / "a.jsonl", _sums(10)), _rows(tmp_path / "b.jsonl", _sums(6))
    task = T.JsonlTask(TextCodec.load(ARITH), rewards.load_rewards(("numeric_match",), ()), train, held, eval_size=4)
    assert len(task.train) == 10 and [p.prompt for p in task.eval_set] == [r["prompt"] for r in _sums(4)]
    with pytest.raises(C.ConfigError, match="fewer than --eval-prompts 8"):
        T.JsonlTask(TextCodec.load(ARITH), rewards.load_rewards(("numeric_match",), ()), train, held, eval_size=8)


def test_a_reward_that_raises_skips_its_group_and_none_or_nan_skip_a_sample(capsys):
    calls = [0]

    def flaky(prompts, completions, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("server down")
        return [None, math.nan, 0.5]

    task = T.ReverseText(TextCodec.load(TINY), [rewards.Reward("flaky", flaky)], eval_size=2)
    ps = task.sample(3, random.Random(0))
    out = task.score([ps[0]] * 3 + [ps[1]] * 3 + [ps[2]] * 3, [[3, 2]] * 9, group=3)
    assert [math.isnan(x) for x in out] == [True, True, False, True, True, True, True, True, False]
    assert out[2] == 0.5 and "reward flaky raised RuntimeError: server down" in capsys.readouterr().out


def test_a_wrong_length_reward_stops_naming_the_function():
    task = T.ReverseText(TextCodec.load(TINY), [rewards.Reward("short", lambda prompts, completions, **k: [1.0])],
                         eval_size=2)
    with pytest.raises(D.RunError, match="reward short returned 1 values for 2 completions"):
        task.score(task.eval_set[:1] * 2, [[2], [2]], group=2)


def test_rewards_load_by_path_module_and_name(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text("def f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    by_path = rewards.load_reward(f"{tmp_path / 'myreward.py'}:f", 0.5)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = rewards.load_reward("myreward:f")
    assert by_path.weight == 0.5 and by_path.fn(None, ["a"]) == by_module.fn(None, ["a"]) == [1.0]
    assert rewards.reward_hashes([by_path, rewards.load_reward("similarity")]) == {
        by_path.name: hashlib.sha256((tmp_path / "myreward.py").read_bytes()).hexdigest()}
    for spec, words in ((f"{tmp_path}/nope.py:f", "no such file"), (f"{tmp_path / 'myreward.py'}:g", "no function 'g'"),
                        ("no_such_module_here:f", "ModuleNotFoundError"), ("numeric", "not a built-in")):
        with pytest.raises(C.ConfigError, match=words):
            rewards.load_reward(spec)
    with pytest.raises(C.ConfigError, match="2 weights for 1"):
        rewards.load_rewards(("similarity",), (1.0, 2.0))


def test_a_reward_asking_for_a_missing_column_is_refused(tmp_path):
    path = _rows(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 6)
    with pytest.raises(C.ConfigError, match=r"needs the column\(s\) \['target'\]"):
        T.JsonlTask(TextCodec.load(ARITH), rewards.load_rewards(("similarity",), ()), path, eval_size=2)


def test_eval_metrics_pass_at_k():
    m = T.eval_metrics([1, 0, 0, 0, 0, 0, 0, 0, 1, 1, math.nan, 1], 4)
    assert m["eval/reward"] == pytest.approx(4 / 11) and m["eval/reward_error"] == pytest.approx(1 / 12)
    assert m["eval/pass@1"] == pytest.approx((0.25 + 0 + 1) / 3) and m["eval/pass@4"] == pytest.approx(2 / 3)
    assert "eval/pass@1" not in T.eval_metrics([0.5, 1.0], 2)  # not a 0/1 reward


def test_the_word_list_cannot_hang_the_sampler():
    with pytest.raises(C.ConfigError, match="more than half of the 492 distinct prompts"):
        T.ReverseText(TextCodec.load(TINY), max_words=1, eval_size=247)
    task = T.ReverseText(TextCodec.load(TINY), max_words=1, eval_size=246)
    assert len({p.prompt[0]["content"] for p in task.sample(40, random.Random(0))} & {
        p.prompt[0]["content"] for p in task.eval_set}) == 0


def test_arithmetic_is_checkable_and_held_out():
    task = T.Arithmetic(TextCodec.load(ARITH), eval_size=8)
    p = task.sample(1, random.Random(3))[0]
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d)=", p.prompt).groups()
    assert p.columns["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b)) == p.reference
    codec = task.codec
    right, wrong = codec.encode(p.reference) + [2], codec.encode("1000") + [2]
    assert task.score([p, p], [right, wrong], group=2) == [1.0, 0.0]
    assert p.ids == task.codec.encode(p.prompt)  # a plain prompt, no chat wrapper
    assert {q.prompt for q in task.sample(200, random.Random(0))}.isdisjoint({q.prompt for q in task.eval_set})


def test_the_task_table_drives_the_task_check_the_flag_checks_the_note_the_alphabet_and_build(monkeypatch, capsys):
    """A built-in task is its class and its TASKS entry: an entry added here, and nothing else, is a
    --task whose flag is checked, noted when unread, and passed to its class; its alphabet is the class's."""
    class Toy(T.Arithmetic):
        alphabet = T.DIGITS + "?"

    toy = T.Builtin(Toy, ("max_operand",), (T.Check(lambda c: c.max_operand <= 50, "--max-operand must be <= 50 "
                                                   "for toy, got {max_operand}"),))
    monkeypatch.setitem(T.TASKS, "toy", toy)
    cfg = _cfg(task="toy", max_operand=20)
    T.check_flags(cfg)
    task = T.build(cfg, TextCodec.load(ARITH))
    assert type(task) is Toy and task.max_operand == 20 and len(task.eval_set) == 4
    assert T.alphabet(cfg) == Toy.alphabet and T.alphabet(_cfg(task="jsonl:x.jsonl")) == T.PRINTABLE
    with pytest.raises(C.ConfigError, match=r"^--task must be reverse-text, arithmetic, toy or jsonl:PATH, got 'nope'$"):
        T.check_flags(_cfg(task="nope"))
    with pytest.raises(C.ConfigError, match=r"^--max-operand must be <= 50 for toy, got 60$"):
        T.check_flags(_cfg(task="arithmetic", max_operand=60))  # every entry's checks, whatever --task
    assert T.unread(cfg) == [(f, "is not read with --task toy (it is --task reverse-text's)", False)
                             for f in ("min_words", "max_words")]
    start.check_read(_cfg(task="reverse-text", max_operand=20))
    assert capsys.readouterr().out.strip() == ("note: --max-operand 20 is not read with --task reverse-text (it is "
                                               "--task arithmetic, toy's); the run goes on without it")


# ----------------------------------------------------------------------------- from the command line

SMALL = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-every", "0"]


def _train(tmp_path, *args):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--out-dir", str(out), *SMALL, *args],
                       capture_output=True, text=True, timeout=180)
    return r, out



@pytest.mark.parametrize("rows,words", [
    ([{"prompt": "1+1=", "answer": "2"}, "{not json"], ["t.jsonl:2", "not valid JSON"]),
    ([], ["t.jsonl", "empty"]),
    ([{"prompt": "1+1=", "answer": "2"}, {"question": "2+2="}], ["t.jsonl:2", "`prompt`"]),
    ([{"prompt": [{"role": "user"}], "answer": "2"}], ["t.jsonl:1", "messages"]),
    ([{"prompt": "what is 1+1?", "answer": "2"}], ["t.jsonl:1", "'?' is not in the tokenizer"]),
])
def test_bad_jsonl_is_one_line_and_writes_nothing(tmp_path, rows, words):
    path = _rows(tmp_path / "t.jsonl", rows)
    r, out = _train(tmp_path, "--model", str(ARITH), "--task", f"jsonl:{path}", "--reward", "numeric_match")
    one_line(r, 2, *words)
    assert not out.exists()


def test_a_missing_reward_file_or_function_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "rw.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    for spec, words in ((str(tmp_path / "missing.py") + ":score", "no such file"),
                        (str(tmp_path / "rw.py") + ":scor", "no function 'scor'")):
        r, out = _train(tmp_path, "--reward", spec)
        one_line(r, 2, "--reward", words)
        assert not out.exists()


def test_an_eval_file_too_small_isone_line(tmp_path):
    path, held = _rows(tmp_path / "t.jsonl", _sums(8)), _rows(tmp_path / "e.jsonl", _sums(2))
    r, out = _train(tmp_path, "--model", str(ARITH), "--task", f"jsonl:{path}", "--reward", "numeric_match",
                    "--eval-file", str(held), "--eval-prompts", "4")
    one_line(r, 2, "e.jsonl has 2 rows, fewer than --eval-prompts 4")
    assert not out.exists()


def test_a_jsonl_run_trains_saves_the_reward_hash_and_counts_long_prompts(tmp_path):
    rows = _sums(12) + [{"prompt": "1+" * 300 + "1=", "answer": "301"}] * 30  # most prompts exceed 512 tokens
    path = _rows(tmp_path / "t.jsonl", rows)
    rw = tmp_path / "rw.py"
    rw.write_text("def close(prompts, completions, answer, **kw):\n"
                  "    return [1.0 if c.strip() == a else 0.1 for c, a in zip(completions, answer)]\n")
    args = ["--model", str(ARITH), "--task", f"jsonl:{path}", "--reward", f"{rw}:close", "--reward", "numeric_match",
            "--reward-weights", "0.5", "0.5", "--prompts-per-step", "8", "--steps", "2", "--save-every", "1",
            "--eval-prompts", "4", "--eval-every", "1"]
    r, out = _train(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(x.get("skipped/too_long", 0) for x in rows) > 0 and "eval/reward" in rows[0]
    saved = json.loads((out / "config.json").read_text())
    assert saved["reward_sha256"] == {f"{rw}:close": hashlib.sha256(rw.read_bytes()).hexdigest()}
    rw.write_text(rw.read_text() + "# edited\n")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--out-dir", str(out), *SMALL, *args,
                        "--steps", "3", "--resume"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rw.py:close: its file changed since the run started" in r.stdout


def test_sft_on_a_file_without_completions_is_refused(tmp_path):
    path = _rows(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 8)
    r, out = _train(tmp_path, "--model", str(ARITH), "--task", f"jsonl:{path}", "--reward", "numeric_match",
                    "--stage", "sft", "--eval-prompts", "2")
    one_line(r, 2, "--stage sft needs a reference completion")
