"""The OpenAI wire format: request bodies checked into a ``Request``, errors as OpenAI error bodies.

Fields a client may send that graft_tk does not use (``user``, ``stream_options``,
``frequency_penalty`` at its default, ...) are ignored, as OpenAI-compatible servers do; a field
graft_tk reads with the wrong type or out of range is a 400 naming the field; a feature it does
not offer (``n`` > 1, ``logprobs``, ``echo``) is a 400 saying so, never silently dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOP_STRINGS = 4           # OpenAI's limit
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}   # completions: OpenAI's default; chat: room for an answer


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """One generation request, checked: what the scheduler decodes and how the answer is shaped."""
    kind: str                          # "completion" | "chat"
    model: str
    prompt: str | tuple[int, ...] | tuple[dict, ...]   # text, token ids, or chat messages
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", param=param)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    x = body.get(name, default)
    if x is None:
        return default
    # an int too large for a float (JSON has no limit) is compared exactly, never converted first
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and not math.isfinite(x)):
        raise _bad(name, f"expected a number, got {x!r}")
    if x > hi or x < lo or (lo_open and x == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {x}")
    return float(x)


INT64 = (-2 ** 63, 2 ** 63 - 1)   # OpenAI's integer fields are int64; a larger one would overflow a tensor


def _int(body: dict, name: str, default: int | None) -> int | None:
    x = body.get(name, default)
    if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
        raise _bad(name, f"expected an integer, got {x!r}")
    if x is not None and not INT64[0] <= x <= INT64[1]:
        raise _bad(name, f"must be a 64-bit integer in [{INT64[0]}, {INT64[1]}], got {x}")
    return x


UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias")


def _unsupported(body: dict) -> None:
    for name in ("n", "best_of"):
        if _int(body, name, 1) not in (1, None):           # null is OpenAI's "default"
            raise _bad(name, "only 1 is supported (one choice per request)")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise _bad(name, "is not supported by graft-serve")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(name, "is not supported by graft-serve (it would change the output distribution)")


def _encodable(param: str, text: str) -> str:
    """``text`` if it is valid Unicode; JSON's \\ud800-style escapes can smuggle in lone surrogates,
    which no tokenizer (and no UTF-8 answer echoing them) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(param, f"is not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


def _prompt(body: dict, kind: str):
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "expected a non-empty list of {role, content} objects")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _bad(f"messages[{i}]", "expected an object with a string 'role' and a string 'content'")
            out.append({"role": _encodable(f"messages[{i}].role", m["role"]),
                        "content": _encodable(f"messages[{i}].content", m["content"])})
        if not any(m["content"].strip() for m in out):
            raise _bad("messages", "every message is empty")
        return tuple(out)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]                              # a batch of one text
    if isinstance(prompt, str):
        _encodable("prompt", prompt)
        if not prompt.strip():
            raise _bad("prompt", "is empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "a batch of several prompts is not supported; send one request per prompt")
    raise _bad("prompt", "expected a non-empty string or a list of token ids")


def parse_request(body, kind: str) -> Request:
    """A decoded JSON body -> a checked Request (``kind``: "completion" or "chat"), else APIError 400."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "expected the model's name (GET /v1/models lists it)")
    _encodable("model", model)
    _unsupported(body)
    prompt = _prompt(body, kind)
    max_tokens = _int(body, "max_tokens", None)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None)
    max_tokens = DEFAULT_MAX_TOKENS[kind] if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise _bad("max_tokens", f"must be >= 1, got {max_tokens}")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if (not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"expected a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected true or false, got {stream!r}")
    return Request(kind=kind, model=model, prompt=prompt, max_tokens=max_tokens,
                   temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                   top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                   seed=_int(body, "seed", None), stop=tuple(stop), stream=stream)
