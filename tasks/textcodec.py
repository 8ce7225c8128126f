"""Text to token ids and back: the tokenizer and the chat template of a model directory (`TextCodec`),
and the tiny models' one-character tokenizers.

Simplifications:
1. One loading path for the tiny models and real HF checkpoints: `tokenizers` reads
   tokenizer.json, a chat template (tokenizer_config.json or chat_template.jinja) renders
   `messages` prompts with jinja2 the way transformers does, and generation stops at the
   directory's own stop ids (generation_config.json eos_token_id, else the tokenizer's eos).
2. The tiny models' tokenizers are one token per character with the ChatML specials (calc-tiny's
   also with the four hermes tool tags, one id each, and a template that renders tools); a
   character outside a tokenizer is an error, never a silent unknown id.

    python -m pytest -q tests/test_tasks.py tests/test_model.py -k "codec or template or tokenizer"
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the tiny tokenizers' ids 0, 1, 2
# The tiny models' chat template: ChatML, the format Qwen checkpoints use. A real model directory
# brings its own (tokenizer_config.json or chat_template.jinja), rendered the same way.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LETTERS = "abcdefghijklmnopqrstuvwxyz :\n"  # reverse-tiny's alphabet (the role names need the letters)
# calc-tiny's template: ChatML that renders tools as Qwen3 does, the list compact (one `name(params)` a
# tool: the schema's tojson would cost a character tokenizer hundreds of ids a prompt), calls and
# results exactly hermes: a call `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after the
# turn's text, consecutive results merged into one user turn of <tool_response> blocks.
CHATML_TOOLS = (
    "{%- set first = 1 if messages[0].role == 'system' else 0 -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\n' + (messages[0].content + '\\n' if first else '') + 'tools:' -}}"
    "{%- for t in tools -%}{{- ' ' + t.function.name + '(' + (t.function.parameters.properties | join(', ')) + ')' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif first -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages[first:] -%}{%- set i = loop.index0 + first -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- for tc in m.tool_calls or [] -%}{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if not loop.first or m.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if i == first or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[i + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # one id each, not special (as Qwen3's)


def char_tokenizer(alphabet: str = LETTERS, tags: list[str] = ()) -> Tokenizer:
    """A tiny model's tokenizer: one token per character of `alphabet`, after the ChatML specials and
    `tags` (one id each, added as tokens that are not special: decode keeps them, as Qwen3's tool tags)."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(tags) + list(dict.fromkeys(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if tags:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in tags])
    return tok


def write_tokenizer(out_dir: str | Path, alphabet: str = LETTERS, template: str = CHATML, tags: list[str] = ()) -> None:
    """A tiny model's tokenizer files: tokenizer.json, tokenizer_config.json (with the chat template,
    ChatML unless told) and generation_config.json (generation stops at <|im_end|> or <|endoftext|>)."""
    out = Path(out_dir)
    char_tokenizer(alphabet, tags).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "unk_token": "<|endoftext|>", "model_max_length": 512, "chat_template": template}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}, indent=2))


def _read_json(path: Path) -> dict:
    """An optional JSON-object file ({} when absent; a FIFO or a directory is no file)."""
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: not a JSON object")
    return out


def _stop_ids(d: Path, tok: Tokenizer, specials: dict) -> tuple[list[int], str]:
    """generation_config.json's eos_token_id (an id or a non-empty list of ids), else the id of
    tokenizer_config.json's eos_token; with the file and key they came from. Whether each lies in
    the vocabulary is start.check_start's to say (config.json holds its size)."""
    gen = d / "generation_config.json"
    stop = _read_json(gen).get("eos_token_id")
    if stop is not None:
        ids = stop if isinstance(stop, list) else [stop]
        if not ids or not all(type(i) is int for i in ids):  # JSON true and 2.0 are no ids; bool is an int
            raise ValueError(f"{gen}: eos_token_id must be a token id (an integer) or a non-empty list of them, "
                             f"got {json.dumps(stop)}")
        return ids, f"{gen} eos_token_id"
    eos = specials.get("eos_token")
    if eos is None:
        raise ValueError(f"{d}: no stop token: generation_config.json has no eos_token_id and "
                         "tokenizer_config.json no eos_token")
    if not isinstance(eos, str) or tok.token_to_id(eos) is None:
        raise ValueError(f"{d / 'tokenizer_config.json'}: eos_token {json.dumps(eos)} is not a token of tokenizer.json")
    return [tok.token_to_id(eos)], f"{d / 'tokenizer_config.json'} eos_token"


def _token(x) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return x.get("content") if isinstance(x, dict) else x


