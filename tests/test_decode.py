"""The device-driven decode on real runs (CPU reference path): bit-identical tokens for every cache size, policy,
predictor, batch and speculation, and the accounting invariants of the table's counters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import moeprefetch
from moeprefetch import EngineConfig, MoEPrefetchEngine
from moeprefetch.errors import RequestError
from moeprefetch.residency import Residency

PREDICTORS = ["none", "previous", "next_layer_gate", "mtp", "mtp_router", "oracle", "mtp+next_layer_gate",
              "mtp_router+next_layer_gate", "previous+next_layer_gate"]


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)
    logits = engine.forward([[3, 4, 5, 6, 7]])
    return path, prompts, result.sequences, logits, engine.plan.total_experts


def check_invariants(stats: dict, expert_bytes: int) -> None:
    assert stats["hits"] + stats["misses"] == stats["expert_uses"]
    assert stats["bytes_h2d"] == stats["zero_copy_bytes"] + stats["fill_bytes"]
    # the CPU path completes every fill it starts: whole records only
    assert stats["zero_copy_bytes"] % expert_bytes == 0 and stats["fill_bytes"] % expert_bytes == 0
    assert stats["prefetch_issued"] == stats["prefetch_useful"] + stats["prefetch_late"] + stats["prefetch_wasted"]
    for key in ("prediction_recall_main_layers", "prediction_precision_main_layers"):
        assert stats[key] is None or 0 <= stats[key] <= 1
    layers = stats["per_layer"].values()
    for key in ("expert_uses", "hits", "misses", "bytes_h2d", "evictions", "prefetch_issued", "prefetch_wasted"):
        assert sum(layer[key] for layer in layers) == stats[key], key
    assert stats["syncs_per_token"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lrfu", "lfu", "static"])
def test_every_cache_size_policy_and_predictor_gives_identical_tokens(reference, policy):
    path, prompts, expected, logits, total = reference
    hot = [(1, e) for e in range(2)] if policy == "static" else None
    top_k = 3
    for slots in ((top_k, 7, 11, total // 2, total) if policy != "static" else (5, 11, total // 2)):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots, policy=policy,
                                                   hot_set=hot)
        assert torch.equal(engine.forward([[3, 4, 5, 6, 7]]), logits)  # prefill path: bit-identical too
        for predictor in PREDICTORS:
            engine.reset_expert_cache()
            result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, policy, predictor)
            check_invariants(result.stats.to_dict(), engine.residency.expert_bytes)
            assert not engine.residency.problems()
        spec = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, speculative="mtp",
                               predictor="next_layer_gate")
        assert spec.sequences == expected
        assert 0 <= spec.stats.to_dict()["draft_acceptance"] <= 1



def test_drafts_below_verify_confidence_are_not_checked_and_move_no_expert_bytes():
    """speculative='mtp' with verify_confidence: the tokens stay plain decode's at every cut and cache size; a
    higher cut checks fewer drafts (tokens per step fall towards 1) and reads fewer draft experts (bytes per token
    fall towards plain decode's). The shipped reference model: its MTP head is trained, so drafts' confidences
    spread over (0, 1)."""
    reference_model = Path(moeprefetch.__file__).parent / "reference_model"
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89], [7, 11, 13]]
    with MoEPrefetchEngine.from_pretrained(reference_model, progress=False) as resident:
        expected = resident.generate(prompts, max_new_tokens=16, stop_at_eos=False).sequences
        total = resident.plan.total_experts
    for slots in (total // 4,):  # offloaded, where unchecked drafts save bytes
        with MoEPrefetchEngine.from_pretrained(reference_model, progress=False, expert_cache_slots=slots) as engine:
            runs = {}
            for cut in (0.0, 0.5, 1.0):
                engine.options = dataclasses.replace(engine.options, verify_confidence=cut)
                engine.reset_expert_cache(forget_routing=True)
                result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
                assert result.sequences == expected, (slots, cut)
                stats = result.stats.to_dict()
                check_invariants(stats, engine.residency.expert_bytes)
                assert stats["draft_accepted"] <= stats["draft_proposed"] <= 2 * stats["decode_steps"]
                runs[cut] = stats
            checked = [runs[cut]["draft_proposed"] for cut in (0.0, 0.5, 1.0)]
            assert checked[0] > checked[1] > checked[2] >= 0, checked
            steps = [runs[cut]["decode_steps"] for cut in (0.0, 0.5, 1.0)]
            assert steps[0] < steps[2], steps  # fewer drafts checked: fewer tokens per step
            moved = [runs[cut]["decode_bytes_h2d_per_token"] for cut in (0.0, 1.0)]
            assert moved[1] < moved[0], moved  # unchecked drafts read none of their experts
    with pytest.raises(RequestError, match="verify_confidence must be a number in \\[0, 1\\]"):
        EngineConfig(verify_confidence=1.5).check()

@pytest.mark.slow  # the fast lane's chains: test_speculation's chain-length choices (tokens checked there too)
@pytest.mark.parametrize("draft_tokens", [2, 3])
def test_chained_drafts_keep_plain_decodes_tokens_and_count_each_position(draft_tokens):
    """speculative='mtp' with draft_tokens > 1 (the MTP head chained on its own output, every draft checked in one
    step): greedy and sampled tokens are plain decode's, resident and offloaded. Every generated token after the
    first is a live row's sampled one or a kept draft's; a draft is only kept after the ones before it, and with
    the shipped model's trained head the chain adds tokens per step over one draft."""
    reference_model = Path(moeprefetch.__file__).parent / "reference_model"
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89], [7, 11, 13]]
    sampling = [dict(), dict(temperature=0.8, seed=3)]
    with MoEPrefetchEngine.from_pretrained(reference_model, progress=False) as resident:  # draft_tokens=1
        expected = [resident.generate(prompts, max_new_tokens=24, stop_at_eos=False, **kw).sequences
                    for kw in sampling]
        total = resident.plan.total_experts
        one_draft = resident.generate(prompts, max_new_tokens=24, stop_at_eos=False, speculative="mtp")
    per_step = {}
    for slots in (None, total // 4):
        sized = {} if slots is None else dict(expert_cache_slots=slots)
        with MoEPrefetchEngine.from_pretrained(reference_model, progress=False, draft_tokens=draft_tokens,
                                               **sized) as engine:
            for kw, tokens in zip(sampling, expected):
                result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, speculative="mtp", **kw)
                assert result.sequences == tokens, (slots, kw)
                stats = result.stats.to_dict()
                check_invariants(stats, engine.residency.expert_bytes)
                assert stats["generated_tokens"] == len(prompts) + stats["draft_offered"] + stats["draft_accepted"]
                proposed, accepted = (result.stats.draft_proposed_by_position,
                                      result.stats.draft_accepted_by_position)
                assert len(proposed) == draft_tokens and all(a <= p for a, p in zip(accepted, proposed))
                # position j + 1 is reached only where position j was kept
                assert all(proposed[j + 1] <= accepted[j] for j in range(draft_tokens - 1))
                assert stats["draft_accepted"] == sum(accepted)
                per_step[slots, bool(kw)] = stats["tokens_per_verify_step"]
    # one draft (the default) gains less per step than the chain
    assert per_step[None, False] > one_draft.stats.to_dict()["tokens_per_verify_step"]


