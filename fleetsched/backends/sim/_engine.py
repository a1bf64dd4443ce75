"""The synchronous core of the simulated engine: vLLM v1's scheduler over a `BlockPool`.

No awaits and no clock here: `schedule()` picks the next step's work and returns it with its
duration from the profile, the async loop sleeps that long, then `complete()` applies it.
Requests that arrive or are aborted while a step runs take effect at the next `schedule()`, as
in vLLM.

Scheduling follows ``vllm/v1/core/sched/scheduler.py``:

1. Running requests first, in running order. Each asks for all its uncomputed tokens (a whole
   remaining prompt chunk, or 1 for a decode), capped by the step's token budget (chunked
   prefill). When its KV blocks cannot be allocated, the policy's victim is preempted (blocks
   freed, back to waiting, recomputed from scratch) until the allocation fits or the request
   itself is the victim.
2. Then, only if nothing was preempted in this step, waiting requests in policy order while a
   running slot (``max_num_seqs``) and budget remain: prefix cache lookup (none when
   ``enable_prefix_caching`` is off), allocation, admit.
   A request is admitted only when the blocks of its whole sequence are free (vLLM's
   ``scheduler_reserve_full_isl``), though it is given only this step's chunk of them. The
   first that does not fit stops admission.

**Coasting.** Most running requests, most of the time, decode one token a step and need nothing
else: their last block has room, they are not about to finish, and nobody is owed a wake-up. Such
a request *coasts*: the engine stops looking at it and counts its tokens from the number of steps
since it began (``num_computed`` and ``num_output`` are read through properties). It is entered
in a calendar at the step where it next needs attention (a new block, its last token, or the
token that wakes its consumer: see `watch`), and is looked at again from then on. A step thus
costs the requests that need something, not all of them. When a step could run short of budget or
blocks, every request is looked at and the step is scheduled exactly as above. ``coast=False``
turns coasting off (the reference the tests compare against).

**Gliding.** When every running request coasts and no waiting request can be admitted, the steps
up to the next calendar entry are all alike but for their context, which grows by one token per
request a step: `schedule()` returns them as one `Step` with ``repeat`` > 1, and the loop sleeps
once for all of them (`Step.time_for`). Anything that happens meanwhile (an arrival, an abort, a
consumer that starts waiting) ends the glide at the step under way: `complete(step, n)` applies
the first ``n`` steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from fleetsched.errors import ContextTooLong
from fleetsched.settings import SimSettings

from ..base import completion_room
from ._kv_cache import TOKEN_TEXT, BlockPool, extend_hashes
from ._queues import make_queue
from ._tools import ForcedToolCall

WAITING, RUNNING, FINISHED, ABORTED = range(4)
#: Made but not yet queued: on its way through the API server (see `SimEngine.arrive`).
ARRIVING = -1


class SimRequest:
    """One request's state in the engine. Token counts only; no token objects."""

    __slots__ = (
        "seq", "priority", "prompt_tokens", "max_tokens", "hashes", "status", "_computed",
        "_output", "num_hashed", "blocks", "num_preemptions", "waiter", "delivered", "wake_every",
        "engine", "coasting_since", "run_order", "collect", "first_token_at", "continuous_usage",
        "text", "top_logprobs", "finish_reason", "tool_call", "stop", "echo",
    )  # fmt: skip

    def __init__(self, seq: int, prompt_tokens: int, max_tokens: int, hashes: list[int], priority: int = 0) -> None:
        self.seq = seq
        self.priority = priority
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.hashes = hashes
        self.status = WAITING
        self._computed = 0  # tokens in the KV cache when last looked at
        self._output = 0  # tokens generated when last looked at
        self.num_hashed = 0
        self.blocks: list[int] = []
        self.num_preemptions = 0
        self.waiter: object = None  # the consumer's wake-up handle while it waits for tokens
        self.delivered = 0  # tokens the consumer has already been handed
        self.wake_every = 1  # new tokens that wake a waiting consumer (besides the first and the end)
        self.engine: SimEngine | None = None
        self.coasting_since = -1  # the engine step it began coasting at, or -1
        self.run_order = 0  # position in the running order (admission order)
        self.collect = False  # collected whole (`SimBackend.complete_chat`): no wake-up for the first token
        self.first_token_at: float | None = None  # when the first token came (set by the async loop)
        self.continuous_usage = False  # usage on every chunk (`stream_options.continuous_usage_stats`)
        self.text: str | None = None  # what its answer follows (`answer_lead`): its answer's blocks are hashed from it
        self.top_logprobs: int | None = None  # with ``logprobs``: the alternatives listed a token
        #: How its answer ends: "length" (cut at a max_tokens the call named, or at the context), or
        #: "stop" where the sim chose the answer's length itself (the model ended it, as at an EOS).
        self.finish_reason = "length"
        #: The tool call its answer is (a `ForcedToolCall`: the request's ``tool_choice`` forced
        #: one), else None: an answer in text.
        self.tool_call: ForcedToolCall | None = None
        #: The stop string that ends its answer (`max_tokens` is where it matched) and the
        #: characters of the answer's text kept then (the string left out, as vLLM leaves it).
        self.stop: tuple[str, int] | None = None
        #: The text its answer opens with before its tokens (``echo``: the last message's, which
        #: the answer continues), as vLLM's server echoes it; "" for none.
        self.echo = ""

    @property
    def num_computed(self) -> int:
        """Tokens in the KV cache (prompt and output)."""
        if self.coasting_since < 0:
            return self._computed
        assert self.engine is not None
        return self._computed + self.engine.steps - self.coasting_since

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        if self.coasting_since < 0:
            return self._output
        assert self.engine is not None
        return self._output + self.engine.steps - self.coasting_since

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


