"""The vLLM server backend: OpenAI chat completions over HTTP to one or more vLLM replicas.

Each replica (a vLLM OpenAI-compatible server) gets its own `AsyncOpenAI` client and its own
`CircuitBreaker`. A call goes to the replica named by the caller (``replica=`` or the body key
``"fleetsched_replica"``, which is removed before the body is sent), else to the replica with the
fewest calls in flight whose breaker is not open; if that replica fails it before its first chunk
(`BackendUnavailable`: unreachable, a 5xx but 503, breaker open), the call goes to the next such
replica, at once when the first could not be reached. A named replica is the caller's: no failover,
and an unreachable one is retried like any other, unless the body says the caller falls back
itself (`FALLBACK_KEY`, as the dispatcher does for a session's replica): then it is given up at once.

A replica's breaker opens after calls that found it down (unreachable, a 5xx but 503), not after
answers that it is busy (429, 503: the caller gets `Overloaded` with the wait asked). A 5xx is
the replica's failure only where its ``/health`` does not answer 200 just after: vLLM answers
some bodies it cannot serve with a 500 while its engine is well, and five of them from one
tenant opened the breaker for every tenant's calls. A call that
the dispatcher falls back from a session's replica with (`AVOID_KEY`) goes to another replica, or
fails at once where none can take it.

What is retried: connection errors, 429 and 5xx, with jittered exponential backoff (longer where
the answer's Retry-After asks it, up to `retry_max_s`), bounded by attempts (never by elapsed
time, so virtual-time tests stay exact), and only until the first chunk arrived; after that a
failure is the caller's (a model call is not idempotent once it streamed).

The body is forwarded as is: the messages, and keys the SDK does not name (``priority``, vLLM
sampling extras), travel in ``extra_body``, which the SDK sends without walking them. vLLM
honours ``priority`` only under ``--scheduling-policy priority``; the backend checks the policy
of each replica once, in a task of its own from when it is entered (off the call path and the
window's polls: the check can take seconds), else at its first `signals` poll, and logs a
warning when it is not priority (see `VLLMServerBackend.scheduling_policy` for how it is found).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import openai
from openai import AsyncOpenAI
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from ..errors import BackendError, BackendUnavailable, InvalidRequest, Overloaded, UnknownModel
from ..resources.kv_sizing import KVCacheCapacity, parse_vllm_cache_config, read_vllm_kv_capacity
from .base import AVOID_KEY, DEFAULT_MODEL, FALLBACK_KEY, REPLICA_KEY, REQUEST_ID_KEY, Backend, ChatBody, Chunk, EngineSignals, estimate_prompt_tokens, invalid_request, make_chunk, usage_dict
from .metrics import merge_signals, parse_vllm_metrics

try:  # openai >= 2 speaks httpx2; older releases speak httpx.
    import httpx2

    _UNDECODABLE: tuple[type[BaseException], ...] = (httpx.DecodingError, httpx2.DecodingError)
    _TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.TransportError, httpx2.TransportError, *_UNDECODABLE)
    _TIMEOUTS: tuple[type[BaseException], ...] = (openai.APITimeoutError, httpx.TimeoutException, httpx2.TimeoutException)
    _CONNECT_TIMEOUTS: tuple[type[BaseException], ...] = (httpx.ConnectTimeout, httpx2.ConnectTimeout)
    _WRITE_TIMEOUTS: tuple[type[BaseException], ...] = (httpx.WriteTimeout, httpx2.WriteTimeout)
    _POOL_TIMEOUTS: tuple[type[BaseException], ...] = (httpx.PoolTimeout, httpx2.PoolTimeout)
except ImportError:  # pragma: no cover - depends on the installed openai
    _UNDECODABLE = (httpx.DecodingError,)
    _TRANSPORT_ERRORS = (httpx.TransportError, *_UNDECODABLE)
    _TIMEOUTS = (openai.APITimeoutError, httpx.TimeoutException)
    _CONNECT_TIMEOUTS = (httpx.ConnectTimeout,)
    _WRITE_TIMEOUTS = (httpx.WriteTimeout,)
    _POOL_TIMEOUTS = (httpx.PoolTimeout,)

logger = logging.getLogger(__name__)

ClientFactory = Callable[[str, str], AsyncOpenAI]
"""Builds the client of one replica from (base_url, api_key); tests inject mock transports."""


class CircuitBreaker:
    """Consecutive-failure circuit breaker with a half-open probe. Synchronous; time is passed in.

    Closed: calls pass. After `failures` consecutive failed calls it opens: calls are refused for
    `reset_s` seconds. Then it is half-open: one probe call passes (others are refused); its
    success closes the breaker, its failure opens it again for another `reset_s`. A call granted
    before, still under way, ends with no say on the probe: its failure does not free the
    probe's slot, nor does its cancellation (`acquire` tells which grant a call holds).
    """

    def __init__(self, failures: int = 5, reset_s: float = 30.0) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if not 0 < reset_s < math.inf:  # inf (or nan): no probe ever, the replica out for good
            raise ValueError(f"reset_s must be a finite number of seconds > 0, got {reset_s}")
        self.failures = failures
        self.reset_s = reset_s
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.probing = False

    def state(self, now: float) -> Literal["closed", "open", "half-open"]:
        if self.opened_at is None:
            return "closed"
        return "half-open" if now - self.opened_at >= self.reset_s else "open"

    def acquire(self, now: float) -> Literal["call", "probe"] | None:
        """Ask to make a call now: the grant ("probe": the half-open breaker's one probe), to
        report with `record_*` or `release`; None: refused."""
        state = self.state(now)
        if state == "closed":
            return "call"
        if state == "half-open" and not self.probing:
            self.probing = True
            return "probe"
        return None

    def retry_in(self, now: float) -> float:
        """Seconds until a refused caller may try again."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.reset_s - now)

    def refusal(self, now: float) -> str:
        """Why `acquire` refused a call now, and when to try again, in words."""
        if self.state(now) == "half-open":
            return f"after {self.consecutive_failures} consecutive failures; a probe call is under way"
        return f"after {self.consecutive_failures} consecutive failures; next probe in {self.retry_in(now):.1f} s"

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.probing = False

    def record_failure(self, now: float, grant: Literal["call", "probe"] = "call") -> None:
        self.consecutive_failures += 1
        probe = grant == "probe" and self.probing
        if probe or self.consecutive_failures >= self.failures:
            self.opened_at = now
        if probe:
            self.probing = False

    def release(self, grant: Literal["call", "probe"] = "call") -> None:
        """A granted call ended without a verdict (it was cancelled): the probe frees its slot.
        (Any call's did: a second probe then passed beside the first.)"""
        if grant == "probe":
            self.probing = False


@dataclass(eq=False)
class Replica:
    """One vLLM server: its client, breaker and the calls this backend has in flight there."""

    name: str
    url: str
    client: AsyncOpenAI
    breaker: CircuitBreaker
    in_flight: int = 0
    scheduling_policy: str | None = None
    policy_checked: bool = False
    policy_checking: bool = False
    """Its policy is being checked in the backend's task (`VLLMServerBackend.__aenter__`)."""
    metrics_warned: bool = False
    """Whether a failed read of its ``/metrics`` was logged as a warning (once: the window polls often)."""
    metrics_lost: bool = False
    """Its ``/metrics`` answered a poll, and the last one failed (it died, or hangs: `replicas_down`)."""
    metrics_answered: bool = False
    """Whether its ``/metrics`` ever answered a poll."""
    last_signals: EngineSignals = field(default_factory=EngineSignals)
    """Its last reading; the counters in it carry over the replica's restarts (`_carry_counters`)."""
    counter_offsets: dict[str, float] = field(default_factory=dict)
    """Per counter, what it had counted before the replica's last restart."""
    kv_capacity: KVCacheCapacity | None = None
    """Its KV cache as `VLLMServerBackend.kv_capacities` read it (the memory pool is sized from it)."""
    kv_reported: tuple[int, int] | None = None
    """The blocks and block size it last reported on /metrics, where they differed from `kv_capacity`."""
    kv_seen: KVCacheCapacity | None = None
    """Its KV cache as its /metrics last reported it (`VLLMServerBackend.kv_capacities_seen`)."""


_COUNTERS = ("preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total")
"""The `EngineSignals` fields that are counters: consumers take their rise between two readings."""


def _carry_counters(rep: Replica, signals: EngineSignals) -> EngineSignals:
    """`signals` (a fresh reading of `rep`) with its counters made to only rise.

    vLLM's counters begin again at 0 when the server restarts; a reading below the last one is
    taken as such a restart (as Prometheus' rate() does), and the count before it is kept as an
    offset. A counter absent from the page keeps its last value."""
    carried: dict[str, float | None] = {}
    for name in _COUNTERS:
        raw, last = getattr(signals, name), getattr(rep.last_signals, name)
        if raw is None:
            carried[name] = last
            continue
        offset = rep.counter_offsets.get(name, 0.0)
        if last is not None and raw < last - offset:  # restarted since the last reading
            offset = rep.counter_offsets[name] = last
        carried[name] = offset + raw
    return dataclasses.replace(signals, **carried)


def _check_kv_capacity(rep: Replica, metrics_text: str) -> None:
    """Keep the KV cache `rep` reports (`Replica.kv_seen`), and warn (once per change) when it is
    another than the one the memory pool was sized from: a server restarted with another
    ``VLLM_CPU_KVCACHE_SPACE``, ``--block-size`` or ``--gpu-memory-utilization`` went on being
    admitted to as before, without a word, and, its cache now smaller, preempted the sessions
    admission was there to keep whole. A `Scheduler` whose pool was sized from the caches limits
    the replica's device to a smaller cache of the same block size (`Scheduler` follows
    `VLLMServerBackend.kv_capacities_seen`); a cache grown, or of another block size, is the
    warning's alone."""
    assert rep.kv_capacity is not None
    try:
        now = parse_vllm_cache_config(metrics_text)
    except ValueError:  # not reported yet (an engine still profiling): nothing to compare
        return
    rep.kv_seen = now
    known = rep.kv_capacity
    reported = (now.num_gpu_blocks, now.block_size)
    if reported == (known.num_gpu_blocks, known.block_size):
        rep.kv_reported = None  # back as it was: a later change is said again
        return
    if reported == rep.kv_reported:
        return
    rep.kv_reported = reported
    if now.block_size == known.block_size and now.num_gpu_blocks < known.num_gpu_blocks:
        what = "a scheduler sized from the caches (resources.kv_cache) admits to it as to the smaller cache"
    elif now.block_size == known.block_size:
        what = "admission keeps to the smaller cache it was sized from; restart fleetsched to use the rest"
    else:
        what = "admission no longer matches its cache and the engine may preempt; restart fleetsched to size the pool again"
    logger.warning(
        "vLLM replica %s (%s) now reports a KV cache of %s tokens (%s blocks of %s), not the %s tokens (%s blocks "
        "of %s) the memory pool was sized from when the scheduler started: %s",
        rep.name, rep.url, f"{now.tokens:,}", f"{now.num_gpu_blocks:,}", now.block_size,
        f"{known.tokens:,}", f"{known.num_gpu_blocks:,}", known.block_size, what,
    )  # fmt: skip


class _ErrorEvent(Exception):
    """A failure vLLM reported inside a stream it had begun with 200 (an event ``{"error": {...}}``,
    its create_streaming_error_response), with the HTTP code it would have answered, if any."""

    def __init__(self, message: str, status_code: int | None, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        #: The field the event names (``"param": "logit_bias"``), as vLLM's answer with the code would.
        self.param = param


def _as_event(exc: BaseException) -> BaseException:
    """`exc` as `_ErrorEvent` where it is the SDK's own reading of an error event (a bare
    ``openai.APIError`` carrying the event's body, as its streams raise it on the completions
    path, which the SDK parses); otherwise `exc` itself."""
    if type(exc) is openai.APIError and isinstance(exc.body, Mapping):
        code, param = exc.body.get("code"), exc.body.get("param")
        return _ErrorEvent(exc.message, code if type(code) is int else None, param if isinstance(param, str) else None)
    return exc


def _status(exc: BaseException) -> int | None:
    """The HTTP code of the server's answer `exc` stands for (an error status or event), else None."""
    exc = _as_event(exc)
    if isinstance(exc, (openai.APIStatusError, _ErrorEvent)):
        return exc.status_code
    return None


def _check_counts(usage: object) -> None:
    """Make a chunk's ``usage`` (parsed here, ours to change) hold its token counts as ints, in
    place: vLLM's schema lets a count be null (read as 0: a null went on into the records and
    failed the run's summary). ValueError for one that is not an object of counts."""
    if not isinstance(usage, dict):
        raise ValueError(f"sent a usage that is not an object: {usage!r:.80}")
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        value = usage.get(key)
        if value is None:
            usage[key] = usage["prompt_tokens"] + usage["completion_tokens"] if key == "total_tokens" else 0
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"sent a usage whose {key} is not a count: {value!r:.80}")


def _busy(exc: BaseException) -> bool:
    """An answer that the replica is busy (429, or 503 as vLLM answers when overloaded): it is
    up, and its breaker is not told otherwise (a replica rate limiting for a moment was locked
    out for the breaker's whole reset period)."""
    return _status(exc) in (429, 503)


def _retryable(exc: BaseException) -> bool:
    return _retryable_answer(exc) or _unreachable(exc)


def _retryable_answer(exc: BaseException) -> bool:
    """An answer of the server that a later attempt may not get: 429 or 5xx."""
    status = _status(exc)
    return status is not None and (status == 429 or status >= 500)


def _unreachable(exc: BaseException) -> bool:
    """A failure to talk to the server at all (refused, reset, timed out, bytes that do not
    decode: a body broken on the way), not an answer."""
    return isinstance(exc, (openai.APIConnectionError, *_TRANSPORT_ERRORS))


def broken_off(exc: BaseException, target: Replica, chunks: int) -> BackendUnavailable | None:
    """The error for an answer `target` had begun (`chunks` chunks) when `exc` ended it, where the
    connection broke (the server died, say); None for any other failure. It was reached: "cannot
    reach" would name the wrong failure."""
    if not _unreachable(exc):
        return None
    return BackendUnavailable(f"vLLM replica {target.name} ({target.url}) broke off the answer after {chunks} chunks: {_reason(exc)}")


def _retry_after(exc: openai.APIStatusError, default: float = 1.0) -> float:
    asked = _asked_delay(exc)
    return default if asked is None else asked


def _asked_delay(exc: BaseException | None) -> float | None:
    """The seconds an answer's Retry-After header asks the client to wait, or None where it
    names no number of seconds (absent, an HTTP date, garbage)."""
    if not isinstance(exc, openai.APIStatusError):
        return None
    try:
        asked = float(exc.response.headers.get("retry-after", ""))
    except (TypeError, ValueError):
        return None
    return max(0.0, asked) if math.isfinite(asked) else None


def _said(exc: openai.APIStatusError, limit: int = 200) -> str:
    """The SDK's message for an error answer, with an excerpt of the body where the message has
    none of it: the SDK takes a JSON body's ``message`` alone, so a proxy's page, a plain-text
    500 or vLLM's own ``{"error": "Unauthorized"}`` (a wrong api_key) read "Error code: 401" and
    no more. A page's tags are left out."""
    body = exc.body
    if body is None or (isinstance(body, Mapping) and isinstance(body.get("message"), str) and body["message"]):
        return exc.message  # nothing read, or the SDK's message has it
    text = body if isinstance(body, str) else json.dumps(body)
    if text.lstrip().startswith("<"):
        text = re.sub(r"<[^>]*>", " ", text)
    text = " ".join(text.split())
    if not text:
        return exc.message
    return f"{exc.message} - {text[:limit]}{'...' if len(text) > limit else ''}"


def translate_error(exc: BaseException, replica: str, url: str | None = None) -> BackendError:
    """The fleetsched error for a foreign exception raised while calling `replica` (at `url`,
    the server root, which the message names where it is given)."""
    where = f"vLLM replica {replica}" if url is None else f"vLLM replica {replica} ({url})"
    exc = _as_event(exc)
    if isinstance(exc, _ErrorEvent):
        said = f"{where} failed the call in its stream ({exc.status_code}): {exc}"
        if exc.status_code in (400, 422):
            return invalid_request(said, exc.param)
        if _retryable_answer(exc):
            return BackendUnavailable(said)
        return BackendError(said)
    if isinstance(exc, openai.RateLimitError):
        return Overloaded(f"{where} rate-limited the call", _retry_after(exc))
    if isinstance(exc, openai.APIStatusError):
        said = _said(exc)  # the SDK's message, with the body's words where it has none of them
        if exc.status_code == 503:
            return Overloaded(f"{where} is overloaded: {said}", _retry_after(exc))
        if exc.status_code >= 500:
            return BackendUnavailable(f"{where} failed with {exc.status_code}: {said}")
        if exc.status_code in (400, 422):  # the body as it stands: retrying cannot help
            param = exc.body.get("param") if isinstance(exc.body, Mapping) else None
            return invalid_request(f"{where} rejected the call ({exc.status_code}): {said}", param if isinstance(param, str) else None)
        if exc.status_code == 404 and isinstance(exc.body, Mapping) and exc.body.get("param") == "model":
            # vLLM's `check_model`: the call names a model this server does not serve.
            return UnknownModel(f"{where} does not serve the model the call names: {said}", param="model")
        if exc.status_code == 404 and not (isinstance(exc.body, Mapping) and exc.body.get("message")):
            # No route there (vLLM's own 404s carry a message, as the unknown model's above).
            return BackendError(
                f"{where}: POST {exc.request.url} answered 404 Not Found; the URL must be the root "
                "URL of a vLLM server (http://host:port, without /v1 or another path)"
            )
        return BackendError(f"{where} rejected the call ({exc.status_code}): {said}")
    if isinstance(exc, json.JSONDecodeError):  # the SDK's parse of an event (the completions path)
        return BackendError(f"{where}: sent an event that is not JSON: {exc}")
    if _unreachable(exc):
        reason = _reason(exc)
        if reason == TIMED_OUT:  # it took the call: reached, then silent
            return BackendUnavailable(f"{where} took the call, then sent nothing: {TIMED_OUT}")
        if reason.startswith(UNDECODABLE):  # it answered, in bytes that do not decode
            return BackendUnavailable(f"{where} sent {reason}")
        if isinstance(exc, httpx.RemoteProtocolError) and "[DONE]" in str(exc):  # reached: it answered, then stopped
            return BackendUnavailable(f"{where} answered the call, then broke off: {reason}")
        return BackendUnavailable(f"cannot reach {where}: {reason}")
    return BackendError(f"{where}: {exc}")


#: Seconds to open a connection to a replica (then `backend.read_timeout_s` for each read).
CONNECT_TIMEOUT_S = 5.0

#: Seconds a replica's ``/metrics`` page has to come whole, in each poll of the signals.
SCRAPE_TIMEOUT_S = 5.0

#: Seconds a replica's ``/health`` has to answer after a 5xx, for the 5xx to be the call's alone.
HEALTH_TIMEOUT_S = 2.0

#: Seconds a replica's ``/server_info`` has to answer: vLLM gathers the host's environment for
#: it on the first request (``collect_env``, which runs pip and the like), 8 s on this project's
#: machine, past the 5 s of the other reads; after that it answers at once.
SERVER_INFO_TIMEOUT_S = 30.0

#: A transport error's reason when the server was silent past `backend.read_timeout_s`.
TIMED_OUT = "no answer within the read timeout (backend.read_timeout_s)"

#: How a transport error's reason begins when the answer's bytes do not decode (a body that
#: says it is gzip and is not, from a proxy in front of the server, say).
UNDECODABLE = "an answer that cannot be decoded"


def _reason(exc: BaseException) -> str:
    """What the innermost cause of a transport error says ("Connection error." says nothing);
    for a timeout, which one (the innermost cause is then a cancel scope's message)."""
    chain = [exc]
    seen = {id(exc)}  # a chain may lead back into itself: an exception re-raised while handling its own cause
    while (after := exc.__cause__ or exc.__context__) is not None and id(after) not in seen:
        exc = after
        chain.append(exc)
        seen.add(id(exc))
    undecodable = next((e for e in chain if isinstance(e, _UNDECODABLE)), None)
    if undecodable is not None:
        return f"{UNDECODABLE} ({undecodable})"
    if any(isinstance(e, _CONNECT_TIMEOUTS) for e in chain):
        return f"no connection within the connect timeout ({CONNECT_TIMEOUT_S:g} s)"
    if any(isinstance(e, _WRITE_TIMEOUTS) for e in chain):  # the call never went out whole
        return "the call could not be sent within the timeout (backend.read_timeout_s): the server does not read"
    if any(isinstance(e, _POOL_TIMEOUTS) for e in chain):  # the call never left this process
        return "no free connection to it within the timeout (backend.read_timeout_s): the client's connections are all busy"
    if any(isinstance(e, _TIMEOUTS) for e in chain):
        return TIMED_OUT
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (no server listens there)"
    return str(exc) or type(exc).__name__


def _scrape_failure(exc: BaseException) -> str:
    """What went wrong reading a replica's page, in a line (httpx's own message for a status
    runs to two, the second a link to MDN)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"it answered {exc.response.status_code} {exc.response.reason_phrase}".rstrip()
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__


def _policy_in_server_info(info: Any) -> str | None:
    """The policy in vLLM's ``/server_info`` JSON (``vllm_config.scheduler_config.policy``), or
    None where the answer is not of that shape (text config, another server's JSON)."""
    for key in ("vllm_config", "scheduler_config", "policy"):
        if not isinstance(info, Mapping):
            return None
        info = info.get(key)
    return None if info is None else str(info)


def first_listed_model(response: httpx.Response) -> str:
    """The first model a server's ``GET /v1/models`` answer lists (vLLM's ``--served-model-name``
    or model path). Raises `httpx.HTTPStatusError` for an error status, ValueError for an answer
    not in OpenAI's shape (not JSON, or no model listed)."""
    try:
        return str(response.raise_for_status().json()["data"][0]["id"])
    except (LookupError, TypeError) as exc:
        raise ValueError(f"no model listed: {type(exc).__name__}: {exc}") from None


def _default_client(base_url: str, api_key: str) -> AsyncOpenAI:
    # The SDK's own retries are off: ours know about the breaker and the first chunk.
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    # The SDK imports its chat resources on first use: 31 ms that the first call paid on top of
    # its TTFT (a cold critical call took 38-55 ms against 6-8 ms warm). Pay it here.
    client.chat.completions  # noqa: B018
    return client


#: Seconds to read a response's end after its ``[DONE]`` (the server ends it at once).
DRAIN_S = 1.0


class _EventStream:
    """The chunks of one streamed response, parsed from its server-sent event lines.

    `read_timeout_s` bounds the wait for the next event as the client's read timeout bounds the
    wait for the next bytes: a replica that sends only keep-alive comments (a proxy's, in front
    of a hung server) is silent too."""

    def __init__(self, opened: Any, lines: AsyncIterator[str], read_timeout_s: float = math.inf) -> None:
        self._opened = opened
        self._lines = lines
        self._read_timeout_s = read_timeout_s
        self._closed = False
        self._done = False

    async def next(self) -> Chunk | None:
        """The next chunk, or None at ``[DONE]``. A stream that ends before ``[DONE]`` was cut
        (vLLM ends every stream with it): that raises a transport error, as a broken one does."""
        if self._done:
            return None
        since: float | None = None  # when comments began: the clock is read for them only, not a chunk
        async for line in self._lines:
            if not line.startswith("data:"):
                # A comment, a blank line, an `event:` or `id:` line: keep-alives, no chunk. Only
                # they, for that long, are a stall (a blank line or `event: ping` every second
                # kept a stalled stream open past the read timeout, where a comment did not).
                now = anyio.current_time()
                since = now if since is None else since
                if now - since > self._read_timeout_s:
                    raise httpx.ReadTimeout("no event within the read timeout, only keep-alive lines")
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self._done = True
                await self._drain()
                return None
            try:
                chunk = json.loads(data)
            except ValueError:
                chunk = None
            if not isinstance(chunk, dict):  # it said "Expecting value: line 1 column 1 (char 0)"
                raise ValueError(f"sent an event that is not a JSON object: {data!r:.80}")
            if "error" in chunk and "choices" not in chunk:  # vLLM reports a failure mid-stream so
                error = chunk["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                code = error.get("code") if isinstance(error, dict) else None
                param = error.get("param") if isinstance(error, dict) else None
                # Translated (and retried, before the first chunk) by its code, as an answer with it.
                raise _ErrorEvent(str(message), code if isinstance(code, int) else None, param if isinstance(param, str) else None)
            choices = chunk.get("choices")
            if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
                # Named here, as an event that is no object is: it failed the collected answer
                # (ctx.chat, the gateway's non-streamed call) with a bare AttributeError.
                raise ValueError(f"sent an event whose choices are not a list of objects: {data!r:.80}")
            usage = chunk.get("usage")
            if usage is not None:  # on every chunk of a stream with continuous usage: no copy made
                _check_counts(usage)
            return chunk
        # A body delimited by the connection's close (no length, not chunked, as some proxies
        # send it) ends cleanly wherever the connection dropped: without [DONE], it was cut.
        raise httpx.RemoteProtocolError("the stream ended before its 'data: [DONE]'")

    async def _drain(self) -> None:
        """Read the body to its end after ``[DONE]``: a response closed before that takes its
        connection down with it, and every call would open a new one (measured: a quarter of the
        calls under load, each an accept and a handshake for the API server too). The answer is
        whole by then, so a connection that breaks or stalls here fails nothing: `close` drops
        it (before, a reset after ``[DONE]`` failed the finished call, and counted against the
        replica's breaker)."""
        with anyio.move_on_after(DRAIN_S):
            try:
                async for _ in self._lines:
                    pass
            except Exception as exc:
                logger.debug("a response broke off after its [DONE]: %r", exc)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._opened.__aexit__(None, None, None)


class VLLMServerBackend(Backend):
    """Stream chat completions from vLLM OpenAI-compatible servers.

    `urls` are server roots (``http://host:port``, no ``/v1``); a mapping names the replicas,
    a sequence names them ``r0``, ``r1``, ... Use as an async context manager, or call `aclose`.
    """

    name = "vllm-server"

    def __init__(
        self,
        urls: str | Sequence[str] | Mapping[str, str],
        *,
        model: str | None = DEFAULT_MODEL,
        api_key: str = "EMPTY",
        retry_attempts: int = 4,
        retry_initial_s: float = 0.25,
        retry_max_s: float = 8.0,
        breaker_failures: int = 5,
        breaker_reset_s: float = 30.0,
        read_timeout_s: float = 60.0,
        client_factory: ClientFactory | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        named = dict(urls) if isinstance(urls, Mapping) else {f"r{i}": u for i, u in enumerate(urls)}
        if not named:
            raise ValueError("at least one vLLM server URL is needed")
        if http_client is not None and not isinstance(http_client, httpx.AsyncClient):
            # An httpx2 client (the SDK's own kind) raised its own errors past every reader here.
            raise TypeError(f"http_client: expected an httpx.AsyncClient, got {type(http_client).__module__}.{type(http_client).__qualname__}")
        factory = client_factory or _default_client
        #: The model a call that names none asks for. None: the one the servers list first,
        #: asked when the backend is entered (`served_model`).
        self.model = model
        self._api_key = api_key
        self.retry_attempts = retry_attempts
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        #: Sent with every call: the SDK's own default waits 600 s for each read.
        self.timeout = openai.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        self._replicas = {
            name: Replica(
                name=name,
                url=url.rstrip("/").removesuffix("/v1"),
                client=factory(url.rstrip("/").removesuffix("/v1") + "/v1", api_key),
                breaker=CircuitBreaker(breaker_failures, breaker_reset_s),
            )
            for name, url in named.items()
        }
        self._http = http_client or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._own_http = http_client is None
        #: The task group of the policy checks, while the backend is entered (`__aenter__`).
        self._checks: anyio.abc.TaskGroup | None = None

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> VLLMServerBackend:
        """Build from a `fleetsched.settings.BackendSettings` section."""
        options: dict[str, Any] = dict(
            # Not named in the settings: the servers' own, as they list it (a server started
            # for another model refused every call that named the default with a 404).
            model=settings.model if "model" in settings.model_fields_set else None,
            api_key=settings.api_key,
            retry_attempts=settings.retry_attempts,
            retry_initial_s=settings.retry_initial_s,
            retry_max_s=settings.retry_max_s,
            breaker_failures=settings.breaker_failures,
            breaker_reset_s=settings.breaker_reset_s,
            read_timeout_s=settings.read_timeout_s,
        )
        options.update(overrides)
        return cls(settings.urls, **options)

    @property
    def replicas(self) -> Mapping[str, Replica]:
        """The replicas by name (read-only view; the dispatcher routes by these names)."""
        return dict(self._replicas)

    def pick_replica(self, name: str | None = None, *, avoid: str | None = None) -> Replica:
        """The replica `name`, or the least-loaded one whose breaker is not open, other than
        `avoid` while another can take the call.

        Raises `BackendError` for an unknown name. A named replica is returned even when its
        breaker is open (the call will then raise `BackendUnavailable`): affinity is the caller's
        choice, and failing over is too.
        """
        if name is not None:
            try:
                return self._replicas[name]
            except (KeyError, TypeError):  # TypeError: not a name (a list, say)
                raise BackendError(f"unknown vLLM replica {name!r:.80}; replicas: {', '.join(self._replicas)}") from None
        now = anyio.current_time()
        candidates = [r for r in self._replicas.values() if r.breaker.state(now) != "open"]
        others = [r for r in candidates if r.name != avoid]
        return min(others or candidates or self._replicas.values(), key=lambda r: r.in_flight)

    async def stream_chat(self, body: ChatBody, *, replica: str | None = None) -> AsyncIterator[Chunk]:
        """Stream one chat completion; see the module docstring for routing and retries.

        A call routed by load (no replica named) that its replica fails before the first chunk
        with `BackendUnavailable` goes to the least loaded of the others whose breaker is not
        open; one that cannot reach its replica goes there at once, without backing off.

        Raises `BackendUnavailable` (unreachable, 5xx, breaker open), `Overloaded` (429/503),
        `InvalidRequest` (the server rejected the body; `ContextTooLong` for one over the context)
        or `BackendError` (another 4xx). Leaving the iteration early or being
        cancelled closes the HTTP stream, and vLLM aborts the request.
        """
        request = dict(body)
        named = request.pop(REPLICA_KEY, None) or replica
        caller_falls_back = bool(request.pop(FALLBACK_KEY, False))
        avoid = request.pop(AVOID_KEY, None)
        target = self.pick_replica(named, avoid=avoid)
        if named is None and avoid is not None and target.name == avoid:
            # It had its attempts there: sent again, it had them twice, and cost the breaker two.
            raise BackendUnavailable(f"no vLLM replica but {avoid}, which failed this call, can take it (the others' breakers are open)")
        kwargs = self._create_kwargs(request)
        tried = self._tried_first(target, avoid)
        failed: list[str] = []  # why each replica it failed over from failed it
        while True:
            others = [] if named is not None else self._untried(tried)
            try:
                stream, first = await self._connect(target, kwargs, fail_over=bool(others) or caller_falls_back)
                break
            except BackendUnavailable as exc:
                if not others and failed:
                    # Each replica's failure, not the last one's alone: with every replica down,
                    # the call (and `fleetsched run`) named one of them as if it were the only one.
                    raise BackendUnavailable(f"no vLLM replica could take the call: {'; '.join([*failed, str(exc)])}") from exc
                if not others:
                    raise
                failed.append(str(exc))
                target = min(others, key=lambda r: r.in_flight)
                tried.append(target)
                logger.info("vLLM replica %s failed a call before it began (%s); sending it to %s", tried[-2].name, exc, target.name)
        breaker = target.breaker
        try:
            saw_usage = False
            completion_chunks = 0
            chunk: Chunk | None = first
            try:
                while chunk is not None:
                    saw_usage = saw_usage or bool(chunk.get("usage"))
                    completion_chunks += bool(chunk.get("choices"))
                    yield chunk
                    # When the server is ahead, every read is served from the socket buffer and
                    # never suspends, so a cancelled consumer would read the whole answer first.
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    chunk = await self._next_chunk(stream)
            except Exception as exc:
                if isinstance(exc, BackendError):
                    raise
                if _retryable(exc) and not _busy(exc) and not (_status(exc) is not None and await self._healthy(target)):
                    breaker.record_failure(anyio.current_time())
                broken = broken_off(exc, target, completion_chunks)
                if broken is not None:
                    raise broken from exc
                raise translate_error(exc, target.name, target.url) from exc
            if not saw_usage:  # a server without include_usage support: estimate, keep the seam's promise
                usage = usage_dict(estimate_prompt_tokens(body), max(0, completion_chunks - 1))
                yield make_chunk("", kwargs["model"], 0, usage=usage)
        finally:
            target.in_flight -= 1
            # Closing the response drops the connection; vLLM aborts the request on disconnect.
            with anyio.CancelScope(shield=True):
                await stream.close()

    def _tried_first(self, target: Replica, avoid: str | None) -> list[Replica]:
        """What a call has tried as it begins: its `target`, and the replica it `avoid`s (a call
        falling back from it does not fall over to it again)."""
        avoided = self._replicas.get(avoid) if isinstance(avoid, str) else None
        return [target] if avoided is None or avoided is target else [target, avoided]

    def _untried(self, tried: list[Replica]) -> list[Replica]:
        """The replicas a call routed by load may fall over to: not `tried`, breaker not open."""
        now = anyio.current_time()
        return [r for r in self._replicas.values() if r not in tried and r.breaker.state(now) != "open"]

    async def _connect(self, target: Replica, kwargs: dict[str, Any], *, fail_over: bool) -> tuple[_EventStream, Chunk | None]:
        """Open the call on `target` and wait for its first chunk, with retries (none for an
        unreachable replica when the call can `fail_over`), and give its breaker the verdict.

        On return the call counts in `target.in_flight`; the caller takes it out when it ends."""
        breaker = target.breaker
        now = anyio.current_time()
        grant = breaker.acquire(now)
        if grant is None:
            raise BackendUnavailable(f"circuit open for vLLM replica {target.name} ({target.url}) {breaker.refusal(now)}")
        target.in_flight += 1
        try:
            opened = await self._open_with_retries(target, kwargs, fail_over=fail_over)
        except BaseException as exc:
            target.in_flight -= 1
            if _status(exc) is not None and (not _retryable(exc) or _busy(exc)):
                breaker.record_success()  # it answered: the replica is up (the body was wrong, or it is busy)
            elif _retryable(exc):
                healthy = False
                try:  # a 5xx answered by a replica whose engine is well was the call's failure
                    healthy = _status(exc) is not None and await self._healthy(target)
                finally:
                    if healthy:
                        breaker.record_success()
                    else:
                        breaker.record_failure(anyio.current_time(), grant)
            else:
                breaker.release(grant)  # cancelled: no verdict
            if isinstance(exc, Exception) and not isinstance(exc, BackendError):
                raise translate_error(exc, target.name, target.url) from exc
            raise
        breaker.record_success()
        return opened

    async def _healthy(self, target: Replica) -> bool:
        """Whether `target` answers ``/health`` with 200 within `HEALTH_TIMEOUT_S`: vLLM's server
        does while its engine is alive (a dead one is a 503), so a 5xx it answered just before was
        the call's, not the replica's."""
        try:
            response = await self._get_whole(f"{target.url}/health", HEALTH_TIMEOUT_S, timeout=HEALTH_TIMEOUT_S)
        except (httpx.HTTPError, TimeoutError) as exc:
            logger.debug("vLLM replica %s: /health failed: %r", target.name, exc)
            return False
        return response.status_code == 200

    def _create_kwargs(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            messages = request.pop("messages")
        except KeyError:
            raise InvalidRequest("chat body has no 'messages'") from None
        model = request.pop("model", None) or self.model or DEFAULT_MODEL
        request.pop("stream", None)
        given_options = request.pop("stream_options", None) or {}
        if not isinstance(given_options, Mapping):
            raise InvalidRequest(f"stream_options: expected an object, got {given_options!r:.80}")
        stream_options = {**given_options, "include_usage": True}
        # The messages travel in `extra_body`, which the SDK sends as given: as a typed argument
        # the SDK walks them against its message types on every call (`maybe_transform`), about
        # 135 us a message on this project's machine, which cost this process 2.4 ms of CPU a
        # call for a 20-message conversation. The bodies here are JSON as sent already.
        request_id = request.pop(REQUEST_ID_KEY, None)
        return dict(
            model=model,
            messages=[],
            stream=True,
            stream_options=stream_options,
            extra_body={**request, "messages": messages},
            extra_headers=request_id_header(request_id),
            timeout=self.timeout,
        )

    async def _open_with_retries(self, target: Replica, kwargs: dict[str, Any], *, fail_over: bool) -> tuple[Any, Chunk | None]:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retry_attempts),
            wait=self._backoff,
            # Can the call fail over, an unreachable replica is left at once, without backing off.
            retry=retry_if_exception(_retryable_answer if fail_over else _retryable),
            sleep=anyio.sleep,
            before_sleep=lambda state: logger.debug(
                "vLLM replica %s: attempt %d failed (%r), retrying",
                target.name,
                state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )
        return await retrying(self._open, target, kwargs)

    def _backoff(self, state: RetryCallState) -> float:
        """Seconds to wait before the next attempt: initial * 2**n capped at max, or longer where
        the answer's Retry-After asks it (but at most max: "come back in an hour" is the caller's
        to decide on, not a call's to sleep through), plus up to `initial` of jitter: the calls
        that failed together when a replica went away must not all come back in the same instant."""
        exponential = wait_exponential(multiplier=self.retry_initial_s, max=self.retry_max_s)(state)
        asked = _asked_delay(state.outcome.exception() if state.outcome else None)
        if asked is not None:
            exponential = max(exponential, min(asked, self.retry_max_s))
        return exponential + wait_random(0, self.retry_initial_s)(state)

    async def _open(self, target: Replica, kwargs: dict[str, Any]) -> tuple[_EventStream, Chunk | None]:
        """Send the request and wait for its first chunk (a failure up to there is retried).

        The SDK sends the request (its errors are the ones retried and translated), but the
        stream is read as raw server-sent events: ``json.loads`` per chunk instead of building
        and dumping a pydantic model, which on a small machine costs more than the engine's work.
        """
        opened = target.client.chat.completions.with_streaming_response.create(**kwargs)
        try:
            response = await opened.__aenter__()
        except (TypeError, ValueError) as exc:
            if isinstance(exc, json.JSONDecodeError):  # an answer read, not the body sent
                raise
            # The body is encoded as JSON in UTF-8 before it goes out: a value JSON cannot hold
            # (NaN, a date, a lone surrogate in a tool's text) is the caller's to change, as the
            # sim refuses it. It was a BackendError naming the replica (a 500 to ctx.openai).
            raise InvalidRequest(f"the request cannot be sent as JSON: {exc}") from exc
        stream = _EventStream(opened, response.iter_lines(), self.timeout.read or math.inf)
        try:
            # Another service there (a proxy's page, say) answers 200 too: it was retried as a
            # stream cut short, and counted against the breaker. Not a server to retry.
            kind = response.headers.get("content-type", "text/event-stream")
            if not kind.lower().startswith("text/event-stream"):
                raise BackendError(
                    f"vLLM replica {target.name} ({target.url}) answered with {kind!r:.60}, not an event stream: "
                    "the URL must be the root URL of a vLLM server"
                )
            return stream, await stream.next()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.close()
            raise

    @staticmethod
    async def _next_chunk(stream: _EventStream) -> Chunk | None:
        return await stream.next()

    async def _get_whole(self, url: str, timeout_s: float, **options: Any) -> httpx.Response:
        """GET `url` with its whole answer within `timeout_s` seconds (TimeoutError past them).

        The client's timeout bounds each read alone: a server, or a proxy in front of it, that
        sends its answer a byte a second held the read for as long as it lasted (the start of
        `fleetsched run`, which waits for the model's name and the KV caches, with it)."""
        with anyio.fail_after(timeout_s):
            return await self._http.get(url, **options)

    async def scheduling_policy(self, replica: str | None = None) -> str | None:
        """The scheduling policy of `replica` ("priority", "fcfs"), or None when it cannot tell.

        vLLM 0.32 does not put the scheduler config on ``/metrics``; it shows it at
        ``/server_info`` only when the server runs with ``VLLM_SERVER_DEV_MODE=1``. So: a
        ``*_info`` metric with a policy label if a future vLLM exports one, else ``/server_info``,
        else None. The first answer per replica is logged once: a warning when the policy is not
        priority (then ``priority`` is silently ignored), at info level when it is unknown.
        """
        target = self.pick_replica(replica)
        if target.policy_checked:
            return target.scheduling_policy
        policy: str | None = None
        try:
            response = await self._get_whole(f"{target.url}/metrics", SCRAPE_TIMEOUT_S)
            if response.status_code == 200:
                policy = parse_vllm_metrics(response.text).scheduling_policy
            if policy is None:
                response = await self._get_whole(
                    f"{target.url}/server_info", SERVER_INFO_TIMEOUT_S, params={"config_format": "json"}, timeout=SERVER_INFO_TIMEOUT_S
                )
                if response.status_code == 200:
                    policy = _policy_in_server_info(response.json())
        except (httpx.HTTPError, ValueError, TimeoutError) as exc:
            logger.debug("vLLM replica %s: could not read its scheduling policy: %r", target.name, exc)
            return None  # not checked: try again next time
        target.scheduling_policy = str(policy).lower() if policy is not None else None
        target.policy_checked = True
        if target.scheduling_policy is None:
            logger.info(
                "vLLM replica %s (%s): cannot see its scheduling policy; request priorities only take "
                "effect if it runs with --scheduling-policy priority",
                target.name,
                target.url,
            )
        elif target.scheduling_policy != "priority":
            logger.warning(
                "vLLM replica %s (%s) runs the %r scheduling policy: request priorities are ignored. "
                "Start it with --scheduling-policy priority",
                target.name,
                target.url,
                target.scheduling_policy,
            )
        return target.scheduling_policy

    async def replica_signals(self) -> dict[str, EngineSignals]:
        """Fetch and parse ``/metrics`` of every replica (concurrently). Unreachable ones are left out;
        the counters carry over restarts (`_carry_counters`)."""
        results: dict[str, EngineSignals] = {}

        async def fetch(rep: Replica) -> None:
            try:
                # The whole page within the timeout: the client's bounds each read alone, and a
                # page that trickled in (a byte a second, through a choked proxy) held every
                # poll, and the adaptive window with it, for as long as it lasted.
                response = await self._get_whole(f"{rep.url}/metrics", SCRAPE_TIMEOUT_S)
                response.raise_for_status()
                rep.last_signals = _carry_counters(rep, parse_vllm_metrics(response.text).signals)
                rep.metrics_answered, rep.metrics_lost = True, False
                if rep.kv_capacity is not None:
                    _check_kv_capacity(rep, response.text)
            except (httpx.HTTPError, ValueError, TimeoutError) as exc:
                rep.metrics_lost = rep.metrics_answered
                # Said once, as a warning: at debug level alone, a replica whose /metrics never
                # answers (behind a proxy that does not pass it on, say) left the adaptive window
                # without its signals, held where it was, and nothing said so.
                if not rep.metrics_warned:
                    rep.metrics_warned = True
                    logger.warning(
                        "vLLM replica %s (%s): cannot read its /metrics (%s): the adaptive window goes without "
                        "its signals while it does not answer (said once)",
                        rep.name, rep.url, _scrape_failure(exc),
                    )  # fmt: skip
                else:
                    logger.debug("vLLM replica %s: /metrics failed: %r", rep.name, exc)
                return
            results[rep.name] = rep.last_signals

        async with anyio.create_task_group() as tg:
            for rep in self._replicas.values():
                tg.start_soon(fetch, rep)
        return results

    async def signals(self) -> EngineSignals:
        """Load signals summed over the replicas that answered; the counters over every replica
        that ever answered (a replica that misses a scrape counts with its last reading, or the
        sum would fall, then jump back up at its return).

        Raises `BackendUnavailable` when none answered.
        """
        per_replica = await self.replica_signals()
        for name in per_replica:
            rep = self._replicas[name]
            if rep.policy_checked or rep.policy_checking:
                continue
            if self._checks is not None:  # entered: in its own task, the poll does not wait for it
                self._start_policy_check(rep)
            else:
                await self.scheduling_policy(name)
        if not per_replica:
            raise BackendUnavailable(
                f"no vLLM replica answered /metrics ({', '.join(r.url for r in self._replicas.values())})"
            )
        answered = merge_signals(per_replica.values())
        known = merge_signals(rep.last_signals for rep in self._replicas.values())
        return dataclasses.replace(answered, **{name: getattr(known, name) for name in _COUNTERS})

    async def kv_capacities(self) -> dict[str, KVCacheCapacity]:
        """Each replica's KV cache, as it reports it on ``/metrics`` (``vllm:cache_config_info``).
        Raises `BackendUnavailable` naming the replica that did not answer, or whose metrics
        lack the cache."""
        capacities = {}
        for name, rep in self._replicas.items():
            try:
                with anyio.fail_after(SCRAPE_TIMEOUT_S):  # the whole page (`_get_whole`)
                    capacities[name] = rep.kv_capacity = await read_vllm_kv_capacity(rep.url, client=self._http)
            except TimeoutError as exc:
                raise BackendUnavailable(
                    f"vLLM replica {name} ({rep.url}): cannot read its KV cache: /metrics did not answer whole within {SCRAPE_TIMEOUT_S:g} s"
                ) from exc
            except (httpx.HTTPError, ValueError) as exc:
                raise BackendUnavailable(f"vLLM replica {name} ({rep.url}): cannot read its KV cache: {exc}") from exc
        return capacities

    def kv_capacities_seen(self) -> dict[str, KVCacheCapacity]:
        """Each replica's KV cache as its /metrics last reported it, in a `signals` poll after
        `kv_capacities` (which the scheduler's sizing from the caches calls); replicas not read
        since are left out."""
        return {name: rep.kv_seen for name, rep in self._replicas.items() if rep.kv_seen is not None}

    def replicas_down(self) -> frozenset[str]:
        """The replicas whose breaker is open (calls routed by load, and the dispatcher's falling
        back from a session's replica, go elsewhere until its next probe), or whose ``/metrics``
        answered a `signals` poll before and not the last one: a replica that hangs opens its
        breaker only after calls that each waited `backend.read_timeout_s`, where a poll gives up
        on it within `SCRAPE_TIMEOUT_S`."""
        now = anyio.current_time()
        return frozenset(name for name, rep in self._replicas.items() if rep.breaker.state(now) == "open" or rep.metrics_lost)

    async def __aenter__(self) -> VLLMServerBackend:
        await self.served_model()
        # The replicas' policies are checked at once, in tasks of their own: checked at the first
        # `signals` poll and awaited there, the check held the adaptive window still while vLLM
        # made its first /server_info answer (8 s, cut at 5 s, then asked again at the next poll),
        # and a run on a fixed window (no poll) was never warned.
        self._checks = anyio.create_task_group()
        await self._checks.__aenter__()
        for rep in self._replicas.values():
            self._start_policy_check(rep)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._checks is not None:
                self._checks.cancel_scope.cancel()
                await self._checks.__aexit__(None, None, None)
        finally:
            self._checks = None
            await self.aclose()

    def _start_policy_check(self, rep: Replica) -> None:
        """Check the policy of `rep` in the backend's task group (`scheduling_policy`); a check
        that cannot reach it is made again at a later `signals` poll that could."""

        async def check() -> None:
            try:
                await self.scheduling_policy(rep.name)
            except Exception as exc:  # a check in the background must not end the backend's user
                logger.debug("vLLM replica %s: could not read its scheduling policy: %r", rep.name, exc)
            finally:
                rep.policy_checking = False

        assert self._checks is not None
        rep.policy_checking = True
        self._checks.start_soon(check, name=f"vLLM replica {rep.name} policy check")

    async def served_model(self) -> str:
        """`model` if given; else the model the first replica that answers lists first
        (``GET /v1/models``), as vLLM's ``--served-model-name`` or model path names it, kept as
        `model`; `DEFAULT_MODEL` when none answers (with a warning: calls then name it, and a
        server serving another model refuses them)."""
        if self.model is None:
            self.model = await self._listed_model()
        return self.model

    async def max_model_len(self) -> int | None:
        """The smallest context (``max_model_len``) the replicas list for `model` on ``GET
        /v1/models`` (a session's calls may go to any of them); None where none that answered
        lists one. Replicas that cannot be reached, or do not answer in vLLM's shape, are left out."""
        model = await self.served_model()
        lengths = []
        for rep in self._replicas.values():
            try:
                response = await self._get_whole(
                    f"{rep.url}/v1/models", SCRAPE_TIMEOUT_S, headers={"Authorization": f"Bearer {self._api_key}"}
                )
                listed = response.raise_for_status().json()["data"]
                lengths += [e.get("max_model_len") for e in listed if isinstance(e, Mapping) and e.get("id") == model]
            except (httpx.HTTPError, ValueError, LookupError, TypeError, TimeoutError) as exc:
                logger.debug("vLLM replica %s: could not read its max_model_len: %r", rep.name, exc)
        lengths = [n for n in lengths if type(n) is int and n > 0]
        return min(lengths) if lengths else None

    async def _listed_model(self) -> str:
        failures = []
        reached = False  # a replica answered, if not with vLLM's list
        refused = False  # a replica refused the API key (vLLM's --api-key guards /v1/models too)
        for rep in self._replicas.values():
            try:
                response = await self._get_whole(
                    f"{rep.url}/v1/models", SCRAPE_TIMEOUT_S, headers={"Authorization": f"Bearer {self._api_key}"}
                )
                return first_listed_model(response)
            except TimeoutError:  # it was reached, and began an answer it did not finish in time
                reached = True
                failures.append(f"{rep.name} ({rep.url}): /v1/models did not answer whole within {SCRAPE_TIMEOUT_S:g} s")
            except (httpx.HTTPError, ValueError) as exc:  # down, or not vLLM's answer
                reached = reached or not isinstance(exc, httpx.TransportError)
                refused = refused or (isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (401, 403))
                said = _scrape_failure(exc) if isinstance(exc, httpx.HTTPStatusError) else f"{type(exc).__name__}: {exc}"
                failures.append(f"{rep.name} ({rep.url}): {said}")
        if refused:  # every call will be refused the same way: backend.model is no fix
            logger.warning(
                "a vLLM replica refused backend.api_key when asked for its model (%s): calls name %r, and it refuses "
                "them too; set backend.api_key to the server's --api-key",
                "; ".join(failures), DEFAULT_MODEL,
            )  # fmt: skip
            return DEFAULT_MODEL
        if not reached:  # none could be: backend.model is no fix
            logger.warning(
                "no vLLM replica could be reached to list its model (%s): calls name %r; is the server up?",
                "; ".join(failures), DEFAULT_MODEL,
            )  # fmt: skip
            return DEFAULT_MODEL
        logger.warning(
            "no vLLM replica listed its model (%s): calls name %r; set backend.model to the server's --served-model-name",
            "; ".join(failures), DEFAULT_MODEL,
        )  # fmt: skip
        return DEFAULT_MODEL

    async def aclose(self) -> None:
        if self._checks is not None:  # closed while entered: the checks would read through a closed client
            self._checks.cancel_scope.cancel()
        for rep in self._replicas.values():
            await rep.client.close()
        if self._own_http:
            await self._http.aclose()


def request_id_header(request_id: str | None) -> dict[str, str] | None:
    """The ``X-Request-Id`` header that names a call to vLLM's server (its logs and the answer's
    ``id``, ``chatcmpl-<ID>``), for a call the gateway gave `request_id` (`REQUEST_ID_KEY`)."""
    return None if request_id is None else {"X-Request-Id": request_id}