@pytest.mark.slow  # verify_rows="shared" is off by default: the full suite checks it
@pytest.mark.parametrize("variant", ["reference", "glm4"])
def test_shared_rows_keep_the_tokens_in_every_mode_and_up_to_the_cache_end(checkpoint_factory, variant):
    """verify_rows='shared' (every step one batch of 1 + draft_tokens rows a sequence: the real row, the drafts or
    shadow row, padding rows): plain, shadow-row and verify steps (of the loaded chain, a shorter one, confident
    drafts only) give the tokens and log-probabilities of the same layout's all-resident plain decode, offloaded
    too, greedy and sampled, on MLA (the shipped model, a trained MTP head) and grouped-query attention (GLM-4.5's
    layout); and a run to the last position max_seq_len allows, whose padding rows would sit past the cache, keeps
    the uncached forward's greedy tokens."""
    path = Path(moeprefetch.__file__).parent / "reference_model" if variant == "reference" \
        else checkpoint_factory(variant)
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89], [7, 11, 13], [19, 23, 29, 31, 37]]
    sampling = [dict(logprobs=2), dict(temperature=0.8, seed=3)]
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, draft_tokens=2,
                                           verify_rows="shared") as resident:
        expected = [resident.generate(prompts, max_new_tokens=16, stop_at_eos=False, **kw) for kw in sampling]
        total = resident.plan.total_experts
    for slots in (None, total // 4):
        sized = {} if slots is None else dict(expert_cache_slots=slots)
        with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, draft_tokens=2,
                                               verify_rows="shared", **sized) as engine:
            assert engine.options.verify_rows == "shared"
            loaded = engine.options
            # verify steps of the loaded chain, of a shorter one (a padding row beside the draft), and checking
            # only confident drafts (unchecked draft rows)
            for options in (dict(), dict(draft_tokens=1), dict(verify_confidence=0.5)):
                engine.options = dataclasses.replace(loaded, **options)
                for kw, want in zip(sampling, expected):
                    for mode in (dict(), dict(predictor="mtp"), dict(speculative="mtp")):
                        result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, **mode, **kw)
                        assert result.sequences == want.sequences, (slots, kw, mode, options)
                        if "logprobs" in kw:  # the log-probabilities too (logits of row 0 and of draft rows)
                            assert [[e.logprob for e in row] for row in result.logprobs] == \
                                [[e.logprob for e in row] for row in want.logprobs], (slots, mode, options)
                        check_invariants(result.stats.to_dict(), engine.residency.expert_bytes)
            assert not engine.residency.problems()
    # the last position: 4 drafts make 5 rows a sequence, and the padding rows of the last steps clamp to the cache
    prompt, seq_len = prompts[0], 24
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=seq_len, draft_tokens=4,
                                           verify_rows="shared") as engine:
        longest = seq_len - len(prompt) - 2  # requests keep two positions beyond the last token
        got = engine.generate([prompt], max_new_tokens=longest, stop_at_eos=False).sequences[0]
        ids = list(prompt)
        for _ in range(longest):
            ids.append(int(engine.forward([ids])[0, -1].argmax()))
        assert got == ids[len(prompt):]