class Step:
    """One scheduled step: the requests looked at and their token counts, plus the coasting ones.

    With ``repeat`` > 1, a glide: that many steps of coasting requests only, each one's context
    ``coasting`` tokens longer than the one before, so each takes ``growth`` seconds longer.
    ``context`` and ``duration`` are the first step's.
    """

    __slots__ = ("requests", "counts", "coasting", "tokens", "context", "duration", "repeat", "growth")

    def __init__(
        self, requests: list[SimRequest], counts: list[int], coasting: int, tokens: int, context: int, duration: float
    ) -> None:
        self.requests = requests
        self.counts = counts
        self.coasting = coasting  # requests decoding one token each without being looked at
        self.tokens = tokens  # sum(counts) + coasting
        self.context = context  # tokens attended to: the step's tokens plus what each has cached
        self.duration = duration
        self.repeat = 1
        self.growth = 0.0

    @property
    def seqs(self) -> int:
        return len(self.requests) + self.coasting

    def time_for(self, n: int) -> float:
        """Seconds the first `n` steps take."""
        return n * self.duration + self.growth * n * (n - 1) / 2

    def steps_by(self, elapsed: float) -> int:
        """How many whole steps are done `elapsed` seconds in (at most ``repeat``). A step that ends
        exactly then is not: stepping, what happens at that instant (a request reaching the engine,
        a consumer that set its timer before the step began) comes before the loop completes the
        step, and the next step is the first to see it."""
        lo, hi = 0, self.repeat
        while lo < hi:  # the largest n with time_for(n) < elapsed
            mid = (lo + hi + 1) // 2
            if self.time_for(mid) < elapsed:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _advance(self, n: int) -> None:
        """Drop the first `n` steps of a glide: what is left starts with step n."""
        self.repeat -= n
        self.context += n * self.coasting
        self.duration += n * self.growth


