"""The learned routing predictor: recording, training against baselines, saving, fingerprints, resuming, the CLI."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moeprefetch import MoEPrefetchEngine
from moeprefetch.cli import main
from moeprefetch.errors import CheckpointError, RequestError
from moeprefetch.checkpoint import checkpoint_fingerprint
from moeprefetch.learned_predictor import HeadConfig, RoutingHead, load_predictor
from moeprefetch.predictor_training import TrainSettings, sample_index, train_predictor
from moeprefetch.model import route
from moeprefetch.routing_record import record_routing

from conftest import LEARNED_ROWS, ROOT, hf_model

REFERENCE = ROOT / "moeprefetch" / "reference_model"
# in-repo English and code text, near the reference model's corpus (kernel and Python documentation)
TEXT_FILES = [REFERENCE / "README.md", ROOT / "moeprefetch" / "predictors.py", ROOT / "moeprefetch" / "model.py",
              ROOT / "moeprefetch" / "runner.py", ROOT / "moeprefetch" / "decode.py"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the heads and windows are tiny: on a loaded 2-core runner, two OpenMP threads made each small GEMM ~16 ms
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_engine(one_thread):
    engine = MoEPrefetchEngine.from_pretrained(REFERENCE, device="cpu", dtype="float32", progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_engine, one_thread):
    out = tmp_path_factory.mktemp("predictor") / "predictor.safetensors"
    # no horizon block: the round trip checks "needed soon" made from the two leads' own probabilities
    settings = TrainSettings(leads=2, steps=200, window=256, max_tokens=6000, eval_share=0.2, horizon=0)
    result = train_predictor(REFERENCE, TEXT_FILES, out, settings=settings, progress=False,
                             engine=reference_engine)
    return out, result


def test_recorded_routing_is_the_routers_choice_on_transformers_hidden_states(checkpoint_factory):
    """Independent of the engine's forward: transformers' inputs to each MoE block, through the same routers."""
    path = checkpoint_factory("v3")
    engine = MoEPrefetchEngine.from_pretrained(path, device="cpu", dtype="float32", progress=False)
    ids = [[(7 * i + 3) % 256 for i in range(40)], [(11 * i + 5) % 256 for i in range(24)]]
    record = record_routing(engine, ids)
    model = hf_model(path)
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: captured.setdefault(i, []).append(a[0]))
             for i, layer in enumerate(model.model.layers) if i in engine.args.moe_layers]
    with torch.no_grad():
        hf_hidden = [model.model(torch.tensor([w])).last_hidden_state[0] for w in ids]
    for hook in hooks:
        hook.remove()
    layers = [lw for lw in engine.weights.layers if lw.router is not None]
    assert record.ids.shape == (64, len(layers), engine.args.num_experts_per_tok)
    for p, lw in enumerate(layers):
        expected = torch.cat([route(engine.args, lw.router, x[0]).ids for x in captured[lw.index]])
        assert torch.equal(record.ids[:, p].sort(-1).values, expected.sort(-1).values)
    torch.testing.assert_close(record.hidden, torch.cat(hf_hidden), atol=2e-4, rtol=2e-4)
    assert record.window.tolist() == [0] * 40 + [1] * 24
    engine.close()


def test_recorded_hidden_states_give_the_engines_logits(reference_engine):
    ids = list(range(100, 164))
    record = record_routing(reference_engine, [ids])
    logits, mtp_logits = reference_engine.forward([ids], return_mtp=True)
    runner = reference_engine.runner
    torch.testing.assert_close(runner.logits(record.hidden), logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.mtp_logits(record.mtp_hidden[:-1]), mtp_logits[0], atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(record.mtp_hidden[-1]) == 0  # the window's last token has no next token
    # the experts every layer used in the window, as the residency counted them
    before = reference_engine.routing_profile
    record_routing(reference_engine, [ids])
    after = reference_engine.routing_profile
    used = {key for key in after if after[key] > before.get(key, 0)}
    layers = [lw.index for lw in reference_engine.weights.layers if lw.router is not None]
    recorded = {(layers[p], int(e)) for p in range(len(layers)) for e in record.ids[:, p].unique()}
    assert {key for key in used if key[0] in layers} == recorded


@pytest.mark.slow  # the fast lane trains through the CLI (test_cli_trains_a_head_...)
def test_training_beats_previous_and_chance(trained):
    _, result = trained
    rows = {(r["predictor"], r["lead"], r["guesses"]): r for r in result["rows"]}
    learned, previous, chance = rows[("learned", 1, 4)], rows[("previous", 1, 4)], rows[("chance", 1, 4)]
    assert learned["recall"] > previous["recall"] + 0.1
    assert learned["recall"] > 2.5 * chance["recall"]
    assert rows[("learned", 2, 4)]["recall"] > rows[("previous", 2, 4)]["recall"]
    assert rows[("learned", 1, 8)]["recall"] > learned["recall"]  # more guesses find more
    assert len(learned["recall_per_layer"]) == 4 and result["mtp_router"] == "recorded"
    assert result["tokens"] > 500 and result["start_step"] == 0


@pytest.mark.slow  # the fast lane trains through the CLI (test_cli_trains_a_head_...)
def test_save_load_round_trip_and_predict(trained):
    out, _ = trained
    head = load_predictor(out, REFERENCE)
    assert head.config.leads == 2 and head.config.layers == (1, 2, 3, 4) and head.config.use_mtp
    hidden, mtp = torch.randn(3, 256), torch.randn(3, 256)
    ids, conf, soon = head.predict(hidden, mtp)
    assert ids.shape == conf.shape == (3, 2, 4, 4)
    assert bool(((conf > 0) & (conf <= 1)).all())
    # every expert's chance of being needed by one of the next two tokens, from the two leads' own probabilities
    p = torch.sigmoid(head(hidden, mtp).double())
    assert soon.shape == (3, 4, 32)
    assert torch.allclose(soon.double(), p[:, 0] + p[:, 1] - p[:, 0] * p[:, 1], atol=1e-6)
    again = load_predictor(out, REFERENCE)
    assert torch.equal(again(hidden, mtp), head(hidden, mtp))
    # the head's bytes (bf16, as stored and held on the GPU) stay within 5 % of the checkpoint's non-expert bytes
    assert {t.dtype for t in load_file(str(out)).values()} == {torch.bfloat16}
    assert sum(p.numel() for p in head.parameters()) * 2 <= 0.05 * 8.4e6 * 2


@pytest.mark.slow  # the fast lane trains through the CLI (test_cli_trains_a_head_...)
def test_a_predictor_of_another_checkpoint_is_refused(trained, checkpoint_factory, tmp_path):
    out, _ = trained
    with pytest.raises(CheckpointError, match="another checkpoint"):
        load_predictor(out, checkpoint_factory("v3"))
    changed = tmp_path / "changed"
    shutil.copytree(REFERENCE, changed)
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (changed / "config.json").write_text(json.dumps(config))
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(REFERENCE)


def test_a_predictor_whose_config_or_weights_do_not_fit_is_one_sentence(tmp_path):
    from safetensors.torch import save_file

    shipped = REFERENCE / "routing_head.safetensors"
    with safe_open(str(shipped), "pt") as handle:
        metadata = dict(handle.metadata())
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    broken = tmp_path / "config.safetensors"
    save_file(state, str(broken), {**metadata, "config": "{not json"})
    with pytest.raises(CheckpointError, match="config cannot be read by this version"):
        load_predictor(broken, REFERENCE)
    first = next(iter(state))
    shapes = tmp_path / "shapes.safetensors"
    save_file({**state, first: torch.zeros(3, 3)}, str(shapes), metadata)
    with pytest.raises(CheckpointError, match="weights do not match its config"):
        load_predictor(shapes, REFERENCE)
    nan = tmp_path / "nan.safetensors"
    save_file({**state, first: torch.full_like(state[first], float("nan"))}, str(nan), metadata)
    with pytest.raises(CheckpointError, match=f"holds NaN or infinite weights \\({first}\\)"):
        load_predictor(nan, REFERENCE)


def test_resume_continues_the_step_count(reference_engine, tmp_path, monkeypatch):
    out = tmp_path / "p.safetensors"
    settings = TrainSettings(steps=20, window=128, max_tokens=1200, save_every=10)
    first = train_predictor(REFERENCE, TEXT_FILES, out, settings=settings, progress=False, engine=reference_engine)
    assert first["start_step"] == 0
    state = torch.load(out.with_name(out.name + ".resume.pt"), weights_only=False)
    assert state["step"] == 20
    longer = TrainSettings(steps=35, window=128, max_tokens=1200, save_every=10)
    second = train_predictor(REFERENCE, TEXT_FILES, out, settings=longer, progress=False, engine=reference_engine)
    assert second["start_step"] == 20 and second["steps"] == 35
    assert torch.load(out.with_name(out.name + ".resume.pt"), weights_only=False)["step"] == 35
    # a resume state is of its text and a step count it has not passed: one sentence otherwise, before the
    # routing is recorded (minutes on a large checkpoint)
    import moeprefetch.predictor_training as training

    real_record = training._record
    monkeypatch.setattr(training, "_record", lambda *a, **k: pytest.fail("recorded before the resume check"))
    with pytest.raises(RequestError, match="was trained on other tokens"):
        train_predictor(REFERENCE, TEXT_FILES[1:], out, settings=longer, progress=False, engine=reference_engine)
    with pytest.raises(RequestError, match="is at step 35, past steps=20"):
        train_predictor(REFERENCE, TEXT_FILES, out, settings=settings, progress=False, engine=reference_engine)
    with pytest.raises(RequestError, match="it is a directory"):
        train_predictor(REFERENCE, TEXT_FILES, tmp_path, settings=settings, progress=False, engine=reference_engine)
    with pytest.raises(RequestError, match="steps must be >= 1"):  # no step would save an untrained head
        train_predictor(REFERENCE, TEXT_FILES, out, steps=0, progress=False, engine=reference_engine)
    with pytest.raises(RequestError, match=r"name it \*.safetensors, not p.txt"):
        train_predictor(REFERENCE, TEXT_FILES, tmp_path / "p.txt", settings=settings, progress=False,
                        engine=reference_engine)
    monkeypatch.setattr(training, "_record", real_record)
    fresh = train_predictor(REFERENCE, TEXT_FILES, out, settings=longer, progress=False, resume=False,
                            engine=reference_engine)
    assert fresh["start_step"] == 0


def test_bad_inputs_are_one_sentence_errors(reference_engine, checkpoint_factory, tmp_path):
    with pytest.raises(RequestError, match="does not exist"):
        train_predictor(REFERENCE, TEXT_FILES, tmp_path / "missing" / "p.safetensors", engine=reference_engine)
    with pytest.raises(RequestError, match="too short"):
        train_predictor(REFERENCE, ["a few words"], tmp_path / "p.safetensors", engine=reference_engine,
                        progress=False)
    dense = tmp_path / "dense"
    dense.mkdir()
    config = json.loads((checkpoint_factory("v3") / "config.json").read_text())
    config["first_k_dense_replace"] = config["num_hidden_layers"]
    (dense / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no MoE layers"):
        train_predictor(dense, ["text"], tmp_path / "p.safetensors")


def test_samples_stay_inside_their_window():
    from moeprefetch.routing_record import RoutingRecord

    record = RoutingRecord(hidden=torch.zeros(7, 4), mtp_hidden=None, ids=torch.zeros(7, 1, 1, dtype=torch.long),
                           window=torch.tensor([0, 0, 0, 1, 1, 1, 1]), mtp_router=None)
    assert sample_index(record, 1).tolist() == [0, 1, 3, 4, 5]
    assert sample_index(record, 2).tolist() == [0, 3, 4]


def test_the_horizon_block_learns_any_use_within_the_horizon():
    """horizon H: one more block of targets, 1 where a layer used the expert at any of tokens t+1..t+H (checked
    against a loop over random routing), and predict's 'needed soon' is that block's sigmoid."""
    from moeprefetch.predictor_training import targets
    from moeprefetch.routing_record import RoutingRecord

    g = torch.Generator().manual_seed(3)
    n, layers, k, experts, horizon = 12, 2, 2, 6, 3
    ids = torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                       for _ in range(n)])
    record = RoutingRecord(hidden=torch.zeros(n, 4), mtp_hidden=None, ids=ids, window=torch.zeros(n, dtype=torch.long),
                           mtp_router=None)
    index = sample_index(record, horizon)
    out = targets(record, index, 2, experts, horizon)
    assert out.shape == (index.numel(), 3, layers, experts)
    for s, t in enumerate(index.tolist()):
        for p in range(layers):
            for e in range(experts):
                assert out[s, 0, p, e] == float(e in ids[t + 1, p].tolist())
                assert out[s, 2, p, e] == float(any(e in ids[t + j, p].tolist() for j in range(1, horizon + 1)))
    head = RoutingHead(HeadConfig(hidden_size=4, layers=(1, 2), n_experts=experts, top_k=k, rank=8, leads=2,
                                  horizon=horizon))
    hidden = torch.randn(3, 4)
    ids_, conf, soon = head.predict(hidden)
    assert ids_.shape == (3, 2, layers, k)
    assert torch.allclose(soon, torch.sigmoid(head(hidden)[:, 2]))
    assert HeadConfig.from_json(head.config.to_json()) == head.config


def test_head_needs_the_mtp_output_it_was_trained_on():
    head = RoutingHead(HeadConfig(hidden_size=8, layers=(1, 2), n_experts=6, top_k=2, rank=4, use_mtp=True))
    assert head(torch.randn(2, 8), torch.randn(2, 8)).shape == (2, 1, 2, 6)
    with pytest.raises(RequestError, match="mtp_hidden"):
        head(torch.randn(2, 8))


def test_cli_exits_2_on_a_missing_text_file(tmp_path, capsys):
    code = main(["train-predictor", str(REFERENCE), "--text", str(tmp_path / "none.txt"), "--out",
                 str(tmp_path / "p.safetensors")])
    assert code == 2
    assert "is not a file" in capsys.readouterr().err


def test_cli_trains_a_head_that_generate_then_loads_and_refuses_binary_text(tmp_path, capsys):
    """The command end to end (it once failed on every run, reading an option its parser did not have): a few
    steps on a text file, the head written with its evaluation, then loaded by `generate --predictor learned`;
    bytes that are not UTF-8 are refused as text, and a file that is not safetensors as a predictor."""
    text = tmp_path / "text.txt"
    text.write_text((REFERENCE / "README.md").read_text() * 2)
    out, report = tmp_path / "head.safetensors", tmp_path / "eval.json"
    code = main(["train-predictor", str(REFERENCE), "--text", str(text), "--out", str(out), "--steps", "3",
                 "--max-tokens", "3000", "--dtype", "float32", "--json", str(report)])
    assert code == 0, capsys.readouterr().err
    assert out.is_file() and json.loads(report.read_text())["steps"] == 3
    assert load_predictor(out, REFERENCE).config.horizon == TrainSettings.horizon == 8  # victims' "needed soon"
    capsys.readouterr()
    code = main(["generate", str(REFERENCE), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--cache-slots",
                 "40", "--predictor", "learned", "--predictor-path", str(out)])
    assert code == 0, capsys.readouterr().err
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    assert main(["train-predictor", str(REFERENCE), "--text", str(binary), "--out", str(tmp_path / "b.safetensors"),
                 "--steps", "1"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    assert main(["generate", str(REFERENCE), "--prompt-ids", "5,6", "--max-new-tokens", "2", "--cache-slots", "40",
                 "--predictor", "learned", "--predictor-path", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "is not a safetensors file" in err and "Traceback" not in err


def test_cli_trains_from_token_id_files_and_refuses_bad_ones(tmp_path, capsys):
    """`--ids` (a checkpoint without a tokenizer can only be given token ids): a text file of ids and the same ids
    as a .npy array train the same head; words, floats, ids outside the vocabulary and --text beside --ids are one
    sentence each, exit 2."""
    import numpy as np

    from moeprefetch.config import load_model_args

    vocab = load_model_args(REFERENCE).vocab_size
    ids = torch.randint(0, vocab, (1200,), generator=torch.Generator().manual_seed(5)).tolist()
    listed, array = tmp_path / "ids.txt", tmp_path / "ids.npy"
    listed.write_text(",".join(map(str, ids[:600])) + "\n" + " ".join(map(str, ids[600:])))
    np.save(array, np.array(ids, dtype=np.int64))
    heads = []
    for source in (listed, array):
        out = tmp_path / f"{source.suffix[1:]}.safetensors"
        code = main(["train-predictor", str(REFERENCE), "--ids", str(source), "--out", str(out), "--steps", "2",
                     "--dtype", "float32", "--no-resume"])
        assert code == 0, capsys.readouterr().err
        heads.append(load_file(out))
    assert heads[0].keys() == heads[1].keys()
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    words, floats, outside = tmp_path / "words.txt", tmp_path / "floats.npy", tmp_path / "outside.txt"
    words.write_text("the quick brown fox")
    np.save(floats, np.array([1.5, 2.0]))
    outside.write_text(f"1 2 {vocab}")
    for bad, message in ((words, "is not a list of integer token ids"), (floats, "not integer token ids"),
                         (outside, f"token id {vocab} is outside the vocabulary")):
        capsys.readouterr()
        assert main(["train-predictor", str(REFERENCE), "--ids", str(bad), "--out",
                     str(tmp_path / "bad.safetensors"), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exited:
        main(["train-predictor", str(REFERENCE), "--ids", str(listed), "--text", str(listed), "--out",
              str(tmp_path / "both.safetensors")])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# ---- predictor="learned" in the engine ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_learned_predictor_changes_no_token_and_finds_the_next_tokens_experts(trained):
    """predictor='learned' inside the decode step: its guesses (1 and 2 tokens ahead, from the final hidden state
    and the MTP head's output) steer prefetches and protection, never tokens, at every cache size; its recall of the
    next token's experts beats 'previous' on the same prompts."""
    out, _ = trained
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False) as resident:
        expected = resident.generate(prompts, max_new_tokens=12, stop_at_eos=False).sequences
    recalls = {}
    # victims by predicted reuse, by the policy alone, and misses bypassing the cache by predicted reuse
    for slots, reuse, bypass in ((8, 0.9, False), (40, 0.0, False), (40, 0.9, False), (8, 0.0, True),
                                 (24, 0.9, True)):
        with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, expert_cache_slots=slots,
                                               predictor_path=str(out), reuse_weight=reuse,
                                               bypass=bypass) as engine:
            for predictor, lookahead in LEARNED_ROWS:
                result = engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor=predictor,
                                         lookahead=lookahead)
                assert result.sequences == expected, (slots, predictor, lookahead)
                stats = result.stats.to_dict()
                recalls[(slots, predictor, lookahead)] = stats["prediction_recall"]
                # the learned head reads link 1 of the MTP head, whose vocabulary head (drafts) does not run
                assert stats["mtp_draft_accuracy"] is None, predictor
            # the head's reuse map reaches the table during the call (read between tokens) and is cleared at its end
            seen = []
            engine.generate(prompts[:1], max_new_tokens=4, stop_at_eos=False, predictor="learned",
                            callback=lambda _: seen.append(float(engine.residency.st.reuse.sum())))
            assert max(seen) > 0 and float(engine.residency.st.reuse.sum()) == 0.0
            # no autograd through the head: the table's tensors would grow a graph every step
            assert not engine.residency.st.reuse.requires_grad and not engine.residency.st.pred.requires_grad
            assert not engine.residency.problems()
    assert recalls[(40, "learned", 1)] > recalls[(40, "previous", 1)]


