"""Bad requests, resource limits and faults: a clear error, nothing lost, and the same engine keeps serving."""

from __future__ import annotations

import logging

import pytest
import torch

from moeprefetch import MoEPrefetchEngine, RequestError, ResourceError
from moeprefetch.store import HostExpertStore, PinResult


@pytest.fixture(scope="module")
def engine(checkpoint_factory, tiny_tokenizer_dir):
    return MoEPrefetchEngine.from_pretrained(
        checkpoint_factory("v3", tokenizer_from=str(tiny_tokenizer_dir)), progress=False, expert_cache_slots=8
    )


@pytest.fixture(scope="module")
def expected(engine):
    return engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences


BAD_REQUESTS = [
    (dict(prompts=""), "prompt 0 is empty"),
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[[3, 999999]]), "token id 999999 is outside the vocabulary"),
    (dict(prompts=[[3, -1]]), "token id -1 is outside the vocabulary"),
    (dict(prompts=[[3, 4.5]]), "must be a string or a list of integer token ids"),
    (dict(prompts=[[3] * 600]), "more than the model's 512 positions"),
    (dict(prompts=[[3] * 400], max_new_tokens=200),
     r"needs 602 positions \(the decode step writes 2 beyond them\), more than max_seq_len=512"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be a positive integer"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.0), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=-(2**63) - 1), r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"),  # 65 bits: it would alias
    (dict(seed=2**63), r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(predictor="magic"), "unknown predictor 'magic'"),
    (dict(predictor="mtp+magic"), "unknown predictor 'magic'"),
    (dict(predictor="none+mtp"), "cannot be combined"),
    (dict(predictor=""), "non-empty name"),
    (dict(lookahead=0), "lookahead must be a positive integer"),
    (dict(speculative="eagle"), "speculative must be None, 'mtp' or 'auto'"),
    (dict(stop_at_eos="no"), "stop_at_eos must be True or False, got 'no'"),
    (dict(prompts=[[3]] * 9), "exceed max_batch_size=8"),
]


@pytest.mark.parametrize("kwargs,message", BAD_REQUESTS)
def test_bad_request_then_the_same_engine_serves(engine, expected, kwargs, message):
    request = {"prompts": [[3, 4, 5]], "max_new_tokens": 6, "stop_at_eos": False, **kwargs}
    with pytest.raises(RequestError, match=message):
        engine.generate(request.pop("prompts"), **request)
    assert engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences == expected
    assert not engine.residency.problems()


def test_stream_refuses_what_it_does_not_take(engine, expected):
    for kwargs, message in ((dict(foo=1), r"unknown argument\(s\) to stream: foo"),
                            (dict(callback=print), "stream takes no callback: iterate over the events")):
        with pytest.raises(RequestError, match=message):
            engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False, **kwargs)
    events = list(engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False))
    assert [[e.token for e in events]] == expected


