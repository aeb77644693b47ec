"""The controller's side of server mode: replicas, routing, the buffer, weight updates, replacement.

A :class:`RolloutService` owns the rollout pool's replicas (``replica.py``) and everything the
trainer needs from them. The trainer (``hybridflow.trainer.runner``) drives it, per step ``k``
(the trainer's policy version before the step is ``k - 1``):

1. :meth:`RolloutService.next_batch` keeps the replicas fed (every group the submission gate
   allows, ``buffer.may_submit``, each routed to the least-loaded replica), collects what they
   finished into the replay buffer (dropping all-equal groups with dynamic sampling), checks
   the replicas' health, and returns once the buffer holds the step's ``B`` groups: the ``B``
   oldest, as prompts and packed responses.
2. The step function trains on them (through :class:`ServedRollout`, the rollout it sees).
3. :meth:`RolloutService.push` updates every replica to version ``k``: each pauses (keeping or
   aborting what it decodes, ``rollout.onWeightUpdate``), loads the buckets ``actor.push_weights``
   broadcasts over the ``weights`` bridge, and resumes. Aborted samples continue on the
   least-loaded replica with what they generated so far.

Between two calls nothing waits on the replicas: they keep generating while the actor trains.

**Replicas that fail alone.** A replica whose process died (a poll raises), or that has work and
produced no token for ``rollout.replicaTimeoutSeconds`` (a poll that does not answer counts the
same), leaves the routing; its open requests are routed again from their prompts (same seeds),
and a new replica starts on the same bundle. It joins at the first moment the service looks at
it after its model loaded on every rank (:func:`replica_join`, the rule): the service looks at the
step boundary (the push after every step) and whenever the controller waits for generation. At
the boundary after step ``k`` it joins that push (the bridge is rebuilt with it: a collective
group cannot take a new member), receives version ``k`` with the others and is routed requests
from step ``k + 1``; while the controller waits in step ``k`` it joins at once, by a push of the
current version, and serves in step ``k`` (the only way on when no replica serves). Either way no
step boundary passes between the service seeing it loaded and routing requests to it.
:attr:`RolloutService.replacements` records each one: the seconds from detection to loaded and to
serving, the step it was seen loaded in and the first step it serves.

**Checkpoints.** :meth:`checkpoint_state` first drains: it submits everything the gate allows
and waits until every open request has finished, so the saved state is the buffer alone, with
no generation in flight. A resumed run restores the buffer and the counters
(:meth:`restore`) and continues from exactly the state the uninterrupted run continued from:
the steps the saved buffer covers train on the same samples in both (the test shows it).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, cast

import numpy as np
import torch

from hybridflow.controller import Batch, WorkerGroup
from hybridflow.controller.resource_pool import PoolPlacement
from hybridflow.engines.base import RolloutOutput, SamplingParams
from hybridflow.engines.continuous import GenerationRequest, RequestResult, continuation_of
from hybridflow.rollout.buffer import ReplayBuffer, informative, may_submit, staleness_histogram
from hybridflow.rollout.routing import RequestRouter
from hybridflow.rollout.trajectories import TrajectorySource, TrajectoryStats, trajectory_metrics
from hybridflow.spec import RLHFJobSpec
from hybridflow.workers.rollout import pack_responses, response_texts
from hybridflow.workers.weight_push import WEIGHTS_BRIDGE

__all__ = [
    "ReplicaJoin",
    "ReplicaReplacement",
    "RolloutService",
    "ServedRollout",
    "replica_join",
    "replica_verdict",
]

PUSH_ATTEMPTS = 3
"""Weight pushes tried before the step fails (each after replacing the replicas that died in the last)."""

POLL_SECONDS = 0.02
"""How long one poll waits for a finished request on a replica (the controller's loop period)."""


def failure_summary(error: BaseException) -> str:
    """What a replica's failure says, for the log, the status and the Event.

    A Ray task error's first line names only the call; the cause (the replica's own exception,
    with where it was raised) follows it, so that is kept, within 600 characters.
    """
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {' | '.join(lines)}"[:600]


def _lost_rank(rank: int, cause: str) -> str:
    """Why a replica is replaced when one of its processes died: rank 0 (the one that serves) or a follower."""
    return f"died: {cause}" if rank == 0 else f"lost tensor-parallel rank {rank}: {cause}"


def replica_verdict(
    *,
    now: float,
    last_answer_at: float,
    last_progress_at: float,
    has_work: bool,
    timeout_seconds: float,
) -> str | None:
    """Why a live replica must be replaced, or ``None``: the stall rule, pure.

    ``last_answer_at``: when its last poll answered; ``last_progress_at``: when its token count
    last grew, or it last had no work (a replica with nothing to do is never stalled).

    >>> replica_verdict(now=100, last_answer_at=99, last_progress_at=50, has_work=True, timeout_seconds=30)
    'produced no token for 50 s with work queued'
    >>> replica_verdict(now=100, last_answer_at=99, last_progress_at=50, has_work=False, timeout_seconds=30)
    """
    if now - last_answer_at > timeout_seconds:
        return f"answered no poll for {now - last_answer_at:.0f} s"
    if has_work and now - last_progress_at > timeout_seconds:
        return f"produced no token for {now - last_progress_at:.0f} s with work queued"
    return None


ReplicaJoin = Literal["serving", "loading", "failed", "join"]
"""Where a replica stands for the routing: see :func:`replica_join`."""


def replica_join(*, serving: bool, ranks: int, ranks_loaded: int, start_failed: bool) -> ReplicaJoin:
    """Whether a replica joins the routing now: the join rule, pure.

    The service asks at every moment a replica may join without pausing a step: at the step
    boundary (the push after each step) and while the controller waits for generation (the
    actor idle). ``ranks_loaded``: how many of its ``ranks`` returned from ``start`` (model
    loaded); ``start_failed``: one of them raised. ``"join"``: every rank loaded, so it joins now
    (the push in progress, or one of the current version, gives it the weights); ``"loading"``:
    ask again at the next moment; ``"failed"``: replace it again; ``"serving"``: nothing to do.

    >>> replica_join(serving=False, ranks=2, ranks_loaded=1, start_failed=False)
    'loading'
    >>> replica_join(serving=False, ranks=2, ranks_loaded=2, start_failed=False)
    'join'
    """
    if serving:
        return "serving"
    if start_failed:  # before waiting for the other ranks: they would only load for nothing
        return "failed"
    if ranks_loaded < ranks:
        return "loading"
    return "join"


@dataclass(frozen=True)
class ReplicaReplacement:
    """One replaced replica: which, why, and when its successor loaded and served.

    Seconds count from the failure's detection (``time.monotonic``). Steps are the trainer's:
    ``loaded_in_step`` is the step in which the successor's last rank returned from ``start``
    (before that step's push), ``serving_from_step`` the first step it serves: the same step or
    the next, by :func:`replica_join`.
    """

    index: int
    reason: str
    detected_at: float
    serving_after_seconds: float | None = None
    loaded_after_seconds: float | None = None
    loaded_in_step: int | None = None
    serving_from_step: int | None = None


@dataclass
class _Replica:
    index: int
    handle: Any  # the leader (rank 0): the rank the service sends requests to
    ready: Any  # the ObjectRef of the leader's start() call: resolved once the model is loaded
    followers: list[Any] = field(default_factory=list)  # ranks 1..t_g-1 of a tensor-parallel replica
    follower_starts: list[Any] = field(default_factory=list)
    watches: list[Any] = field(default_factory=list)  # one outstanding watch() per follower, once started
    serving: bool = False
    poll: Any = None  # the outstanding poll's ObjectRef
    last_answer_at: float = 0.0
    last_progress_at: float = 0.0
    tokens: int = 0
    busy_seconds: float = 0.0
    alive_seconds: float = 0.0
    has_work: bool = False
    replacing: ReplicaReplacement | None = None
    ranks_started: list[float] = field(default_factory=list)  # when each rank's start returned
    loaded_at: float | None = None  # when the last did (or the service saw them all, if earlier)
    loaded_in_step: int | None = None

    @property
    def ranks(self) -> list[Any]:
        return [self.handle, *self.followers]


@dataclass
class _Open:
    """A request on its way: its prompt row and whether it is a trainer group or a direct call."""

    prompt: Batch
    request: GenerationRequest
    for_buffer: bool
    turn: bool = False
    """One model turn of a multi-turn trajectory (its result goes to the trajectory driver)."""


@dataclass
class _Counters:
    accepted: int = 0
    dropped_uninformative: int = 0
    groups_drawn: int = 0
    replaced: int = 0


class RolloutService:
    """The rollout in server mode, as the controller drives it (see the module docstring).

    ``prompts_for(count)`` draws the next ``count`` prompts (the trainer's sampler) as a batch;
    ``score`` gives a group's rewards (dynamic sampling only); ``tokenizer`` and ``pad_id`` pack
    responses for training exactly as a batch-mode rollout does.
    """

    def __init__(
        self,
        spec: RLHFJobSpec,
        *,
        placement: PoolPlacement,
        actor: WorkerGroup,
        actor_host: Any,
        tokenizer: Any,
        pad_id: int,
        prompts_for: Callable[[int], Batch],
        score: Callable[[Batch], torch.Tensor] | None = None,
        torch_threads: int = 1,
        log: Callable[[str], None] = print,
        setup_timeout_seconds: float = 600.0,
        trajectories: TrajectorySource | None = None,
    ) -> None:
        self.spec = spec
        self.placement = placement
        self.actor = actor
        self.actor_host = actor_host
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.prompts_for = prompts_for
        self.score = score
        self.torch_threads = torch_threads
        self.log = log
        self.setup_timeout_seconds = setup_timeout_seconds
        rollout = spec.rollout
        self.max_staleness = rollout.max_staleness
        self.tensor_parallel_size = rollout.tensor_parallel_size
        self.groups_per_step = spec.training.prompts_per_step
        self.total_groups = spec.training.total_steps * self.groups_per_step
        self.buffer: ReplayBuffer[tuple[Batch, RequestResult]] = ReplayBuffer(self.max_staleness)
        self.counters = _Counters()
        self.replicas: dict[int, _Replica] = {}
        self.router = RequestRouter([])
        self.replacements: list[ReplicaReplacement] = []
        self.version = 0
        self._open: dict[str, _Open] = {}
        self._unrouted: list[str] = []  # open requests waiting for a serving replica
        self._direct_done: dict[str, RequestResult] = {}
        self._submissions: list[tuple[int, Any]] = []  # (replica, ObjectRef of its submit call)
        self._ids = itertools.count()
        # The replicas on the current bridge; None: rebuild it (a member died, or a push broke it),
        # even for the same members, or none (the actor's side of a broken bridge is broken too).
        self._bridge_members: tuple[int, ...] | None = None
        self._served_stalenesses: list[int] = []
        self._served_spans: list[int] = []
        self._poll_window_started = time.monotonic()
        self._busy_at_window_start: dict[int, tuple[float, float]] = {}
        self._tokens_at_window_start: dict[int, int] = {}
        self._replacements_reported = 0
        self._last_replica_rates: dict[int, float] = {}
        self.started_at = ""
        """When :meth:`start` ran (RFC 3339): the operator tells attempts' replacement counts apart by it."""
        self.trajectories = trajectories
        self._served_trajectories: list[TrajectoryStats] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self, version: int) -> None:
        """Start the replicas (``t_g`` bundles each) and load version ``version`` into them."""
        import ray

        self.started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for index in range(len(self.placement.bundles) // self.tensor_parallel_size):
            self.replicas[index] = self._launch(index)
        ray.get(
            [ref for r in self.replicas.values() for ref in (r.ready, *r.follower_starts)],
            timeout=self.setup_timeout_seconds,
        )
        self.push(version)

    def _launch(self, index: int) -> _Replica:
        """Replica ``index`` on bundles ``index * t_g ..`` of the pool (one node's: the spec's rule)."""
        import ray

        from hybridflow.rollout.replica import RolloutReplica, replica_options

        size = self.tensor_parallel_size
        handles: list[Any] = []
        for rank in range(size):
            group, bundle = self.placement.bundles[index * size + rank]
            options = replica_options(group, bundle, self.placement.pool.cpus_per_gpu, follower=rank > 0)
            handles.append(
                cast(Any, ray.remote(RolloutReplica))
                .options(**options)
                .remote(self.spec, index, self.torch_threads, rank, size)
            )
        rendezvous = handles[0].open_rendezvous.remote() if size > 1 else None
        starts = [handle.start.remote(rendezvous) for handle in handles]
        now = time.monotonic()
        replica = _Replica(
            index,
            handles[0],
            starts[0],
            followers=handles[1:],
            follower_starts=starts[1:],
            last_answer_at=now,
            last_progress_at=now,
        )
        for start in starts:
            start.future().add_done_callback(lambda _, replica=replica: self._rank_started(replica))
        return replica

    def _rank_started(self, replica: _Replica) -> None:
        """Ray's callback thread, as each rank's ``start`` returns (or raises): the last one loaded the replica.

        Timed here, not when the service next looks, so that a replacement's record says when its
        load ended (and in which step), whatever the join rule then did with it.
        """
        replica.ranks_started.append(time.monotonic())  # one append per rank: atomic
        if len(replica.ranks_started) == len(replica.ranks) and replica.loaded_at is None:
            replica.loaded_at, replica.loaded_in_step = replica.ranks_started[-1], self.version + 1

    def shutdown(self, wait_seconds: float = 10.0) -> None:
        """Kill every replica and wait (bounded) until Ray reports each dead, so that its GPU is free."""
        import ray

        ranks = [handle for replica in self.replicas.values() for handle in replica.ranks]
        for handle in ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + wait_seconds
        for handle in ranks:
            with contextlib.suppress(Exception):  # a dead actor's call raises: what we wait for
                ray.get(handle.stats.remote(), timeout=max(0.1, deadline - time.monotonic()))
        self.replicas.clear()

    # ------------------------------------------------------------------ weights

    def _build_bridge(self, members: list[int]) -> None:
        """Bridge rank 0 is the actor's rank 0, rank ``1 + j * t_g + r`` rank ``r`` of the ``j``-th replica (by index)."""
        import ray

        size = self.tensor_parallel_size
        world = 1 + size * len(members)
        timeout = self.setup_timeout_seconds
        address, port = ray.get(
            self.actor_host.open_bridge.remote(WEIGHTS_BRIDGE, world, timeout), timeout=timeout
        )
        cuda = str(ray.get(self.actor_host.device.remote(), timeout=timeout)).startswith("cuda")
        backend = "nccl" if cuda else "gloo"
        wait = self._bridge_timeout()
        refs = [self.actor_host.join_bridge.remote(WEIGHTS_BRIDGE, address, port, 0, world, backend, wait)]
        refs += [
            handle.join_bridge.remote(address, port, 1 + j * size + rank, world, backend, wait)
            for j, index in enumerate(members)
            for rank, handle in enumerate(self.replicas[index].ranks)
        ]
        ray.get(refs, timeout=timeout)
        self._bridge_members = tuple(members)

    def push(self, version: int) -> float:
        """Step 3 of the protocol: every replica to ``version`` (joining replicas included); seconds taken.

        A replica that dies during the push is replaced and the push made again over a rebuilt
        bridge (at most :data:`PUSH_ATTEMPTS` times): the actor walks all its buckets whatever
        happens on the bridge (``weight_push.send_pushed_weights``), so a retry finds it ready.
        """
        started = time.monotonic()
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            failure = self._push_once(version)
            if failure is None:
                break
            self.log(
                f"weight push to the rollout replicas failed ({failure}); attempt {attempt} of {PUSH_ATTEMPTS}"
            )
            self._bridge_members = None
            if attempt == PUSH_ATTEMPTS:
                raise RuntimeError(
                    f"weight push to the rollout replicas failed {PUSH_ATTEMPTS} times: {failure}"
                )
        self.version = version
        self._serve_joined()
        self._route_unrouted()
        return time.monotonic() - started

    def _push_once(self, version: int) -> str | None:
        """One push; the reason it failed, or ``None``."""
        import ray

        self._probe_liveness()
        # A replica that loaded joins this push; one still loading joins at a later moment, so
        # that the step never waits for it (replica_join).
        members = sorted(r.index for r in list(self.replicas.values()) if r.serving or self._joins(r))
        if tuple(members) != self._bridge_members:
            self._build_bridge(members)
        abort = self.spec.rollout.on_weight_update == "abort"
        sending = self.actor.push_weights.submit()
        receiving = {
            index: [handle.receive_weights.remote(version, abort) for handle in self.replicas[index].ranks]
            for index in members
        }
        failure: str | None = None
        try:
            sending.result()
        except Exception as error:
            failure = f"the actor's send: {str(error).splitlines()[0][:200]}"
        for index, refs in receiving.items():
            aborted: list[RequestResult] = []
            died = False
            for rank, ref in enumerate(refs):
                try:
                    _, from_rank = ray.get(ref)
                    aborted += from_rank  # the leader's only: followers abort nothing of their own
                except Exception as error:
                    failure = failure or f"replica {index} rank {rank}: {str(error).splitlines()[0][:200]}"
                    died = died or isinstance(error, ray.exceptions.RayActorError)
            if died:
                self._replace(self.replicas[index], "died during a weight push")
                continue
            self.replicas[index].last_answer_at = time.monotonic()  # it answered: alive
            for result in aborted:
                self._continue_aborted(index, result)
        return failure

    def _joins(self, replica: _Replica) -> bool:
        """:func:`replica_join` for a replica not serving, now (one whose start failed is started again).

        A joining tensor-parallel replica gets one outstanding ``watch`` per follower. (Its load is
        timed by :meth:`_rank_started`; here only if Ray's callback has not run yet.)
        """
        import ray

        starts = [replica.ready, *replica.follower_starts]
        loaded, _ = ray.wait(starts, num_returns=len(starts), timeout=0)
        failure = ""
        try:
            ray.get(loaded)
        except Exception as error:
            failure = failure_summary(error)
        verdict = replica_join(
            serving=replica.serving, ranks=len(starts), ranks_loaded=len(loaded), start_failed=bool(failure)
        )
        if verdict == "failed":
            self._replace(replica, f"failed to start: {failure}")
        if verdict != "join":
            return False
        if replica.loaded_at is None:
            replica.loaded_at, replica.loaded_in_step = time.monotonic(), self.version + 1
        if len(replica.watches) < len(replica.followers):
            replica.watches = [follower.watch.remote() for follower in replica.followers]
        return True

    def _probe_liveness(self) -> None:
        """Replace the serving replicas whose process is gone, before a push needs every member.

        A push is a collective: a member that died before it would leave the others waiting
        for the bridge's timeout. A replica busy in a poll answers after it; one that answers
        nothing within the bridge's timeout is left to the stall rule.
        """
        import ray

        serving = [r for r in self.replicas.values() if r.serving]
        probes = {handle.stats.remote(): (r, rank) for r in serving for rank, handle in enumerate(r.ranks)}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=self._bridge_timeout())
        for ref in ready:
            replica, rank = probes[ref]
            try:
                ray.get(ref)
            except Exception as error:
                if self.replicas.get(replica.index) is replica:  # not replaced for another rank already
                    self._replace(replica, _lost_rank(rank, type(error).__name__))
        self._check_health()

    def _bridge_timeout(self) -> float:
        """A bridge member that does not take part within this is as stalled as a silent replica."""
        return float(self.spec.rollout.replica_timeout_seconds)

    def _serve_joined(self) -> None:
        """Replicas that received their first weights join the routing (a replacement: recorded)."""
        now = time.monotonic()
        for replica in self.replicas.values():
            if replica.serving or replica.index not in (self._bridge_members or ()):
                continue
            replica.serving = True
            replica.last_answer_at = replica.last_progress_at = now
            self.router.add(replica.index)
            if replica.replacing is not None:
                self._record_replacement(replica, now)

    def _record_replacement(self, replica: _Replica, now: float) -> None:
        """A successor serves: its :class:`ReplicaReplacement` (self.version: the weights it got)."""
        assert replica.replacing is not None
        detected = replica.replacing.detected_at
        loaded_at = now if replica.loaded_at is None else replica.loaded_at  # joins only via _joins
        done = ReplicaReplacement(
            replica.index,
            replica.replacing.reason,
            detected,
            serving_after_seconds=now - detected,
            loaded_after_seconds=loaded_at - detected,
            loaded_in_step=replica.loaded_in_step,
            serving_from_step=self.version + 1,
        )
        self.replacements.append(done)
        replica.replacing = None
        self.log(
            f"rollout replica {done.index} replaced ({done.reason}); serving again after "
            f"{done.serving_after_seconds:.1f} s (loaded after {done.loaded_after_seconds:.1f} s, in step "
            f"{done.loaded_in_step}; serving from step {done.serving_from_step})"
        )

    def _continue_aborted(self, index: int, result: RequestResult) -> None:
        request_id = result.request.request_id
        self.router.finished(request_id)
        continuation = continuation_of(result)
        if continuation is None:  # every sample had ended: it finished after all
            self._finished(result)
            return
        self._open[request_id].request = continuation
        self._unrouted.append(request_id)

    # ------------------------------------------------------------------ requests

    def _request(self, prompt: Batch, *, greedy: bool, seed: int | None, for_buffer: bool) -> str:
        rollout = self.spec.rollout
        samples = int(prompt.meta.get("samples", self.spec.algorithm.samples_per_prompt))
        params = SamplingParams(
            max_new_tokens=rollout.max_response_tokens,
            temperature=0.0 if greedy else rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            n=samples,
            seed=seed,
            return_logprobs=True,
        )
        request_id = f"g{next(self._ids)}"
        ids = [int(token) for token in prompt.non_tensors["prompt_token_ids"][0]]
        request = GenerationRequest(request_id, ids, params)
        self._open[request_id] = _Open(prompt, request, for_buffer)
        if self.trajectories is None:
            self._unrouted.append(request_id)
        else:  # the group's entry stays open until its trajectories end; its turns are routed
            row = {key: values[0] for key, values in prompt.non_tensors.items()}
            self._open_turns(prompt, self.trajectories.begin(request, row))
        return request_id

    def _open_turns(self, prompt: Batch, turns: list[GenerationRequest]) -> None:
        for turn in turns:
            self._open[turn.request_id] = _Open(prompt, turn, for_buffer=False, turn=True)
            self._unrouted.append(turn.request_id)

    def _advance_trajectories(self) -> None:
        """Route the trajectories' next turns; finish the groups whose trajectories all ended."""
        if self.trajectories is None:
            return
        turns, groups = self.trajectories.advance()
        for turn in turns:
            group_id = turn.session_id.split("/")[0] if turn.session_id else ""
            self._open_turns(self._open[group_id].prompt, [turn])
        for result in groups:
            self._finished(result)
        self._route_unrouted()

    def _route_unrouted(self) -> None:
        if not self.router.replicas or not self._unrouted:
            return
        by_replica: dict[int, list[GenerationRequest]] = {}
        for request_id in self._unrouted:
            request = self._open[request_id].request
            tokens = len(request.prompt_token_ids) + request.params.n * request.params.max_new_tokens
            replica = cast(int, self.router.route(request_id, tokens, request.session_id))
            by_replica.setdefault(replica, []).append(request)
        self._unrouted = []
        for index, requests in by_replica.items():
            self._submissions.append((index, self.replicas[index].handle.submit.remote(requests)))

    def _fill(self, trainer_version: int) -> None:
        """Submit every group the gate allows (rule 1 of ``buffer.py``)."""
        counters = self.counters
        # Groups dropped as stale count neither as trained nor as on their way: fresh ones take
        # their places (counting them left the last step waiting forever for groups never drawn).
        counted = counters.accepted - self.buffer.dropped_stale + self._groups_on_the_way()
        room = 0
        # Never more than the job trains on: the last steps' gate would reach past the end.
        while counted + room < self.total_groups and may_submit(
            accepted_or_on_the_way=counted + room,
            trainer_version=trainer_version,
            max_staleness=self.max_staleness,
            groups_per_step=self.groups_per_step,
        ):
            room += 1  # at most (k + 1) * B a call: the gate's whole window
        if room == 0:
            return
        prompts = self.prompts_for(room)
        for row in range(len(prompts)):
            index = counters.groups_drawn
            counters.groups_drawn += 1
            seed = self.spec.training.seed * 100_003 + index
            self._request(prompts.rows([row]), greedy=False, seed=seed, for_buffer=True)
        self._route_unrouted()

    def _groups_on_the_way(self) -> int:
        return sum(1 for o in self._open.values() if o.for_buffer)

    def _pump(self, wait_seconds: float) -> None:
        """Poll every serving replica once (waiting up to ``wait_seconds``) and take what finished.

        Called only while the controller waits for the replicas (the actor is idle then): a
        replacement that has loaded its model joins here, with the current weights, rather than
        at the push after the step, which might never come if no replica serves.
        """
        import ray

        if any(not replica.serving and self._joins(replica) for replica in list(self.replicas.values())):
            self.push(self.version)
        self._check_submissions()

        serving = [r for r in self.replicas.values() if r.serving]
        for replica in serving:
            if replica.poll is None:
                replica.poll = replica.handle.poll.remote(wait_seconds)
        refs = {r.poll: r for r in serving}
        if not refs:
            time.sleep(wait_seconds)
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_seconds + 1.0)
        now = time.monotonic()
        for ref in ready:
            replica = refs[ref]
            replica.poll = None
            try:
                answer = ray.get(ref)
            except Exception as error:  # the process died, or decoding raised
                self._replace(replica, f"died: {failure_summary(error)}")
                continue
            replica.last_answer_at = now
            stats = answer.stats
            if stats.tokens_generated > replica.tokens or not (
                stats.waiting_samples or stats.running_samples
            ):
                replica.last_progress_at = now
            replica.tokens = stats.tokens_generated
            replica.busy_seconds, replica.alive_seconds = stats.busy_seconds, stats.alive_seconds
            replica.has_work = bool(stats.waiting_samples or stats.running_samples)
            for result in answer.finished:
                self.router.finished(result.request.request_id)
                self._finished(result)
        self._advance_trajectories()
        self._check_health()

    def _check_submissions(self) -> None:
        """What became of the submit calls: a refused request raises (it would never finish), a
        replica whose decoding broke is replaced, a dead one is left to the polls."""
        import ray

        pending = []
        for index, ref in self._submissions:
            if ray.wait([ref], timeout=0)[1]:
                pending.append((index, ref))
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # the replica died: its poll reports it and its requests are routed again
            except Exception as error:
                cause = getattr(error, "cause", None) or error
                if isinstance(cause, ValueError):  # the request itself (a prompt it cannot hold)
                    raise RuntimeError(
                        f"rollout replica {index} refused requests: {failure_summary(error)}"
                    ) from error
                replica = self.replicas.get(index)
                if replica is not None and replica.serving:  # its decoding broke: as a poll would say
                    self._replace(replica, f"died: {failure_summary(error)}")
        self._submissions = pending

    def _check_health(self) -> None:
        import ray

        now = time.monotonic()
        for replica in list(self.replicas.values()):
            if not replica.serving:
                continue
            ended = ray.wait(replica.watches, num_returns=1, timeout=0)[0] if replica.watches else []
            if ended:  # a follower's loop ended or its process died: the leader would hang in a collective
                try:
                    ray.get(ended[0])
                    cause = "its command loop ended"
                except Exception as error:
                    cause = failure_summary(error)
                self._replace(replica, _lost_rank(1 + replica.watches.index(ended[0]), cause))
                continue
            reason = replica_verdict(
                now=now,
                last_answer_at=replica.last_answer_at,
                last_progress_at=replica.last_progress_at,
                has_work=replica.has_work,
                timeout_seconds=self.spec.rollout.replica_timeout_seconds,
            )
            if reason is not None:
                self._replace(replica, reason)

    def _replace(self, replica: _Replica, reason: str) -> None:
        import ray

        detected = time.monotonic()
        self.log(f"rollout replica {replica.index} {reason}: replacing it")
        for handle in replica.ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(handle, no_restart=True)
        if replica.serving:
            for request_id in self.router.remove(replica.index):
                opened = self._open[str(request_id)]
                # From its prompt again: what the dead process generated is gone with it.
                opened.request = GenerationRequest(
                    opened.request.request_id,
                    opened.request.prompt_token_ids,
                    opened.request.params,
                    session_id=opened.request.session_id,
                )
                self._unrouted.append(str(request_id))
        self.counters.replaced += 1
        successor = self._launch(replica.index)
        successor.replacing = ReplicaReplacement(replica.index, reason, detected)
        self.replicas[replica.index] = successor
        self._bridge_members = None
        self._route_unrouted()

    def _finished(self, result: RequestResult) -> None:
        opened = self._open.pop(result.request.request_id)
        if opened.turn:
            assert self.trajectories is not None
            self.trajectories.turn_finished(result)
            return
        if not opened.for_buffer:
            self._direct_done[result.request.request_id] = result
            return
        if self.spec.rollout.dynamic_sampling.enabled and self.score is not None:
            rewards = self.score(self._pack([(opened.prompt, result)])[1])
            if not informative(rewards) and self._refills_left() > 0:
                self.counters.dropped_uninformative += 1
                return
        versions = [v for sample in result.samples for v in sample.versions] or [self.version]
        self.buffer.put((opened.prompt, result), oldest_version=min(versions), newest_version=max(versions))
        self.counters.accepted += 1

    def _refills_left(self) -> int:
        tries = self.spec.rollout.dynamic_sampling.max_tries
        allowed = (tries - 1) * max(self.counters.accepted + self._groups_on_the_way(), self.groups_per_step)
        return allowed - self.counters.dropped_uninformative

    # ------------------------------------------------------------------ the trainer's calls

    def next_batch(self, trainer_version: int) -> tuple[Batch, Batch]:
        """Step 1: the step's prompts and responses (waits until the buffer holds ``B`` groups)."""
        self._pump(0.0)  # what finished meanwhile, and fresh replica figures, even with the buffer full
        while True:
            self._fill(trainer_version)
            if self.buffer.ready(self.groups_per_step, trainer_version):
                break
            self._pump(POLL_SECONDS)
        taken = self.buffer.take(self.groups_per_step, trainer_version)
        self._served_stalenesses = []
        self._served_spans = []
        self._served_trajectories = []
        for group in taken:
            _, result = group.payload
            if isinstance(result.request.tag, list):
                self._served_trajectories += result.request.tag
            for sample in result.samples:
                versions = sample.versions or [self.version]
                self._served_stalenesses.append(trainer_version - min(versions))
                self._served_spans.append(max(versions) - min(versions))
        return self._pack([group.payload for group in taken])

    def generate_now(self, prompts: Batch) -> Batch:
        """Generate ``prompts`` now, outside the buffer and the gate (ReMax's greedy pass, say)."""
        greedy = bool(prompts.meta.get("greedy", False))
        seed = prompts.meta.get("seed")
        ids = [
            self._request(
                prompts.rows([row]).with_meta(**prompts.meta),
                greedy=greedy,
                seed=None if seed is None else int(seed) * 1000 + row,
                for_buffer=False,
            )
            for row in range(len(prompts))
        ]
        self._route_unrouted()
        while not all(request_id in self._direct_done for request_id in ids):
            self._pump(POLL_SECONDS)
        results = [self._direct_done.pop(request_id) for request_id in ids]
        _, responses = self._pack([(prompts.rows([row]), result) for row, result in enumerate(results)])
        return responses.with_meta(**prompts.meta)

    def _pack(self, groups: list[tuple[Batch, RequestResult]]) -> tuple[Batch, Batch]:
        """The trainer's prompts and packed responses of ``groups`` (rows interleaved per prompt)."""
        prompts = Batch.concat([prompt for prompt, _ in groups])
        samples = [sample for _, result in groups for sample in result.samples]
        n = len(groups[0][1].samples)
        multi_turn = all(s.loss_mask is not None for s in samples)
        output = RolloutOutput(
            [s.token_ids for s in samples],
            ["stop" if s.finish_reason == "stop" else "length" for s in samples],
            [s.logprobs for s in samples],
            [cast(list[int], s.loss_mask) for s in samples] if multi_turn else None,
        )
        # A trajectory's reward reads its last model turn, not the tool results before it.
        texts = (
            response_texts(
                self.tokenizer,
                [s.token_ids[slice(*(s.answer_span or (0, len(s.token_ids))))] for s in samples],
            )
            if multi_turn
            else None
        )
        prompt_ids = [[int(t) for t in ids] for ids in prompts.non_tensors["prompt_token_ids"]]
        if all(s.prompt_token_ids is not None for s in samples):  # each row its own prompt (an agent's)
            prompt_ids = [list(cast(list[int], s.prompt_token_ids)) for s in samples]
        responses = pack_responses(
            self.spec,
            self.tokenizer,
            self.pad_id,
            prompts.with_meta(samples=n),
            prompt_ids,
            output,
            n,
            policy_version=0,
            texts=texts,
        )
        oldest = torch.tensor(
            [min(s.versions) if s.versions else self.version for s in samples], dtype=torch.int64
        )
        responses = responses.with_fields(policy_version=oldest)
        stats = [
            s for _, result in groups if isinstance(result.request.tag, list) for s in result.request.tag
        ]
        if len(stats) == len(samples):  # multi-turn: each row's trajectory, for the reward functions
            extra = np.empty(len(samples), dtype=object)
            infos = responses.non_tensors.get("extra_info", [None] * len(samples))
            for row, (info, trajectory) in enumerate(zip(infos, stats, strict=True)):
                extra[row] = {**(info or {}), "agent": trajectory.as_extra_info()}
            responses = responses.with_fields(extra_info=extra)
        return prompts.with_meta(samples=n), responses

    def step_metrics(self) -> dict[str, float]:
        """The rollout's metrics for the step just served (and the service's counters)."""
        counters = self.counters
        metrics: dict[str, float] = trajectory_metrics(self._served_trajectories)
        if self._served_stalenesses:
            metrics.update(staleness_histogram(self._served_stalenesses, self.max_staleness))
            spans = self._served_spans
            metrics["rollout/version_span_mean"] = sum(spans) / len(spans)
            metrics["rollout/version_span_max"] = float(max(spans))
            for span in range(self.max_staleness + 1):  # a span never exceeds the sample's staleness
                metrics[f"rollout/version_span/samples/{span}"] = float(spans.count(span))
        drawn = counters.accepted + counters.dropped_uninformative
        metrics["rollout/dropped_uninformative_fraction"] = counters.dropped_uninformative / max(drawn, 1)
        metrics["rollout/dropped_stale"] = float(self.buffer.dropped_stale)
        metrics["rollout/buffer_groups"] = float(len(self.buffer))
        metrics["rollout/in_flight_requests"] = float(len(self._open))
        metrics["rollout/queue_depth"] = float(len(self._unrouted))
        metrics["rollout/replicas_serving"] = float(sum(r.serving for r in self.replicas.values()))
        metrics["rollout/replicas_replaced"] = float(counters.replaced)
        new = self.replacements[self._replacements_reported :]
        self._replacements_reported = len(self.replacements)
        seconds = [r.serving_after_seconds for r in new if r.serving_after_seconds is not None]
        if seconds:  # replacements that completed since the last step's metrics: detection to serving
            metrics["rollout/replica_replace_seconds"] = max(seconds)
            metrics["rollout/replica_load_seconds"] = max(
                r.loaded_after_seconds for r in new if r.loaded_after_seconds is not None
            )
        now = time.monotonic()
        window = now - self._poll_window_started
        idle: list[float] = []
        for index, replica in self.replicas.items():
            busy0, alive0 = self._busy_at_window_start.get(index, (0.0, 0.0))
            if replica.serving and replica.alive_seconds > alive0:
                busy = (replica.busy_seconds - busy0) / (replica.alive_seconds - alive0)
                idle.append(1.0 - min(1.0, max(0.0, busy)))
            self._busy_at_window_start[index] = (replica.busy_seconds, replica.alive_seconds)
        if idle:
            metrics["rollout/idle_fraction"] = sum(idle) / len(idle)
        tokens = {index: r.tokens for index, r in self.replicas.items()}
        if window > 0:
            for index, count in tokens.items():
                # A replaced replica's successor counts from 0 again.
                before = self._tokens_at_window_start.get(index, 0)
                grown = count - before if count >= before else count
                metrics[f"rollout/replica{index}/tokens_per_second"] = grown / window
                self._last_replica_rates[index] = grown / window
            metrics["rollout/tokens_per_second"] = sum(
                metrics[f"rollout/replica{index}/tokens_per_second"] for index in tokens
            )
        self._tokens_at_window_start, self._poll_window_started = tokens, now
        return metrics

    def health(self) -> dict[str, Any]:
        """The replicas' health as ``status.progress.rollout`` holds it (the operator's RolloutProgress)."""
        last = self.replacements[-1] if self.replacements else None
        replaced_times: dict[int, int] = {}
        for replacement in self.replacements:
            replaced_times[replacement.index] = replaced_times.get(replacement.index, 0) + 1
        health: dict[str, Any] = {
            "startedAt": self.started_at,
            "replicasServing": sum(r.serving for r in self.replicas.values()),
            "replicasReplaced": self.counters.replaced,
            "replicas": [
                {
                    "index": index,
                    "state": "Serving" if replica.serving else "Starting",
                    "tokensPerSecond": round(self._last_replica_rates.get(index, 0.0), 1),
                    "replaced": replaced_times.get(index, 0),
                }
                for index, replica in sorted(self.replicas.items())
            ],
        }
        if last is not None:
            health["lastReplacement"] = (
                f"replica {last.index}: {last.reason}; serving again after {last.serving_after_seconds:.1f} s"
            )[:1024]
        return health

    # ------------------------------------------------------------------ checkpoints

    def drain(self, trainer_version: int) -> None:
        """Submit what the gate allows, then wait until nothing is in flight (before a checkpoint)."""
        self._fill(trainer_version)
        while self._open:
            self._pump(POLL_SECONDS)

    def checkpoint_state(self, trainer_version: int) -> dict[str, Any]:
        """What a checkpoint keeps (after :meth:`drain`): the buffer's groups and the counters."""
        self.drain(trainer_version)
        return {
            "groups": [
                (g.payload, g.oldest_version, g.newest_version, g.arrival) for g in self.buffer.groups
            ],
            "dropped_stale": self.buffer.dropped_stale,
            "counters": {
                "accepted": self.counters.accepted,
                "dropped_uninformative": self.counters.dropped_uninformative,
                "groups_drawn": self.counters.groups_drawn,
            },
        }

    def restore(self, state: dict[str, Any]) -> None:
        """What :meth:`checkpoint_state` returned, in a fresh service before :meth:`start`."""
        for payload, oldest, newest, _ in sorted(state["groups"], key=lambda g: g[3]):
            self.buffer.put(payload, oldest_version=oldest, newest_version=newest)
        self.buffer.dropped_stale = int(state["dropped_stale"])
        for name in ("accepted", "dropped_uninformative", "groups_drawn"):
            setattr(self.counters, name, int(state["counters"][name]))


