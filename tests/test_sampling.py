"""sampling: logit bias and presence / frequency penalties against a float64 reference, log-probabilities against
log-softmax in float64, the row sampler's adjusted draws against the call sampler's, and bad arguments as one
sentence each."""

from __future__ import annotations

import pytest
import torch

from conftest import reference_adjusted
from moeprefetch.errors import RequestError
from moeprefetch.sampling import (LOGPROBS_MAX, DeviceSampler, LogitAdjuster, RowSampler, SamplingParams,
                                  bias_pairs, read_logprobs, seed_halves, token_logprobs)

CPU = torch.device("cpu")


def reference_of(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    return reference_adjusted(logits, params.logit_bias, params.presence_penalty, params.frequency_penalty, generated)


def test_the_adjuster_biases_and_penalises_each_row_as_the_float64_reference():
    generator = torch.Generator().manual_seed(3)
    vocab, rows = 50, 3
    params = [SamplingParams(logit_bias=((2, 5.0), (7, -100.0), (49, 0.25)), presence_penalty=0.6,
                             frequency_penalty=0.3),
              SamplingParams(presence_penalty=-1.5),
              SamplingParams(frequency_penalty=2.0, logit_bias=((0, -3.5),))]
    adjuster = LogitAdjuster(vocab, CPU, rows)
    for row, p in enumerate(params):
        adjuster.set_row(row, p)
    generated: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(12):  # tokens arrive step by step, some rows idle (inactive) at some steps
        tokens = torch.randint(0, 9, (rows,), generator=generator)  # few ids: repeats make counts above one
        active = torch.rand(rows, generator=generator) < 0.8
        adjuster.count(tokens, active)
        for row in range(rows):
            if active[row]:
                generated[row].append(int(tokens[row]))
        logits = torch.randn(rows, vocab, generator=generator) * 4
        got = adjuster(logits)
        for row, p in enumerate(params):
            expected = reference_of(logits[row], p, generated[row])
            assert torch.allclose(got[row].double(), expected, atol=1e-5), row
    assert any(generated[0].count(t) > 1 for t in generated[0])  # the frequency term was exercised


def test_a_row_without_bias_or_penalties_keeps_its_logits_bit_for_bit():
    adjuster = LogitAdjuster(40, CPU, 2)
    adjuster.set_row(0, SamplingParams(logit_bias=((1, 2.0),), presence_penalty=1.0))
    adjuster.set_row(1, SamplingParams())
    adjuster.count(torch.tensor([4, 4]), torch.tensor([True, True]))
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    out = adjuster(logits)
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])


def test_set_row_clears_the_previous_requests_counts_and_bias():
    adjuster = LogitAdjuster(20, CPU, 1)
    adjuster.set_row(0, SamplingParams(logit_bias=((3, 9.0),), frequency_penalty=1.0))
    adjuster.count(torch.tensor([5]), torch.tensor([True]))
    adjuster.set_row(0, SamplingParams(presence_penalty=0.5))
    logits = torch.zeros(1, 20)
    assert torch.equal(adjuster(logits), logits)  # nothing generated yet, and the old bias is gone


def test_token_logprobs_are_log_softmax_in_float64_with_the_most_likely_alternatives():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=generator) * 3
    chosen = torch.tensor([0, 17, 299, 150])
    values, ids = token_logprobs(logits, chosen, 5)
    reference = logits.double().log_softmax(-1)
    assert torch.allclose(values[:, 0].double(), reference.gather(-1, chosen[:, None])[:, 0], atol=1e-5)
    order = reference.argsort(-1, descending=True)[:, :5]
    assert torch.equal(ids, order)
    assert torch.allclose(values[:, 1:].double(), reference.gather(-1, order), atol=1e-5)
    rows = read_logprobs(chosen.tolist(), values.tolist(), ids.tolist())
    assert [r.token for r in rows] == chosen.tolist()
    assert rows[1].top[0][0] == int(order[1, 0]) and len(rows[1].first(2).top) == 2


def test_greedy_and_sampled_draws_read_the_adjusted_logits():
    logits = torch.zeros(1, 30)
    logits[0, 4] = 3.0
    sampler = DeviceSampler(30, CPU, 1)
    params = SamplingParams(logit_bias=((4, -100.0), (9, 2.0)))
    sampler.set_params(params)
    assert int(sampler(logits, params, torch.zeros(1, dtype=torch.long), torch.tensor([3]))[0]) == 9
    # the flag in the call, not the request, decides in a captured step; off, the raw logits decide
    assert int(sampler(logits, params, torch.zeros(1, dtype=torch.long), torch.tensor([3]), adjust=False)[0]) == 4
    hot = SamplingParams(temperature=0.5, seed=3, logit_bias=((4, -100.0),))
    sampler.set_params(hot)
    draws = {int(sampler(logits, hot, torch.zeros(1, dtype=torch.long), torch.tensor([p]))[0]) for p in range(60)}
    assert 4 not in draws and len(draws) > 5


