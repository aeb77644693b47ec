"""A tensor-parallel rollout replica: one vLLM engine over ``t_g`` processes, kept in lock step.

vLLM's ``external_launcher`` executor runs one full engine (scheduler, model shard, sampler) in
every rank of a tensor-parallel group and needs every rank to make the same engine calls in the
same order: the ranks schedule alike because they see the same requests, and meet in the
model's all-reduces at every step. A replica's requests arrive at one process, its *leader*
(rank 0, the one the controller talks to), at times of the controller's choosing. So the leader
sends each call that changes the engine's state to its *followers* (ranks ``1..t_g-1``) before
or right after making it itself, over a gloo group of the replica's own world, and each
follower makes the same call on its own engine, in order:

* ``add``: the request (after the leader's own ``add`` accepted it; a refused request is never
  sent, so a follower never meets one its leader refused);
* ``step``: sent before the leader steps (the step is collective: both must enter it);
* ``abort``: every open request ends (the weight update's first stage, with ``abort``);
* ``pause``: a weight update comes; the follower stops reading commands until its own
  ``receive_weights`` has loaded the pushed weights (each rank receives the full tensors over
  the weights bridge, and vLLM's loader keeps the rank's shard), so no step runs on half-loaded
  weights;
* ``stop``: the follower's loop ends.

The followers' batchers compute what the leader's does (same requests, same seeds, same
weights); only the leader's results reach the controller, and a follower drops its own.
Commands are pickled and broadcast (``broadcast_object_list``), a few hundred bytes a step
beside a decode step's milliseconds.

If a follower dies or its loop fails, the leader's next step waits in a collective that never
completes: the controller keeps a ``watch()`` call outstanding on every follower (the replica's,
``rollout/replica.py``) and probes every rank before a push, and replaces the whole replica; the
stall rule's timeout is the fallback, not the way it notices.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from hybridflow.engines.continuous import GenerationRequest, RequestResult

if TYPE_CHECKING:
    from hybridflow.engines.vllm_continuous import VLLMContinuousBatcher

__all__ = ["Follower", "LockstepBatcher"]

CommandKind = Literal["add", "step", "abort", "pause", "stop"]


@dataclass(frozen=True)
class Command:
    kind: CommandKind
    request: GenerationRequest | None = None


class LockstepBatcher:
    """The leader's batcher: :class:`VLLMContinuousBatcher`'s protocol, each state change sent to the followers.

    Calls come from one thread at a time (the replica's condition serialises its decode thread
    and the controller's calls), so commands leave in the order the leader makes the calls.
    """

    def __init__(self, inner: VLLMContinuousBatcher, group: Any) -> None:
        self.inner = inner
        self._group = group

    def _send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self._group)

    def add(self, request: GenerationRequest) -> None:
        self.inner.add(request)  # raises on a request it cannot serve, before anything is sent
        self._send(Command("add", request))

    def step(self) -> int:
        self._send(Command("step"))
        return self.inner.step()

    def abort(self) -> list[RequestResult]:
        aborted = self.inner.abort()
        self._send(Command("abort"))
        return aborted

    def pause(self) -> None:
        """Tell the followers a weight update comes (the leader's own decode thread is already quiet)."""
        self._send(Command("pause"))

    def stop(self) -> None:
        self._send(Command("stop"))

    def take_finished(self) -> list[RequestResult]:
        return self.inner.take_finished()

    @property
    def busy(self) -> bool:
        return self.inner.busy

    @property
    def waiting_samples(self) -> int:
        return self.inner.waiting_samples

    @property
    def running_samples(self) -> int:
        return self.inner.running_samples

    @property
    def tokens_generated(self) -> int:
        return self.inner.tokens_generated

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value


class Follower:
    """A follower's command loop, on a thread of its own (see the module docstring)."""

    def __init__(self, batcher: VLLMContinuousBatcher, group: Any) -> None:
        self.batcher = batcher
        self._group = group
        self._paused = threading.Event()
        self._resumed = threading.Event()
        self._ended = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="replica-follower", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                received: list[Any] = [None]
                dist.broadcast_object_list(received, src=0, group=self._group)
                command: Command = received[0]
                if command.kind == "stop":
                    return
                if command.kind == "add":
                    assert command.request is not None
                    self.batcher.add(command.request)
                elif command.kind == "step":
                    self.batcher.step()
                elif command.kind == "abort":
                    self.batcher.abort()
                elif command.kind == "pause":
                    self._paused.set()
                    self._resumed.wait()
                    self._resumed.clear()
                self.batcher.take_finished()  # only the leader's results are reported
        except BaseException as error:
            self.failure = error
        finally:
            self._ended.set()
            self._paused.set()  # a load waiting for the pause must not wait forever

    def wait_for_pause(self, timeout_seconds: float) -> None:
        """Until the leader's ``pause`` arrived (the engine is between steps); raises if the loop ended."""
        if not self._paused.wait(timeout_seconds):
            raise TimeoutError(f"no pause from the replica's leader within {timeout_seconds:.0f} s")
        self._paused.clear()
        self.check()

    def resume(self) -> None:
        self._resumed.set()

    def wait_ended(self, timeout_seconds: float | None = None) -> bool:
        return self._ended.wait(timeout_seconds)

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the follower's command loop failed: {self.failure!r}") from self.failure
        if self._ended.is_set():
            raise RuntimeError("the follower's command loop has ended (its leader stopped it)")