def test_speculation_serves_what_plain_decode_serves_near_the_context_end(caplog):
    """A call that fits plain decode but not its draft rows (draft_tokens=4 reaches 7 positions further) decodes
    plainly, with the same tokens, and says so (a warning for speculative='mtp'); one that fits neither is one
    sentence naming the positions the step writes beyond the tokens."""
    caplog.set_level("INFO", logger="moeprefetch.requests")
    reference_model = Path(moeprefetch.__file__).parent / "reference_model"
    prompt = list(range(5, 27))
    with MoEPrefetchEngine.from_pretrained(reference_model, progress=False, max_seq_len=64, draft_tokens=4) as engine:
        plain = engine.generate([prompt], max_new_tokens=40, stop_at_eos=False)
        for mode in ("mtp", "auto"):
            caplog.clear()
            result = engine.generate([prompt], max_new_tokens=40, stop_at_eos=False, speculative=mode)
            assert result.sequences == plain.sequences and "draft_offered" not in result.stats.to_dict()
            assert any("speculation off for this call" in r.message for r in caplog.records), mode
        with pytest.raises(RequestError, match="needs 65 positions \\(the decode step writes 2 beyond them\\)"):
            engine.generate([prompt], max_new_tokens=41, stop_at_eos=False, speculative="mtp")
        assert engine.generate([prompt], max_new_tokens=16, stop_at_eos=False, speculative="mtp").stats \
            .to_dict()["draft_offered"] > 0  # room for the drafts: speculation runs


