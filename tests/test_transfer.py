"""transfer.py: copies into slots and the side stream keep their order (synchronously on the CPU, by events on
the GPU)."""

from __future__ import annotations

import pytest
import torch

from moeprefetch.transfer import SideStream, TransferEngine

CUDA = torch.cuda.is_available()


def test_cpu_copies_land_at_once_and_demand_copies_count_as_stall():
    engine = TransferEngine(torch.device("cpu"), n_slots=2)
    src, dst = torch.arange(1 << 16, dtype=torch.float32), torch.zeros(2, 1 << 16)
    engine.copy(src, dst[0], 0, demand=False)
    assert engine.collect_stall_seconds() == 0.0  # a prefetch is not a stall
    engine.copy(src * 2, dst[1], 1, demand=True)
    assert engine.is_ready(0) and engine.is_ready(1)
    assert torch.equal(dst[0], src) and torch.equal(dst[1], src * 2)
    assert engine.collect_stall_seconds() > 0.0 and engine.collect_stall_seconds() == 0.0  # collected once


def test_cpu_side_stream_runs_work_inline_in_order():
    side = SideStream(torch.device("cpu"))
    order: list[int] = []
    side.launch(lambda: order.append(1))
    order.append(2)
    side.launch(lambda: order.append(3))
    side.join()
    assert order == [1, 2, 3]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_compute_after_wait_for_sees_the_copy_and_a_slot_is_not_overwritten_while_read():
    dev = torch.device("cuda")
    engine = TransferEngine(dev, n_slots=1)
    first = torch.full((1 << 22,), 1.0).pin_memory()
    second = torch.full((1 << 22,), 2.0).pin_memory()
    slot = torch.zeros(1 << 22, device=dev)
    engine.copy(first, slot, 0, demand=False)
    engine.wait_for([0])
    total = slot.sum()  # enqueued on the compute stream after the copy's event
    engine.release([0])
    engine.copy(second, slot, 0, demand=False)  # must wait for the sum above
    engine.wait_for([0])
    assert total.item() == float(1 << 22) and slot.sum().item() == 2.0 * (1 << 22)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_side_stream_work_follows_the_compute_stream_and_join_orders_after_it():
    dev = torch.device("cuda")
    side = SideStream(dev)
    x = torch.zeros(1 << 20, device=dev)  # sums stay exact in fp32
    x.add_(1.0)  # compute stream
    out = torch.empty_like(x)
    side.launch(lambda: out.copy_(x * 3))  # sees the add
    side.join()
    assert out.sum().item() == 3.0 * (1 << 20)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_copies_and_waits_captured_in_a_graph_replay_in_order_and_time_the_wait():
    """Inside a capture: fork, a copy that the side of the graph delays, a timed wait, a read, join. Each replay
    reads the copy's bytes (never the slot's old ones), and the device clock counts the delay as stall."""
    dev = torch.device("cuda")
    engine = TransferEngine(dev, n_slots=1)
    host = torch.zeros(1 << 20).pin_memory()
    slot = torch.zeros(1 << 20, device=dev)
    total = torch.zeros((), device=dev)
    delay_cycles = 20_000_000  # ~10 ms at the H200's clock

    def step() -> None:
        engine.fork()
        with torch.cuda.stream(engine.demand_stream):  # the copy starts late: the wait below must cover it
            torch.cuda._sleep(delay_cycles)
        engine.copy(host, slot, 0, demand=True)
        engine.wait_for([0])
        total.copy_(slot.sum())
        engine.release([0])
        engine.join()

    step()  # warm-up: compiles the clock kernel
    torch.cuda.synchronize()
    engine.collect_stall_seconds()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for value in (1.0, 2.0, 3.0):
        host.fill_(value)
        slot.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert total.item() == value * (1 << 20)
    stalled = engine.collect_stall_seconds()
    assert 3 * 0.002 < stalled < 3.0, stalled  # three replays, each waiting for a ~10 ms delay
