"""The start checks of an episode's parts, before the first byte is written: the environment
(--env: it imports, is a class with the contract's methods, every row holds the columns its reset
reads, the episodes have a reward) and the tools (--tool, an environment's tools(): their schemas
build, the chat template renders them and a result, a call format is found). Each refusal is one
line naming what was wrong (start.check_start calls these; train.main exits 2). An environment's
tools() exist after reset, so the eval-set fit asks `eval_prompt_length` for a held-out row's
first prompt as the eval will render it.

    python -m pytest -q tests/test_tools.py tests/test_episodes.py -k "refus or column or env"
"""

from __future__ import annotations

import copy
import inspect
import json
from typing import Callable

from config import Config, ConfigError
from data import Prompt
from agents import envs, toolcalls, toolrun, toolschema
from agents.episodes import EnvSpec, end_of_turn, reply_ids
from tasks import usercode
from tasks.task import Task
from tasks.textcodec import TextCodec


def load_env(cfg: Config, task: Task, tools: dict) -> EnvSpec | None:
    """--env, checked before the run writes anything: it imports, is a class with `step` (optional
    when it has tools), every row holds the columns it declares its `reset` reads, and the episodes
    have a reward (the environment's `reward`, or --reward functions). --tool without --env plays
    the built-in `tools` environment (envs.ToolsOnly): no step, no reward."""
    if not cfg.env:
        if not tools:
            return None
        if not task.rewards:
            raise ConfigError("--tool without --env needs --reward: the episodes have no environment to score them")
        return EnvSpec("tools", envs.ToolsOnly, None, False, has_step=False)
    try:
        cls, path = usercode.load(cfg.env, "--env", envs.BUILTIN, "class", cfg.call_timeout)
    except usercode.LoadError as e:
        raise ConfigError(str(e)) from None
    if not inspect.isclass(cls):
        raise ConfigError(f"--env {cfg.env}: {cls!r} is not a class (one instance is made per episode)")
    has_tools = hasattr(cls, "tools")
    if has_tools and cfg.stage == "sft":  # rollout.sft_samples renders the task's prompts: no reset, no tools()
        raise ConfigError(f"--env {cfg.env}: {cls.__name__}.tools() reach an episode's prompt after reset, which "
                            "--stage sft does not call, so its references would train on prompts without them; "
                            "give the same tools with --tool for the warm-up")
    for method in tuple(m for m in ("step", "reset", "reward", "tools") if hasattr(cls, m) or (m == "step" and not has_tools)):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"--env {cfg.env}: {cls.__name__}.{method} is not a method (agents/envs.py has the contract)")
    if clash := [n for n in tools if hasattr(cls, n)]:
        raise ConfigError(f"--tool {clash[0]}: named like --env {cfg.env}'s {cls.__name__}.{clash[0]}; rename the tool")
    check_columns(cfg.env, cls, getattr(task, "train", []) + task.eval_set)
    has_reward = callable(getattr(cls, "reward", None))
    if not has_reward and not task.rewards:
        raise ConfigError(f"--env {cfg.env}: {cls.__name__} has no reward() and no --reward is given: "
                            "an episode needs one")
    return EnvSpec(cfg.env, cls, path, has_reward, hasattr(cls, "step"), has_tools)


def check_columns(name: str, cls: type, rows: list) -> None:
    """Every row holds the columns the class declares its reset reads (`columns`), as it holds those a
    reward asks for: a row without one would fail its group's reset at every step that drew it."""
    columns = getattr(cls, "columns", ())
    if not isinstance(columns, (tuple, list)) or not all(isinstance(c, str) for c in columns):
        raise ConfigError(f"--env {name}: {cls.__name__}.columns must be a tuple of column names, got {columns!r}")
    for p in rows:
        if missing := [c for c in columns if c != "prompt" and c not in p.columns]:
            raise ConfigError(f"{p.where}: --env {name} needs the column(s) {missing}, which this row lacks "
                                f"(it has {sorted(p.columns) or 'none'})")


def load_tools(cfg: Config) -> dict:
    """--tool's functions with their schemas (toolschema.toolset), or one line: a tool that does not
    import, is not a function, has a parameter JSON cannot describe, or shares a name."""
    try:
        return toolschema.toolset(toolschema.load(cfg.tool, cfg.call_timeout), [f"--tool {spec}" for spec in cfg.tool])
    except ValueError as e:
        raise ConfigError(str(e)) from None


def file_order(p: Prompt, task: str) -> tuple[bool, int]:
    """A jsonl row's place in the files it came from ("path:N"): --task's rows by line, then --eval-file's."""
    path, _, line = (p.where or "").rpartition(":")
    return path != task.removeprefix("jsonl:"), int(line) if line.isdigit() else 0


