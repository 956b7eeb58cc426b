"""Expert parallelism (distributed=True) over gloo with two CPU processes: the tokens of one process for every predictor
and cache size, each rank about half of the expert bytes, the same result on every rank, clean shutdown; placement.

The GPU half (NCCL, two H200s) is not run here: no two-GPU machine was lent (see the README)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from moeprefetch import MoEPrefetchEngine
from moeprefetch.errors import RequestError
from moeprefetch.placement import ExpertPlacement
from moeprefetch.speculation import DraftCost, ModeCost

CASES = [  # (cache slots or None for all-resident, predictor)
    (None, "none"), (3, "none"), (3, "mtp+next_layer_gate"), (6, "previous"), (6, "mtp"), (6, "oracle"),
    (4, "next_layer_gate"),
]
PROMPTS = [[3, 4, 5, 6], [9, 10]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, path: str, out: str, cases: list, extra: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks on a 2-core CI machine; the one-process reference uses one thread too
    results = []
    for slots, predictor in cases:
        engine = MoEPrefetchEngine.from_pretrained(path, distributed=True, expert_cache_slots=slots, max_seq_len=128,
                                                   **extra)
        result = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
        spec = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, speculative="mtp") \
            if engine.has_mtp and predictor == "none" else None
        logits = engine.forward([[3, 4, 5, 6, 7]])
        stats = result.stats.to_dict()
        results.append({"sequences": result.sequences, "spec": spec.sequences if spec else None,
                        "decode_hit_rate": stats["decode_hit_rate"],
                        "logits": logits.tolist(), "memory": engine.memory_stats(),
                        "uses": stats["expert_uses"], "hits": stats["hits"], "misses": stats["misses"],
                        "problems": engine.residency.problems()})
        engine.close()
    # the engines leave the group joined (a later engine reuses it); the process ends it
    torch.distributed.barrier()
    results.append({"joined_after_close": torch.distributed.is_initialized()})
    torch.distributed.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))


def run_ranks(path: Path, tmp: Path, world: int = 2, cases=CASES, **extra) -> list[list[dict]]:
    mp.start_processes(_rank_main, args=(world, _free_port(), str(path), str(tmp), cases, extra), nprocs=world,
                       join=True, start_method="spawn")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
@pytest.mark.parametrize("variant", ["v3", pytest.param("qwen3", marks=pytest.mark.slow)])  # the fast lane: one family
def test_two_ranks_give_the_tokens_of_one_process(checkpoint_factory, tmp_path, variant):
    path = checkpoint_factory(variant)
    cases = CASES if variant == "v3" else [(None, "none"), (3, "next_layer_gate"), (5, "previous")]
    ranks = run_ranks(path, tmp_path, cases=cases)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU matmuls block by thread count: the same count gives the same bits
    try:
        _compare_with_one_process(path, cases, ranks)
    finally:
        torch.set_num_threads(threads)
    assert all(rows[-1] == {"joined_after_close": True} for rows in ranks)


def _compare_with_one_process(path: Path, cases: list, ranks: list[list[dict]]) -> None:
    for i, (slots, predictor) in enumerate(cases):
        alone = MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=slots, max_seq_len=128)
        expected = alone.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
        logits = alone.forward([[3, 4, 5, 6, 7]])
        whole = alone.memory_stats()
        for rank, rows in enumerate(ranks):
            got = rows[i]
            assert got["sequences"] == expected.sequences, (rank, slots, predictor)
            if got["spec"] is not None:
                assert got["spec"] == expected.sequences
            assert torch.equal(torch.tensor(got["logits"]), logits), (rank, slots, predictor)  # bit for bit
            assert got["problems"] == []
            assert got["memory"]["rank"] == rank and got["memory"]["world_size"] == 2
            if slots is not None:  # each rank's host arena holds its half of the experts
                assert got["memory"]["host_expert_bytes"] == pytest.approx(whole["host_expert_bytes"] / 2, rel=0.1)
            else:
                assert got["memory"]["vram_expert_cache_bytes"] == pytest.approx(
                    whole["vram_expert_cache_bytes"] / 2, rel=0.1)
        # the call's statistics are every rank's together: each use is counted by the rank that owns the expert
        assert ranks[0][i]["uses"] == ranks[1][i]["uses"] == expected.stats.to_dict()["expert_uses"]
        assert ranks[0][i]["decode_hit_rate"] == ranks[1][i]["decode_hit_rate"]
        alone.close()


def _rank_disagreeing(rank: int, world: int, port: int, path: str, out: str, scenario: str) -> None:
    """Ranks that differ where they must not: their own random state and placement profile (agreed from rank 0), or
    a setting that shapes the collectives (refused, one sentence on every rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    result: dict = {}
    try:
        if scenario == "sampling":
            engine = MoEPrefetchEngine.from_pretrained(path, distributed=True, expert_cache_slots=4, max_seq_len=128,
                                                       placement_profile={(1, rank): 100.0, (2, 3 - rank): 50.0},
                                                       draft_experts="auto")
            result["sampled"] = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, temperature=1.0,
                                                speculative="mtp").sequences
            result["profile"] = sorted(map(list, engine.routing_profile))
            # the auto choices from timings that differ between the ranks (here: opposite ones): every rank runs
            # rank 0's, or their steps (and collectives) would differ
            key = (len(PROMPTS), "+".join(engine.options.predictor.split("+")), True)
            fast, slow = (ModeCost(1.0), ModeCost(9.0)) if rank == 0 else (ModeCost(9.0), ModeCost(1.0))
            engine._speculation.speculative[key, 1], engine._speculation.plain[key] = fast, slow
            for speculative in ("mtp", None):
                engine._draft_modes.costs[key + (speculative,)] = {
                    "all": DraftCost(*(1.0, 0.5, 1.0) if rank == 0 else (9.0, 0.5, 1.0)),
                    "cached": DraftCost(*(9.0, 0.5, 1.0) if rank == 0 else (1.0, 0.5, 1.0))}
            auto = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, speculative="auto").stats.to_dict()
            result["auto"] = [auto["speculative_auto"]["mode"], auto["draft_experts_auto"]["mode"]]
            engine.close()
        elif scenario == "draft_mismatch":  # "auto" agrees on each call's choice, a collective the others lack
            MoEPrefetchEngine.from_pretrained(path, distributed=True, expert_cache_slots=4,
                                              draft_experts="auto" if rank else "cached")
        elif scenario == "rows_mismatch":  # verify_rows shapes every step's batches, so its collectives
            MoEPrefetchEngine.from_pretrained(path, distributed=True, expert_cache_slots=4,
                                              verify_rows="shared" if rank else "separate")
        else:
            MoEPrefetchEngine.from_pretrained(path, distributed=True, expert_cache_slots=4, max_seq_len=64 + 64 * rank)
    except RequestError as exc:
        result["error"] = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("scenario", [pytest.param(name, marks=pytest.mark.slow)  # the fast lane: two ranks' tokens
                                      for name in ("sampling", "mismatch", "draft_mismatch", "rows_mismatch")])
