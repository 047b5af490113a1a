"""The OpenAI wire format: request validation, response and stream-chunk objects, error objects.

Every field is checked here, before tokenizing or touching the model, and every problem becomes an
:class:`APIError` with OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and the
status a client expects, so user input never reaches the server as a 500.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m2r2.decoding.base import GenerationConfig, trim_stop_text

#: Token budget when a request names none (OpenAI's own default is "until the context ends").
DEFAULT_MAX_TOKENS = 256
#: OpenAI accepts at most this many stop sequences.
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant")
#: Fields m2r2 cannot honour; a request that sets them gets a 400 rather than a silently different answer.
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "echo", "suffix", "best_of")


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ParsedRequest:
    """A validated request: what to generate and how to answer."""

    model: str
    gen: GenerationConfig
    stream: bool
    include_usage: bool
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text or token ids


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad(key, f"{key} must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(key, f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"{key} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise bad(key, f"{key} must be >= {lo}, got {v}")
    return v


def _common(body: dict[str, Any], served: list[str]) -> tuple[str, GenerationConfig, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required (a string; see GET /v1/models)", "missing_required_parameter")
    if model not in served:
        raise APIError(404, f"the model {model!r} does not exist; this server has {', '.join(served)}",
                       param="model", code="model_not_found")  # fmt: skip
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, [], {}):
            raise bad(key, f"{key} is not supported by m2r2 serve", "unsupported_parameter")
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise bad(key, f"{key} other than 0 is not supported by m2r2 serve", "unsupported_parameter")
    if _int(body, "n", 1) not in (None, 1):
        raise bad("n", "n must be 1 (one choice per request)", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", "only response_format {'type': 'text'} is supported", "unsupported_parameter")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
    seed = _int(body, "seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad("seed", f"seed must fit in 64 bits, got {seed}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be true or false, got {stream!r}")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise bad("stream_options", "stream_options must be an object like {'include_usage': true}")
    gen = GenerationConfig(
        max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        stop=stop,
    )
    return model, gen, stream, bool(opts and opts.get("include_usage"))


def _content(m: dict[str, Any], i: int) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
    ):
        return "".join(p["text"] for p in c)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def parse_chat(body: Any, served: list[str]) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model, gen, stream, usage = _common(body, served)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list", "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}] needs a role among {', '.join(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise bad("messages", "messages need at least one non-empty user message")
    return ParsedRequest(model, gen, stream, usage, messages=out)


def parse_completion(body: Any, served: list[str], vocab_size: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model, gen, stream, usage = _common(body, served)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise bad("prompt", f"prompt token ids must be in 0..{vocab_size - 1}")
        return ParsedRequest(model, gen, stream, usage, prompt=p)
    if not isinstance(p, str) or not p:
        raise bad("prompt", "prompt must be a non-empty string (or one list of token ids); batches are not supported")
    return ParsedRequest(model, gen, stream, usage, prompt=p)


def context_error(prompt_tokens: int, context: int) -> APIError:
    return bad(
        "messages",
        f"this model's maximum context length is {context} tokens; the prompt has {prompt_tokens} tokens "
        "and leaves no room for an answer",
        "context_length_exceeded",
    )


#: Stopper reasons -> OpenAI finish_reason.
FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length"}


class TextStream:
    """Token ids in, text deltas out: whole characters only, never past a stop string.

    The whole answer is decoded each time (multi-token characters and joining spaces come out
    right); a trailing replacement character waits for its next token, and with stop strings the
    last ``len(longest stop) - 1`` characters wait until it is clear they do not start one. Used for
    non-streamed answers too, so both give exactly the same text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # sent so far

    def feed(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        full = self.decode(self.ids)
        cut = trim_stop_text(full, self.stop) if self.stop else full
        end = len(cut)
        if not final and end == len(full):
            end -= self.hold
            while end > 0 and full[end - 1] == "\ufffd":
                end -= 1
        if end <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text) : end]
        self.text += delta
        return delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    rid: str, model: str, chat: bool, text: str, finish: str, use: dict[str, int], stats: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``chat.completion`` or ``text_completion`` object; m2r2's statistics under ``m2r2``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "m2r2": stats,
    }


def chunk(
    rid: str,
    model: str,
    chat: bool,
    delta: dict[str, Any] | str | None,
    finish: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk: a delta (chat: ``{"content": ...}``, completions: text), or usage alone (``delta`` None)."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        c["delta" if chat else "text"] = delta
        choices.append(c)
    out = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    return {**out, **(extra or {})}
