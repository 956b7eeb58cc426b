"""session: streamed text pieces (TextStream) and the prefill's windows of chunks (prefill_windows, prefill_steps),
which both a generate call and a continuous batch's admissions run through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.session import prefill_steps, prefill_windows, window_lengths, window_tokens


def test_streamed_pieces_never_split_a_character():
    """Byte-level BPE can end a token inside a multi-byte character; streamed pieces must still add up exactly,
    and each piece is decoded from a short window of tokens, not the whole sequence (linear, not quadratic)."""
    from moeprefetch.cli import REFERENCE_MODEL
    from moeprefetch.session import TextStream

    engine = MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False)
    text = "naïve café 🙂 Ελληνικά — 日本語 " * 3
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in engine.tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))  # the hard case occurs
    decoded: list[int] = []
    tokenizer = engine.tokenizer

    class Counting:
        def decode(self, part, **kwargs):
            decoded.append(len(part))
            return tokenizer.decode(part, **kwargs)

    stream = TextStream(Counting())
    pieces = [stream.piece(ids[: i + 1], final=i == len(ids) - 1) for i in range(len(ids))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert max(decoded) <= 8  # a few tokens of context, however long the text



@pytest.mark.parametrize("length,chunk,window,offset", [(1, 4, 4, 0), (17, 4, 8, 0), (17, 4, 10, 1), (64, 16, 16, 0),
                                                      (5, 8, 4, 1), (100, 7, 30, 3)])
def test_prefill_windows_cover_the_prompt_in_whole_chunks(length, chunk, window, offset):
    """Every token once, in order, in chunks of `chunk` (the last shorter), each window whole chunks (at least one)
    and at most `window` tokens unless one chunk is longer; positions count from `offset`; prefill_steps counts the
    windows."""
    engine = SimpleNamespace(options=SimpleNamespace(prefill_chunk=chunk, prefill_window=window))
    tokens = torch.arange(100, 100 + length)[None]
    windows = list(prefill_windows(engine, tokens, offset))
    per_window = max(window // chunk, 1) * chunk
    seen, seen_positions = [], []
    for starts, pieces, positions in windows:
        assert len(pieces) == len(starts) == len(positions) >= 1
        assert sum(p.shape[1] for p in pieces) <= per_window
        for start, piece, pos in zip(starts, pieces, positions):
            assert piece.shape[1] == min(chunk, length - start)
            seen += piece[0].tolist()
            seen_positions += pos[0].tolist()
            assert pos[0, 0] == start + offset
    assert seen == tokens[0].tolist()
    assert seen_positions == list(range(offset, offset + length))
    assert prefill_steps(engine, length) == len(windows)


@pytest.mark.parametrize("chunk,window,asked,expected", [(16, 64, 512, 64), (16, 64, 40, 32), (16, 64, 8, 16),
                                                         (16, 64, None, 64), (512, 2048, 512, 512),
                                                         (2048, 8192, 512, 2048)])
def test_a_window_asked_for_is_whole_chunks_within_the_engines_window(chunk, window, asked, expected):
    """A continuous batch's smaller prefill windows (the server's 512 prompt tokens between steps) are whole chunks,
    at least one, and never more than the engine's prefill_window, which sized the prefill's workspace (a fitted or
    given window stays the bound); windows of that size cover the prompt."""
    engine = SimpleNamespace(options=SimpleNamespace(prefill_chunk=chunk, prefill_window=window))
    assert window_tokens(engine, asked) == expected
    tokens = torch.arange(300)[None]
    assert all(sum(p.shape[1] for p in pieces) <= expected
               for _, pieces, _ in prefill_windows(engine, tokens, 0, asked))


@pytest.mark.parametrize("length,chunk,window,asked", [(1, 4, 4, None), (17, 4, 8, None), (100, 7, 30, 14),
                                                       (13, 4, 16, 4), (300, 16, 64, 40)])
def test_window_lengths_are_the_windows_prefill_windows_makes(length, chunk, window, asked):
    """A continuous batch counts an admission's windows ahead (`window_lengths`): the same windows, token for
    token, that the prefill then runs."""
    engine = SimpleNamespace(options=SimpleNamespace(prefill_chunk=chunk, prefill_window=window))
    made = [sum(p.shape[1] for p in pieces) for _, pieces, _ in
            prefill_windows(engine, torch.arange(length)[None], 0, asked)]
    assert window_lengths(engine, length, asked) == made and sum(made) == length


@pytest.mark.parametrize("predictor,given,expected", [
    # the learned head alone protects only, at reuse weight 0.7, with bypass (its fastest rows measured offloaded)
    ("learned", {}, (0.0, 0.7, True)),
    # with another predictor the fills stay theirs; the head's victims and bypass keep their defaults
    ("learned+next_layer_gate", {}, (1.5, 0.7, True)),
    ("next_layer_gate", {}, (1.5, 0.0, False)),
    ("none", {}, (1.5, 0.0, False)),
    # what the options say wins, and reuse and bypass act only where the head runs
    ("learned", {"prefetch_budget": 2.0, "reuse_weight": 0.0, "bypass": False}, (2.0, 0.0, False)),
    ("mtp", {"prefetch_budget": 0.0, "reuse_weight": 0.9, "bypass": True}, (0.0, 0.0, False)),
])
def test_prefetch_settings_are_the_options_else_the_predictors_defaults(predictor, given, expected):
    from moeprefetch.options import EngineConfig
    from moeprefetch.predictors import PredictorSpec
    from moeprefetch.session import prefetch_settings

    options = EngineConfig(**given)
    assert prefetch_settings(options, PredictorSpec.parse(predictor)) == expected


def test_a_learned_call_with_default_options_protects_only_and_keeps_the_tokens():
    """An engine given a routing head and nothing else: predictor='learned' issues no fill, ranks victims by the
    head at 0.7 and bypasses; tokens equal the all-resident run's; the same engine's next_layer_gate call fills."""
    from moeprefetch.cli import REFERENCE_MODEL

    prompts = [[40, 41, 42, 43, 44, 45, 46, 47]]
    with MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False) as resident:
        expected = resident.generate(prompts, max_new_tokens=10, stop_at_eos=False).sequences
    with MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False, expert_cache_slots=24,
                                           predictor_path=str(REFERENCE_MODEL / "routing_head.safetensors")) as engine:
        learned = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="learned")
        cfg = engine.residency.cfg
        assert (cfg.budget_per_target, cfg.reuse_weight, cfg.bypass) == (0, 0.7, True)
        assert learned.sequences == expected
        assert learned.stats.to_dict()["prefetch_issued"] == 0
        gate = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="next_layer_gate")
        assert gate.sequences == expected and gate.stats.to_dict()["prefetch_issued"] > 0
        assert (engine.residency.cfg.reuse_weight, engine.residency.cfg.bypass) == (0.0, False)