def test_ranks_agree_on_seeds_and_placement_and_refuse_other_differences(checkpoint_factory, tmp_path, scenario):
    path = checkpoint_factory("v3")
    mp.start_processes(_rank_disagreeing, args=(2, _free_port(), str(path), str(tmp_path), scenario), nprocs=2,
                       join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if scenario == "sampling":  # rank 0's seed and placement: the same tokens, and one profile over all experts
        assert "error" not in ranks[0] and ranks[0]["sampled"] == ranks[1]["sampled"]
        assert ranks[0]["profile"] == ranks[1]["profile"] and len(ranks[0]["profile"]) > 4
        assert ranks[0]["auto"] == ranks[1]["auto"] == ["mtp", "all"]  # rank 0's estimates decide
    else:
        assert all("the ranks disagree on the model, the memory plan" in r["error"] for r in ranks)


def test_round_robin_and_balanced_placement():
    rr = ExpertPlacement.round_robin(2, 6, 2, 1)
    assert rr.owned(0) == (1, 3, 5) and rr.local == 3 and rr.global_expert(1, 2) == 5
    assert rr.local_table(torch.device("cpu"))[0].tolist() == [-1, 0, -1, 1, -1, 2]
    # a skewed profile: two hot experts go to different ranks, and the traffic evens out
    profile = [[100.0, 90.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.0]]
    placed = [ExpertPlacement.balanced(profile, 2, r) for r in range(2)]
    assert placed[0].owner == placed[1].owner  # every rank computes the same placement
    loads = placed[0].traffic(profile)
    assert max(loads) / min(loads) < 1.1 and sorted(loads) != [3.0 + 4 + 5 + 2, 100 + 90 + 1 + 1]
    assert {placed[0].owner[0][0], placed[0].owner[0][1]} == {0, 1}
    assert all(sum(1 for o in placed[0].owner[0] if o == r) == 4 for r in range(2))
    odd = ExpertPlacement.balanced([[1.0] * 5], 2, 0)
    assert odd.local == 3 and sorted(len(ExpertPlacement(r, 2, odd.owner).owned(0)) for r in range(2)) == [2, 3]
    keyed = ExpertPlacement.build([1, 2], 8, 2, 0, {(2, 0): 50.0, (2, 1): 40.0})
    assert keyed.owner[0] == ExpertPlacement.round_robin(1, 8, 2, 0).owner[0] or keyed.owner[1][0] != keyed.owner[1][1]


def test_distributed_needs_a_launch_and_profiles_need_it(checkpoint_factory, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = checkpoint_factory("v3")
    with pytest.raises(RequestError, match="torchrun"):
        MoEPrefetchEngine.from_pretrained(path, distributed=True)
    with pytest.raises(RequestError, match="needs distributed=True"):
        MoEPrefetchEngine.from_pretrained(path, placement_profile={(1, 0): 3})
    assert not torch.distributed.is_initialized()
    MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=3).close()  # still usable


@pytest.mark.slow
def test_two_ranks_on_the_reference_model_with_mtp_prefetch(tmp_path):
    """The trained reference model (learned routing, MTP head), a quarter of the experts cached, the default MTP
    predictor: both ranks produce the one-process tokens and logits."""
    from moeprefetch.cli import REFERENCE_MODEL

    cases = [(40, "mtp+next_layer_gate")]
    ranks = run_ranks(REFERENCE_MODEL, tmp_path, cases=cases)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_with_one_process(REFERENCE_MODEL, cases, ranks)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_torchrun_launch_prints_once_and_exits_cleanly(checkpoint_factory):
    """`torchrun --nproc-per-node 2 -m moeprefetch generate ... --distributed`: rank 0 alone prints the answer."""
    import subprocess

    path = checkpoint_factory("v3")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "moeprefetch", "generate", str(path), "--prompt-ids", "3,4,5",
               "--max-new-tokens", "6", "--cache-slots", "4", "--distributed"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = [line for line in done.stdout.splitlines() if line.startswith("[0] ")]
    assert len(answers) == 1, done.stdout
    alone = subprocess.run([sys.executable, "-m", "moeprefetch", "generate", str(path), "--prompt-ids", "3,4,5",
                            "--max-new-tokens", "6", "--cache-slots", "4"], capture_output=True, text=True,
                           timeout=300, env=env)
    assert [line for line in alone.stdout.splitlines() if line.startswith("[0] ")] == answers


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_give_the_tokens_of_one(checkpoint_factory, tmp_path):
    """NCCL between two GPUs, bf16: the tokens of one GPU for every predictor and cache size."""
    path = checkpoint_factory("v3")
    ranks = run_ranks(path, tmp_path, device="cuda", dtype=torch.bfloat16)
    for i, (slots, predictor) in enumerate(CASES):
        alone = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots,
                                                  max_seq_len=128)
        expected = alone.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor=predictor).sequences
        assert all(rows[i]["sequences"] == expected for rows in ranks), (slots, predictor)
        alone.close()