def test_draft_tokens_is_checked(checkpoint_factory, capsys):
    """One sentence for a chain the engine cannot run: from the options, the command line, and a chain longer than
    the engine was loaded for (its steps are shaped at load)."""
    from moeprefetch.cli import main

    for bad in (0, 5, 1.5, True):
        with pytest.raises(RequestError, match="draft_tokens must be"):
            EngineConfig(draft_tokens=bad).check()
    path = checkpoint_factory("v3_groups_qlora_yarn")
    capsys.readouterr()
    assert main(["generate", str(path), "--prompt-ids", "1,2", "--speculative", "mtp", "--draft-tokens", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "draft_tokens must be at most 4" in err and "Traceback" not in err
    for bad in ("both", None, 1):
        with pytest.raises(RequestError, match="verify_rows must be one of separate, shared"):
            EngineConfig(verify_rows=bad).check()
    with pytest.raises(SystemExit) as exited:  # argparse's choices: one line, exit 2
        main(["generate", str(path), "--prompt-ids", "1,2", "--verify-rows", "both"])
    assert exited.value.code == 2 and "invalid choice: 'both'" in capsys.readouterr().err
    with MoEPrefetchEngine.from_pretrained(path, progress=False) as engine:  # loaded for one draft
        expected = engine.generate([[3, 4, 5]], max_new_tokens=4, stop_at_eos=False).sequences
        engine.options = dataclasses.replace(engine.options, draft_tokens=3)
        with pytest.raises(RequestError, match="draft_tokens=3 needs 4 rows a sequence, but this engine was loaded "
                                               "for 2: load it with draft_tokens=3"):
            engine.generate([[3, 4, 5]], max_new_tokens=4, stop_at_eos=False, speculative="mtp")
        engine.options = dataclasses.replace(engine.options, draft_tokens=1)  # still usable
        assert engine.generate([[3, 4, 5]], max_new_tokens=4, stop_at_eos=False, speculative="mtp").sequences == \
            expected


def test_batch_of_four_matches_all_resident_at_every_cache_size(reference):
    path, _, _, _, total = reference
    prompts = [[3, 4, 5], [10, 11, 12, 13, 14, 15, 16], [7], [20, 21, 22, 23]]
    expected = MoEPrefetchEngine.from_pretrained(path, progress=False).generate(
        prompts, max_new_tokens=8, stop_at_eos=False).sequences
    for slots in (3, 9, total // 3):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots)
        for predictor in ("none", "mtp+next_layer_gate", "oracle"):
            result = engine.generate(prompts, max_new_tokens=8, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, predictor)
            check_invariants(result.stats.to_dict(), engine.residency.expert_bytes)


def test_draft_experts_change_what_the_mtp_head_reads_never_the_tokens(reference):
    """'cached': the head drafts with the experts in VRAM and never reads one from host during decode; 'all' reads
    every expert it routes to. Tokens are the same either way, for the shadow-row predictor and for speculation."""
    path, prompts, expected, _, _ = reference
    for slots in (3, 11):
        reads = {}
        for mode in ("cached", "all"):
            engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots,
                                                       draft_experts=mode)
            mtp_layer = engine.residency.layers[-1]
            for predictor, speculative in (("mtp", None), ("mtp+next_layer_gate", None), ("none", "mtp")):
                engine.reset_expert_cache()
                result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor,
                                         speculative=speculative)
                assert result.sequences == expected, (slots, mode, predictor, speculative)
                head = result.stats.decode_per_layer[mtp_layer]
                reads[mode, predictor] = head.uses, head.zero_copy
        for predictor in ("mtp", "mtp+next_layer_gate", "none"):
            assert reads["cached", predictor] == (0, 0)
            assert reads["all", predictor][0] > 0


def test_sparing_recent_experts_changes_the_fills_never_the_tokens(reference):
    """Sparing holds a real predictor's prefetches back; an oracle's prefetches are never wrong, so the one-token
    oracle spares nothing whatever the option says."""
    path, prompts, expected, _, _ = reference
    issued, oracle = {}, {}
    for spare in (0, 1, 3):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=7, spare_recent=spare)
        result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="mtp+next_layer_gate")
        assert result.sequences == expected, spare
        issued[spare] = result.stats.to_dict()["prefetch_issued"]
        result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle_next")
        assert result.sequences == expected, spare
        stats = result.stats.to_dict()
        oracle[spare] = stats["prefetch_issued"], stats["decode_misses_per_token"]
    assert issued[0] > issued[1] >= issued[3]  # the longer the memory, the fewer victims a prefetch may take
    assert oracle[0] == oracle[1] == oracle[3] and oracle[0][0] > 0



def test_the_prefetch_lead_changes_when_fills_are_reserved_never_the_tokens(checkpoint_factory):
    """On a model of 6 MoE layers: the oracle's predictions are exact, so each of its prefetches is used at the need
    it was reserved for, and a lead of L MoE layers reserves none more than L layers before it
    (mean_lead_layers <= L); without a lead (0) fills are reserved up to a step ahead."""
    path = checkpoint_factory("v3_groups_qlora_yarn", num_hidden_layers=7)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    expected = MoEPrefetchEngine.from_pretrained(path, progress=False).generate(
        prompts, max_new_tokens=10, stop_at_eos=False).sequences
    leads = {}
    for lead in (0, 1, 2):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=24, prefetch_lead=lead)
        for predictor in ("oracle", "mtp+next_layer_gate"):
            result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (lead, predictor)
            check_invariants(result.stats.to_dict(), engine.residency.expert_bytes)
            if predictor == "oracle":
                stats = result.stats.to_dict()
                assert stats["prefetch_useful"] > 0
                leads[lead] = stats["mean_lead_layers"]
    assert leads[1] <= 1 and leads[2] <= 2 and leads[0] > leads[2] > leads[1], leads