def test_row_sampler_with_bias_and_penalties_draws_what_each_request_draws_alone():
    generator = torch.Generator().manual_seed(1)
    vocab = 64
    params = [SamplingParams(logit_bias=((3, 4.0),), presence_penalty=0.7),
              SamplingParams(temperature=0.8, seed=5, frequency_penalty=1.2),
              SamplingParams(temperature=1.1, top_k=9, seed=2),
              SamplingParams(temperature=0.6, top_p=0.8, seed=8, logit_bias=((10, -2.0), (11, 1.5)))]
    rows = RowSampler(vocab, CPU, len(params))
    alone = [DeviceSampler(vocab, CPU, 1) for _ in params]
    for row, p in enumerate(params):
        rows.set_row(row, p)
        alone[row].set_params(p)
    view = rows.first_rows(2)  # a smaller step's view shares the adjuster
    assert view.logit_adjuster() is rows.logit_adjuster()
    flags = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    for position in range(6):
        tokens = torch.randint(0, 12, (len(params),), generator=generator)
        active = torch.ones(len(params), dtype=torch.bool)
        rows.logit_adjuster().count(tokens, active)
        for row in range(len(params)):
            alone[row].logit_adjuster().count(tokens[row : row + 1], active[:1])
        logits = torch.randn(len(params), vocab, generator=generator) * 2
        positions = torch.full((len(params),), position)
        got = rows(logits, flags, torch.arange(len(params)), positions, adjust=True)
        for row, p in enumerate(params):
            expected = alone[row](logits[row : row + 1], p, torch.zeros(1, dtype=torch.long),
                                  positions[row : row + 1], adjust=True)
            assert int(got[row]) == int(expected[0]), (position, row)


@pytest.mark.parametrize("value,message", [
    ([1, 2], "must be a mapping"), ({"x": 1.0}, "keys must be token ids"), ({True: 1.0}, "keys must be token ids"),
    ({1: 1.0, "1": 2.0}, "twice")])
def test_bias_pairs_refuse_other_shapes_in_one_sentence(value, message):
    with pytest.raises(RequestError, match=message):
        bias_pairs(value)


def test_bias_pairs_accept_json_keys_and_sort():
    assert bias_pairs({"12": 1, 3: -2.5}) == ((3, -2.5), (12, 1.0))
    assert bias_pairs(None) == () and bias_pairs({}) == ()


@pytest.mark.parametrize("params,message", [
    (SamplingParams(logit_bias=((50, 1.0),)), r"not a token id of the vocabulary \[0, 50\)"),
    (SamplingParams(logit_bias=((-1, 1.0),)), "not a token id"),
    (SamplingParams(logit_bias=((1, 101.0),)), r"must be a number in \[-100, 100\]"),
    (SamplingParams(logit_bias=((1, float("nan")),)), "must be a number"),
    (SamplingParams(logit_bias=((1, "a"),)), "must be a number"),
    (SamplingParams(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (SamplingParams(frequency_penalty=float("inf")), "frequency_penalty must be a number"),
    (SamplingParams(frequency_penalty=True), "frequency_penalty must be a number"),
    (SamplingParams(logprobs=LOGPROBS_MAX + 1), r"logprobs must be None or an integer in \[0, 20\]"),
    (SamplingParams(logprobs=-1), "logprobs must be"), (SamplingParams(logprobs=1.5), "logprobs must be"),
    (SamplingParams(temperature=10**400), "temperature must be a finite number"),
    (SamplingParams(temperature=1e39), "temperature must be at most 1e\\+06"),
    (SamplingParams(top_p=10**400), "top_p must be a number"),
    (SamplingParams(presence_penalty=10**400), "presence_penalty must be a number")])
def test_bad_bias_penalties_and_logprobs_are_one_sentence(params, message):
    with pytest.raises(RequestError, match=message):
        params.validate(50)


def test_flags_say_what_a_request_adjusts():
    assert not SamplingParams().adjusts and not SamplingParams(logprobs=3).adjusts
    assert SamplingParams(logit_bias=((1, 0.5),)).adjusts and not SamplingParams(logit_bias=((1, 0.5),)).penalises
    assert SamplingParams(frequency_penalty=-0.1).penalises and SamplingParams(presence_penalty=0.1).adjusts


def test_the_noise_is_finite_everywhere_so_a_ban_holds():
    """The noise's uniform value stays below 1 in fp32: with 24 bits it rounded up to 1 once in 2**24 entries and
    gave +inf noise, and that entry won a draw against a -100 bias or a top-k cut (seed 5, stream 0, position 37
    of a 102,400-token vocabulary hit one at index 21,897)."""
    from moeprefetch.kernels.sampling import gumbel_noise, pcg
    from moeprefetch.sampling import sample

    vocab = 102400
    vocab_hash = pcg(torch.arange(vocab, dtype=torch.int64))
    zero = torch.zeros(1, dtype=torch.int64)
    noise = gumbel_noise(vocab_hash, zero, torch.tensor([37]), zero, torch.tensor([5]))
    assert bool(noise.isfinite().all())
    bits = torch.arange(2**23 - 4, 2**23, dtype=torch.int64) << 9 | 511  # the largest hashes the noise can see
    largest = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    assert bool((largest < 1.0).all())
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 50.0
    banned = SamplingParams(temperature=1.0, seed=5, logit_bias=((0, -100.0),))
    assert int(sample(logits, SamplingParams(temperature=1.0, seed=5), [0], [37])[0]) == 0  # the logit decides
    assert int(sample(logits, banned, [0], [37])[0]) != 0
    assert int(sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=5), [0], [37])[0]) == 0


