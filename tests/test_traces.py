"""traces.py: routing trace files (the format of ../shared/traces) and `routing_trace=`, decode routing forced from
one; scripts/record_trace.py, which writes a checkpoint's own."""

from __future__ import annotations

import json

import pytest
import torch

from moeprefetch.errors import RequestError
from moeprefetch.kernels.router import RouterShape, select_experts_reference
from moeprefetch.traces import ForcedRouting, TraceError, load_trace, trace_from_needed, write_trace


def random_experts(tokens: int, layers: int, experts: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                        for _ in range(tokens)])


def test_a_written_trace_reads_back_with_its_layers_and_router_order(tmp_path):
    experts = random_experts(7, 3, 16, 4)
    write_trace(tmp_path / "t.jsonl", [1, 2, 5], experts)
    first = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert first[:4] == [[1, e] for e in experts[0, 0].tolist()]  # the nvmoe layout: [layer, expert] in order
    trace = load_trace(tmp_path / "t.jsonl", n_experts=16)
    assert trace.layers == (1, 2, 5) and trace.top_k == 4 and trace.tokens == 7 and trace.n_experts == 16
    assert torch.equal(trace.experts, experts)
    needed = trace.needed()
    assert needed.shape == (7, 3, 16) and int(needed.sum()) == 7 * 3 * 4
    assert bool(needed[2, 1, experts[2, 1]].all())
    assert torch.equal(trace_from_needed(needed, trace.layers), experts.sort(-1).values)
    steps = trace.steps()
    assert steps[3] == [(p, e) for p in range(3) for e in experts[3, p].tolist()]
    assert load_trace(tmp_path / "t.jsonl").n_experts == int(experts.max()) + 1  # inferred
    assert trace.head(2).tokens == 2


@pytest.mark.parametrize("lines,message", [
    (["[[1, 2], [1, 3]]", "not json"], "line 2 is not JSON"),
    (["[[1, 2], [1, 3]]", "[[1, 2], [2, 3]]"], "every token must route the same MoE layers"),
    (["[[1, 2], [1, 2]]"], "chooses an expert twice"),
    (["[[1, 2], [2, 3], [1, 4]]"], "layer 1 in two places"),
    (["[[1, 2], [1, 3], [2, 4]]"], "same number of experts in every layer"),
    (["[[1, 2]]", "[[1, 2], [1, 3]]"], "same number of experts"),
    (["{\"layer\": 1}"], r"array of \[layer, expert\] integer pairs"),
    (["[[1, 2.5]]"], "integer pairs"),
    (["[[1, -2]]"], "negative expert"),
    (["", "  "], "holds no tokens"),
])
def test_a_malformed_trace_is_one_sentence(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path)
    assert "\n" not in str(info.value) and isinstance(info.value, RequestError)


def test_a_trace_that_is_not_utf8_text_is_one_sentence(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(b"\xff\xfe[[1, 2]]\n" + bytes(range(128, 200)))
    with pytest.raises(TraceError, match="is not UTF-8 text") as info:
        load_trace(path)
    assert "\n" not in str(info.value)


def test_trace_ids_must_fit_the_experts(tmp_path):
    write_trace(tmp_path / "t.jsonl", [0], torch.tensor([[[9, 2]]]))
    with pytest.raises(TraceError, match="names expert 9, but the layers have 8 experts"):
        load_trace(tmp_path / "t.jsonl", n_experts=8)
    with pytest.raises(TraceError, match="is not a file"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("shape", [
    RouterShape(16, 3, 4, 2, "noaux_tc", sigmoid=True, norm_topk_prob=True, scaling=2.5),
    RouterShape(16, 3, 1, 1, "greedy", sigmoid=False, norm_topk_prob=False, scaling=1.0),
])
def test_forced_routing_weights_are_the_routers_own_for_the_traces_experts(shape):
    """Forced experts get the weights the router's selection would give them, also in groups the selection drops;
    row b of a batch reads token (step + b * tokens / batch) of the trace."""
    experts = random_experts(6, 2, 16, 3, seed=1)
    from moeprefetch.traces import DecodeTrace

    forced = ForcedRouting(DecodeTrace((1, 2), experts, 16), shape, torch.device("cpu"))
    logits = torch.randn(2, 16, dtype=torch.float64).float()
    ids, weights = forced.route(1, logits, torch.tensor([4]))
    assert ids.tolist() == [experts[4, 1].tolist(), experts[(4 + 3) % 6, 1].tolist()]
    scores = logits.double().sigmoid() if shape.sigmoid else logits.double().softmax(-1)
    expected = scores.gather(1, ids)
    if shape.norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), expected * shape.scaling, rtol=1e-5, atol=1e-6)  # fp32 arithmetic
    # where the trace agrees with the router, the weights are the selection's own, bit for bit (same logits tensor:
    # the CPU's vector kernels may round a row differently in a tensor of another shape)
    own_ids, own_weights, _ = select_experts_reference(shape, logits, None)
    agreeing = experts.clone()
    agreeing[0, 0], agreeing[3, 0] = own_ids[0], own_ids[1]  # rows 0 and 1 read tokens 0 and 3 at step 0
    ids, weights = ForcedRouting(DecodeTrace((1, 2), agreeing, 16), shape, torch.device("cpu")).route(
        0, logits, torch.tensor([0]))
    assert torch.equal(ids, own_ids) and torch.equal(weights, own_weights)


