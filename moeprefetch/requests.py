"""Requests: every argument of a generate/stream/forward call checked and turned into a `Request`, before any state
changes, so a bad request raises one clear `RequestError` and the engine serves the next one normally."""

from __future__ import annotations

import logging
import numbers
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .build import ResolvedConfig, predictor_spec
from .predictors import PredictorSpec, default_lookahead
from .options import check_fraction, check_positive_int
from .config import ModelArgs
from .errors import RequestError
from .sampling import SamplingParams, bias_pairs
from .session import Request

logger = logging.getLogger(__name__)

SPECULATIVE_MODES = (None, "mtp", "auto")


class SpeculationUnavailable(NamedTuple):
    """Why a call cannot verify MTP drafts: `reason` for speculative="auto"'s report, `error` for "mtp"'s refusal."""

    reason: str
    error: str


def speculation_unavailable(has_mtp: bool, routing_trace: Any, spec: PredictorSpec,
                            sampling: SamplingParams | None = None) -> SpeculationUnavailable | None:
    """The one list of conditions under which speculative decoding cannot run (None: it can)."""
    if not has_mtp:
        return SpeculationUnavailable("no MTP layer in this checkpoint",
                                      "speculative='mtp' needs an MTP layer, and this checkpoint has none")
    if routing_trace is not None:
        return SpeculationUnavailable(
            "routing_trace routes one token per step",
            "routing_trace forces the routing of each decode step from a trace; speculative decoding computes two "
            "tokens per step, which the trace cannot route: use one or the other")
    if spec.chain > 1:
        return SpeculationUnavailable(
            f"lookahead={spec.lookahead} chains MTP drafts for prefetching",
            f"lookahead={spec.lookahead} chains MTP drafts for prefetching, but with speculative='mtp' the MTP head "
            "verifies one draft per step: use lookahead=1")
    if sampling is not None and sampling.penalises:
        return SpeculationUnavailable(
            "presence/frequency penalties count each token before the next is drawn",
            "presence_penalty and frequency_penalty count each generated token before the next one is drawn, but "
            "speculative='mtp' draws the token after each draft in the same step: use one or the other")
    return None


def unused_learned_options(options: ResolvedConfig, spec: PredictorSpec) -> str | None:
    """Why the engine's bypass / reuse_weight do nothing under this predictor (they act on the learned head's
    predictions, which only 'learned' and its combinations run), or None when they act or are off."""
    if not (options.bypass or options.reuse_weight) or spec.learned:
        return None
    names = " and ".join(n for n, on in (("bypass", options.bypass), ("reuse_weight", options.reuse_weight)) if on)
    return (f"{names} act{'s' if ' and ' not in names else ''} on the learned routing head's predictions, and "
            f"predictor {'+'.join(spec.names)!r} does not run it")


