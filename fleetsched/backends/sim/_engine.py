"""The synchronous core of the simulated engine: vLLM v1's scheduler over a `BlockPool`.

No awaits and no clock here: `schedule()` picks the next step's work and returns its duration
from the profile, the async loop sleeps that long, then `complete()` applies it. Requests that
arrive or are aborted while a step runs take effect at the next `schedule()`, as in vLLM.

Scheduling follows ``vllm/v1/core/sched/scheduler.py``:

1. Running requests first, in running order. Each asks for all its uncomputed tokens (a whole
   remaining prompt chunk, or 1 for a decode), capped by the step's token budget (chunked
   prefill). When its KV blocks cannot be allocated, the policy's victim is preempted (blocks
   freed, back to waiting, recomputed from scratch) until the allocation fits or the request
   itself is the victim.
2. Then, only if nothing was preempted in this step, waiting requests in policy order while a
   running slot (``max_num_seqs``) and budget remain: prefix cache lookup, allocation, admit.
   The first that does not fit stops admission.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetsched.settings import SimSettings

from ._kv_cache import BlockPool
from ._queues import make_queue

WAITING, RUNNING, FINISHED, ABORTED = range(4)


class SimRequest:
    """One request's state in the engine. Token counts only; no token objects."""

    __slots__ = (
        "seq", "priority", "prompt_tokens", "max_tokens", "hashes", "status", "num_computed",
        "num_output", "num_hashed", "blocks", "num_preemptions", "waiter", "delivered", "wake_every",
    )  # fmt: skip

    def __init__(self, seq: int, prompt_tokens: int, max_tokens: int, hashes: list[int], priority: int = 0) -> None:
        self.seq = seq
        self.priority = priority
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.hashes = hashes
        self.status = WAITING
        self.num_computed = 0
        self.num_output = 0
        self.num_hashed = 0
        self.blocks: list[int] = []
        self.num_preemptions = 0
        self.waiter = None  # the consumer's wake-up Event while it waits for tokens
        self.delivered = 0  # tokens the consumer has already been handed
        self.wake_every = 1  # new tokens that wake a waiting consumer (besides the first and the end)

    @property
    def waiting(self) -> bool:
        return self.status == WAITING

    @property
    def done(self) -> bool:
        return self.status >= FINISHED

    def __repr__(self) -> str:
        return (
            f"SimRequest(#{self.seq}, status={self.status}, computed={self.num_computed}, "
            f"output={self.num_output}/{self.max_tokens}, blocks={len(self.blocks)})"
        )