@dataclass
class TextCodec:
    """A model directory's text side: its `tokenizers.Tokenizer`, the ids generation stops at, and
    its chat template (rendered with jinja2 as transformers renders it)."""

    tok: Tokenizer
    stop_ids: list[int]  # the first is the end of a reference completion (--stage sft)
    template: str | None = None  # the jinja chat template; None: the directory has none
    specials: dict = field(default_factory=dict)  # bos_token, eos_token, ...: what the template may read
    stop_source: str = "the tiny tokenizer"  # where stop_ids came from, for the line that refuses one
    template_source: str = "the ChatML template"  # where the template came from, for the line a bad one gets

    @staticmethod
    def load(model_dir: str | Path) -> TextCodec:
        """tokenizer.json; stop ids from generation_config.json's eos_token_id, else the tokenizer's
        eos token; the chat template from chat_template.jinja, else tokenizer_config.json (transformers' order)."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: {'not a regular file' if path.exists() else 'missing'}; "
                                    "a model directory needs tokenizer.json")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a damaged file
            raise ValueError(f"{path}: unreadable tokenizer ({e})") from None
        tc = _read_json(d / "tokenizer_config.json")
        specials = {k: _token(v) for k, v in tc.items() if k.endswith("_token") and _token(v) is not None}
        stop_ids, stop_source = _stop_ids(d, tok, specials)
        template, source = tc.get("chat_template"), d / "tokenizer_config.json"
        if isinstance(template, list):  # named templates: transformers takes "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():  # transformers reads it over tokenizer_config.json's, as vLLM then does
            template, source = (d / "chat_template.jinja").read_text(), d / "chat_template.jinja"
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{source}: chat_template must be a string (or a list of named ones), got {type(template).__name__}")
        return TextCodec(tok, stop_ids, template, specials, stop_source, str(source))

    @staticmethod
    def tiny(alphabet: str = LETTERS) -> TextCodec:
        """The codec a tiny model's directory loads to (write_tokenizer), built in memory."""
        specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
        return TextCodec(char_tokenizer(alphabet), [2, 0], CHATML, specials)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`; special: let the tokenizer add its own (a BOS, for a plain-string
        prompt). A character the tokenizer cannot represent is an error, not a silent unknown id."""
        enc = self.tok.encode(text, add_special_tokens=special)
        unk = self.specials.get("unk_token") or getattr(self.tok.model, "unk_token", None)
        unk_id = self.tok.token_to_id(unk) if unk else None
        if unk_id is not None:
            for i, (a, b) in zip(enc.ids, enc.offsets):
                if i == unk_id and text[a:b] != unk:
                    raise ValueError(f"{text[a:b]!r} is not in the tokenizer (it would become {unk})")
        return enc.ids

    def render(self, prompt: str | list[dict], **template_kwargs) -> list[int]:
        """A prompt's ids: a string as it is (with the tokenizer's own BOS, if it adds one), a chat
        `messages` list through the chat template with the generation prompt (BOS as the
        template writes it)."""
        if isinstance(prompt, str):
            return self._some(self.encode(prompt, special=True), "the prompt")
        return self._some(self.encode(self.render_text(prompt, **template_kwargs)),
                          f"chat template {self.template_source}")

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """A `messages` list through the chat template, as text; ValueError (one line naming the
        template) for any error the template raises."""
        if self.template is None:
            raise ValueError("a chat `messages` prompt needs a chat template, and the model directory has none "
                             "(tokenizer_config.json chat_template or chat_template.jinja); give the prompt as a string")
        import jinja2

        try:  # the template is the model directory's code: any error it raises is its own, in one line
            return _jinja(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **{**self.specials, **template_kwargs})
        except jinja2.TemplateSyntaxError as e:  # a syntax error, an unknown filter (found when compiled)
            raise ValueError(f"chat template {self.template_source}: {type(e).__name__}: {e.message} "
                             f"(template line {e.lineno})") from None
        except Exception as e:  # raise_exception, the sandbox's SecurityError, a ZeroDivisionError, ...
            message = " ".join(str(e).split()) or "(no message)"
            raise ValueError(f"chat template {self.template_source}: {type(e).__name__}: {message}") from None

    @staticmethod
    def _some(ids: list[int], what: str) -> list[int]:
        """A prompt of no tokens has no last position to sample from: refused where it is made."""
        if not ids:
            raise ValueError(f"{what} renders to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Decode up to (not including) the first stop token."""
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                ids = ids[:i]
                break
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_turn(self, ids: list[int]) -> tuple[str, str]:
        """A model turn as a tool-call parser reads it: decoded with special tokens kept (Llama's
        <|python_tag|>, Qwen's <tool_call> when marked special), cut before the first stop token; and
        that stop token's text, "" when none ended the turn (whether <|eom_id|> or <|eot_id|> did)."""
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                return self.tok.decode(ids[:i], skip_special_tokens=False), self.tok.decode([t], skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False), ""


@functools.lru_cache(maxsize=8)
def _jinja(source: str):
    """A chat template compiled as transformers compiles it: a sandbox, trim_blocks and lstrip_blocks,
    loop controls, and the helpers templates call (raise_exception, tojson, strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)