def test_small_caches_admit_misses_and_prefetches_land(reference):
    """A cache smaller than a prefill chunk's experts still works: experts without a free slot stream through
    staging; misses are admitted as they stream; predicted experts arrive before their layer."""
    path, prompts, expected, logits, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=6, prefill_chunk=3)
    stats = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False).stats.to_dict()
    assert stats["misses"] > stats["expert_uses"] / 4 and stats["admitted"] > 0
    assert engine.generate(prompts, max_new_tokens=10, stop_at_eos=False).sequences == expected
    predicted = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle").stats.to_dict()
    assert predicted["prefetch_useful"] > 0 and predicted["fill_bytes"] > 0


@pytest.mark.parametrize("predictor", ["none", "oracle", "oracle_next"])
def test_every_published_slot_holds_its_experts_host_record(reference, predictor):
    """After admissions, fills and evictions the published slots are whole copies of their experts' records, and
    the check sees a slot whose bytes were changed behind the table's back."""
    path, prompts, expected, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=9, spare_recent=0)
    result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
    res = engine.residency
    assert result.sequences == expected and result.stats.to_dict()["admitted"] > 0
    assert res.corrupt_slots() == []
    resident = [s for s in range(res.n_slots) if int(res.st.slot_state[s]) == 1 and int(res.st.key_of[s]) >= 0]
    res.pool[resident[-1], 3] ^= 1
    assert res.corrupt_slots() == [resident[-1]]


def test_the_slot_probe_sees_every_read_whole_and_a_slot_changed_under_a_read(reference):
    """The probe counts every slot read before an expert kernel; on a correct run none is torn. A slot whose bytes
    change behind the table's back is counted as a stale hit when the next read of it comes."""
    path, prompts, expected, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=20, spare_recent=0)
    probe = engine.residency.enable_probe()
    assert engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle").sequences == expected
    counts = probe.report()
    assert counts["checked"] > 0 and counts["waited_early"] == counts["stale_hit"] == counts["overwritten"] == 0
    assert counts["torn_in_table"] == 0 and counts["torn_events"] == []
    probe.mirror ^= 1  # every record now differs from what the slots hold: every read is a stale hit
    engine.generate(prompts, max_new_tokens=2, stop_at_eos=False)
    counts = probe.report()
    published = int((engine.residency.st.slot_state == 1).sum())
    assert counts["stale_hit"] > 0 and counts["torn_in_table"] >= published
    first = counts["torn_events"][0]  # found before the first decode layer's plan, in a slot the prompt filled
    assert (first["position"], first["phase"]) == (0, 0) and first["fill_entry_state"] == -1
    assert 0 <= first["slot"] < engine.residency.n_slots and first["key"] >= 0
    probe.clear()
    assert probe.report()["torn_events"] == []


def test_all_resident_has_no_transfers_and_oracle_recall_is_perfect(reference):
    path, prompts, expected, _, total = reference
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False)
    stats = resident.generate(prompts, max_new_tokens=10, stop_at_eos=False).stats.to_dict()
    assert stats["misses"] == stats["bytes_h2d"] == 0 and stats["hit_rate"] == 1.0
    offloaded = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=12)
    oracle = offloaded.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle").stats.to_dict()
    none = offloaded.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    assert oracle["prediction_recall_main_layers"] == 1.0 and oracle["prediction_precision_main_layers"] == 1.0
    assert oracle["decode_misses_per_token"] < none["decode_misses_per_token"]
    assert none["prediction_recall_main_layers"] is None  # no predictor ran: no figure, not 0 %


def test_cold_cache_compulsory_misses_and_warm_hits(reference):
    path, prompts, _, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=total)
    cold = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    warm = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    # a cache that holds everything misses each expert at most once, then never again
    assert cold["misses"] <= total and cold["evictions"] == 0
    assert warm["misses"] == 0 and warm["expert_uses"] == cold["expert_uses"]


def test_one_synchronisation_per_decode_step(reference):
    path, prompts, _, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8)
    for speculative in (None, "mtp"):
        stats = engine.generate(prompts[:1], max_new_tokens=12, stop_at_eos=False, speculative=speculative,
                                predictor="mtp+next_layer_gate" if speculative is None else "none").stats
        assert stats.decode_syncs == stats.decode_steps
        assert stats.to_dict()["syncs_per_token"] <= 1.0


