"""OpenAI request bodies -> `Job`s (validated, one clear sentence per problem) and OpenAI-style error bodies."""

from __future__ import annotations

import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import RequestError
from ..sampling import LOGPROBS_MAX, PENALTY_LIMIT, SEED_LIMIT, SEED_MIN, SamplingParams, bias_pairs

MAX_STOP_STRINGS = 4
# the chat prompt of a tokenizer without a chat template (the shipped reference model has none)
FALLBACK_CHAT_LINE = "{role}: {content}\n"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
FALLBACK_CHAT_END = "assistant:"

# OpenAI parameters this server cannot honour, each with the values that ask for nothing (those pass); any other
# value is refused with a 400 naming it, so that no client believes it got what it asked for: features the engine
# does not have (suffix insertion, best_of ranking, tool calls, constrained output, audio). logprobs, top_logprobs,
# logit_bias and the penalties are honoured (`parse_common`, `parse_completion`, `parse_chat`).
NOT_HONOURED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("suffix", (None, "")), ("best_of", (None, 1)), ("tools", (None, [])), ("tool_choice", (None, "none", "auto")),
    ("functions", (None, [])), ("function_call", (None, "none", "auto")),
    ("response_format", (None, {"type": "text"})), ("modalities", (None, ["text"])), ("audio", (None,)),
    ("prediction", (None,)), ("store", (None, False)), ("service_tier", (None, "auto", "default")),
    ("reasoning_effort", (None,)), ("web_search_options", (None,)), ("verbosity", (None, "medium")),
    ("moderation", (None,)), ("parallel_tool_calls", (None, True, False)),  # about tool calls, refused anyway
    # vLLM's sampling extras, which its clients and benchmarks send: their neutral values pass
    ("min_p", (None, 0)), ("repetition_penalty", (None, 1)), ("min_tokens", (None, 0)), ("stop_token_ids", (None, [])),
    ("skip_special_tokens", (None, True)), ("chat_template_kwargs", (None, {})),
)
# labels of a request (what it is for, caching hints): any string, or an object, changing nothing
LABELS = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "prompt_cache_retention": str,
          "metadata": dict, "prompt_cache_options": dict}
# the parameters each endpoint reads (with NOT_HONOURED's names, the LABELS and chat's refused echo); any other name
# is refused with a 400 naming it, as OpenAI's API does ("Unrecognized request argument"), so that a client's
# sampling option is never silently dropped. top_k and ignore_eos are vLLM's, honoured.
COMMON_PARAMS = frozenset({
    "model", "n", "temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "stream",
    "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "logprobs",
    "top_logprobs", *LABELS, *(name for name, _ in NOT_HONOURED)})
COMPLETION_PARAMS = COMMON_PARAMS | {"prompt", "echo"}
CHAT_PARAMS = COMMON_PARAMS | {"messages", "echo"}
# a chat message's keys: role, content, name and a tool result's tool_call_id are read (and reach the template); an
# earlier answer's reasoning is dropped, as reasoning models' own templates drop it from the history; the others a
# client may echo back from an answer (OpenAI's clients serialise a returned message with these set to null) pass
# only empty
MESSAGE_KEYS = ("role", "content", "name", "tool_call_id")
MESSAGE_DROPPED_KEYS = ("reasoning_content", "reasoning")
MESSAGE_ECHOED_KEYS = ("refusal", "tool_calls", "function_call", "audio", "annotations")