def test_numpy_token_ids_are_prompts_as_lists_are(engine, expected):
    """Token ids from numpy (a tokenizer's return_tensors="np", an array row, numpy integers) run as lists do; numpy
    floats and bools are refused as Python's are."""
    np = pytest.importorskip("numpy")
    for prompts in (np.array([[3, 4, 5]]), np.array([3, 4, 5]), [np.array([3, 4, 5])], [[np.int64(3), 4, np.int32(5)]],
                    [np.int64(3), np.int64(4), np.int64(5)]):
        assert engine.generate(prompts, max_new_tokens=6, stop_at_eos=False).sequences == expected
    for bad in (np.array([[3.0, 4.0]]), [[np.float64(3), 4]], [[np.bool_(True), 4]]):
        with pytest.raises(RequestError, match="must be a string or a list of integer token ids"):
            engine.generate(bad, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(policy="fifo"), RequestError, "unknown cache policy 'fifo'"),
        (dict(expert_cache_slots=1), RequestError, "cannot hold one layer's working set"),
        (dict(expert_cache_slots=4, vram_budget="1GiB"), RequestError, "expert_cache_slots or vram_budget, not both"),
        (dict(vram_budget="12 parsecs"), RequestError, "cannot read memory size"),
        (dict(vram_budget="1KiB"), RequestError, "cannot hold one layer's working set.*fixed allowance.*takes .* GiB: "),
        (dict(predictor="oracle+oracle"), RequestError, "names a component twice"),
        (dict(dtype="int4"), RequestError, "dtype 'int4' is not supported"),
        (dict(device="tpu"), RequestError, "not a valid torch device|not supported"),
        (dict(expert_dtype="fp4"), RequestError, "expert_dtype must be one of"),
        (dict(max_seq_len=100000), RequestError, "exceeds the model's max_position_embeddings"),
        (dict(max_seq_len=3), RequestError, "max_seq_len=3 cannot hold a one-token prompt and one new token"),
        (dict(prefetch_budget=-1), RequestError, "prefetch_budget must be a number >= 0"),
        (dict(draft_experts="some"), RequestError, "draft_experts must be one of cached, all, auto"),
        (dict(spare_recent=-1), RequestError, "spare_recent must be an integer from 0 to 64"),
        (dict(prefetch_lead=-1), RequestError, "prefetch_lead must be an integer from 0 to 4096"),
        (dict(prefetch_lead=2.5), RequestError, "prefetch_lead must be an integer from 0 to 4096"),
        (dict(lrfu_halflife=0), RequestError, "lrfu_halflife must be a number of steps above 0 and at most 1e6"),
        (dict(lrfu_halflife=float("nan")), RequestError, "lrfu_halflife must be a number of steps above 0"),
        (dict(lrfu_halflife="8"), RequestError, "lrfu_halflife must be a number of steps above 0"),
        (dict(cache_slots=3), RequestError, "unknown engine option 'cache_slots'; the options are: device"),
    ],
)
def test_bad_engine_options(checkpoint_factory, kwargs, error, message):
    with pytest.raises(error, match=message):
        MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_cuda_requested_without_cuda(checkpoint_factory):
    with pytest.raises(ResourceError, match="device='cuda' was requested but CUDA is not available"):
        MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), device="cuda", progress=False)