def test_the_learned_predictor_needs_its_head(checkpoint_factory):
    out = REFERENCE / "routing_head.safetensors"  # the shipped head: two tokens ahead
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, expert_cache_slots=8) as engine:
        with pytest.raises(RequestError, match="predictor_path"):
            engine.generate([[5, 6]], max_new_tokens=2, predictor="learned")
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, predictor_path=str(out)) as engine:
        with pytest.raises(RequestError, match="further than the learned head"):
            engine.generate([[5, 6]], max_new_tokens=2, predictor="learned", lookahead=3)
    with pytest.raises(CheckpointError, match="another checkpoint"):
        MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, predictor_path=str(out))


def test_the_shipped_reference_head_loads_and_beats_previous():
    """The reference model's add-on (experiments/learned_predictor_reference.py trained it): it belongs to this
    checkpoint, reads the MTP output, and in the engine finds more of the next token's experts than 'previous'."""
    path = REFERENCE / "routing_head.safetensors"
    head = load_predictor(path, REFERENCE)
    assert head.config.use_mtp and head.config.leads == 2 and head.config.layers == (1, 2, 3, 4)
    prompts = [[40, 41, 42, 43, 44, 45, 46, 47]]
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, expert_cache_slots=40,
                                           predictor_path=str(path)) as engine:
        learned = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor="learned")
        previous = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor="previous")
    assert learned.sequences == previous.sequences
    assert learned.stats.to_dict()["prediction_recall"] > previous.stats.to_dict()["prediction_recall"]