class ServedRollout:
    """``workers.rollout`` in server mode: the step's responses come from the service's buffer.

    The same protocol as :class:`~hybridflow.algorithms.prefetch.PrefetchedRollout`: the trainer
    serves the step's prompts and responses before calling the step function; the step's
    ``generate_sequences(prompts)`` with that very batch returns them; any other batch is
    generated at once on the replicas (:meth:`RolloutService.generate_now`); ``sync_weights`` is
    a no-op (the trainer pushes after every update).
    """

    def __init__(self, service: RolloutService) -> None:
        self.service = service
        self._prompts: Batch | None = None
        self._responses: Batch | None = None

    def serve(self, prompts: Batch, responses: Batch) -> None:
        self._prompts, self._responses = prompts, responses

    def sync_weights(self) -> int:
        return 0

    def generate_sequences(self, prompts: Batch) -> Batch:
        if prompts is self._prompts and self._responses is not None:
            responses, self._responses = self._responses, None
            return responses
        return self.service.generate_now(prompts)

    def transition_stats(self) -> list[dict[str, float]]:
        return []

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        raise AttributeError(
            f"rollout.{method}: in spec.rollout.mode 'server' the rollout is a service of engine replicas; "
            "a step may call generate_sequences, sync_weights and transition_stats only"
        )
