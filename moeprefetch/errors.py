"""Error types. Every error the engine raises on bad input is one of these, with a one-sentence message
that names what is wrong, so the CLI can print it without a traceback."""

from __future__ import annotations


class MoEPrefetchError(Exception):
    """Base class of every error raised deliberately by moeprefetch."""


class CheckpointError(MoEPrefetchError, ValueError):
    """The checkpoint directory, its config, its tokenizer or one of its tensors is missing or malformed."""


class RequestError(MoEPrefetchError, ValueError):
    """A generate/forward request or an engine option is invalid; the engine stays usable."""


class ResourceError(MoEPrefetchError, RuntimeError):
    """The machine lacks what the request needs: host RAM, VRAM or a CUDA device."""