def test_event_log_jsonl(reference, tmp_path):
    path, prompts, _, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8)
    log = tmp_path / "events.jsonl"
    stats = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False, predictor="mtp+next_layer_gate",
                            event_log=log).stats.to_dict()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["kind"] == "call" and lines[0]["expert_uses"] == stats["expert_uses"]
    layers = [line for line in lines if line["kind"] == "layer"]
    assert sum(line["misses"] for line in layers) == stats["misses"]
    assert sum(line["decode"]["expert_uses"] for line in layers) <= stats["expert_uses"]


def test_memory_stats(reference):
    path, _, _, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=10)
    stats = engine.memory_stats()
    assert stats["expert_cache_slots"] == 10
    assert stats["vram_expert_cache_bytes"] == 10 * engine.residency.expert_bytes
    assert stats["host_expert_bytes"] == total * engine.residency.expert_bytes
    assert stats["host_pinned_bytes"] == 0  # CPU: nothing to page-lock
    assert stats["vram_resident_bytes"] > 0 and stats["vram_residency_table_bytes"] > 0


def test_the_cache_policy_applies_from_the_next_call(reference):
    """engine.options.policy is read at each call: LRFU after LRU on the same engine, tokens unchanged."""
    path, prompts, expected, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=7, policy="lru")
    first = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none")
    st = engine.residency.st  # LRFU's history is kept under LRU too: every use but the last step's is folded in
    last_step = int((st.use_count - st.counted).sum())
    most = len(prompts) * engine.args.num_experts_per_tok * len(engine.residency.layers)
    assert float(st.frequency.sum()) > 0 and 0 < last_step <= most
    engine.options = dataclasses.replace(engine.options, policy="lrfu")
    second = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none")
    assert first.sequences == second.sequences == expected
    assert (first.stats.policy, second.stats.policy, engine.residency.cfg.policy) == ("lru", "lrfu", "lrfu")
    assert engine.residency.cfg.frequency_halflife == EngineConfig.lrfu_halflife == 16.0
    engine.options = dataclasses.replace(engine.options, lrfu_halflife=2.5)
    third = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none")
    assert third.sequences == expected and engine.residency.cfg.frequency_halflife == 2.5


def test_static_hot_set_from_a_routing_profile(reference):
    path, prompts, expected, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=16, policy="static",
                                               max_batch_size=2)
    engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)  # builds the routing profile
    profile = engine.routing_profile
    hot = engine.set_hot_set_from_profile(share=0.4)  # 6 wanted, 13 may be pinned (all but top-3)
    assert len(hot) == 6 and all(profile[k] >= max(v for key, v in profile.items() if key not in hot) for k in hot)
    engine.reset_expert_cache()
    assert engine.routing_profile == profile  # a cold cache keeps the routing history
    for _ in range(3):
        result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)
        assert result.sequences == expected
    assert set(hot) <= set(engine.residency.resident_keys())  # pinned experts, once in, stay resident
    engine.reset_expert_cache(forget_routing=True)
    assert engine.routing_profile == {} and not engine.residency.resident_keys()
    with pytest.raises(Exception, match="only used by policy='static'"):
        MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=16).set_hot_set_from_profile()
    # the cache is smaller than a full step's experts of a layer (2 rows a sequence x 2 sequences x top-3): pins
    # take what is asked up to all but top-k slots, as hot_set= at load, and the tokens stay the same
    small = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=12, policy="static",
                                              max_batch_size=2)
    assert len(small.set_hot_set_from_profile(share=0.5, profile=profile)) == 6
    assert len(small.set_hot_set_from_profile(share=0.9, profile=profile)) == 9  # 10 asked
    assert small.generate(prompts, max_new_tokens=10, stop_at_eos=False).sequences == expected
    bad_profiles = [([1, 2], "profile must be a dict"), ({"a": 5}, r"must be \(layer, expert\) pairs"),
                    ({(99, 99): 5}, "names no routed expert"), ({next(iter(profile)): -5}, "non-negative integers")]
    for bad, match in bad_profiles:
        with pytest.raises(RequestError, match=match):
            small.set_hot_set_from_profile(profile=bad)
    assert small.residency.hot_set_size == 9  # a refused profile changes nothing
    small.close()
    for method in (lambda: small.routing_profile, small.set_hot_set_from_profile):  # closed: one sentence too
        with pytest.raises(RequestError, match="this engine has been closed"):
            method()


