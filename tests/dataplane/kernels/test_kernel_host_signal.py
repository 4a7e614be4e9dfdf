"""The device's wait on a number in pinned host memory (kernels/host_signal.py): a queued wait holds its
stream until the host writes its number, waits are counted on the device (a graph's replays wait for one
number after another), and a release never lowers the signal."""

import threading
import time

import pytest
import torch


def release_later(signal, number: int, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), signal.release(number)))
    thread.start()
    return thread


def test_a_wait_goes_on_once_its_number_is_released(device):
    from modelfleet.dataplane.kernels.host_signal import HostSignal

    signal = HostSignal(device)
    number = signal.queue()
    started = time.monotonic()
    thread = release_later(signal, number, 0.2)
    signal.wait()
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        assert not done.query()  # the stream holds until the release
        done.synchronize()
    assert time.monotonic() - started >= 0.15
    thread.join()
    signal.release(number - 1)  # never lowered
    assert int(signal.host[0]) == number
    number = signal.queue()
    signal.release(number)  # released before it is queued: no wait
    signal.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert int(signal._waited[0]) == number


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_each_replay_of_a_graph_waits_for_the_next_number():
    """A graph that holds a wait replays it for one number after another: the device counts its waits."""
    from modelfleet.dataplane.kernels.host_signal import HostSignal

    signal = HostSignal(torch.device("cuda"))
    out = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        signal.wait()
        out.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(1, 4):
        number = signal.queue()
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query()  # (reading `out` now would wait for the graph: it waits for the release)
        signal.release(number)
        done.synchronize()
        assert out.item() == replay
    signal.release_all()
