"""Text in, text out: the model's tokenizer, incremental detokenizer and chat template.

Everything is read from the tokenizer files of a converted model folder (copied unchanged
from the Hugging Face checkpoint) and behaves like ``transformers`` 5 with the same files:
``tokenizer.json`` through the ``tokenizers`` library, special tokens from
``tokenizer_config.json`` (``special_tokens_map.json`` fills gaps), stop tokens from
``generation_config.json`` / ``config.json``, and the chat template rendered in a jinja2
sandbox (`template_sandbox`: templates come from strangers, so unsafe attribute access is
refused, not rendered as an empty value, and a render's time and size are bounded).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Mapping

import jinja2
import numpy as np
from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from colibri.formats.layout import FormatError, inside
from colibri.formats.messages import one_line
from colibri.formats.safe_json import read_json_object
from colibri.runtime.template_sandbox import environment, render

__all__ = ["Tokenizer", "DetokenizeStream", "TokenizerError", "ChatTemplateError"]

#: the named special tokens transformers passes to chat templates
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: names a message's reasoning may be passed under (the first is what templates read)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


MAX_TEXT_BYTES = 1 << 30  # a text file to score or calibrate on larger than this is refused unread


def read_text_file(path: pathlib.Path, error: type[Exception], max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of `path`; `error` with one line naming the file when it is missing,
    larger than `max_bytes` or not UTF-8."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes, larger than the {max_bytes >> 20} MiB of text a run reads")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read as UTF-8 text ({e.__class__.__name__}: {one_line(e)})") from None


class TokenizerError(Exception):
    """A tokenizer folder that cannot be used as it is; the message names the file."""


class ChatTemplateError(TokenizerError):
    """A chat template that is missing, failed or was refused; the message names the template."""


def _inside(directory: pathlib.Path, name: str) -> pathlib.Path:
    try:
        return inside(directory, name)
    except FormatError as e:
        raise TokenizerError(str(e)) from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config writes it: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A model's tokenizer, special tokens and chat template.

    ``bos_id``: the BOS token (tokenizer_config's ``bos_token``, else the configs' id);
    ``eos_ids``: every stop token (tokenizer_config's ``eos_token`` and the ``eos_token_id``
    of generation_config.json and config.json, lists included); ``special_tokens``: the
    named special-token strings (``bos_token``, ``eos_token``, ...) templates receive.
    """

    def __init__(self, tokenizer: _HFTokenizer, config: dict, generation_config: dict, model_config: dict,
                 chat_template, template_source: str):
        self._tok = tokenizer
        self.special_tokens = {k: t for k in _SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k))) is not None}
        named = {k: tokenizer.token_to_id(t) for k, t in self.special_tokens.items()}
        bos = [named.get("bos_token"), *_id_list(generation_config.get("bos_token_id")),
               *_id_list(model_config.get("bos_token_id"))]
        self.bos_id: int | None = next((i for i in bos if i is not None), None)
        eos = [named.get("eos_token"), *_id_list(generation_config.get("eos_token_id")),
               *_id_list(model_config.get("eos_token_id"))]
        self.eos_ids: set[int] = {i for i in eos if i is not None}
        self._chat_template = chat_template
        self._template_source = template_source
        self._compiled = None

    @classmethod
    def from_dir(cls, model_dir) -> Tokenizer:
        """Load ``tokenizer.json`` and its companion files from a (converted) model folder; a
        file that links outside the folder is refused."""
        d = pathlib.Path(model_dir)
        path = _inside(d, "tokenizer.json")
        if not path.is_file():
            raise TokenizerError(f"{path}: missing (the model folder needs the checkpoint's tokenizer.json)")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception on bad files
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({one_line(e)})") from None
        config = read_json_object(_inside(d, "tokenizer_config.json"), TokenizerError)
        config = {**read_json_object(_inside(d, "special_tokens_map.json"), TokenizerError), **config}
        jinja_path = _inside(d, "chat_template.jinja")
        if jinja_path.is_file():
            try:
                template, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_path}: cannot read ({one_line(e)})") from None
        else:
            template, source = config.get("chat_template"), f"{d / 'tokenizer_config.json'} (chat_template)"
        return cls(tok, config, read_json_object(_inside(d, "generation_config.json"), TokenizerError),
                   read_json_object(_inside(d, "config.json"), TokenizerError), template, source)

    # ----------------------------------------------------------------------------- tokens

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids.

        ``add_bos=None`` applies the tokenizer.json post-processor, exactly like transformers 5
        (which ignores ``add_bos_token`` in tokenizer_config.json when tokenizer.json exists);
        ``True``/``False`` give the plain text tokens with/without the BOS token in front.
        """
        if add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if not add_bos:
            return ids
        if self.bos_id is None:
            raise ValueError("add_bos=True but this model has no BOS token")
        return [self.bos_id, *ids]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token's vocabulary string has: no token stands for more
        of a text, so a text of n bytes has at least n / max_token_bytes tokens."""
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> DetokenizeStream:
        """A new incremental detokenizer for one generated sequence."""
        return DetokenizeStream(self._tok, skip_special_tokens)

    # ----------------------------------------------------------------------- chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` with the model's chat template, like transformers' ``tokenize=False``.

        The template writes the BOS token itself when the model wants one: encode the
        result with ``add_bos=False``.  ``kwargs`` (e.g. ``tools``, ``enable_thinking``) are
        passed to the template and override the special-token variables.
        """
        template = self._compile()
        variables = _plain({"tools": None, "documents": None, **self.special_tokens, **kwargs})
        try:
            return render(template, messages=_chat_messages(messages), add_generation_prompt=add_generation_prompt,
                          **variables)
        except SecurityError as e:
            raise ChatTemplateError(f"chat template {self._template_source} refused: {one_line(e)}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # the template is foreign code: any failure is the template's
            raise ChatTemplateError(
                f"chat template {self._template_source} failed: {type(e).__name__}: {one_line(e)}"
            ) from None

    def check_chat_template(self) -> None:
        """Compile the chat template, if the model has one (ChatTemplateError if it is invalid)."""
        if self._chat_template is not None:
            self._compile()

    def _compile(self) -> jinja2.Template:
        if self._compiled is None:
            template = self._chat_template
            if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if "default" not in named:
                    raise ChatTemplateError(
                        f"chat template {self._template_source}: several templates {sorted(map(str, named))} "
                        "and none named 'default'"
                    )
                template = named["default"]
            if not isinstance(template, str):
                raise ChatTemplateError(
                    f"no chat template: {self._template_source} has none (and there is no chat_template.jinja)"
                )
            try:
                self._compiled = environment(self._template_source, ChatTemplateError).from_string(template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template {self._template_source} is invalid: {one_line(e)}") from None
            except (RecursionError, SyntaxError):  # jinja's parser recurses once per nested bracket
                raise ChatTemplateError(f"chat template {self._template_source} is nested too deeply to parse") from None
        return self._compiled


class DetokenizeStream:
    """Incremental detokenizer: ``push(id)`` returns the newly completed text ("" while a
    character is still split across tokens, e.g. the bytes of a multi-byte UTF-8 character)."""

    def __init__(self, tokenizer: _HFTokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


def _plain(value):
    """A fresh copy of ``value`` made of plain JSON-like types (anything else: "<TypeName>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):  # subclasses (enums, numpy scalars) may carry methods
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _chat_messages(messages) -> list[dict]:
    """Messages as transformers hands them to templates: None-valued keys dropped, reasoning
    under every name templates read it by."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
