"""Decoding with KV caches, batching, sampling, streaming and prompts of every accepted form."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_model, reference_adjusted
from moeprefetch import MoEPrefetchEngine, RequestError
from moeprefetch.decode import DecodeStep, StepShape
from moeprefetch.predictors import PredictorSpec
from moeprefetch.runner import KVCaches


@pytest.fixture(scope="module")
def v3(checkpoint_factory):
    return MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False)


@pytest.mark.parametrize("variant", ["v3", "v3_groups_qlora_yarn", "v2_greedy", "v2_qlora_yarn_norm"])
def test_cached_decode_equals_uncached_forward(checkpoint_factory, variant):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory(variant), progress=False, prefill_chunk=4)
    prompt = torch.randint(0, engine.args.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    result = engine.generate([prompt], max_new_tokens=12, stop_at_eos=False)
    sequence = prompt + result.sequences[0]
    full = engine.forward([sequence])[0]
    # greedy decoding picks the uncached forward's argmax at every position
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == result.sequences[0]

    # and the cached logits themselves match the uncached ones, step by step
    res = engine.residency
    res.configure()
    res.begin_call()
    caches = KVCaches.allocate(engine.args, 1, engine.options.max_seq_len, torch.float32, engine.device, False)
    res.begin_step(decode=False)
    positions = torch.arange(len(prompt))[None]
    hidden = engine.runner.forward_block(torch.tensor([prompt]), positions, caches, 0, 0)[0]
    assert torch.allclose(engine.runner.logits(hidden), full[: len(prompt)], atol=1e-4)
    shape = StepShape(batch=1, mode="none", spec=PredictorSpec(("none",)), run_mtp=False, greedy=True, top_k=False,
                      top_p=False, reserve=False)
    step = DecodeStep(engine.runner, caches, engine.sampler, shape, graphs=False)
    for i, token in enumerate(result.sequences[0][:-1]):
        position = len(prompt) + i
        out = step([token], [position], [True])
        assert (step.logits[0] - full[position]).abs().max().item() < 1e-4
        assert out.next_tokens == [result.sequences[0][i + 1]]
    res.end_call()


def test_batched_generation_equals_one_by_one(v3):
    prompts = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [7], [20, 21, 22, 23]]
    batched = v3.generate(prompts, max_new_tokens=9, stop_at_eos=False)
    for prompt, tokens in zip(prompts, batched.sequences):
        assert v3.generate([prompt], max_new_tokens=9, stop_at_eos=False).sequences[0] == tokens
    assert [len(s) for s in batched.sequences] == [9] * 4


def test_sampling_is_seeded_and_batch_independent(v3):
    prompts = [[3, 4, 5], [30, 31]]
    kwargs = dict(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=1234, stop_at_eos=False)
    first = v3.generate(prompts, **kwargs)
    again = v3.generate(prompts, **kwargs)
    assert first.sequences == again.sequences
    # per-token noise is seeded by (seed, sequence index, position): row 0 alone draws what it drew in the batch
    assert v3.generate([prompts[0]], **kwargs).sequences[0] == first.sequences[0]
    other_seed = v3.generate(prompts, **{**kwargs, "seed": 99}).sequences
    assert other_seed != first.sequences
    greedy = v3.generate(prompts, max_new_tokens=10, stop_at_eos=False).sequences
    assert greedy != first.sequences


def test_top_k_one_is_greedy(v3):
    prompts = [[3, 4, 5]]
    sampled = v3.generate(prompts, max_new_tokens=8, temperature=1.5, top_k=1, seed=5, stop_at_eos=False)
    greedy = v3.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    assert sampled.sequences == greedy.sequences


def test_top_p_filter_keeps_the_smallest_mass_prefix():
    from moeprefetch.sampling import SamplingParams, filter_logits

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert torch.isfinite(kept).tolist() == [True, False, False, False]
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_k=3, seed=0))
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_sampling_follows_the_distribution():
    from moeprefetch.sampling import SamplingParams, sample

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    params = SamplingParams(temperature=1.0, seed=3)
    counts = torch.zeros(4)
    for position in range(4000):
        counts[sample(logits, params, [0], [position])[0]] += 1
    expected = torch.softmax(logits[0], -1) * 4000
    assert ((counts - expected).abs() / expected.sqrt()).max() < 4.5  # within ~4 sigma per bin


def test_stop_at_eos_and_finish_reasons(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False)
    free = engine.generate([[3, 4, 5]], max_new_tokens=20, stop_at_eos=False).sequences[0]
    # pretend a token that first appears a few steps in is the end-of-sequence token
    first_new = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    eos = free[first_new]
    engine.args = engine.args.__class__(**{**engine.args.__dict__, "eos_token_ids": (eos,)})
    stopped = engine.generate([[3, 4, 5]], max_new_tokens=20)
    assert stopped.sequences[0] == free[: free.index(eos) + 1]
    assert stopped.finish_reasons == ["eos"]
    assert engine.generate([[3, 4, 5]], max_new_tokens=first_new).finish_reasons == ["length"]


def test_streaming_callback_and_iterator(v3):
    events = []
    result = v3.generate([[3, 4], [5, 6, 7]], max_new_tokens=5, callback=events.append, stop_at_eos=False)
    for b in range(2):
        assert [e.token for e in events if e.sequence == b] == result.sequences[b]
    streamed = list(v3.stream([[3, 4], [5, 6, 7]], max_new_tokens=5, stop_at_eos=False))
    assert [(e.sequence, e.token) for e in streamed] == [(e.sequence, e.token) for e in events]


def test_text_prompts_use_the_checkpoint_tokenizer(checkpoint_factory, tiny_tokenizer_dir):
    path = checkpoint_factory("v3", tokenizer_from=str(tiny_tokenizer_dir))
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    assert engine.tokenizer is not None
    text = "the quick brown fox"
    ids = engine.tokenizer(text)["input_ids"]
    by_text = engine.generate(text, max_new_tokens=6, stop_at_eos=False)
    by_ids = engine.generate([ids], max_new_tokens=6, stop_at_eos=False)
    assert by_text.sequences == by_ids.sequences
    assert by_text.texts == [engine.tokenizer.decode(by_ids.sequences[0], skip_special_tokens=True)]
    pieces = []
    engine.generate(text, max_new_tokens=6, stop_at_eos=False, callback=lambda e: pieces.append(e.text))
    assert "".join(pieces) == by_text.texts[0]


def test_prompt_forms(v3):
    a = v3.generate([3, 4, 5], max_new_tokens=4, stop_at_eos=False).sequences
    b = v3.generate([[3, 4, 5]], max_new_tokens=4, stop_at_eos=False).sequences
    c = v3.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, stop_at_eos=False).sequences
    assert a == b == c
    with pytest.raises(RequestError, match="no tokenizer"):
        v3.generate("hello", max_new_tokens=4)


def test_fused_expert_layout_loads_identically(checkpoint_factory):
    per_expert = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False)
    fused = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3", fused_experts=True), progress=False)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(per_expert.forward(ids), fused.forward(ids))
    a, am = per_expert.forward(ids, return_mtp=True)
    b, bm = fused.forward(ids, return_mtp=True)
    assert torch.equal(am, bm)


def test_single_file_checkpoint(checkpoint_factory):
    sharded = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False)
    single_path = checkpoint_factory("v3", max_shard_size=None)
    assert (single_path / "model.safetensors").is_file()
    single = MoEPrefetchEngine.from_pretrained(single_path, progress=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(sharded.forward(ids), single.forward(ids))


def test_checkpoint_without_mtp_says_so(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3", with_mtp=False), progress=False)
    assert not engine.has_mtp
    assert engine.options.predictor == "none"  # the default, MTP layer or not
    with pytest.raises(RequestError, match="MTP"):
        engine.forward([[1, 2, 3]], return_mtp=True)
    with pytest.raises(RequestError, match="MTP"):
        engine.generate([[1, 2]], max_new_tokens=3, predictor="mtp")
    with pytest.raises(RequestError, match="MTP"):
        engine.generate([[1, 2]], max_new_tokens=3, speculative="mtp")
    generated = engine.generate([[1, 2]], max_new_tokens=4, stop_at_eos=False).sequences[0]
    assert generated == greedy_by_forward(engine, [1, 2], 4)  # without an MTP layer, decode is still exact
    engine.close()
    # no MTP layer, no extra rows: a step's kernels are shaped for its real rows alone (a batch of 4 stays on the
    # GEMV path), and verify_rows='shared' would compute only padding, so the real rows go alone
    assert engine.rows_per_sequence == 1 and engine.options.max_step_rows == engine.options.max_batch_size
    with MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3", with_mtp=False), progress=False,
                                           verify_rows="shared") as shared:
        assert shared.options.verify_rows == "separate"
        assert shared.generate([[1, 2]], max_new_tokens=4, stop_at_eos=False).sequences[0] == generated


def test_bfloat16_engine_runs_and_tracks_fp32(checkpoint_factory):
    path = checkpoint_factory("v3")
    fp32 = MoEPrefetchEngine.from_pretrained(path, progress=False)
    bf16 = MoEPrefetchEngine.from_pretrained(path, dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    a, b = fp32.forward(ids), bf16.forward(ids)
    assert b.dtype == torch.float32  # logits are returned in fp32
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05
    generated = bf16.generate([[3, 4]], max_new_tokens=5, stop_at_eos=False).sequences[0]
    logits = bf16.forward([[3, 4] + generated[:-1]])[0, 1:]  # the logits each generated token was chosen from
    ranks = [(row > row[token]).sum().item() for row, token in zip(logits, generated)]
    assert len(generated) == 5 and max(ranks) <= 2, ranks  # greedy up to bf16 rounding of near-ties


def greedy_by_forward(engine, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full uncached forwards: the definition decode must match."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(engine.forward([ids])[0, -1].argmax()))
    return ids[len(prompt):]


def test_time_to_first_token_covers_prefill_and_precedes_decode(v3):
    result = v3.generate([[3, 4, 5, 6, 7, 8], [9, 10]], max_new_tokens=4, stop_at_eos=False)
    stats = result.stats.to_dict()
    assert 0 < stats["prefill_seconds"] <= stats["ttft_seconds"]
    assert stats["ttft_seconds"] < stats["prefill_seconds"] + 1.0  # only the call's set-up comes before prefill
    assert stats["prefill_tokens_per_s"] == pytest.approx(8 / stats["prefill_seconds"])


# ---- logit bias, penalties and log-probabilities ---------------------------------------------------------------------
ADJUSTED = dict(presence_penalty=0.8, frequency_penalty=0.4)


@pytest.mark.parametrize("variant", ["v3", "qwen3"])
def test_bias_and_penalties_follow_transformers_greedy_with_its_logprobs(checkpoint_factory, variant):
    """Greedy decoding with logit_bias and both penalties picks, at every step, the argmax of transformers' logits
    biased and penalised in float64; each token's logprobs are transformers' log-softmax, alternatives included."""
    path = checkpoint_factory(variant)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    reference = hf_model(path)
    prompt, new = [3, 4, 5, 6], 14
    plain = engine.generate([prompt], new, stop_at_eos=False).sequences[0]
    bias = {plain[0]: -100.0, plain[1]: -100.0, 7: 1.5}
    result = engine.generate([prompt], new, stop_at_eos=False, logit_bias=bias, logprobs=3, **ADJUSTED)
    got, logprobs = result.sequences[0], result.logprobs[0]
    ids, generated, bias_only = list(prompt), [], []
    with torch.no_grad():
        for step in range(new):
            logits = reference(torch.tensor([ids])).logits[0, -1].double()
            token = int(reference_adjusted(logits, sorted(bias.items()), 0.8, 0.4, generated).argmax())
            bias_only.append(int(reference_adjusted(logits, sorted(bias.items()), 0.0, 0.0, generated).argmax()))
            logp = logits.log_softmax(-1)
            entry = logprobs[step]
            assert entry.token == token == got[step], step
            assert abs(entry.logprob - float(logp[token])) < 1e-4
            assert [t for t, _ in entry.top] == logp.topk(3).indices.tolist()
            assert max(abs(v - float(logp[t])) for t, v in entry.top) < 1e-4
            generated.append(token)
            ids.append(token)
    assert plain[0] not in got and plain[1] not in got
    assert got != bias_only  # the penalties changed a choice (the reference without them goes elsewhere)


def test_bias_penalties_and_logprobs_are_the_same_at_every_cache_size_and_predictor(checkpoint_factory):
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5], [10, 11, 12, 13]]
    kwargs = dict(max_new_tokens=10, temperature=0.9, seed=7, stop_at_eos=False, logit_bias={5: 3.0, 9: -100.0},
                  logprobs=2, **ADJUSTED)
    expected = MoEPrefetchEngine.from_pretrained(path, progress=False, max_batch_size=2).generate(prompts, **kwargs)
    assert all(9 not in s for s in expected.sequences)
    for slots in (3, 7, 12):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_batch_size=2, expert_cache_slots=slots)
        for predictor in ("none", "mtp+next_layer_gate", "oracle"):
            got = engine.generate(prompts, predictor=predictor, **kwargs)
            assert got.sequences == expected.sequences, (slots, predictor)
            assert got.logprobs == expected.logprobs, (slots, predictor)  # the same logits, bit for bit
    events = list(engine.stream(prompts, **{k: v for k, v in kwargs.items()}))
    assert [e.logprob for e in events if e.sequence == 1] == expected.logprobs[1]


def test_speculation_keeps_biased_tokens_and_refuses_penalties(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=7)
    kwargs = dict(max_new_tokens=12, stop_at_eos=False, logit_bias={4: 2.0, 8: -100.0}, logprobs=1)
    plain = engine.generate([[3, 4, 5]], **kwargs)
    spec = engine.generate([[3, 4, 5]], speculative="mtp", **kwargs)
    assert spec.sequences == plain.sequences and spec.stats.draft_proposed > 0
    for a, b in zip(spec.logprobs[0], plain.logprobs[0]):  # a verified token's come from the draft row: close
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
    with pytest.raises(RequestError, match="presence_penalty and frequency_penalty .* speculative='mtp'"):
        engine.generate([[3, 4]], 4, speculative="mtp", frequency_penalty=0.5)
    auto = engine.generate([[3, 4]], 4, speculative="auto", presence_penalty=0.5)
    decision = auto.stats.extra["speculative_auto"]
    assert decision["mode"] == "none" and "penalties" in decision["reason"]
    assert engine.generate([[3, 4]], 4).sequences  # the engine stays usable


@pytest.mark.parametrize("kwargs,message", [
    (dict(logit_bias={10**6: 1.0}), "not a token id of the vocabulary"), (dict(logit_bias=[1]), "mapping"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(frequency_penalty="high"), "frequency_penalty")])
def test_bad_bias_penalties_and_logprobs_are_refused_and_change_nothing(v3, kwargs, message):
    before = v3.generate([[3, 4]], 5, stop_at_eos=False).sequences
    with pytest.raises(RequestError, match=message):
        v3.generate([[3, 4]], 5, **kwargs)
    with pytest.raises(RequestError, match=message):
        v3.stream([[3, 4]], 5, **kwargs)
    assert v3.generate([[3, 4]], 5, stop_at_eos=False).sequences == before


def test_from_pretrained_without_a_path_loads_the_bundled_model_and_direct_construction_says_how(tmp_path,
                                                                                                  monkeypatch):
    from moeprefetch.checkpoint import REFERENCE_MODEL

    with MoEPrefetchEngine.from_pretrained(progress=False, max_seq_len=32) as default, \
            MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False, max_seq_len=32) as named:
        assert default.path == named.path
        prompt = [[5, 6, 7, 8]]
        expected = named.generate(prompt, max_new_tokens=4).sequences
        assert default.generate(prompt, max_new_tokens=4).sequences == expected
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(REFERENCE_MODEL.parent)
    monkeypatch.setenv("HOME", str(home))  # a path written as in a shell: ~ is the user's home
    with MoEPrefetchEngine.from_pretrained(f"~/models/{REFERENCE_MODEL.name}", progress=False,
                                           max_seq_len=32) as tilde:
        assert tilde.generate(prompt, max_new_tokens=4).sequences == expected
    for build in (lambda: MoEPrefetchEngine(), lambda: MoEPrefetchEngine(REFERENCE_MODEL),
                  lambda: MoEPrefetchEngine(REFERENCE_MODEL, vram_budget="1GiB")):
        with pytest.raises(RequestError, match=r"MoEPrefetchEngine.from_pretrained\(path"):
            build()


def test_the_static_policy_says_when_it_has_no_hot_set_yet(caplog):
    import logging

    with MoEPrefetchEngine.from_pretrained(progress=False, max_seq_len=32, expert_cache_slots=40, policy="static",
                                           max_batch_size=1) as engine:
        with caplog.at_level(logging.WARNING, logger="moeprefetch.engine"):
            engine.generate([[5, 6, 7]], max_new_tokens=3)
            engine.generate([[5, 6, 7]], max_new_tokens=3)
        said = [r for r in caplog.records if "no hot set yet" in r.getMessage()]
        assert len(said) == 1
        assert engine.set_hot_set_from_profile(0.25) and engine.residency.hot_set_size > 0
