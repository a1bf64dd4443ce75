"""`SimBackend`: the async front of the simulated engine, on anyio time.

One engine-loop task, owned by the backend's task group, drives `SimEngine`: schedule a step,
``await anyio.sleep(duration)``, apply it, wake the consumers that have new tokens. With nothing
to do it waits on an event (no polling). Because time is read only through anyio, the same code
runs on real time (asyncio or trio) and on virtual time (`fleetsched.virtual_time`).

A request first passes the API server: its turn there (`request_serial_s`, one request at a
time), the hand-off (`request_overhead_s`) and `request_delay_per_running_s` for each request the
engine runs as it is sent give the time it reaches the engine, and the engine loop queues it
then. Its consumer waits meanwhile as it waits for tokens: no task sleeps through the front end,
which spares every call a timer and a task switch.

A glide (steps of coasting requests only, see `_engine`) is one sleep for all its steps. Whatever
happens during it first applies the steps done by then (`_settle`), so it sees the engine as it
would between steps: an arrival or an abort then ends the glide at the step under way (an
arrival known in advance, at the step under way when it comes), and a consumer that starts
waiting ends it at the step that will wake it (`_cut`).

Consumers never block the engine: tokens are counters on the request, and a consumer that falls
behind receives the tokens it missed coalesced into one chunk, as vLLM's output collector does.
A waiting consumer is woken for the first token, every ``stream_interval`` tokens after it (the
request body's where larger than the settings', as vLLM clamps it, else the settings'), and at the
end; one whose body says ``"stream": False`` (it collects the whole answer) only for the first
token and at the end, and a call collected by `complete_chat` (the dispatcher's `chat`) only at
the end: the engine loop notes when its first token came. That is one or two task switches per
call instead of one per chunk, and the times of the first token and of the end, all that a
collector observes, stay the same.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from fleetsched.errors import BackendUnavailable, ContextTooLong, InvalidRequest, UnknownModel
from fleetsched.resources.kv_sizing import KVCacheCapacity
from fleetsched.settings import SimSettings

from ..base import (
    Backend,
    ChatBody,
    Chunk,
    EngineSignals,
    Received,
    TEXT_PROMPT_KEY,
    chat_completion,
    checked_stream_interval,
    invalid_messages,
    make_chunk,
    max_tokens_field,
    new_completion_id,
    requested_max_tokens,
    tools_text,
    usage_dict,
    wants_continuous_usage,
)
from ..chat_options import check_chat_options, echoed, prompt_cut, response_role
from ..sampling import MAX_LOGPROBS, check_sampling, is_true, lax_int, requested_top_logprobs
from ._engine import ABORTED, FINISHED, SimEngine, SimRequest, Step, fit_request
from ._kv_cache import CHARS_PER_TOKEN, TOKEN_TEXT, answer_lead, block_hashes, prompt_text
from ._tools import forced_tool_call
from ..._parking import Park, Unpark, park_event, parking_for_current_library, unpark_event

#: Completion length when the body names none (as `requested_max_tokens`).
DEFAULT_MAX_TOKENS = 256
#: The log probability of each token the sim answers.
TOKEN_LOGPROB = -0.1
#: What ``top_logprobs`` lists, most likely first: the answer's token, then 19 others (-4, -5, ...),
#: a fixed, valid distribution (0.905 on the answer, about 0.03 on the others).
_ALTERNATIVES = [(TOKEN_TEXT, TOKEN_LOGPROB)] + [(f" t{i:02d}", -4.0 - i) for i in range(MAX_LOGPROBS - 1)]


def token_logprobs(count: int, top: int) -> dict[str, list[dict[str, Any]]]:
    """A choice's ``logprobs`` for `count` answer tokens, as vLLM gives them: each token with its
    log probability and bytes, and `top` entries in ``top_logprobs``, the token itself first."""
    return {
        "content": [
            {
                "token": TOKEN_TEXT, "logprob": TOKEN_LOGPROB, "bytes": list(TOKEN_TEXT.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _ALTERNATIVES[:top]],
            }  # fmt: skip
            for _ in range(count)
        ]
    }


@dataclass(frozen=True, slots=True)
class SimStatistics:
    """A snapshot of the engine's counters. Times are seconds on the anyio clock."""

    steps: int
    busy_s: float
    """Sum of step durations (time the engine was computing)."""
    elapsed_s: float
    """Time since the backend was entered."""
    running: int
    waiting: int
    generated_tokens: int
    """Output tokens produced (one per decode, plus the first token of each prefill)."""
    computed_tokens: int
    """Tokens run through the model: prefill chunks (recomputation included) and decodes."""
    prompt_tokens_computed: int
    """`computed_tokens` that were prefill (prompt and recomputed output), not decodes."""
    requests_finished: int
    requests_aborted: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_usage: float

    @property
    def busy_fraction(self) -> float:
        """Share of elapsed time spent in steps (a benchmark's engine_busy_frac)."""
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of elapsed time."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_step_s(self) -> float:
        return self.busy_s / self.steps if self.steps else 0.0