def test_routing_trace_forces_decode_routing_and_keeps_tokens_across_cache_sizes(checkpoint_factory, tmp_path):
    """The engine's decode steps use the trace's experts at every main MoE layer (the recorded routing equals the
    trace's rows); tokens do not depend on the cache size or the predictor."""
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.analysis import record_routing

    path = checkpoint_factory("v3")
    probe = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    moe, n, k = probe.args.moe_layers, probe.args.n_routed_experts, probe.args.num_experts_per_tok
    experts = random_experts(5, len(moe), n, k, seed=2)
    write_trace(tmp_path / "t.jsonl", moe, experts)
    probe.close()
    runs = []
    for slots, predictor in ((None, "none"), (5, "none"), (5, "oracle_next"), (9, "mtp+next_layer_gate")):
        options = dict(expert_cache_slots=slots) if slots else {}
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64,
                                                   routing_trace=str(tmp_path / "t.jsonl"), **options)
        runs.append(engine.generate([[3, 4, 5]], max_new_tokens=6, stop_at_eos=False, predictor=predictor).sequences)
        if slots == 5 and predictor == "none":
            recorded = record_routing(engine, [3, 4, 5], 6)
            decode = recorded.uses[recorded.first_decode:]
            per_step = len(moe) * k  # distinct experts per main layer (the MTP head does not run without mtp)
            for step in range(5):
                uses = decode[step * per_step:(step + 1) * per_step]
                for p, layer in enumerate(moe):
                    chosen = {e for lay, e in uses if lay == layer}
                    assert chosen == set(experts[step, p].tolist()), (step, layer)
            with pytest.raises(RequestError, match="speculative decoding computes two tokens per step"):
                engine.generate([[3, 4]], max_new_tokens=3, speculative="mtp")
        engine.close()
    assert all(r == runs[0] for r in runs)


def test_a_routing_trace_that_does_not_fit_the_model_is_refused(checkpoint_factory, tmp_path):
    from moeprefetch import MoEPrefetchEngine

    write_trace(tmp_path / "t.jsonl", [1], torch.tensor([[[0, 1]]]))
    with pytest.raises(TraceError, match="routes 1 MoE layers top-2, but the model has"):
        MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=64,
                                          routing_trace=str(tmp_path / "t.jsonl"))
    with pytest.raises(RequestError, match="routing_trace must be the path"):
        MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, routing_trace=3)


def test_record_trace_writes_the_decode_routing_that_replays_read(checkpoint_factory, tmp_path):
    """scripts/record_trace.py: one row per decode token of each prompt, the layers' experts as the table recorded
    them; the file loads back and replays."""
    from conftest import load_script
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.analysis import record_routing
    from moeprefetch.replay import ReplaySetup, replay

    script = load_script("record_trace")
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=64,
                                               expert_cache_slots=5)
    experts = script.record(engine, [[3, 4, 5], [9, 8]], 6)
    moe, k = engine.args.moe_layers, engine.args.num_experts_per_tok
    assert experts.shape == (10, len(moe), k)  # 5 decode tokens per prompt
    engine.reset_expert_cache(forget_routing=True)
    uses = record_routing(engine, [9, 8], 6)
    second = [(moe[p], e) for token in experts[5:].tolist() for p, chosen in enumerate(token) for e in chosen]
    assert sorted(second) == sorted(uses.uses[uses.first_decode:])
    write_trace(tmp_path / "t.jsonl", moe, experts)
    trace = load_trace(tmp_path / "t.jsonl", engine.args.n_routed_experts)
    assert replay(trace, ReplaySetup(slots=5, expert_bytes=100)).uses == 10 * len(moe) * k