class SimEngine:
    """vLLM v1's scheduler and KV cache manager, as a synchronous state machine."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.block_size = settings.block_size
        self.pool = BlockPool(settings.kv_cache_tokens // settings.block_size, settings.block_size)
        self.queue = make_queue(settings.policy)
        self.running: list[SimRequest] = []
        self._seq = 0
        # Counters, monotonic.
        self.steps = 0
        self.busy_s = 0.0
        self.computed_tokens = 0
        self.prompt_computed = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.finished = 0
        self.aborted = 0

    def new_request(self, prompt_tokens: int, max_tokens: int, hashes: list[int], priority: int = 0) -> SimRequest:
        """Queue a request (already validated to fit the cache); the next `schedule()` sees it."""
        self._seq += 1
        request = SimRequest(self._seq, prompt_tokens, max_tokens, hashes, priority)
        self.queue.add(request)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.queue) > 0

    def abort(self, request: SimRequest) -> None:
        """Drop `request` wherever it is and free its blocks. No-op once it is done."""
        if request.status == WAITING:
            self.queue.discard(request)
        elif request.status == RUNNING:
            self.running.remove(request)
            self.pool.free(request.blocks)
            request.blocks = []
        else:
            return
        request.status = ABORTED
        self.aborted += 1

    def _allocate(self, request: SimRequest, num_new: int) -> bool:
        """Give `request` the blocks for `num_new` more tokens; False when the pool is short."""
        bs = self.block_size
        end = request.num_computed + num_new
        need = -(-end // bs) - len(request.blocks)
        if need > 0:
            if need > self.pool.num_free:
                return False
            self.pool.allocate(need, request.blocks)
        # Hash prompt blocks once they are scheduled in full (vLLM caches at allocation time).
        full = min(end // bs, len(request.hashes))
        if full > request.num_hashed:
            blocks, hashes, cache = request.blocks, request.hashes, self.pool.cache
            for i in range(request.num_hashed, full):
                cache(blocks[i], hashes[i])
            request.num_hashed = full
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.pool.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_hashed = 0
        request.status = WAITING
        request.num_preemptions += 1
        self.preemptions += 1
        self.queue.add_preempted(request)

    def schedule(self) -> tuple[list[SimRequest], list[int], float] | None:
        """Choose the next step: (requests, tokens each, duration in seconds), or None if idle."""
        budget = self.settings.max_num_batched_tokens
        running = self.running
        scheduled: dict[SimRequest, int] = {}
        preempted = False
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = request.prompt_tokens + request.num_output - request.num_computed
            if num_new > budget:
                num_new = budget
            if (
                request.num_computed + num_new <= len(request.blocks) * bs
                and request.num_hashed == len(request.hashes)
            ):  # the common decode: its last block has room, nothing to hash
                scheduled[request] = num_new
                budget -= num_new
                i += 1
                continue
            while not self._allocate(request, num_new):
                victim = self.queue.victim(running)
                index = running.index(victim)
                del running[index]
                if index < i:
                    i -= 1
                    budget += scheduled.pop(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                budget -= num_new
                i += 1
                continue
            break

        if not preempted:
            self._admit(scheduled, budget)
        if not scheduled:
            return None
        return self._plan(scheduled)

    def _admit(self, scheduled: dict[SimRequest, int], budget: int) -> None:
        queue, pool, running, bs = self.queue, self.pool, self.running, self.block_size
        max_running = self.settings.max_num_seqs
        while budget > 0 and len(running) < max_running:
            request = queue.peek()
            if request is None:
                break
            num_tokens = request.prompt_tokens + request.num_output
            # At least one token is always computed, so a full hit leaves the last block out.
            hits = pool.lookup(request.hashes, (num_tokens - 1) // bs)
            num_computed = len(hits) * bs
            num_new = min(num_tokens - num_computed, budget)
            need = -(-(num_computed + num_new) // bs) - len(hits)
            if need > pool.num_free - pool.num_evictable(hits):
                break
            queue.pop()
            pool.touch(hits)
            request.blocks = hits
            request.num_hashed = len(hits)
            request.num_computed = num_computed
            self._allocate(request, num_new)
            self.prefix_queries += num_tokens
            self.prefix_hits += num_computed
            request.status = RUNNING
            running.append(request)
            scheduled[request] = num_new
            budget -= num_new

    def _plan(self, scheduled: dict[SimRequest, int]) -> tuple[list[SimRequest], list[int], float]:
        requests = list(scheduled)
        counts = list(scheduled.values())
        tokens = sum(counts)
        context = tokens + sum(r.num_computed for r in requests)
        s = self.settings
        duration = (
            s.step_base_s
            + s.step_per_token_s * tokens
            + s.step_per_context_token_s * context
            + s.step_per_seq_s * len(requests)
        )
        return requests, counts, duration

    def complete(self, requests: Sequence[SimRequest], counts: Sequence[int], duration: float) -> list[SimRequest]:
        """Apply a finished step; returns the requests that produced a token (some finished)."""
        self.steps += 1
        self.busy_s += duration
        emitted: list[SimRequest] = []
        any_finished = False
        computed = decoded = 0
        for request, n in zip(requests, counts):
            if request.status != RUNNING:  # aborted while the step ran
                continue
            computed += n
            if n == 1 and request.num_output and request.num_computed >= request.prompt_tokens:
                decoded += 1
            request.num_computed += n
            if request.num_computed == request.prompt_tokens + request.num_output:
                request.num_output += 1
                emitted.append(request)
                if request.num_output >= request.max_tokens:
                    request.status = FINISHED
                    self.pool.free(request.blocks)
                    request.blocks = []
                    any_finished = True
        self.computed_tokens += computed
        self.prompt_computed += computed - decoded
        self.generated_tokens += len(emitted)
        if any_finished:
            self.running = [r for r in self.running if r.status == RUNNING]
            self.finished += sum(1 for r in emitted if r.status == FINISHED)
        return emitted