@pytest.mark.parametrize("predictor", ["mtp+next_layer_gate", "oracle", "next_layer_gate"])
def test_rereading_late_prefetches_changes_no_token(reference, predictor):
    """late_prefetch="reread" (the default waits): late experts are read from host memory again; tokens and the
    counters' invariants stay as with waiting."""
    path, prompts, expected, logits, total = reference
    for slots in (3, 7, total // 2):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots,
                                                   late_prefetch="reread")
        result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
        assert result.sequences == expected, (slots, predictor)
        check_invariants(result.stats.to_dict(), engine.residency.expert_bytes)
        assert not engine.residency.cfg.wait_late and not engine.residency.problems()


def test_late_prefetch_option_is_checked(reference):
    from moeprefetch.errors import RequestError

    with pytest.raises(RequestError, match="late_prefetch must be one of"):
        MoEPrefetchEngine.from_pretrained(reference[0], progress=False, late_prefetch="sometimes")


def test_the_oracles_prompt_leaves_behind_what_decode_needs_first(monkeypatch):
    """With the future known, the prompt's layers evict by it too (Belady over the prompt), so decode starts from
    the experts it needs first rather than the prompt's first layers: fewer decode bytes, the same tokens."""
    path = Path(moeprefetch.__file__).parent / "reference_model"
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=64)
    prompts = [engine.tokenizer(text)["input_ids"] for text in
               ("1:1 Now in the first year of Cyrus king of Persia", "The kernel's memory manager keeps")]

    def decode_bytes() -> tuple[float, list]:
        engine.reset_expert_cache()
        result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor="oracle")
        return result.stats.to_dict()["decode_bytes_h2d_per_token"], result.sequences

    steered, tokens = decode_bytes()
    begin_step = Residency.begin_step
    monkeypatch.setattr(Residency, "begin_step",
                        lambda self, decode, belady=False: begin_step(self, decode, belady and decode))
    unsteered, same = decode_bytes()
    assert same == tokens
    assert steered < unsteered
    engine.close()


def test_the_oracles_lookahead_is_how_many_steps_ahead_it_prefetches(reference):
    """lookahead=d plans fills for the next d steps (with no prefetch_lead: fills as soon as predicted): prefetches
    are made earlier (a longer lead before their use) and the tokens stay those of reactive decoding."""
    path, prompts, expected, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=total // 2, prefetch_lead=0)
    leads = []
    for lookahead in (1, 2):
        engine.reset_expert_cache()
        result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle",
                                 lookahead=lookahead)
        assert result.sequences == expected
        stats = result.stats.to_dict()
        assert stats["prefetch_useful"] > 0 and stats["prefetch_wasted"] == 0
        leads.append(stats["mean_lead_layers"])
    assert leads[1] > leads[0]
    engine.close()


def test_the_slot_probe_never_reads_a_device_value_on_the_host(reference):
    """The probe runs inside the captured decode step, where reading a device value on the host fails the capture
    (an H200 run of the table check fell back to eager launches). On meta tensors every such read raises."""
    path, prompts, _, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=20)
    probe = engine.residency.enable_probe()
    for name, value in vars(probe).items():
        if isinstance(value, torch.Tensor):
            setattr(probe, name, value.to("meta"))
    st = engine.residency.st
    meta = type(st)(**{f.name: getattr(st, f.name).to("meta") for f in dataclasses.fields(st)})
    u = torch.zeros(probe.reads, dtype=torch.int32, device="meta")
    for phase in (0, 1):
        probe.table(meta, phase, 3)
    probe.before(u, u, u)
    probe.after(u, u)
    engine.close()


def test_the_slot_probe_can_check_only_the_reads(reference):
    """`enable_probe(whole_table=False)`: the reads are checked, the table around each plan is not (so a corrupt
    published slot is found only when it is read)."""
    path, prompts, expected, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=20, spare_recent=0)
    probe = engine.residency.enable_probe(whole_table=False)
    probe.mirror ^= 1  # every record differs from its slot: reads are stale hits, and a table check would see all
    engine.generate(prompts, max_new_tokens=3, stop_at_eos=False, predictor="oracle")
    counts = probe.report()
    assert counts["checked"] > 0 and counts["stale_hit"] > 0
    assert counts["torn_in_table"] == 0 and counts["torn_events"] == []
    engine.close()