PROBE = {"type": "function", "function": {"name": "floe_probe", "description": "A probe.",
                                          "parameters": {"type": "object", "properties": {}}}}


def check_tools(cfg: Config, codec: TextCodec, task: Task, env: EnvSpec | None, tools: dict) -> toolrun.Tools | None:
    """With tools declared (--tool, or an --env with tools()), what they need of the model directory
    and the task, else one line: a chat template that shows them, can render a result after a plain
    assistant turn and writes a known call format (or --tool-format), chat prompts, and no `tools` in
    --chat-template-kwargs. The episodes' tools, their format and limits, and the runner."""
    if env is None or not (tools or env.has_tools):
        return None
    src = codec.template_source
    if "tools" in json.loads(cfg.chat_template_kwargs):
        raise ConfigError("--chat-template-kwargs sets `tools`: floe passes the declared tools' schemas (--tool, "
                            "an environment's tools()); leave it out")
    if codec.template is None:
        raise ConfigError(f"tools reach the model through the chat template, and {cfg.model} has none")
    if bad := [p for p in getattr(task, "train", []) + task.eval_set if isinstance(p.prompt, str)]:
        first = min(bad, key=lambda p: file_order(p, cfg.task))  # the held-out rows are drawn from all over the file
        raise ConfigError(f"{first.where or cfg.task}: a string prompt cannot show the tools (the chat template "
                            "does); give the prompt as chat messages")
    base = {k: v for k, v in task.template_kwargs.items() if k != "tools"}
    schemas = [t.schema for t in tools.values()] or [PROBE]
    probe = [{"role": "user", "content": "floe-probe"}]
    try:
        if codec.render_text(probe, True, **base) == codec.render_text(probe, True, **base, tools=schemas):
            raise ConfigError(f"chat template {src} ignores `tools` (it renders the same text with and without "
                                "them): the model would never see the tools")
        reply_ids(codec, [{"role": "tool", "name": "floe_probe", "content": "1"}], end_of_turn(codec, base),
                    {**base, "tools": schemas})
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"chat template {src} cannot render a tool result after a plain assistant turn ({e}); "
                            "a template that needs the call before its result (as GPT-OSS's) is not supported") from None
    fmt = cfg.tool_format if cfg.tool_format != "auto" else toolcalls.detect_format(codec.template)
    if fmt is None:
        raise ConfigError(f"--tool-format auto: chat template {src} writes neither <tool_call> (hermes) nor ipython "
                            "or <|python_tag|> (llama3-json); give --tool-format")
    if fmt == "llama3-json" and cfg.max_tool_calls_per_turn > 1:
        raise ConfigError(f"--max-tool-calls-per-turn {cfg.max_tool_calls_per_turn} with llama3-json (read from "
                            f"{src}): the format is one call a turn")
    task.tool_format = fmt
    runner = toolrun.Runner(cfg.tool_timeout, cfg.max_tool_result_chars, codec.encode)
    return toolrun.Tools(tools, fmt, cfg.max_tool_calls_per_turn, cfg.max_tool_calls, runner, env.has_tools)


def eval_prompt_length(cfg: Config, codec: TextCodec, task: Task, env: EnvSpec | None,
                       tools: toolrun.Tools | None) -> Callable[[Prompt, int], int] | None:
    """With an environment that declares tools(), the tokens of a held-out row's first prompt as the
    eval plays it, for Task.fit_eval_set: reset with the seed the row at place j of the eval set gets
    (rollout.evaluate_episodes: --seed + 1 + j), its tools()' schemas beside --tool's, rendered. So the
    eval-set fit sees the prompt as the model will, hundreds of tokens of schemas included. A reset or
    render that fails is the eval's to count (it drops the group): the row's own ids then."""
    if env is None or tools is None or not env.has_tools:
        return None

    def first_prompt(p: Prompt, seed: int) -> int:
        e = env.cls()
        first = e.reset(copy.deepcopy({"prompt": p.prompt, **p.columns}), seed) if hasattr(e, "reset") else None
        fns = toolschema.toolset([t.fn for t in tools.fns.values()] + list(e.tools()))
        raw = p.prompt if first is None else first
        return len(codec.render(raw, **{**task.template_kwargs, "tools": [t.schema for t in fns.values()]}))

    def length(p: Prompt, j: int) -> int:
        res = usercode.call_all([lambda: first_prompt(p, cfg.seed + 1 + j)], cfg.call_timeout)[0]
        return res.value if res.ok else len(p.ids)
    return length