# an error's `code` where the raiser names none: OpenAI's clients read a string or null there, never a number
CODES = {404: "not_found", 405: "method_not_allowed", 429: "rate_limit_exceeded", 500: "internal_error",
         503: "service_unavailable"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = CODES.get(status) if code is None else code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server, known when it starts."""

    model: str  # the model id clients send
    context: int  # the engine's max_seq_len: prompt, new tokens and `reserve` must fit in it
    reserve: int = 2  # positions the decode step writes beyond the prompt and the new tokens (shadow, drafts)
    max_token_chars: int | None = None  # the longest vocabulary entry: no token covers more characters
    default_max_tokens: int = 256
    vocab: int | None = None  # token ids a logit_bias may name are below it

    @property
    def max_prompt_chars(self) -> int | None:
        # every token covers at most max_token_chars characters, so a longer text cannot fit the context whatever
        # it tokenises to: refused before the tokenizer spends seconds on it
        return None if self.max_token_chars is None else self.context * self.max_token_chars

    @property
    def largest_body(self) -> int:
        """Bytes no request this server could accept exceeds (a longer body is refused unread, however high
        --max-body-bytes is: decoding tens of MB of JSON holds the interpreter for seconds, which stalls every stream):
        a prompt within the context (text at up to 12 JSON bytes a character, a \\uXXXX pair; token ids at up to 12
        bytes each) and as much again for each stop string, 64 bytes of each message's framing per context position,
        a logit_bias over the whole vocabulary (an entry like `"151935": -0.5488135039273248, ` at up to 40 bytes),
        and a MiB for every other field."""
        chars = max(self.max_prompt_chars or 0, self.context)
        return 12 * chars * (1 + MAX_STOP_STRINGS) + 64 * self.context + 40 * (self.vocab or 0) + (1 << 20)

    def check_chars(self, chars: int, param: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise APIError(400, f"{param}: {chars} characters, more than this server's context of "
                                f"max_seq_len={self.context} tokens can hold", param)


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
    echo: str = ""  # completions' echo: the prompt's text, sent before the completion
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat.completion" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"


def decode_body(raw: bytes) -> Any:
    """The request body's bytes -> its JSON value (400 for what is not JSON, or nests too deep to parse)."""
    try:
        # strict: UTF-8-encoded surrogates are refused here too. A leading byte-order mark is dropped: RFC 8259 lets a
        # parser ignore one, and clients on Windows (PowerShell's UTF-8 files) send it
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise APIError(400, "the request body is not valid JSON") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise APIError(400, "the request body holds a number too long to parse") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply to parse") from None


def _text(value: str, param: str) -> str:
    """A string the tokenizer can take: JSON's \\ud800 escapes can smuggle lone surrogates, which are not text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                            "not valid Unicode text", param) from None
    return value


def shown(value: Any, limit: int = 40) -> str:
    """A client's value as JSON writes it ("0.5" a string, true a flag), cut to `limit` characters: an error
    sentence quotes what was sent, not Python's spelling of it."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except RecursionError:  # nested nearly as deep as the decoder allows
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def refuse_unknown(body: dict[str, Any], known: frozenset[str], endpoint: str) -> None:
    """400 naming the first parameter this endpoint does not read (`COMPLETION_PARAMS`, `CHAT_PARAMS`)."""
    for name in body:
        if name not in known:
            raise APIError(400, f"{shown(name, 60)} is not a parameter of {endpoint} on this server (it reads "
                                "OpenAI's parameters and top_k and ignore_eos); leave it out", name[:60])


def _same(value: Any, allowed: Any) -> bool:
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    if isinstance(allowed, (int, float)):  # 0 and 0.0 alike, but not false
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == allowed
    return type(value) is type(allowed) and value == allowed


def refuse_not_honoured(body: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    """400 for a parameter this server would otherwise silently ignore (`NOT_HONOURED`; `extra`: refused unless
    absent, null or false)."""
    for name, allowed in (*NOT_HONOURED, *((n, (None, False)) for n in extra)):
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise APIError(400, f"{name} is not supported by this server; leave it out", name)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float (JSON allows 10**400)
        return False


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    """A number in [low, high] (in (low, high] with `low_open`)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise APIError(400, f"{name} must be a number, got {shown(value)}", name)
    if not (low < value if low_open else low <= value) or value > high:
        raise APIError(400, f"{name} must lie in {'(' if low_open else '['}{low:g}, {high:g}], got {shown(value)}",
                       name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        wanted = f">= {low}" if high is None else f"in [{low}, {high})"
        raise APIError(400, f"{name} must be an integer {wanted}, got {shown(value)}", name)
    return value


def _stop(body: dict[str, Any], limits: Limits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    for s in stops:  # a stop string longer than any text the context can hold never matches
        limits.check_chars(len(s), "stop")
    return [_text(s, "stop") for s in stops]


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {shown(value)}", name)
    return value


def parse_common(body: Any, limits: Limits, known: frozenset[str], endpoint: str) -> dict[str, Any]:
    """The parameters completions and chat completions share (`known`: every parameter `endpoint` reads)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    refuse_unknown(body, known, endpoint)
    for name, kind in LABELS.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise APIError(400, f"{name} must be {'a string' if kind is str else 'an object'}, got "
                                f"{shown(body[name])}", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {shown(model)}", "model")
    if model is not None and model != limits.model:
        raise APIError(404, f"model {model!r} is not served here; this server serves {limits.model!r}", "model",
                       "not_found_error", code="model_not_found")
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)  # a nucleus of no mass keeps nothing
    top_k = _integer(body, "top_k", 0, 0)
    seed = _integer(body, "seed", None, SEED_MIN, SEED_LIMIT)
    max_tokens = _integer(body, "max_tokens", None, 1)
    newer = _integer(body, "max_completion_tokens", None, 1)  # OpenAI's newer name for the same bound
    if max_tokens is not None and newer is not None and newer != max_tokens:
        raise APIError(400, f"max_tokens ({max_tokens}) and max_completion_tokens ({newer}) differ; give one of "
                            "them", "max_completion_tokens")
    max_tokens = max_tokens or newer or limits.default_max_tokens
    stream, ignore_eos = _flag(body, "stream"), _flag(body, "ignore_eos")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if body.get("stream_options") is not None and not stream:  # as OpenAI: the options of a stream
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if seed is None:  # as engine.generate: a fresh seed, so that unseeded requests differ
        seed = secrets.randbits(62)
    sampling = SamplingParams(temperature=temperature, top_k=top_k or 0, top_p=top_p, seed=seed,
                              presence_penalty=_number(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
                              frequency_penalty=_number(body, "frequency_penalty", 0.0, -PENALTY_LIMIT,
                                                        PENALTY_LIMIT))
    try:
        sampling = replace(sampling, logit_bias=bias_pairs(body.get("logit_bias")))
        sampling.validate(limits.vocab)
    except RequestError as exc:  # the logit_bias's keys or values (every other field is checked above)
        raise APIError(400, str(exc), "logit_bias") from None
    return dict(max_tokens=max_tokens, stream=stream, stop=_stop(body, limits), ignore_eos=ignore_eos,
                include_usage=bool(options.get("include_usage", False)), sampling=sampling)


def _with_logprobs(common: dict[str, Any], count: int | None) -> dict[str, Any]:
    common["sampling"] = replace(common["sampling"], logprobs=count)
    return common


def _job(kind: str, ids: list[int], common: dict[str, Any], limits: Limits, param: str, **extra: Any) -> Job:
    """The job, its max_tokens clamped to the room the prompt leaves in the context (400 when it leaves none)."""
    room = limits.context - limits.reserve - len(ids)
    if room < 1:
        raise APIError(400, f"{param}: {len(ids)} tokens, which leaves no room for new tokens in this "
                            f"server's context of max_seq_len={limits.context}", param)
    common["max_tokens"] = min(common["max_tokens"], room)
    return Job(kind=kind, prompt_ids=ids, **common, **extra)


def parse_completion(body: Any, tokenizer, limits: Limits) -> Job:
    common = parse_common(body, limits, COMPLETION_PARAMS, "/v1/completions")
    refuse_not_honoured(body)
    if "top_logprobs" in body and not any(_same(body["top_logprobs"], v) for v in (None, False, 0)):
        # chat's parameter; completions' logprobs is the count
        raise APIError(400, "top_logprobs is not supported by /v1/completions, whose logprobs is the count of "
                            "alternatives; leave it out", "top_logprobs")
    logprobs = None if body.get("logprobs") is False else _integer(body, "logprobs", None, 0, LOGPROBS_MAX + 1)
    _with_logprobs(common, logprobs)
    echo = _flag(body, "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        _text(prompt, "prompt")
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        limits.check_chars(len(prompt), "prompt")
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    elif isinstance(prompt, list) and len(prompt) > limits.context and isinstance(prompt[0], int):  # before each id
        raise APIError(400, f"the prompt has {len(prompt)} token ids, more than this server's context of "
                            f"max_seq_len={limits.context} tokens", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise APIError(400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt)", "prompt")
    if echo and logprobs is not None:
        raise APIError(400, "echo with logprobs would return the prompt's log-probabilities too, which this server "
                            "does not compute: ask for one or the other", "echo")
    if echo and not isinstance(prompt, str) and tokenizer is None:
        raise APIError(400, "echo needs a tokenizer to turn the prompt's token ids into text", "echo")
    text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=True)) if echo else ""
    return _job("text_completion", ids, common, limits, "prompt", echo=text)


def _content(content: Any, index: int, role: str) -> str:
    """A message's content: a string, or a list of text parts (joined by newlines, as vLLM does); an assistant's
    may be null (OpenAI's own clients send that for a turn that called tools), which is empty text."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return _text(content, param)
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list) or not content:
        raise APIError(400, f"{param} must be a string or a non-empty list of {{\"type\": \"text\", \"text\": ...}} "
                            "parts", param)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}] is a text part without a \"text\" string", param)
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}[{j}] is a {kind!r} part; this model takes only text parts "
                                "({\"type\": \"text\", \"text\": ...})", param)
        texts.append(_text(part["text"], f"{param}[{j}].text"))
    return "\n".join(texts)


def _messages(messages: Any, limits: Limits) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits.context:  # each message takes a token at least: refused before any is read
        raise APIError(400, f"messages: {len(messages)} messages, more than this server's context of "
                            f"max_seq_len={limits.context} tokens can hold", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: dict[str, Any], index: int) -> dict[str, str]:
    """A message as the chat template takes it: role, content as text, and name where given."""
    if message["role"] not in CHAT_ROLES:
        raise APIError(400, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got "
                            f"{shown(message['role'])}", f"messages[{index}].role")
    for key, value in message.items():
        if key not in MESSAGE_KEYS + MESSAGE_DROPPED_KEYS and (key not in MESSAGE_ECHOED_KEYS
                                                               or value not in (None, "", [], {})):
            raise APIError(400, f"messages[{index}] has {shown(key, 60)}, which this server does not read (a "
                                "message is role, content, name and a tool result's tool_call_id); leave it out",
                           f"messages[{index}]")
    out = {"role": message["role"], "content": _content(message.get("content"), index, message["role"])}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            if not isinstance(message[key], str) or not message[key]:
                raise APIError(400, f"messages[{index}].{key} must be a non-empty string, got "
                                    f"{shown(message[key])}", f"messages[{index}].{key}")
            out[key] = _text(message[key], f"messages[{index}].{key}")
    return out


def fallback_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The chat prompt of a tokenizer without a template: one "role: content" line per message ("role (name):
    content" for a named participant), then "assistant:"."""
    return "".join(FALLBACK_CHAT_LINE.format(role=f"{m['role']} ({m['name']})" if "name" in m else m["role"],
                                             content=m["content"]) for m in messages) + FALLBACK_CHAT_END


def parse_chat(body: Any, tokenizer, limits: Limits) -> Job:
    common = parse_common(body, limits, CHAT_PARAMS, "/v1/chat/completions")
    refuse_not_honoured(body, extra=("echo",))  # echo is a completions parameter; chat has none
    wanted, top = _flag(body, "logprobs"), _integer(body, "top_logprobs", None, 0, LOGPROBS_MAX + 1)
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    _with_logprobs(common, (top or 0) if wanted else None)
    messages = _messages(body.get("messages"), limits)
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
    limits.check_chars(sum(len(m["content"]) + len(m.get("name", "")) for m in messages), "messages")
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer(fallback_chat_prompt(messages), add_special_tokens=True)["input_ids"]
    else:
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template can reject roles or orders
            raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding, from tokenizers that return one
            ids = ids["input_ids"]
    return _job("chat.completion", list(ids), common, limits, "messages")
