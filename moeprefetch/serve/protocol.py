"""OpenAI request bodies -> `Job`s (validated, one clear sentence per problem) and OpenAI-style error bodies."""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Job:
    """One request as the scheduler runs it."""

    kind: str  # "text_completion" | "chat.completion"
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    ignore_eos: bool = False  # an extension (as vLLM's): generate max_tokens whatever the model ends with
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat.completion" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"{name} must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise APIError(400, f"{name} must lie in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise APIError(400, f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return stops


def parse_common(body: Any, served_model: str, default_max_tokens: int) -> dict[str, Any]:
    """The parameters completions and chat completions share."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise APIError(404, f"model {model!r} is not served here; this server serves {served_model!r}", "model",
                       "not_found_error")
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise APIError(400, "top_p must be greater than 0", "top_p")
    top_k = _integer(body, "top_k", 0, 0)
    seed = _integer(body, "seed", None, -(2**63))
    max_tokens = _integer(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", default_max_tokens, 1)
    stream, ignore_eos = body.get("stream", False), body.get("ignore_eos", False)
    for name, value in (("stream", stream), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise APIError(400, f"{name} must be true or false, got {value!r}", name)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if seed is None:  # as engine.generate: a fresh seed, so that unseeded requests differ
        seed = secrets.randbits(62)
    return dict(max_tokens=max_tokens, stream=stream, stop=_stop(body), ignore_eos=ignore_eos,
                include_usage=bool(options.get("include_usage", False)),
                sampling=SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=top_p, seed=seed))


def parse_completion(body: Any, tokenizer, served_model: str, default_max_tokens: int) -> Job:
    common = parse_common(body, served_model, default_max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt)", "prompt")
    return Job(kind="text_completion", prompt_ids=ids, **common)


def parse_chat(body: Any, tokenizer, served_model: str, default_max_tokens: int) -> Job:
    common = parse_common(body, served_model, default_max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects with string content",
                       "messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                            add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template can reject roles or orders
        raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from None
    if hasattr(ids, "keys"):  # a BatchEncoding, from tokenizers that return one
        ids = ids["input_ids"]
    return Job(kind="chat.completion", prompt_ids=list(ids), **common)
