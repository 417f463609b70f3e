"""The OpenAI API's request fields, checked, and its response and error objects.

Every check names the offending field and what it must be; `ApiError` carries the HTTP status and
the OpenAI error object (`{"error": {"message", "type", "param", "code"}}`).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from .plan import RowParams

MAX_STOPS = 16
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias",
               "response_format")
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class GenerationRequest:
    """A checked completion or chat completion request."""

    chat: bool
    prompt: list[int] | None  # token ids given directly (completions)
    text: str | None  # the prompt text (completions) or None
    messages: list[dict] | None
    max_tokens: int | None
    params: RowParams
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


def parse_json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(value).__name__}")
    return value


def _type_name(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, not {_type_name(value)}", param=name)
    if not (low < value if low_open else low <= value) or value > high:
        raise ApiError(400, f"'{name}' must lie in {'(' if low_open else '['}{low}, {high}], got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be an integer, not {_type_name(value)}", param=name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' holds {len(stops)} strings, at most {MAX_STOPS} are allowed", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "'stop' strings must not be empty", param="stop")
    return stops


def _prompt(body: dict, vocab_size: int) -> tuple[list[int] | None, str | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"'prompt' token ids must lie in [0, {vocab_size})", param="prompt")
        return list(prompt), None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "'prompt' holds several prompts; this server takes one prompt per request",
                       param="prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    raise ApiError(400, f"'prompt' must be a string or a non-empty array of token ids, not {_type_name(prompt)}",
                   param="prompt")


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"'messages[{index}].content' must be a string or an array of text parts",
                   param=f"messages[{index}].content")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of message objects", param="messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"'messages[{index}]' must be an object, not {_type_name(message)}",
                           param=f"messages[{index}]")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'messages[{index}].role' must be one of {', '.join(ROLES)}, got {role!r}",
                           param=f"messages[{index}].role")
        checked.append({"role": role, "content": _content(message, index)})
    return checked


def parse_request(body: dict, *, chat: bool, model_name: str, vocab_size: int) -> GenerationRequest:
    """Check the fields of a /v1/completions (chat False) or /v1/chat/completions body."""
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string" if model is None else
                       f"'model' must be a string, not {_type_name(model)}", param="model")
    if model != model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'{name}' must be at least 1, got {max_tokens}", param=name)
    top_k = _integer(body, "top_k")
    if top_k is not None and not -1 <= top_k <= vocab_size:
        raise ApiError(400, f"'top_k' must lie in [-1, {vocab_size}] (0 or -1: off), got {top_k}", param="top_k")
    seed = _integer(body, "seed")
    params = RowParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                       top_k=max(0, top_k or 0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                       seed=(seed if seed is not None else uuid.uuid4().int) % 2**31)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(400, f"'stream' must be a boolean, not {_type_name(stream)}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                       param="stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"'ignore_eos' must be a boolean, not {_type_name(ignore_eos)}", param="ignore_eos")
    prompt, text = (None, None) if chat else _prompt(body, vocab_size)
    return GenerationRequest(chat=chat, prompt=prompt, text=text, messages=_messages(body) if chat else None,
                             max_tokens=max_tokens, params=params, stop=_stops(body), stream=bool(stream),
                             include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos)


def check_context(prompt_tokens: int, max_tokens: int | None, max_seq_len: int, field: str) -> int:
    """The request's budget of new tokens: max_tokens, or what the context leaves; 400 when it does not fit."""
    if prompt_tokens >= max_seq_len:
        raise ApiError(400, f"this model's maximum context length is {max_seq_len} tokens, and the prompt has "
                       f"{prompt_tokens}, which leaves no room for a completion", param=field,
                       code="context_length_exceeded")
    if max_tokens is None:
        return max_seq_len - prompt_tokens
    if prompt_tokens + max_tokens > max_seq_len:
        raise ApiError(400, f"this model's maximum context length is {max_seq_len} tokens; you asked for "
                       f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} in the "
                       f"completion): lower max_tokens or shorten the prompt", param="max_tokens",
                       code="context_length_exceeded")
    return max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def completion_object(rid: str, model: str, chat: bool, text: str, finish_reason: str | None,
                      usage_counts: dict | None, created: int | None = None) -> dict:
    created = int(time.time()) if created is None else created
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": usage_counts}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage_counts}


def chunk_object(rid: str, model: str, chat: bool, created: int, text: str | None, finish_reason: str | None,
                 *, first: bool = False, usage_counts: dict | None = None) -> dict:
    """A streamed chunk: a text delta, the finish, or (usage given) the closing usage chunk."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunk = {"id": rid, "object": kind, "created": created, "model": model}
    if usage_counts is not None:
        return {**chunk, "choices": [], "usage": usage_counts}
    if chat:
        delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {**chunk, "choices": [choice]}
