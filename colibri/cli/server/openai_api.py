"""OpenAI's completion and chat-completion requests and responses, checked and shaped.

A request body becomes a `Job` (token ids, sampling, streaming) or an `APIError` with the
status and the error object OpenAI's API returns for it; responses and stream chunks are
built in OpenAI's format (`id`, `object`, `created`, `model`, `choices`, `usage`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from colibri.formats.safe_json import is_int

MAX_STOP_STRINGS = 4  # as OpenAI
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    chat: bool
    prompt: list[int]
    sampling: dict
    stream: bool
    include_usage: bool
    id: str
    created: int


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise APIError(400, f"'{name}' must be a number", name)
    if value < low or value > high or (low_open and value == low):
        raise APIError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}]", name)
    return float(value)


def _integer(body: dict, name: str, default, low: int):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < low:
        raise APIError(400, f"'{name}' must be an integer >= {low}", name)
    return value


def sampling_of(body: dict, ctx: int, prompt_tokens: int, default_max_tokens: int | None) -> dict:
    """The scheduler's parameters of an OpenAI body (`temperature` defaults to 1, as OpenAI)."""
    if body.get("n", 1) != 1:
        raise APIError(400, "only n = 1 is supported", "n")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    room = ctx - prompt_tokens
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise APIError(400, "'seed' must be an integer", "seed")
    return {"max_tokens": min(max_tokens or default_max_tokens or room, room) if room > 0 else 1,
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
            "top_k": _integer(body, "top_k", 0, 0),
            "min_p": _number(body, "min_p", 0.0, 0.0, 0.999),
            "seed": seed, "stop": stop}


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required", "model")
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{served}')", "model",
                       "model_not_found")


def messages_of(body: dict) -> list[dict]:
    """Chat messages with string contents (text parts joined), checked."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, (str, type(None))):
            raise APIError(400, f"messages[{i}].content must be a string or text parts", f"messages[{i}].content")
        out.append({"role": message["role"], "content": content or ""})
    return out


def prompt_of(body: dict):
    """A completion's prompt: a string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")


def make_job(body: dict, chat: bool, model, served: str) -> Job:
    """Check `body` against the model and turn it into a job (tokenizing: call off the event loop)."""
    from colibri.runtime.engine import PromptError
    from colibri.runtime.kv_cache import ContextOverflow
    from colibri.runtime.text import TokenizerError

    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, served)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    source = messages_of(body) if chat else prompt_of(body)
    try:
        ids = model.checked_ids(source if isinstance(source, list) and source and is_int(source[0])
                                else model.prompt_ids(source))
    except ContextOverflow as e:
        raise APIError(400, f"This model's maximum context length is {model.ctx} tokens: {e}", "messages" if chat else "prompt",
                       "context_length_exceeded") from None
    except (PromptError, TokenizerError) as e:
        raise APIError(400, str(e), "messages" if chat else "prompt") from None
    sampling = sampling_of(body, model.ctx, len(ids), None if chat else 16)
    prefix = "chatcmpl" if chat else "cmpl"
    return Job(chat, ids, sampling, stream, bool(options.get("include_usage")), f"{prefix}-{uuid.uuid4().hex[:24]}",
               int(time.time()))


def usage(job: Job, completion_tokens: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt) + completion_tokens}


def response(job: Job, served: str, text: str, finish_reason: str, completion_tokens: int) -> dict:
    reason = FINISH_REASONS[finish_reason]
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
            "model": served, "choices": [choice], "usage": usage(job, completion_tokens)}


def chunk(job: Job, served: str, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
    """One streamed piece; `text` None with `first` opens a chat stream with the role."""
    reason = FINISH_REASONS[finish_reason] if finish_reason else None
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
            "model": served, "choices": [choice]}


def usage_chunk(job: Job, served: str, completion_tokens: int) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
            "model": served, "choices": [], "usage": usage(job, completion_tokens)}