def test_a_batch_larger_than_the_cache_reads_what_does_not_fit_from_host(checkpoint_factory):
    """With zero-copy reads no batch is too large for the cache: what finds no slot is read from host memory."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4], [5, 6], [7, 8], [9, 10]]
    expected = MoEPrefetchEngine.from_pretrained(path, progress=False).generate(prompts, max_new_tokens=5,
                                                                                stop_at_eos=False).sequences
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=2, max_batch_size=4)
    result = engine.generate(prompts, max_new_tokens=5, stop_at_eos=False)
    assert result.sequences == expected
    assert result.stats.to_dict()["zero_copy_bytes"] > 0


def test_cli_bad_arguments_exit_without_traceback(checkpoint_factory, capsys):
    from moeprefetch.cli import main

    path = str(checkpoint_factory("v3"))
    capsys.readouterr()  # the checkpoint builder's progress bar
    for argv, message in [
        (["generate", path, "--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens must be a positive"),
        (["generate", path, "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["generate", path, "--prompt", "hi"], "no tokenizer"),
        (["generate", path, "--prompt-ids", "1,2", "--predictor", "crystal_ball"], "unknown predictor"),
        (["generate", path, "--prompt-ids", "1,2", "--cache-fraction", "1.5"], "--cache-fraction must lie in"),
        (["generate", path, "--prompt-ids", "1,2", "--cache-slots", "4", "--all-resident"],
         "give one of --cache-slots or --all-resident, not both"),
        (["generate", path, "--prompt-ids", "1,2", "--cache-slots", "4", "--vram-budget", "1GiB"], "not both"),
        (["generate", path, "--prompt-ids", "1,2", "--lookahead", "0"], "lookahead must be a positive integer"),
        (["generate", path, "--prompt-ids", "1,2", "--max-seq-len", "0"], "max_seq_len must be a positive integer"),
        (["generate", path, "--prompt-ids", "1,2", "--prefill-chunk", "0"], "prefill_chunk must be a positive integer"),
        (["generate", path, "--prompt-ids", "1,2", "--prefill-window", "-8"], "prefill_window must be a positive"),
        (["generate", path, "--prompt-ids", "1,2", "--stats-json", "/no/such/dir/s.json"], "cannot be written"),
        (["generate", path, "--prompt-ids", "1,2", "--stats-json", "/tmp"], "--stats-json /tmp is a directory"),
        (["generate", path, "--prompt-ids", "1,2", "--int4-group-size", "64"], "int4_group_size shapes int4 experts"),
        (["generate", path, "--prompt-ids", "1,2", "--min-confidence", "2"], "min_confidence must be a number"),
        (["generate", path, "--prompt-ids", "1,2", "--max-batch-size", "0"], "max_batch_size must be a positive"),
        (["generate", path, "--prompt-ids", "1,2", "--lrfu-halflife", "0"], "lrfu_halflife must be a number of steps"),
        (["generate", path, "--prompt-ids", "1,2", "--policy", "mru"], "unknown cache policy 'mru'"),
        (["generate", path, "--prompt-ids", "1,2", "--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
        (["generate", path, "--prompt-ids", "1,2", "--logit-bias", "99999=1"], "not a token id of the vocabulary"),
        (["generate", path, "--prompt-ids", "1,2", "--logit-bias", "5=-300"], "must be a number in [-100, 100]"),
        (["generate", path, "--prompt-ids", "1,2", "--presence-penalty", "3"], "presence_penalty must be a number"),
        # empty values are mistakes too, not the defaults
        (["generate", path, "--prompt-ids", "1,2", "--predictor="], "predictor must be a non-empty name"),
        (["generate", path, "--prompt-ids", "1,2", "--vram-budget="], "cannot read memory size ''"),
        (["generate", path, "--prompt-ids", "1,2", "--dtype="], "dtype '' is not supported"),
        (["generate", path, "--prompt-ids", "1,2", "--temperature", "1e300"], "temperature must be at most"),
        (["generate", path, "--prompt-ids", "1,2", "--bypass"], "bypass acts on a learned routing head"),
        (["generate", path, "--prompt-ids", "1,2", "--max-batch-size", "100000000"], "host RAM is too small"),
        (["generate", path, "--prompt-ids", "1,2", "--lookahead", "3"], "--lookahead 3 means nothing to the default"),
        (["generate", path, "--max-new-tokens", "2"], "give token ids with --prompt-ids"),
    ]:
        assert main(argv) == 2
        captured = capsys.readouterr()
        err = captured.err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
        assert captured.out == ""  # nothing echoed before the error
    # what argparse itself refuses: one line too (not its usage block), exit 2
    for argv, message in [(["generate", path, "--seed", "x"], "argument --seed: invalid int value: 'x'"),
                          (["generate", path, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                          (["bogus"], "invalid choice: 'bogus'")]:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith("error: ") and message in err
        assert err.count("\n") == 1 and "usage:" not in err and "--help" in err


def test_cli_report_on_bad_results_and_verbose_anywhere(checkpoint_factory, tmp_path, capsys):
    from moeprefetch.cli import main

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for argv, message in [
        (["report", str(garbage), "--out", str(tmp_path / "a")], "is not JSON"),
        (["report", str(empty), "--out", str(tmp_path / "b")], "holds no successful sweep points"),
        (["report", str(tmp_path / "missing.jsonl")], "is not a file"),
        (["report", str(tmp_path / "stats.json")], "is not a file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # no empty output folders
    path = str(checkpoint_factory("v3"))
    assert main(["info", path, "-v"]) == 0 and main(["-v", "info", path]) == 0


# ---- limits and faults --------------------------------------------------------------------------------------------


def test_host_ram_too_small_fails_before_allocating(checkpoint_factory):
    from moeprefetch.expert_records import ExpertFormat

    fmt = ExpertFormat.build(64, 32, torch.float32)
    with pytest.raises(ResourceError, match=r"host RAM is too small: the expert store .* needs"):
        HostExpertStore(fmt, [1, 2], 8, pin=False, available_ram=1024)


def test_pinning_refused_falls_back_to_pageable_with_a_warning(caplog):
    from moeprefetch.expert_records import ExpertFormat

    fmt = ExpertFormat.build(64, 32, torch.float32)
    store = HostExpertStore(fmt, [1, 2], 4, pin=True, pin_fn=lambda t: PinResult(False, 0.0, "cudaErrorNotPermitted"))
    with caplog.at_level(logging.WARNING, logger="moeprefetch.store"):
        store.fill(lambda layer, expert, out: out.fill_(expert), progress=False)
    assert not store.pinned and store.pinned_bytes == 0
    assert "falling back to pageable memory" in caplog.text and "4x slower" in caplog.text
    assert store.record(2, 3)[0].item() == 3


def test_a_pinned_store_is_unpinned_once_whether_closed_or_dropped(monkeypatch):
    """A store dropped without close() unregisters its arena when collected (the allocator may reuse the addresses
    for the next store, whose registration CUDA would refuse); close() unregisters now and never a second time."""
    import gc

    from moeprefetch import store as store_module
    from moeprefetch.expert_records import ExpertFormat

    unpinned: list[int] = []
    monkeypatch.setattr(store_module, "_unregister", unpinned.append)
    fmt = ExpertFormat.build(64, 32, torch.float32)

    def pinned_store() -> HostExpertStore:
        s = HostExpertStore(fmt, [1, 2], 4, pin=True, pin_fn=lambda t: PinResult(True, 0.0))
        s.fill(lambda layer, expert, out: out.fill_(expert), progress=False)
        return s

    closed = pinned_store()
    address = closed.arena.data_ptr()
    closed.close()
    closed.close()
    del closed
    gc.collect()
    assert unpinned == [address]
    dropped = pinned_store()
    address = dropped.arena.data_ptr()
    del dropped
    gc.collect()
    assert unpinned[1:] == [address]


def test_out_of_memory_during_a_step_leaves_the_engine_usable(checkpoint_factory, monkeypatch):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=8)
    expected = engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences
    from moeprefetch import decode

    calls = {"n": 0}
    original = decode.DecodeStep._routed

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args)

    monkeypatch.setattr(decode.DecodeStep, "_routed", failing)
    with pytest.raises(ResourceError, match="ran out of memory during generation"):
        engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
    monkeypatch.setattr(decode.DecodeStep, "_routed", original)
    assert not engine.residency.problems()
    assert engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences == expected


def test_a_failure_while_settling_a_failed_call_leaves_the_engine_usable(checkpoint_factory, monkeypatch):
    """A call fails, and settling the expert table after it fails too: the error reaches the caller and the engine
    is not left busy for every later call."""
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=8)
    expected = engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences
    original_abort = engine.residency.abort

    def failing_abort():
        original_abort()
        raise RuntimeError("settling failed")

    def failing_forward(*args):
        raise RuntimeError("the forward failed")

    def failing_end_call():
        raise RuntimeError("ending failed")

    monkeypatch.setattr(engine.runner, "forward_block", failing_forward)
    monkeypatch.setattr(engine.residency, "abort", failing_abort)
    monkeypatch.setattr(engine.residency, "end_call", failing_end_call)  # the table as broken as its settling
    with pytest.raises(RuntimeError, match="settling failed"):
        engine.forward([[3, 4, 5]])
    monkeypatch.undo()
    assert engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences == expected


def test_ctrl_c_returns_the_tokens_so_far_and_leaves_a_consistent_cache(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=8)
    full = engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False, predictor="mtp").sequences[0]
    seen = []

    def interrupt_after_five(event):
        seen.append(event.token)
        if len(seen) == 5:
            raise KeyboardInterrupt

    result = engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False, predictor="mtp",
                             callback=interrupt_after_five)
    assert result.interrupted and result.finish_reasons == ["interrupted"]
    assert result.sequences[0] == full[: len(result.sequences[0])] and 5 <= len(result.sequences[0]) < 12
    assert not engine.residency.problems()
    again = engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False, predictor="mtp").sequences[0]
    assert again == full


def test_ctrl_c_from_the_streaming_iterator_consumer_stops_cleanly(checkpoint_factory, monkeypatch):
    from moeprefetch import decode

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=8)
    full = engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False).sequences[0]
    stream = engine.stream([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False)
    next(stream), next(stream)
    stream.close()  # the consumer walks away mid-generation
    assert not engine.residency.problems()
    assert len(engine.generate([[3, 4, 5]], max_new_tokens=4).sequences[0]) >= 1
    # Ctrl-C while the engine computes a streamed token: the call settles, then the consumer's loop sees it
    original, calls = decode.DecodeStep._routed, {"n": 0}

    def interrupted(self, *args):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(decode.DecodeStep, "_routed", interrupted)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        for event in engine.stream([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False):
            seen.append(event.token)
    monkeypatch.setattr(decode.DecodeStep, "_routed", original)
    assert 1 <= len(seen) < 12 and seen == full[: len(seen)] and not engine.residency.problems()
    assert engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False).sequences[0] == full


# ---- long runs ----------------------------------------------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.slow
def test_thousands_of_decode_steps_and_many_calls_keep_memory_flat(checkpoint_factory):
    path = checkpoint_factory("v3", max_position_embeddings=4096)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8, max_seq_len=4096)
    engine.generate([[3, 4]], max_new_tokens=200, stop_at_eos=False, predictor="mtp+next_layer_gate")
    before = _rss_mib()
    result = engine.generate([[3, 4]], max_new_tokens=3000, stop_at_eos=False, predictor="mtp+next_layer_gate")
    assert len(result.sequences[0]) == 3000
    after_long = _rss_mib()
    for _ in range(60):  # many sweep points on one engine
        engine.reset_expert_cache()
        engine.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False, predictor="oracle")
    after_many = _rss_mib()
    assert after_long - before < 64, (before, after_long)
    assert after_many - after_long < 64, (after_long, after_many)
    assert len(engine.routing_profile) <= engine.plan.total_experts


# ---- regressions found in review ----------------------------------------------------------------------------------


def test_interrupted_forward_with_streamed_layers_leaves_correct_weights(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("v3")
    expected = MoEPrefetchEngine.from_pretrained(path, progress=False).generate([[3, 4, 5]], max_new_tokens=6,
                                                                               stop_at_eos=False).sequences
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, stream_layers=3, stream_ahead=1,
                                               expert_cache_slots=8)
    from moeprefetch import runner

    original = runner.ModelRunner.layer_block
    calls = {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(runner.ModelRunner, "layer_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.forward([[1, 2, 3]])
    monkeypatch.setattr(runner.ModelRunner, "layer_block", original)
    assert engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences == expected


def test_one_call_at_a_time_and_a_failing_callback_closes_its_call(engine, expected):
    stream = engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
    next(stream)
    with pytest.raises(RequestError, match="still running"):
        engine.generate([[3, 4, 5]], max_new_tokens=2)
    with pytest.raises(RequestError, match="still running"):
        engine.forward([[3, 4, 5]])
    stream.close()

    def broken(event):
        raise ValueError("callback bug")

    with pytest.raises(ValueError, match="callback bug"):
        engine.generate([[3, 4, 5]], max_new_tokens=6, callback=broken)
    assert engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences == expected


def test_more_bad_options(checkpoint_factory, engine, tmp_path):
    path = checkpoint_factory("v3")
    for budget in (float("nan"), float("inf")):
        with pytest.raises(RequestError, match="prefetch_budget"):
            MoEPrefetchEngine.from_pretrained(path, progress=False, prefetch_budget=budget)
    with pytest.raises(RequestError, match="names no routed expert"):
        MoEPrefetchEngine.from_pretrained(path, progress=False, policy="static", expert_cache_slots=8,
                                          hot_set=[(0, 1)])  # layer 0 is dense
    static = MoEPrefetchEngine.from_pretrained(path, progress=False, policy="static", expert_cache_slots=8,
                                               hot_set=[[1, 2], [2, 3]])  # JSON-style lists are fine
    pinned = static.residency.st.pinned.nonzero().flatten().tolist()
    assert pinned == [static.residency.key(1, 2), static.residency.key(2, 3)]
    with pytest.raises(RequestError, match="share must be a number"):
        static.set_hot_set_from_profile(share=None)
    with pytest.raises(RequestError, match="event_log .* cannot be written"):
        engine.generate([[3, 4]], max_new_tokens=2, event_log=tmp_path / "missing" / "events.jsonl")
    with pytest.raises(RequestError, match="event_log .* is a directory"):  # before any token, not lost after
        engine.generate([[3, 4]], max_new_tokens=2, event_log=tmp_path)
    with pytest.raises(RequestError, match="callback must be a function"):
        engine.generate([[3, 4]], max_new_tokens=2, callback=5)
    for bad in (5, b"model"):  # no path (None) is the bundled reference model
        with pytest.raises(RequestError, match="path must be a checkpoint directory"):
            MoEPrefetchEngine.from_pretrained(bad)
    with pytest.raises(RequestError, match="config must be an EngineConfig"):
        MoEPrefetchEngine.from_pretrained(path, config=[("expert_cache_slots", 8)])
    with MoEPrefetchEngine.from_pretrained(path, config={"expert_cache_slots": 8, "progress": False}) as mapped:
        assert mapped.residency.n_slots == 8  # a mapping of options is a config too


def test_close_releases_the_pool_and_the_host_store(checkpoint_factory):
    import gc
    import weakref

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, expert_cache_slots=4)
    engine.generate([[3, 4, 5]], max_new_tokens=4, stop_at_eos=False, predictor="mtp+next_layer_gate")
    arena = weakref.ref(engine.residency.store.arena)
    pool = weakref.ref(engine.residency.pool)
    with engine:
        pass  # leaving the block closes it
    gc.collect()
    assert arena() is None and pool() is None  # nothing keeps the experts' memory alive
    for call in (lambda: engine.generate([[3]], max_new_tokens=2), lambda: engine.forward([[3]]),
                 engine.memory_stats):
        with pytest.raises(RequestError, match="has been closed"):
            call()
    engine.close()  # closing twice is harmless


def test_close_during_a_call_abandons_it_in_one_sentence(checkpoint_factory):
    """close() from a callback, or with a stream suspended, frees the engine and ends that call: resuming it is one
    sentence (it was an AttributeError on a freed engine), and a `with` block left with a stream suspended closes
    without raising."""
    path = checkpoint_factory("v3")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=4)
    stream = engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
    next(stream)
    engine.close()
    with pytest.raises(RequestError, match="closed during the call"):
        next(stream)
    with pytest.raises(RequestError, match="has been closed"):
        engine.generate([[3]], max_new_tokens=2)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=4)
    with pytest.raises(RequestError, match="closed during the call"):
        engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False, callback=lambda event: engine.close())
    with MoEPrefetchEngine.from_pretrained(path, progress=False) as engine:
        suspended = engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
        next(suspended)
    assert engine.residency is None  # closed on leaving the block
    with pytest.raises(RequestError, match="closed during the call"):
        next(suspended)
    # streams made but not started are checked when they start: on a closed engine, and beside a running one
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=4)
    expected = engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False).sequences[0]
    first = engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
    second = engine.stream([[6, 7]], max_new_tokens=6, stop_at_eos=False)
    tokens = [next(first).token]
    with pytest.raises(RequestError, match="still running"):
        next(second)
    tokens += [event.token for event in first]
    assert tokens == expected  # the refused stream touched nothing of the running one
    unstarted = engine.stream([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False)
    engine.close()
    with pytest.raises(RequestError, match="has been closed"):
        next(unstarted)
