"""Log-probabilities in OpenAI's two shapes: completions' parallel lists (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat's `content` entries (`token`, `logprob`, `bytes`, `top_logprobs`).

A token's text is the tokenizer's decoding of that token alone (a byte-level token that holds part of a character
decodes to U+FFFD; `bytes` then carries what the decoding gave, as text). Without a tokenizer a token is named
`token_id:N`, as vLLM names it.
"""

from __future__ import annotations

from typing import Any

from ..sampling import TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(entries: list[TokenLogprob], tokenizer: Any, offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs object for these tokens; `offset`: characters of the choice's text before the first
    (the echoed prompt, or the tokens of earlier stream chunks)."""
    tokens = [token_text(tokenizer, e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(tokenizer, t): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """Chat's logprobs object for these tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
                        for e in entries], "refusal": None}