def stop_match(body: ChatBody, max_tokens: int) -> tuple[int, str, int] | None:
    """Where a stop string of `body` ends the sim's answer (`TOKEN_TEXT` a token), as vLLM
    stops: at the first token whose text completes one, not before ``min_tokens`` tokens, within
    `max_tokens`. Returns (its tokens, the string, the characters of text kept: up to the string,
    or through it with ``include_stop_str_in_output``), or None where none matches in time."""
    stops = body["stop"]
    first = lax_int(body.get("min_tokens")) or 1  # as vLLM reads it ("2" is 2)
    best: tuple[int, str, int] | None = None
    for stop in [stops] if isinstance(stops, str) else stops:
        # The answer repeats one token's text: a string that occurs at all first ends within
        # the first tokens, and from then on ends within every token, one token later each time.
        periodic = TOKEN_TEXT * (len(stop) // len(TOKEN_TEXT) + 2)
        at = periodic.find(stop)
        if at < 0:
            continue
        completes = -(-(at + len(stop)) // len(TOKEN_TEXT))  # the token that first completes it
        tokens = max(first, completes)
        start = at + len(TOKEN_TEXT) * (tokens - completes)  # where it begins that ends in that token
        kept = start + len(stop) if is_true(body.get("include_stop_str_in_output")) else start
        if tokens <= max_tokens and (best is None or tokens < best[0]):
            best = (tokens, stop, kept)
    return best


def answer_text(request: SimRequest, output: int) -> str:
    """The text of `request`'s first `output` tokens as its caller sees it: cut where its stop
    string begins (`stop_match`), which vLLM holds back as it streams."""
    text = TOKEN_TEXT * output
    return text if request.stop is None else text[: request.stop[1]]


class SimBackend(Backend):
    """A calibrated model of vLLM v1's continuous-batching engine (backend kind ``"sim"``).

    Use as ``async with SimBackend(settings) as backend:``; entering starts the engine loop,
    leaving stops it and fails streams still open with `BackendUnavailable`. `stream_chat`
    checks the body at once (`InvalidRequest`, `ContextTooLong`) and streams exactly
    ``max_tokens`` tokens (vLLM with ``ignore_eos``), the last with ``finish_reason "length"``
    (``"stop"`` where the body named no max_tokens and the sim's default length was not cut),
    then a chunk with ``usage`` and no choices, as vLLM ends a stream. Leaving the stream early
    aborts the request in the engine.
    """

    name = "sim"

    def __init__(self, settings: SimSettings | None = None, model: str = "fleetsched-sim") -> None:
        self.settings = settings or SimSettings()
        self.model = model
        self.engine = SimEngine(self.settings)
        # Read on every call: copied out of the settings, a pydantic model whose attribute reads
        # cost over twice a plain attribute's (about 570 instructions against 250, measured).
        s = self.settings
        self._fcfs = s.policy == "fcfs"
        self._max_model_len = s.max_model_len
        self._stream_interval = s.stream_interval
        self._request_serial_s = s.request_serial_s
        self._request_overhead_s = s.request_overhead_s
        self._request_delay_per_running_s = s.request_delay_per_running_s
        self._park: Park = park_event
        self._unpark: Unpark = unpark_event
        self._task_group: TaskGroup | None = None
        self._wake: anyio.Event | None = None
        self._closed = False
        self._started_at = 0.0
        self._front_free = 0.0  # when the front end is done with the requests sent so far
        # Requests on their way through the front end: a heap of (when each reaches the engine,
        # the order it was sent in, request). Without a delay per running request, they arrive
        # in the order they were sent.
        self._arriving: list[tuple[float, int, SimRequest]] = []
        self._sent = itertools.count()
        self._stopped_at: float | None = None
        self._step_started: float | None = None
        # A glide under way (see `_engine`): the step, the step count it ends at, and the event
        # that wakes the loop when something cuts it short.
        self._gliding: Step | None = None
        self._glide_until = 0
        self._glide_cut: anyio.Event | None = None

    async def __aenter__(self) -> SimBackend:
        if self._task_group is not None or self._closed:
            raise RuntimeError("a SimBackend can be entered once")
        self._park, self._unpark = parking_for_current_library()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._started_at = anyio.current_time()
        # Started, not just spawned: the loop is waiting for work when this returns, so requests
        # made together reach the same first step whatever order the tasks run in.
        await self._task_group.start(self._run, name="sim-engine-loop")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._shut()
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        # Not given the block's exception: an anyio task group wraps it in an ExceptionGroup
        # (a ConfigError from `Scheduler.__aenter__` reached the command line as a traceback).
        # It propagates as it is; the loop's own errors, if any, are raised here.
        await self._task_group.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Stop the engine loop; open streams fail with `BackendUnavailable`. Idempotent."""
        if self._task_group is not None:
            self._shut()
            self._task_group.cancel_scope.cancel()

    def _shut(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopped_at = anyio.current_time()
        engine = self.engine
        for request in [*engine.running]:
            engine.abort(request)
            self._unpark(request)
        while (request := engine.queue.peek()) is not None:
            engine.abort(request)
            self._unpark(request)
        for _, _, request in self._arriving:
            engine.abort(request)
            self._unpark(request)
        self._arriving.clear()

    # -- the engine loop -----------------------------------------------------------------------

    async def _run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        engine = self.engine
        unpark = self._unpark
        task_status.started()  # the loop runs on to its first wait before the starter resumes
        try:
            await self._loop(engine, unpark)
        finally:
            self._shut()  # on a crash too: open streams fail instead of waiting forever

    async def _loop(self, engine: SimEngine, unpark: Unpark) -> None:
        arriving = self._arriving
        now = anyio.current_time()  # read once after every wait: nothing in between takes time
        while True:
            if arriving:
                self._arrive_due(now)
            step = engine.schedule()
            if step is None:
                if arriving:  # the next arrival is the next thing to happen, unless one sent now comes sooner
                    at = arriving[0][0]
                    wake = self._wake = anyio.Event()
                    with anyio.move_on_after(at - now):
                        await wake.wait()
                    self._wake = None
                    # Woken by a sooner arrival, or at `at` whatever the clock's rounding of the wait.
                    now = anyio.current_time() if wake.is_set() else max(at, anyio.current_time())
                else:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    now = anyio.current_time()
                continue
            self._step_started = now
            if step.repeat == 1:
                await anyio.sleep(step.duration)
                n = 1
            else:
                n = await self._glide(step)
            self._step_started = None
            now = anyio.current_time()
            for request in engine.complete(step, n):
                if request.first_token_at is None:
                    request.first_token_at = now
                    if not request.collect and request.waiter is not None:
                        unpark(request)
                        continue
                if request.waiter is not None and (
                    request.num_output - request.delivered >= request.wake_every or request.status == FINISHED
                ):
                    unpark(request)

    async def _glide(self, step: Step) -> int:
        """Sleep through a glide, or until something cuts it short; returns the steps left to complete."""
        engine = self.engine
        self._gliding = step
        self._glide_until = engine.steps + step.repeat
        if self._arriving:
            self._glide_until = min(self._glide_until, self._step_under_way_at(self._arriving[0][0]))
        try:
            while True:
                cut = self._glide_cut = anyio.Event()
                left = self._glide_until - engine.steps  # `_settle` may have applied some
                assert self._step_started is not None
                with anyio.move_on_after(self._step_started + step.time_for(left) - anyio.current_time()):
                    await cut.wait()
                if not cut.is_set():
                    return self._glide_until - engine.steps  # what is left after any `_settle`
        finally:
            self._gliding = self._glide_cut = None

    def _settle(self) -> None:
        """Apply the steps of the glide under way that are done by now (before anything changes)."""
        step = self._gliding
        if step is None:
            return
        assert self._step_started is not None
        done = min(step.steps_by(anyio.current_time() - self._step_started), self._glide_until - self.engine.steps - 1)
        if done > 0:
            self._step_started += step.time_for(done)
            self.engine.advance(step, done)

    def _arrive_due(self, now: float | None = None) -> None:
        """Queue in the engine the requests that reached it by `now` (default: the time); the
        next schedule sees them."""
        arriving = self._arriving
        if now is None:
            now = anyio.current_time()
        while arriving and arriving[0][0] <= now:
            request = heapq.heappop(arriving)[2]
            if request.status != ABORTED:
                self.engine.arrive(request)

    def _step_under_way_at(self, at: float) -> int:
        """The step count at the end of the glide's step under way at time `at` (a request that
        arrives then is seen by the next schedule)."""
        step = self._gliding
        assert step is not None and self._step_started is not None
        return self.engine.steps + step.steps_by(at - self._step_started) + 1

    def _cut(self, until: int) -> None:
        """End the glide under way by step count `until` (never before the step under way ends)."""
        if self._gliding is None:
            return
        until = max(until, self.engine.steps + 1)
        if until < self._glide_until:
            self._glide_until = until
            assert self._glide_cut is not None
            self._glide_cut.set()

    def _rouse(self) -> None:
        """Wake the engine loop if it idles, waiting for work."""
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def _expect(self, at: float) -> None:
        """A request will arrive at `at`, before any other now on its way: the engine loop must
        look at the engine then (if idle, it wakes to wait for it; a glide ends at the step under
        way then)."""
        self._rouse()
        if self._gliding is not None:
            self._cut(self._step_under_way_at(at))

    def _kick(self) -> None:
        """Something changed for the scheduler (an arrival, an abort): it looks at it next step."""
        self._rouse()
        self._settle()
        self._cut(self.engine.steps + 1)

    # -- requests ------------------------------------------------------------------------------

    def _validate(self, body: ChatBody) -> SimRequest:
        """The request `body` asks for, not yet sent; raises `InvalidRequest` (`ContextTooLong`)
        for a body vLLM would refuse."""
        if type(body) is not dict and not isinstance(body, Mapping):  # a dict skips the ABC check (~2,000 instructions)
            raise InvalidRequest(f"body: expected a chat-completions request dict, got {type(body).__name__}")
        messages = body.get("messages")
        if not messages or not isinstance(messages, (list, tuple)):
            raise InvalidRequest("messages: a chat request needs a non-empty list of messages")
        named = body.get("model")
        if named and named != self.model:  # as vLLM's server refuses it (no model named: its own)
            raise UnknownModel(f"The model `{named!s:.200}` does not exist. Valid aliases: {self.model}.", param="model")
        n = body.get("n")
        if n is not None and lax_int(n) != 1:  # "1" is 1, as vLLM reads it
            raise InvalidRequest(f"n: the sim backend produces one choice per request (n=1), got n={n!r}")
        priority = body.get("priority", 0)
        if priority is None:
            priority = 0
        elif not isinstance(priority, int) or isinstance(priority, bool):  # read as vLLM's server reads it: "5" and 5.0 are 5, true is 1 (a tier, an int, as it is)
            read = lax_int(priority)
            if read is None:
                raise InvalidRequest(f"priority: expected an integer (lower is sooner), got {priority!r}")
            priority = read
        if self._fcfs:
            priority = 0  # vLLM ignores it under fcfs
        check_chat_options(body)  # the options' types first, as vLLM's request model checks them
        engine = self.engine
        try:
            framed = not body.get(TEXT_PROMPT_KEY)
            text = tools_text(body.get("tools")) + prompt_text(messages, framed=framed)
        except (AttributeError, TypeError):  # caught where they are read anyway: no cost when right
            raise invalid_messages(messages) from None
        prompt = max(1, len(text) // CHARS_PER_TOKEN)  # as `estimate_prompt_tokens` counts
        # max_completion_tokens wins over max_tokens, as in vLLM; 5.0 is 5 there (not 5.5), and
        # here as the dispatcher and the gateway read it (it was refused on the sim alone).
        requested = requested_max_tokens(body, default=0)
        if body.get("truncate_prompt_tokens") is not None:
            prompt, text = self._truncated(body, prompt, text, requested)
        max_tokens = requested or max(1, min(DEFAULT_MAX_TOKENS, self._max_model_len - prompt))
        # Cut to the context, as vLLM does (`check_request_fits`).
        max_tokens = fit_request(self._max_model_len, engine.capacity, prompt, max_tokens, field=max_tokens_field(body))
        check_sampling(body, max_tokens)
        forced = None if body.get("tool_choice") is None else forced_tool_call(body)
        if forced is not None:  # the answer is the call's arguments, cut at max_tokens
            whole = forced.tokens <= max_tokens
            max_tokens = min(max_tokens, forced.tokens)
        hashes = block_hashes(text, engine.block_size, prompt)
        request = SimRequest(0, prompt, max_tokens, hashes, priority)
        if forced is not None:
            request.tool_call = forced
            if whole:  # as vLLM ends it: "stop" for a named tool, "tool_calls" for "required"
                request.finish_reason = "stop" if forced.named else "tool_calls"
        elif body.get("stop") and (stop := stop_match(body, max_tokens)) is not None:
            max_tokens, request.stop = stop[0], stop[1:]
            request.max_tokens, request.finish_reason = max_tokens, "stop"
        elif not requested and max_tokens == DEFAULT_MAX_TOKENS:
            # No limit named, none reached: the answer's length is the sim's stand-in for the
            # model's own end (EOS), which vLLM reports as "stop". The SDK's `.parse()` and
            # `.stream(...).get_final_completion()` raise LengthFinishReasonError on "length".
            request.finish_reason = "stop"
        if body.get("echo") is not None:  # the last message, echoed before the answer as vLLM's server does (it was ignored)
            request.echo = echoed(body, messages, response_role(body))
        request.text = answer_lead(text, framed)  # a text completion's answer follows its prompt unframed
        interval = checked_stream_interval(body.get("stream_interval", self._stream_interval))  # per request, as vLLM takes it
        interval = max(interval, self._stream_interval)  # vLLM clamps it to the server's: never smaller
        request.wake_every = max_tokens if body.get("stream") is False else interval
        request.continuous_usage = wants_continuous_usage(body)
        request.top_logprobs = requested_top_logprobs(body)
        return request

    def _truncated(self, body: ChatBody, prompt: int, text: str, requested: int) -> tuple[int, str]:
        """The prompt (its tokens, its text) cut to ``truncate_prompt_tokens`` as vLLM cuts it:
        the last tokens kept (``truncation_side`` "left", a generating model's default), or the
        first ("right"); -1 is the model's context, less a token for the answer when the call
        asks for a length. A size over the context is refused."""
        size = prompt_cut(body)  # -1 or an integer >= 1 (`check_chat_options`)
        context = self._max_model_len
        if size > context:
            raise InvalidRequest(f"truncate_prompt_tokens: expected at most the model's context ({context} tokens), got {size}", param="truncate_prompt_tokens")
        if size == -1:
            size = context - 1 if requested else context
        if size >= prompt:
            return prompt, text
        kept = size * CHARS_PER_TOKEN
        return size, (text[:kept] if body.get("truncation_side") == "right" else text[-kept:])

    def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        """Stream one chat completion. Checks `body` now; the engine sees it on first iteration.

        Raises `InvalidRequest` / `ContextTooLong` (both ValueError) at once for a body the engine
        would refuse, and `BackendUnavailable` if the backend is not running. With ``"stream":
        False`` in `body` the tokens after the first come in one chunk at the end.
        """
        request = self._validate(body)
        self._check_running()
        return self._stream(request, str(body.get("model") or self.model), new_completion_id(body))

    async def complete_chat(self, body: ChatBody, received: Received | None = None) -> tuple[dict[str, Any], float | None]:
        """One chat completion collected whole, without chunks: the consumer waits once, for the
        end (`Backend.complete_chat`); `received` gets the engine's count when the call ends."""
        request = self._validate(body)
        request.collect, request.wake_every = True, request.max_tokens
        self._check_running()
        model = str(body.get("model") or self.model)
        self._send(request)
        engine, park = self.engine, self._park
        try:
            while request.status != FINISHED:
                if request.status > FINISHED:  # aborted by shutdown
                    raise BackendUnavailable("the sim backend stopped while this request was in flight")
                if self._gliding is not None:
                    self._settle()
                until = engine.watch(request)
                if until is not None:
                    self._cut(until)
                await park(request)
        finally:
            self._drop(request)  # settles a call cut short: its count is the engine's then
            if received is not None:
                # The prompt's count comes with the first token, as a stream's first chunk brings
                # it (vLLM sends none before): a call cut in the front end or waiting in the
                # engine has received none, and was reported with its whole prompt counted.
                received.output_tokens = request.num_output
                received.prompt_tokens = request.prompt_tokens if request.num_output else 0
        output = request.delivered = request.num_output
        if request.tool_call is None:
            message = {"role": "assistant", "content": request.echo + answer_text(request, output)}
        else:  # content "" (or the text echoed), as vLLM answers a forced call
            message = {"role": "assistant", "content": request.echo, "tool_calls": request.tool_call.message_calls(output)}
        usage = usage_dict(request.prompt_tokens, output)
        created = int(time.time())  # wall-clock ok: the Unix timestamp of the response
        response = chat_completion(new_completion_id(body), model, created, message, request.finish_reason, usage)
        if request.stop is not None and output == request.max_tokens:
            response["choices"][0]["stop_reason"] = request.stop[0]
        if request.top_logprobs is not None:
            response["choices"][0]["logprobs"] = token_logprobs(output, request.top_logprobs)
        return response, request.first_token_at

    def _check_running(self) -> None:
        if self._task_group is None or self._closed:
            raise BackendUnavailable("the sim backend is not running; use it inside `async with SimBackend(...)`")

    def _send(self, request: SimRequest) -> None:
        """Send `request` (fresh from `_validate`) through the API server: parsing and
        tokenising one request at a time, then the hand-off. The engine loop queues it when it
        reaches the engine; meanwhile its consumer waits as for tokens (no task sleeps through
        the front end). The more requests the engine is running as it is sent, the later it
        reaches it."""
        engine = self.engine
        now = anyio.current_time()
        if self._request_serial_s:
            self._front_free = max(self._front_free, now) + self._request_serial_s
            at = self._front_free + self._request_overhead_s
        else:
            at = now + self._request_overhead_s
        if self._request_delay_per_running_s:
            at += self._request_delay_per_running_s * len(engine.running)
        engine.take(request, arriving=True)
        if at <= now:
            engine.arrive(request)
            self._kick()
        else:
            heapq.heappush(self._arriving, (at, next(self._sent), request))
            if self._arriving[0][2] is request:
                self._expect(at)

    def _drop(self, request: SimRequest) -> None:
        """Its consumer is gone: abort `request` if it is not done (the tokens it had count)."""
        request.waiter = None
        if not request.done:
            self._settle()
            self.engine.abort(request)
            self._kick()

    async def _stream(self, request: SimRequest, model: str, cid: str) -> AsyncIterator[Chunk]:
        engine, park = self.engine, self._park
        self._send(request)
        created = int(time.time())  # wall-clock ok: the Unix timestamp of the response
        try:
            while True:
                if self._gliding is not None:
                    self._settle()  # the tokens of the glide's steps done so far
                if request.num_output == request.delivered:
                    if request.status > FINISHED:  # aborted by shutdown
                        raise BackendUnavailable("the sim backend stopped while this request was in flight")
                    until = engine.watch(request)
                    if until is not None:
                        self._cut(until)
                    await park(request)
                    continue
                count = request.num_output - request.delivered
                opening = request.delivered == 0
                request.delivered = request.num_output
                usage = usage_dict(request.prompt_tokens, request.delivered) if request.continuous_usage else None
                # As vLLM: the finish reason with the last tokens, then the usage with no choices.
                finish = request.finish_reason if request.status == FINISHED else None
                if opening:  # as vLLM opens a stream: the role alone, then the tokens that had come
                    zero = usage_dict(request.prompt_tokens, 0) if request.continuous_usage else None
                    yield make_chunk(cid, model, created, role="assistant", content="", usage=zero)
                    if request.echo:  # then the text echoed, in a chunk of its own, as vLLM sends it
                        yield make_chunk(cid, model, created, content=request.echo, usage=zero)
                if request.tool_call is None:
                    if request.stop is None:
                        content = TOKEN_TEXT * count
                    else:  # the text past what was sent, up to the cut
                        content = answer_text(request, request.delivered)[len(answer_text(request, request.delivered - count)) :]
                    chunk = make_chunk(cid, model, created, content=content, finish_reason=finish, usage=usage)
                    if finish is not None and request.stop is not None:
                        chunk["choices"][0]["stop_reason"] = request.stop[0]
                else:
                    calls = request.tool_call.delta(request.delivered - count, request.delivered)
                    chunk = make_chunk(cid, model, created, tool_calls=calls, finish_reason=finish, usage=usage)
                if request.top_logprobs is not None:
                    chunk["choices"][0]["logprobs"] = token_logprobs(count, request.top_logprobs)
                yield chunk
                if finish is not None:
                    yield make_chunk(cid, model, created, usage=usage_dict(request.prompt_tokens, request.num_output))
                    return
        finally:
            self._drop(request)

    # -- what the engine says about itself -----------------------------------------------------

    async def signals(self) -> EngineSignals:
        """The engine's gauges as vLLM publishes them: ``waiting`` is what the last schedule left
        waiting, not the requests that arrived since (see `SimEngine.left_waiting`)."""
        self._settle()
        engine = self.engine
        return EngineSignals(
            running=len(engine.running),
            waiting=engine.left_waiting,
            kv_cache_usage=engine.pool.usage,
            preemptions_total=float(engine.preemptions),
            prefix_cache_queries_total=float(engine.prefix_queries),
            prefix_cache_hits_total=float(engine.prefix_hits),
        )

    async def kv_capacities(self) -> dict[str, KVCacheCapacity]:
        """The simulated engine's KV cache, as one replica, ``sim``."""
        engine = self.engine
        return {"sim": KVCacheCapacity(engine.capacity // engine.block_size, engine.block_size, {})}

    def statistics(self) -> SimStatistics:
        """Counters so far; `busy_fraction` compares step time with time since entering."""
        if self._stopped_at is None:
            self._settle()
            self._arrive_due()
        engine = self.engine
        now = self._stopped_at if self._stopped_at is not None else anyio.current_time()
        busy = engine.busy_s
        if self._step_started is not None and self._stopped_at is None:
            busy += now - self._step_started  # the step under way, so far
        return SimStatistics(
            steps=engine.steps,
            busy_s=busy,
            elapsed_s=max(0.0, now - self._started_at) if self._task_group is not None else 0.0,
            running=len(engine.running),
            waiting=len(engine.queue),
            generated_tokens=engine.generated_tokens,
            computed_tokens=engine.computed_tokens,
            prompt_tokens_computed=engine.prompt_computed,
            requests_finished=engine.finished,
            requests_aborted=engine.aborted,
            preemptions=engine.preemptions,
            prefix_cache_queries=engine.prefix_queries,
            prefix_cache_hits=engine.prefix_hits,
            kv_cache_usage=engine.pool.usage,
        )