def test_seed_halves_keep_62_bit_seeds_and_tell_every_64_bit_seed_apart():
    """Seeds below 2**62 hash as they always did (bits 0-30 and 31-61); bits 62 and 63 (negative seeds, and those
    past 2**62) take the words' top bits, so no two int64 seeds share draws; each word stays a 32-bit value."""
    for seed in (0, 1, 5, 2**31 - 1, 2**31, 2**62 - 1, 123456789012345):
        assert seed_halves(seed) == (seed >> 31, seed & (2**31 - 1))
    seeds = [0, 1, -1, 2**62, 2**62 - 1, -(2**62), -(2**63), 2**63 - 1, 2**31, -(2**31), 3 << 61, -(3 << 61)]
    generator = torch.Generator().manual_seed(4)
    seeds += [int(v) for v in torch.randint(-(2**63), 2**63 - 1, (200,), generator=generator)]
    words = {seed: seed_halves(seed) for seed in seeds}
    assert len(set(words.values())) == len(set(seeds))
    assert all(0 <= w < 2**32 for pair in words.values() for w in pair)
    # as 64 bits: the words give the seed back (bit 62 from the low word's top, 63 from the high word's)
    for seed, (high, low) in words.items():
        rebuilt = (low & (2**31 - 1)) | ((high & (2**31 - 1)) << 31) | ((low >> 31) << 62) | ((high >> 31) << 63)
        assert rebuilt == seed % 2**64


def test_a_negative_seed_draws_its_own_tokens_every_time():
    """Through the sampler: seed -1 and 2**62 - 1 (one seed under the old 62-bit hash) draw different tokens, each
    the same on every call; the row sampler draws what the one-call sampler does."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    draws = {}
    for seed in (-1, 2**62 - 1, -(2**63), 0):
        sampler = DeviceSampler(500, CPU)
        sampler.set_params(SamplingParams(temperature=5.0, seed=seed))
        draws[seed] = [int(sampler.draw(logits, torch.tensor([0]), torch.tensor([p]))[0]) for p in range(24)]
        rows = RowSampler(500, CPU, 1)
        rows.set_row(0, SamplingParams(temperature=5.0, seed=seed))
        assert [int(rows.draw(logits, torch.tensor([0]), torch.tensor([p]))[0]) for p in range(24)] == draws[seed]
    assert len({tuple(d) for d in draws.values()}) == len(draws)


def test_token_bytes_are_the_bytes_of_a_character_split_over_tokens(tiny_tokenizer_dir):
    """A byte-level token holding part of a character decodes alone to U+FFFD; its `bytes` (chat logprobs) are its
    own, so a character's tokens join to its UTF-8."""
    from transformers import AutoTokenizer

    from moeprefetch.serve.logprobs import chat_logprobs, token_bytes
    from moeprefetch.sampling import TokenLogprob

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    text = "éñü"  # bytes within the tiny tokenizer's alphabet (its first 200 byte characters)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the tiny corpus is ASCII: the bytes are split
    assert bytes(b for t in ids for b in token_bytes(tokenizer, t)) == text.encode()
    content = chat_logprobs([TokenLogprob(t, -1.0, ()) for t in ids], tokenizer)["content"]
    assert bytes(b for c in content for b in c["bytes"]) == text.encode()
    assert token_bytes(None, 7) == list(b"token_id:7")


def test_a_top_p_below_fp32s_range_keeps_the_likeliest_token():
    """top_p=1e-50 passes validation but reads 0 in fp32: every token had mass before it >= 0 and was dropped, so
    draws fell on token 0 (an outside check). The likeliest token always stays: it is what top_p=1e-30 draws."""
    from moeprefetch.sampling import RowSampler, sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50, generator=g)
    for top_p in (1e-50, 1e-30):
        got = sample(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=3), [0, 1], [5, 5])
        assert got.tolist() == logits.argmax(-1).tolist(), top_p
    rows = RowSampler(50, torch.device("cpu"), 2)
    for row in range(2):
        rows.set_row(row, SamplingParams(temperature=1.0, top_p=1e-50, seed=3))
    filtered = rows.filter(logits)
    assert filtered.isfinite().sum(-1).tolist() == [1, 1]
    assert filtered.argmax(-1).tolist() == logits.argmax(-1).tolist()
