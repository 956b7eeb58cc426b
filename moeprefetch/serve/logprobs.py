"""Log-probabilities in OpenAI's two shapes: completions' parallel lists (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat's `content` entries (`token`, `logprob`, `bytes`, `top_logprobs`).

A token's text is the tokenizer's decoding of that token alone; a byte-level token that holds part of a character
decodes to U+FFFD, and its `bytes` are then the token's own bytes (what OpenAI's field is for: joined, a
character's tokens give its UTF-8). Without a tokenizer a token is named `token_id:N`, as vLLM names it. Offsets
come from the scheduler, which knows how many characters of the choice's text came before each token.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from ..sampling import TokenLogprob


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode) inverted: each of its 256 characters -> its byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_text(tokenizer: Any, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """The token's bytes: its text's UTF-8, or, when the token holds part of a character, the bytes its vocabulary
    entry stands for (byte-level BPE's alphabet, or a `<0xNN>` byte token)."""
    text = token_text(tokenizer, token)
    if tokenizer is None or "\ufffd" not in text:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if byte:
            return [int(byte.group(1), 16)]
        alphabet = _byte_of_char()
        if piece and all(ch in alphabet for ch in piece):
            return [alphabet[ch] for ch in piece]
    return list(text.encode("utf-8"))


def completion_logprobs(entries: list[TokenLogprob], offsets: list[int], tokenizer: Any) -> dict[str, Any]:
    """Completions' logprobs object for these tokens, each at its character offset in the choice's text. Each
    `top_logprobs` holds the most likely tokens and the chosen one (OpenAI's: up to logprobs + 1 entries)."""
    def top(e: TokenLogprob) -> dict[str, float]:
        return {**{token_text(tokenizer, t): v for t, v in e.top}, token_text(tokenizer, e.token): e.logprob}

    return {"tokens": [token_text(tokenizer, e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": list(offsets)}


def chat_logprobs(entries: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """Chat's logprobs object for these tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": token_bytes(tokenizer, token)}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}