def check_request_fits(settings: SimSettings, prompt_tokens: int, max_tokens: int, *, whole: bool = False) -> int:
    """The completion tokens the request gets (`completion_room`: `max_tokens` cut to what the
    prompt leaves of the model's context, as vLLM does). Raises `ContextTooLong` for a request
    vLLM would refuse: one that leaves no room in the context, or needs more than the whole KV
    cache holds (the engine would wait for room that never comes); with `whole`, also for one
    the context would cut short (a calibration needs every answer at its full length)."""
    capacity = (settings.kv_cache_tokens // settings.block_size) * settings.block_size
    return fit_request(settings.max_model_len, capacity, prompt_tokens, max_tokens, whole=whole)


def fit_request(max_model_len: int, capacity: int, prompt_tokens: int, max_tokens: int, *, whole: bool = False, field: str = "max_tokens") -> int:
    """`check_request_fits` for a model context of `max_model_len` and a KV cache of `capacity`
    tokens (whole blocks), given as numbers: a call's hot path reads them once per engine.
    `field`: the name the call gave `max_tokens` (`completion_room`)."""
    room = completion_room(max_model_len, prompt_tokens, max_tokens, field)
    if whole and room < max_tokens:
        raise ContextTooLong(
            f"{prompt_tokens} prompt + {max_tokens} completion tokens exceed the model's maximum context "
            f"length of {max_model_len}: the answer would be cut to {room} tokens"
        )
    max_tokens = room
    # Its last token is sampled, never written to the cache: it needs one slot less than its
    # length (a prompt that fills the cache can still get one token, as in vLLM).
    slots = prompt_tokens + max_tokens - 1
    if slots > capacity:
        raise ContextTooLong(
            f"the request needs {slots} tokens of KV cache ({prompt_tokens} prompt + {max_tokens} "
            f"completion, the last never cached) but the whole cache holds {capacity}; shorten it "
            "or enlarge kv_cache_tokens"
        )
    return max_tokens


class SimEngine:
    """vLLM v1's scheduler and KV cache manager, as a synchronous state machine."""

    #: The fewest steps worth a glide (a glide costs the loop more than a plain step's sleep).
    MIN_GLIDE = 4

    def __init__(self, settings: SimSettings, coast: bool = True) -> None:
        self.settings = settings
        # Read on every step or call: copied out of the settings, a pydantic model whose
        # attribute reads cost over twice a plain attribute's (about 570 instructions against 250).
        self.block_size = settings.block_size
        self.max_num_seqs = settings.max_num_seqs
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self.capacity = (settings.kv_cache_tokens // settings.block_size) * settings.block_size
        """Tokens the whole KV cache holds (whole blocks)."""
        self._step_base_s = settings.step_base_s
        self._step_per_token_s = settings.step_per_token_s
        self._step_per_context_token_s = settings.step_per_context_token_s
        self._step_per_seq_s = settings.step_per_seq_s
        self.coast = coast
        self.prefix_caching = settings.enable_prefix_caching
        self.pool = BlockPool(settings.kv_cache_tokens // settings.block_size, settings.block_size)
        self.queue = make_queue(settings.policy)
        #: Running requests in running order (a dict: ordered, with O(1) removal).
        self.running: dict[SimRequest, None] = {}
        self._seq = 0
        self._run_order = 0
        # Coasting: the running requests looked at every step, the number coasting and the sum of
        # their cached tokens, and per step the coasting requests due to be looked at again.
        self._attended: dict[SimRequest, None] = {}
        self._coasting = 0
        self._coasting_context = 0
        self._calendar: dict[int, list[SimRequest]] = {}
        self._calendar_steps: list[int] = []  # the calendar's steps, a heap
        self._watch_now: list[SimRequest] = []
        #: The requests the last schedule left waiting: what vLLM publishes as
        #: num_requests_waiting. A request that arrives during a step is not among them; vLLM holds
        #: it in the engine core's input queue until the next step's schedule.
        self.left_waiting = 0
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

    def new_request(
        self, prompt_tokens: int, max_tokens: int, hashes: list[int], priority: int = 0, *, arriving: bool = False,
        text: str | None = None,
    ) -> SimRequest:
        """Queue a request (already validated to fit the cache); the next `schedule()` sees it.

        With `arriving`, the request is only made (status `ARRIVING`): `arrive()` queues it
        later. Requests must arrive in the order they were made. With the `text` its answer follows
        (`answer_lead` of the prompt's, that `hashes` were made from), the blocks its answer fills
        are cached too.
        """
        request = SimRequest(0, prompt_tokens, max_tokens, hashes, priority)
        request.text = text
        return self.take(request, arriving=arriving)

    def take(self, request: SimRequest, *, arriving: bool = False) -> SimRequest:
        """`new_request` for a request made outside (fresh, never taken): numbered and queued
        (or `ARRIVING`)."""
        self._seq += 1
        request.seq = self._seq
        request.engine = self
        if not self.prefix_caching:  # no hashes: its blocks are never looked up nor cached
            request.hashes = []
            request.text = None
        if arriving:
            request.status = ARRIVING
        else:
            self.queue.add(request)
        return request

    def arrive(self, request: SimRequest) -> None:
        """Queue a request made `arriving`; the next `schedule()` sees it."""
        request.status = WAITING
        self.queue.add(request)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.queue) > 0

    def abort(self, request: SimRequest) -> None:
        """Drop `request` wherever it is and free its blocks. No-op once it is done."""
        if request.status == ARRIVING:  # it never reached the engine: nothing to count
            request.status = ABORTED
            return
        if request.status == WAITING:
            self.queue.discard(request)
        elif request.status == RUNNING:
            self._attend(request)
            del self.running[request]
            del self._attended[request]
            self._free(request)
        else:
            return
        request.status = ABORTED
        self.aborted += 1

    def watch(self, request: SimRequest) -> int | None:
        """A consumer is about to wait on `request`: have `complete()` return it when it owes a wake-up.

        Call with a step under way (consumers run while the engine loop sleeps). A request looked
        at every step needs nothing; a coasting one is put in the calendar for the step that
        produces the token that wakes its consumer. Returns the step count a glide must not go
        past (`steps` when it ends), or None.
        """
        if request.coasting_since < 0:
            return None
        steps = request.delivered + request.wake_every - request.num_output  # steps until that token
        if steps <= 1:
            self._watch_now.append(request)  # the step under way produces it
            return self.steps + 1
        self._remind(self.steps + steps - 1, request)
        return self.steps + steps - 1

    def _remind(self, step: int, request: SimRequest) -> None:
        """Look at `request` again in step number `step`."""
        due = self._calendar.get(step)
        if due is None:
            self._calendar[step] = [request]
            heapq.heappush(self._calendar_steps, step)
        else:
            due.append(request)

    # -- coasting --------------------------------------------------------------------------------

    def _coast(self, request: SimRequest) -> None:
        """Let a running request coast, if it needs nothing for at least one step."""
        if (
            request._output == 0  # its first token is still to come
            or request._computed != request.prompt_tokens + request._output - 1  # prefilling or recomputing
            or request.num_hashed != len(request.hashes)  # prompt blocks left to hash
        ):
            return
        steps = min(
            len(request.blocks) * self.block_size - request._computed,  # room left in its last block
            request.max_tokens - request._output - 1,  # the step of its last token is looked at
        )
        if request.waiter is not None:  # a consumer waits: the step of the token that wakes it is looked at
            steps = min(steps, request.delivered + request.wake_every - request._output - 1)
        if steps <= 0:
            return
        del self._attended[request]
        request.coasting_since = self.steps
        self._coasting += 1
        self._coasting_context += request._computed
        self._remind(self.steps + steps, request)

    def _attend(self, request: SimRequest) -> None:
        """Stop `request` coasting: bring its counts up to date and look at it every step."""
        since = request.coasting_since
        if since < 0:
            return
        advanced = self.steps - since
        request._computed += advanced
        request._output += advanced
        request.coasting_since = -1
        self._coasting -= 1
        self._coasting_context -= request._computed
        self._attended[request] = None

    # -- scheduling --------------------------------------------------------------------------------

    def _allocate(self, request: SimRequest, num_new: int) -> bool:
        """Give `request` the blocks for `num_new` more tokens; False when the pool is short."""
        bs = self.block_size
        end = request._computed + num_new
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

    def _free(self, request: SimRequest) -> None:
        """Give `request`'s blocks back, hashing first those its answer filled (as vLLM does every
        full block): the next turn of its conversation hits them, and so does the request itself
        when recomputed after a preemption (its hash chain grows with them)."""
        if request.text is not None:
            hashes = request.hashes
            done = len(hashes)
            full = min(request.num_computed // self.block_size, len(request.blocks))
            tool_call, output = request.tool_call, request.num_output
            answer = TOKEN_TEXT * output if tool_call is None else tool_call.prompt_text(output)
            extend_hashes(hashes, request.text, answer, self.block_size, full)
            blocks, cache = request.blocks, self.pool.cache
            for i in range(done, len(hashes)):
                cache(blocks[i], hashes[i])
        self.pool.free(request.blocks)
        request.blocks = []

    def _preempt(self, request: SimRequest) -> None:
        del self.running[request]
        del self._attended[request]
        self._free(request)
        request._computed = 0  # its output so far is recomputed as part of the prompt
        request.num_hashed = 0
        request.status = WAITING
        request.num_preemptions += 1
        self.preemptions += 1
        self.queue.add_preempted(request)

    def schedule(self) -> Step | None:
        """Choose the next step (or glide: see `Step`), or None if idle."""
        while True:
            step, preempted = self._schedule()
            # Preempted, and nothing scheduled (the first request in running order, of a worse
            # priority than those after it, was its own victim): vLLM's engine steps again at
            # once, its empty step costing next to nothing, and schedules the rest then. Taken
            # for idle, the sim waited for an arrival that might never come, its running
            # requests stuck. Each pass preempts one running request more, so this ends.
            if step is not None or not preempted or not self.has_work:
                return step

    def _schedule(self) -> tuple[Step | None, bool]:
        """`schedule`'s one pass: the step (None: nothing scheduled), and whether it preempted."""
        ticks = self._calendar_steps
        while ticks and ticks[0] <= self.steps:
            for request in self._calendar.pop(heapq.heappop(ticks)):
                self._attend(request)
        budget = self.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        left = self._fits(scheduled, budget) if self.coast else None
        if left is not None:
            budget, preempted = left, False
        else:
            for request in [r for r in self.running if r.coasting_since >= 0]:
                self._attend(request)
            budget, preempted = self._schedule_running(scheduled, budget)
        if not preempted:
            self._admit(scheduled, budget)
        self.left_waiting = len(self.queue)
        if not scheduled and not self._coasting:
            return None, preempted
        step = self._plan(scheduled)
        if (
            not self._attended
            and ticks[0] - self.steps >= self.MIN_GLIDE
            and (len(self.queue) == 0 or len(self.running) >= self.max_num_seqs)
        ):  # coasting requests alone, and nobody to admit until one of them needs something
            step.repeat = ticks[0] - self.steps
            step.growth = self._step_per_context_token_s * step.coasting
        return step, preempted

    def _fits(self, scheduled: dict[SimRequest, int], budget: int) -> int | None:
        """Schedule the attended requests if the step has budget and blocks for every running one;
        the budget left, or None (nothing scheduled) if it has not."""
        bs = self.block_size
        demand = self._coasting
        blocks = 0
        wants = []
        for request in sorted(self._attended, key=_by_run_order):
            num_new = request.prompt_tokens + request._output - request._computed
            demand += num_new
            blocks += max(0, -(-(request._computed + num_new) // bs) - len(request.blocks))
            wants.append((request, num_new))
        if demand > budget or blocks > self.pool.num_free:
            return None
        for request, num_new in wants:
            self._allocate(request, num_new)
            scheduled[request] = num_new
        return budget - demand

    def _schedule_running(self, scheduled: dict[SimRequest, int], budget: int) -> tuple[int, bool]:
        """Every running request, in running order, as vLLM schedules them; (budget left, preempted)."""
        running = list(self.running)
        preempted = False
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = request.prompt_tokens + request._output - request._computed
            if num_new > budget:
                num_new = budget
            if (
                request._computed + num_new <= len(request.blocks) * bs
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
        return budget, preempted

    def _admit(self, scheduled: dict[SimRequest, int], budget: int) -> None:
        queue, pool, running, bs = self.queue, self.pool, self.running, self.block_size
        max_running = self.max_num_seqs
        while budget > 0 and len(running) < max_running:
            request = queue.peek()
            if request is None:
                break
            num_tokens = request.prompt_tokens + request._output
            # At least one token is always computed, so a full hit leaves the last block out.
            hits = pool.lookup(request.hashes, (num_tokens - 1) // bs)
            num_computed = len(hits) * bs
            num_new = min(num_tokens - num_computed, budget)
            # Admitted only when its whole sequence fits, not only this step's chunk, as vLLM
            # 0.32 admits (`scheduler_reserve_full_isl`, on by default): a long prompt waits,
            # where it started, stalled at its next chunk, and was preempted.
            need = -(-num_tokens // bs) - len(hits)
            if need > pool.num_free - pool.num_evictable(hits):
                break
            queue.pop()
            pool.touch(hits)
            request.blocks = hits
            request.num_hashed = len(hits)
            request._computed = num_computed
            self._allocate(request, num_new)
            # vLLM counts a resumed request's lookup apart, and none without a prefix cache.
            if not request.num_preemptions and self.prefix_caching:
                self.prefix_queries += num_tokens
                self.prefix_hits += num_computed
            request.status = RUNNING
            self._run_order += 1
            request.run_order = self._run_order
            running[request] = None
            self._attended[request] = None
            scheduled[request] = num_new
            budget -= num_new

    def _plan(self, scheduled: dict[SimRequest, int]) -> Step:
        requests = list(scheduled)
        counts = list(scheduled.values())
        coasting = self._coasting
        tokens = sum(counts) + coasting
        context = tokens + self._coasting_context
        for request in requests:  # a loop, not sum() over a generator: about half the instructions
            context += request._computed
        duration = (
            self._step_base_s
            + self._step_per_token_s * tokens
            + self._step_per_context_token_s * context
            + self._step_per_seq_s * (len(requests) + coasting)
        )
        return Step(requests, counts, coasting, tokens, context, duration)

    def complete(self, step: Step, n: int = 1) -> list[SimRequest]:
        """Apply the first `n` steps of `step` (n > 1: of a glide, which then starts after them);
        returns the requests a waiting consumer may need to hear about.

        Those are the looked-at requests that produced a token (some finished) and the coasting
        ones `watch` named for this step; the caller checks each one's consumer.
        """
        if n != 1:
            if not 1 <= n <= step.repeat or step.requests:
                raise ValueError(f"a step of {step.repeat} can complete 1..{step.repeat} steps at once, not {n}")
            self._glide(step, n - 1)
        self.steps += 1
        self.busy_s += step.duration
        # Coasting requests decoded a token each (those aborted meanwhile no longer count).
        coasting = self._coasting
        self._coasting_context += coasting
        emitted: list[SimRequest] = []
        computed = decoded = coasting
        coast = self.coast
        for request, n in zip(step.requests, step.counts):
            if request.status != RUNNING:  # aborted while the step ran
                continue
            computed += n
            # A decode computes the token just sampled; a one-token chunk of a recompute (cut by
            # the budget) that stops short of it is prefill.
            if n == 1 and request._output and request._computed == request.prompt_tokens + request._output - 1:
                decoded += 1
            request._computed += n
            if request._computed == request.prompt_tokens + request._output:
                request._output += 1
                emitted.append(request)
                if request._output >= request.max_tokens:
                    request.status = FINISHED
                    self._free(request)
                    del self.running[request]
                    del self._attended[request]
                    self.finished += 1
                    continue
            if coast:  # in this pass, not one of its own: nothing above depends on who coasts
                self._coast(request)
        self.computed_tokens += computed
        self.prompt_computed += computed - decoded
        self.generated_tokens += len(emitted) + coasting
        if self._watch_now:  # in running order, as if they had been looked at
            emitted.extend(self._watch_now)
            emitted.sort(key=_by_run_order)
            self._watch_now = []
        step._advance(1)
        return emitted

    def advance(self, step: Step, n: int) -> None:
        """Apply the first `n` steps of a glide that goes on (something is about to happen in it)."""
        if not 0 <= n < step.repeat or step.requests:
            raise ValueError(f"a glide of {step.repeat} steps can advance 0..{step.repeat - 1} steps, not {n}")
        if n:
            self._glide(step, n)

    def _glide(self, step: Step, n: int) -> None:
        """Apply `n` steps of a glide at once: its coasting requests decode a token each a step."""
        coasting = self._coasting
        self.busy_s += step.time_for(n)
        self.steps += n
        self._coasting_context += n * coasting
        self.computed_tokens += n * coasting
        self.generated_tokens += n * coasting
        step._advance(n)

    @property
    def next_reminder(self) -> int | None:
        """The step number of the calendar's next entry (a glide ends there), or None."""
        return self._calendar_steps[0] if self._calendar_steps else None


def _by_run_order(request: SimRequest) -> int:
    return request.run_order