def test_bypass_and_reuse_weight_say_when_a_calls_predictor_leaves_them_without_effect(caplog):
    """They act on the learned head's predictions: a call with another predictor (the default 'none' included)
    decodes without them and says so once per predictor; a continuous batch, which serves one predictor, refuses."""
    from moeprefetch.batching import ContinuousBatch

    head = REFERENCE / "routing_head.safetensors"
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, expert_cache_slots=24, predictor_path=str(head),
                                           reuse_weight=0.9, bypass=True) as engine:
        with caplog.at_level(logging.WARNING, logger="moeprefetch.engine"):
            for predictor in ("none", "none", "previous", "learned"):
                engine.generate([[5, 6, 7]], max_new_tokens=2, stop_at_eos=False, predictor=predictor)
        noted = [r.getMessage() for r in caplog.records if "learned routing head" in r.getMessage()]
        assert len(noted) == 2 and "'none'" in noted[0] and "'previous'" in noted[1]
        assert "bypass and reuse_weight act" in noted[0]
        with pytest.raises(RequestError, match="serve with predictor 'learned'"):
            ContinuousBatch(engine, predictor="none")
        ContinuousBatch(engine, predictor="learned")


def test_next_layer_gate_refuses_a_lookahead_past_the_last_moe_layer():
    with MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, expert_cache_slots=24) as engine:
        layers = len(engine.args.moe_layers)
        engine.generate([[5, 6]], max_new_tokens=1, predictor="next_layer_gate", lookahead=layers - 1)
        with pytest.raises(RequestError, match=f"this model has {layers}, so at most {layers - 1}"):
            engine.generate([[5, 6]], max_new_tokens=1, predictor="next_layer_gate", lookahead=layers)
        with pytest.raises(RequestError, match="too far for next_layer_gate"):  # previous reads no lookahead
            engine.generate([[5, 6]], max_new_tokens=1, predictor="previous+next_layer_gate", lookahead=layers)
        # in a combination with a reader of tokens ahead, the gate looks as far as the layers go
        engine.generate([[5, 6]], max_new_tokens=1, predictor="mtp+next_layer_gate", lookahead=layers + 1)
    with pytest.raises(RequestError, match="too far for next_layer_gate"):
        MoEPrefetchEngine.from_pretrained(REFERENCE, progress=False, predictor="next_layer_gate", lookahead=50)