def build_request(args: ModelArgs, tokenizer: Any, options: ResolvedConfig, path: Path, has_mtp: bool, prompts: Any,
                  max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, predictor: Any,
                  lookahead: Any, speculative: Any, stop_at_eos: bool, event_log: Any,
                  min_confidence: Any = None, learned: Any = None, logit_bias: Any = None,
                  presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0, logprobs: Any = None) -> Request:
    """A generate/stream call's arguments, checked against the model and the engine's options."""
    if min_confidence is None:
        min_confidence = options.min_confidence
    check_fraction("min_confidence", min_confidence, upper_open=False)
    if event_log is not None:
        if not isinstance(event_log, (str, Path)) or not str(event_log):
            raise RequestError(f"event_log must be the path of a JSON-lines file, got {event_log!r}")
        target = Path(event_log).expanduser().resolve()
        if target.is_dir():
            raise RequestError(f"event_log {event_log!r} is a directory; give a file name (events.jsonl)")
        parent = target.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise RequestError(f"event_log {event_log!r} cannot be written: {parent} is not a writable directory")
    token_prompts = tokenize(prompts, tokenizer, args, path)
    check_positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(stop_at_eos, bool):  # "no" would be true
        raise RequestError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    sampling = SamplingParams(temperature, top_k, top_p, seed, bias_pairs(logit_bias), presence_penalty,
                              frequency_penalty, logprobs)
    sampling.validate(args.vocab_size)
    name = predictor if predictor is not None else options.predictor
    spec = predictor_spec(name, default_lookahead(name, options.lookahead) if lookahead is None else lookahead,
                          has_mtp, learned, len(args.moe_layers))
    if speculative not in SPECULATIVE_MODES:
        raise RequestError(f"speculative must be None, 'mtp' or 'auto', got {speculative!r}")
    if speculative == "mtp" and (why := speculation_unavailable(has_mtp, options.routing_trace, spec,
                                                                sampling)) is not None:
        raise RequestError(why.error)
    if len(token_prompts) > options.max_batch_size:
        raise RequestError(f"{len(token_prompts)} prompts exceed max_batch_size={options.max_batch_size} "
                           f"set at load time")
    for i, prompt in enumerate(token_prompts):
        if len(prompt) > args.max_position_embeddings:
            raise RequestError(f"prompt {i} has {len(prompt)} tokens, more than the model's "
                               f"{args.max_position_embeddings} positions")
        # the decode step writes the shadow/draft rows up to draft_tokens positions ahead, kept drafts as many more,
        # and chained MTP drafts (lookahead k, or draft_tokens d from the last row kept) k - 1 (d - 1) more
        def needed(reach: int) -> int:
            return len(prompt) + max_new_tokens + 1 + max(reach, spec.chain)

        plain = needed(1)
        if plain > options.max_seq_len:
            raise RequestError(f"prompt {i} ({len(prompt)} tokens) plus max_new_tokens={max_new_tokens} needs "
                               f"{plain} positions (the decode step writes {plain - len(prompt) - max_new_tokens} "
                               f"beyond them), more than max_seq_len={options.max_seq_len}")
        drafted = needed(2 * options.draft_tokens - 1)
        if speculative in ("mtp", "auto") and drafted > options.max_seq_len:
            # what plain decode serves, speculation serves too: this call decodes plainly (same tokens)
            logger.log(logging.WARNING if speculative == "mtp" else logging.INFO,
                       "speculation off for this call: prompt %d's draft rows (draft_tokens=%d) need %d positions, "
                       "more than max_seq_len=%d; it decodes plainly", i, options.draft_tokens, drafted,
                       options.max_seq_len)
            speculative = None
    return Request(token_prompts, max_new_tokens, sampling, spec, speculative, stop_at_eos, event_log,
                   float(min_confidence))


def is_token_id(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool (numpy's bool is no Integral)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_numpy_array(value: Any) -> bool:
    """A numpy array (numpy is not a dependency, so not imported to ask)."""
    return type(value).__module__ == "numpy" and hasattr(value, "ndim") and hasattr(value, "tolist")


def tokenize(prompts: Any, tokenizer: Any, args: ModelArgs, path: Path) -> list[list[int]]:
    """Prompts in any accepted form -> token-id lists, checked against the vocabulary."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, torch.Tensor) or is_numpy_array(prompts):
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise RequestError("prompts must be a string, a non-empty list of strings or a list of token-id lists")
    if all(is_token_id(p) for p in prompts):
        prompts = [list(prompts)]
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError(
                    f"prompt {i} is text but {path} has no tokenizer (no tokenizer.json); pass token ids")
            ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"]) if prompt else []
        elif (isinstance(prompt, (list, tuple)) or is_numpy_array(prompt)) and all(is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise RequestError(f"prompt {i} must be a string or a list of integer token ids")
        if not ids:
            raise RequestError(f"prompt {i} is empty")
        check_token_range(ids, args)
        out.append(ids)
    return out


def as_batch_tensor(input_ids: Any, args: ModelArgs, device: torch.device) -> torch.Tensor:
    """input_ids for `forward`: a [B, T] tensor or equal-length lists -> int64 on the device."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
    else:
        try:
            ids = torch.tensor(input_ids)
        except (TypeError, ValueError):
            raise RequestError("input_ids must be a [B, T] tensor or a list of equal-length token-id lists") from None
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise RequestError(f"input_ids must have shape [B, T] with B, T >= 1, got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise RequestError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    check_token_range(ids.flatten().tolist(), args)
    if ids.shape[1] > args.max_position_embeddings:
        raise RequestError(
            f"input of {ids.shape[1]} tokens exceeds the model's {args.max_position_embeddings} positions")
    return ids.to(device=device, dtype=torch.long)


def check_token_range(tokens: list[int], args: ModelArgs) -> None:
    bad = [t for t in tokens if not 0 <= t < args.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {args.vocab_size})")
