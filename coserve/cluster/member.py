"""`EngineMember`: one engine of a `EngineCluster`: its policy, its iteration loop, what was routed to it.

Each engine keeps what is its own: a `CoServingPolicy` over its KV blocks, adapter slots and latency
model (counting with the cluster's shared counters), and an `EngineCore` with one plan in flight. The
member adds what the router and the job placer read (`RouteCandidate`, `PlacementCandidate`): the
requests routed here and not finished, the prompt tokens of those without a first token yet, the
adapters they asked for, the fan-outs with a sequence here, and the jobs placed here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from coserve.cluster.engine_core import EngineCore, Step
from coserve.cluster.routing import EngineLoad
from coserve.contract.job_spec import FinetuneJobSpec
from coserve.contract.plan import IterationPlan
from coserve.contract.sampling import AdapterRef
from coserve.finetune.job import CoservedJob
from coserve.inference.kv_blocks import KVBlockManager
from coserve.inference.prefix_hashes import PrefixHashes
from coserve.inference.request import Request
from coserve.planner.policy import CoServingPolicy


class EngineMember:
    """One engine under the cluster scheduler (module docstring).

    Args:
        engine_id: the engine's name.
        policy: its policy, built with the cluster's `SharedVtc`.
    """

    def __init__(self, engine_id: str, policy: CoServingPolicy) -> None:
        self._engine_id = engine_id
        self.policy = policy
        self.core = EngineCore(policy)
        self.requests: dict[str, Request] = {}  # routed here, unfinished
        self._awaiting_first: dict[str, int] = {}  # request id -> prompt tokens, until its first token
        self._awaiting_tokens = 0
        self._adapter_users: Counter[int] = Counter()  # adapter id -> unfinished requests here
        self._fanouts: Counter[str] = Counter()  # parent id -> unfinished sequences here
        # Routed here, never sent to the engine (so another engine may take them), by tenant, oldest first.
        self.unsent: dict[str, dict[str, Request]] = {}
        self.jobs: dict[str, CoservedJob] = {}  # placed here, not finished
        self._job_weight: dict[str, float] = {}

    # --------------------------------------------------------------- what the router reads

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def block_size(self) -> int:
        return self.policy.kv.block_size

    def load(self) -> EngineLoad:
        scheduler = self.policy.config.scheduler
        return EngineLoad(unfinished=len(self.requests), awaiting_prefill_tokens=self._awaiting_tokens,
                          max_num_seqs=scheduler.max_num_seqs, max_batch_tokens=scheduler.max_batch_tokens,
                          free_kv_blocks=self._job_kv.num_free_blocks, num_jobs=len(self.jobs),
                          job_weight=sum(self._job_weight.values()))

    def holds_adapter(self, adapter_id: int) -> bool:
        return self._adapter_users[adapter_id] > 0 or self.policy.adapters.slot_of(adapter_id) is not None

    def can_take_adapter(self, adapter: AdapterRef) -> bool:
        return self.policy.adapters.can_acquire(adapter)

    def cached_prefix_blocks(self, prefix: PrefixHashes) -> int:
        return self.policy.kv.cached_prefix_blocks(prefix)

    def holds_fanout(self, parent_id: str) -> bool:
        return self._fanouts[parent_id] > 0

    def fits(self, request: Request) -> bool:
        """Whether the request's tokens fit this engine's context (engines may differ)."""
        return request.num_tokens <= self.policy.config.scheduler.max_model_len

    # ---------------------------------------------------------- what the job placer reads

    @property
    def hosts_jobs(self) -> bool:
        return self.policy.jobs is not None

    @property
    def _job_kv(self) -> KVBlockManager:
        jobs = self.policy.jobs
        return self.policy.kv if jobs is None else jobs.kv

    @property
    def job_kv_blocks(self) -> int:
        return self._job_kv.num_blocks

    @property
    def job_block_size(self) -> int:
        return self._job_kv.block_size

    @property
    def num_adapter_slots(self) -> int:
        return self.policy.adapters.num_slots

    # ---------------------------------------------------------------------- bookkeeping

    def add(self, request: Request, pinned: bool = False) -> None:
        """Queue a request routed here; `pinned`: no other engine may take it before admission.

        Raises:
            ValueError: as `CoServingPolicy.add_request` (nothing is recorded then).
        """
        self.policy.add_request(request)
        request_id = request.request_id
        self.requests[request_id] = request
        if request.num_output_tokens == 0:
            self._awaiting_first[request_id] = len(request.prompt_token_ids)
            self._awaiting_tokens += len(request.prompt_token_ids)
        if request.adapter is not None:
            self._adapter_users[request.adapter.adapter_id] += 1
        if request.parent_id is not None:
            self._fanouts[request.parent_id] += 1
        if not pinned:
            self.unsent.setdefault(request.tenant, {})[request_id] = request

    def forget(self, request: Request) -> None:
        """The request finished or left this engine: drop what was kept for it."""
        if self.requests.pop(request.request_id, None) is None:
            return
        self._first_token(request.request_id)
        self._sent(request)
        if request.adapter is not None:
            _decrement(self._adapter_users, request.adapter.adapter_id)
        if request.parent_id is not None:
            _decrement(self._fanouts, request.parent_id)

    def _first_token(self, request_id: str) -> None:
        tokens = self._awaiting_first.pop(request_id, None)
        if tokens is not None:
            self._awaiting_tokens -= tokens

    def _sent(self, request: Request) -> None:
        queued = self.unsent.get(request.tenant)
        if queued is not None and queued.pop(request.request_id, None) is not None and not queued:
            del self.unsent[request.tenant]

    def sent(self, plan: IterationPlan) -> None:
        """The plan admitted its new sequences: they are the engine's now, no other engine's to take."""
        for new in plan.new_sequences:
            request = self.requests.get(new.request_id)
            if request is not None:
                self._sent(request)

    @property
    def free_slots(self) -> int:
        """Batch slots a plan could still admit requests into."""
        policy = self.policy
        return max(0, policy.config.scheduler.max_num_seqs - policy.num_running)

    def after_step(self, step: Step) -> list[Request]:
        """Note the step's first tokens and finished requests; returns the finished ones."""
        finished = []
        for request in step.advanced:
            self._first_token(request.request_id)
            if request.is_finished:
                self.forget(request)
                finished.append(request)
        return finished

    def start_job(self, spec: FinetuneJobSpec, tenant_weight: float, paused: bool = False) -> CoservedJob:
        """Start a job placed here (on this engine's job host: its KV blocks and adapter slots); `paused`:
        it waits for a resume (it was paused before it was placed).

        Raises:
            ValueError: the policy runs no jobs, or the id is scheduled already.
        """
        host = self.policy.jobs
        if host is None:
            raise ValueError(f"engine {self.engine_id} runs no fine-tuning jobs")
        job = host.start(spec)
        if paused:
            host.pause(job.job_id)
        self.jobs[job.job_id] = job
        self._job_weight[job.job_id] = tenant_weight
        return job

    def drop_job(self, job_id: str) -> None:
        """The job ended (or left with its engine): it no longer counts here."""
        self.jobs.pop(job_id, None)
        self._job_weight.pop(job_id, None)


def _decrement(counter: Counter[Any], key: object) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
