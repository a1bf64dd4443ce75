"""The gateway: an ASGI app serving the OpenAI API to tenants, through the dispatcher.

    POST /v1/chat/completions   POST /v1/completions   (streaming and not)
    GET  /v1/models   GET /metrics   GET /health   DELETE /v1/sessions/{X-Session-ID}

A raw ASGI callable rather than a framework: the hot path (auth, checks, one dispatcher call,
one JSON answer) has no routing or middleware layers, which keeps the added latency well under a
millisecond. The app runs a `Scheduler` (its backend, pool and dispatcher), entered by the ASGI
lifespan or by `Gateway.running()`.

What a request goes through, in order: the API key (401 when missing or wrong) decides tenant,
tier and SLA; the body is parsed and checked (400 naming the field, 413 when too large); a
request whose prompt estimate fills the backend's context, or whose max_tokens alone exceeds
it, is refused (400 naming the limit; a max_tokens the prompt leaves no room for is cut, as
vLLM cuts it); the tenant's rate limits are taken from the shared state (429 with
Retry-After; every answer from here on carries OpenAI's ``x-ratelimit-*`` headers); with
``X-Session-ID`` the call waits for its session's turn (session admission, keep-or-release
across calls, replica placement); then the dispatcher (which sheds batch calls with 503 and
Retry-After). Responses and streams are passed through as the backend produced
them, usage included: on every chunk of a stream, as the dispatcher asks the engine for it (it
charges the tenant by the engine's count). A client that disconnects cancels its call, which
aborts it at the engine.

Calls without ``X-Session-ID`` go straight to the dispatcher: a one-call scheduler session would
add admission bookkeeping to every stateless request and buy nothing (there is no tool time to
release), while the dispatcher still orders, limits and sheds them.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from typing import Any

import anyio
import httpx

from ..agents.transport import CLIENT_ID, CLIENT_ID_FORM, UsageShape, error_response, model_not_found, request_id, response_for
from ..backends import create_backend
from ..backends.base import PRIVATE_KEYS, REQUEST_ID_KEY, Backend, Received, completion_room, estimate_prompt_tokens, max_tokens_field, model_list, requested_max_tokens
from ..errors import BackendError, ContextTooLong, DeadlineExceeded, FleetschedError, InvalidRequest, Overloaded, SchedulerClosed, SessionRejected
from ..resources.ratelimit import RateLimit, Taken, shortfall_text
from ..scheduler import Scheduler
from ..scheduler.dispatcher import INPUT_WEIGHT, OUTPUT_WEIGHT
from ..scheduler.records import Recorder
from ..scheduler.session import SessionHandle
from ..settings import Settings
from .auth import Identity, KeyRing
from .backend import ENDPOINT_KEY, GatewayBackend, collect_completion
from .metrics import GatewayMetrics
from .sessions import SessionTable
from .state import SharedState, StateUnavailable, create_state
from .validate import Invalid, check_chat, check_completion, check_text

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

SESSION_HEADER = b"x-session-id"
REQUEST_ID_HEADER = b"x-request-id"
#: How often an instance with shared state counts its peers' service into its fair-share counters.
FAIR_SHARE_SYNC_S = 0.5

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_ROUTES = {
    "/v1/chat/completions": ("POST", "chat"),
    "/v1/completions": ("POST", "completions"),
    "/v1/models": ("GET", "models"),
    "/metrics": ("GET", "metrics"),
    "/health": ("GET", "health"),
}
#: ``DELETE /v1/sessions/{X-Session-ID}`` ends a session (`Gateway._end_session`).
_SESSIONS_PATH = "/v1/sessions/"
_SESSION_ROUTE = ("DELETE", "session")
#: ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the served model, else a 404.
_MODELS_PATH = "/v1/models/"
_MODEL_ROUTE = ("GET", "model")


class _SessionRecorder(Recorder):
    """Counts calls and forgets them: a server runs for ever."""

    def add_session(self, record: Any) -> None:
        pass

    def add_admission(self, record: Any) -> None:
        pass


def context_limit(settings: Settings) -> int | None:
    """The backend's context in tokens (None: unknown, not checked): a prompt that fills it, or
    a max_tokens over it, is refused as vLLM refuses them."""
    if settings.gateway.max_context_tokens is not None:
        return settings.gateway.max_context_tokens
    kind = settings.backend.kind
    if kind == "sim":
        return settings.backend.sim.max_model_len
    if kind == "vllm-engine":
        return settings.backend.engine_max_model_len
    return None


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class Gateway:
    """The ASGI app. ``async with gateway.running():`` (or the ASGI lifespan) before serving.

    `backend` defaults to the one the settings describe; one passed in is the caller's to close.
    """

    def __init__(self, settings: Settings, *, backend: Backend | None = None, instance: str | None = None) -> None:
        self.settings = settings
        self.instance = instance or uuid.uuid4().hex[:12]
        self.keys = KeyRing.from_settings(settings)
        limits = {
            name: RateLimit(t.requests_per_minute, t.tokens_per_minute)
            for name, t in settings.tenants.items()
            if t.requests_per_minute or t.tokens_per_minute
        }
        self.state: SharedState = create_state(
            limits, settings.gateway.redis_url, instance=self.instance, prefix=settings.gateway.redis_prefix
        )
        # The gateway takes rate limits from the shared state; the dispatcher must not take twice.
        tenants = {
            name: t.model_copy(update={"requests_per_minute": None, "tokens_per_minute": None})
            for name, t in settings.tenants.items()
        }
        self._scheduler_settings = settings.model_copy(update={"tenants": tenants})
        self._own_backend = backend is None
        self.backend = GatewayBackend(backend if backend is not None else create_backend(settings.backend))
        self.metrics = GatewayMetrics()
        self.max_context = context_limit(settings)
        # The sim's and the instant backend's prompts are as long as the gateway estimates them
        # (4 characters a token); a vLLM counts with its tokenizer, and refuses a prompt too long
        # itself: the estimate refused prompts that fit (800 tokens of " continuously" read 2,604).
        self._prompts_counted_here = settings.backend.kind in ("sim", "instant")
        self.scheduler: Scheduler | None = None
        self.sessions: SessionTable | None = None
        self.model = settings.backend.model  # the model served: the settings', else the server's (`running`)
        #: Why the ASGI lifespan's start failed (what `running` raised before it served), or None;
        #: the server is told too, in one line.
        self.start_failure: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Gateway]:
        """Run the scheduler (and, with shared state, the fair-share sync) while the block lasts."""
        # The backend is entered first and left last: one that runs tasks (the sim's engine loop)
        # holds a task group in this task, which must close after the scheduler's.
        backend = self.backend if self._own_backend else nullcontext()
        try:
            async with (
                backend,
                Scheduler(self._scheduler_settings, backend=self.backend, recorder=_SessionRecorder(keep_calls=False)) as scheduler,
                anyio.create_task_group() as tg,
            ):
                self.scheduler = scheduler
                self.model = scheduler.model  # a vLLM server's own, where the settings name none
                self.sessions = SessionTable(
                    scheduler,
                    self.state,
                    instance=self.instance,
                    idle_s=self.settings.gateway.session_idle_s,
                    pick_replica=self.backend.pick_replica,
                )
                if self.state.shared:
                    tg.start_soon(self._sync_fair_share, name="fleetsched gateway fair-share sync")
                try:
                    yield self
                finally:
                    self.sessions.close_all()
                    tg.cancel_scope.cancel()
        finally:
            self.scheduler = None
            with anyio.CancelScope(shield=True):
                await self.state.aclose()

    def stop_waiting(self) -> None:
        """The server begins to shut down: session calls still waiting for their turn, and new
        ones, get a 503; calls under way finish (the server waits for them)."""
        if self.sessions is not None:
            self.sessions.close_all()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            async with self.running():
                started = True
                await send({"type": "lifespan.startup.complete"})
                await receive()  # lifespan.shutdown
        except anyio.get_cancelled_exc_class():
            # The server's loop ends under the app (its start abandoned on Ctrl-C, or its
            # shutdown cut short): no failure of the app's. Said so without a message, which
            # uvicorn would log as an error; unsaid, it logged the cancellation's traceback.
            with anyio.CancelScope(shield=True):
                await send({"type": "lifespan.shutdown.failed" if started else "lifespan.startup.failed"})
            raise
        except BaseException as exc:
            if not started:
                while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                    exc = exc.exceptions[0]  # the task groups' wrapping says nothing to the operator
                self.start_failure = exc
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                return
            raise
        await send({"type": "lifespan.shutdown.complete"})

    async def _sync_fair_share(self) -> None:
        """Charge this instance's fair-share counters with the service its peers gave, and write
        the service this instance gave for them (`SharedState.peer_usage`).

        The first counters read are the baseline. While Redis cannot be reached (from the start,
        too) the local counters stand alone, calls get 503 at the rate limits, and the sync tries
        again a period later: the gateway serves again as soon as Redis is back."""
        assert self.scheduler is not None
        dispatcher = self.scheduler.dispatcher
        last: dict[str, float] | None = None
        failing = False
        while True:
            try:
                by_peers = await self.state.peer_usage()
            except Exception as exc:  # Redis away for a moment: keep the local counters
                if not failing:  # once per outage, not once a period
                    logger.warning("fair-share sync failed (retrying every %g s): %s: %s", FAIR_SHARE_SYNC_S, type(exc).__name__, exc)
                failing = True
                if self.sessions is not None:  # its running sessions skip their placement lookups
                    self.sessions.state_away = True
            else:
                if failing:
                    logger.warning("fair-share sync works again")
                failing = False
                if self.sessions is not None:
                    self.sessions.state_away = False
                if last is None:  # the baseline
                    last = dict(by_peers)
                else:
                    # Charged up to each tenant's highest reading: one low for a moment is made
                    # up when it rises again, not charged twice. (The shared state keeps each
                    # peer's highest total, so its readings do not go down.)
                    for tenant, total in by_peers.items():
                        peers = total - last.get(tenant, 0.0)
                        if peers > 0:
                            last[tenant] = total
                            if tenant in self.settings.tenants:
                                dispatcher.charge_external(tenant, peers)
            await anyio.sleep(FAIR_SHARE_SYNC_S)

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            try:
                await self._http(scope, receive, send)
            except Exception:  # a bug of ours: answer 500 if we still can, never take the server down
                logger.exception("gateway error on %s %s", scope.get("method"), scope.get("path"))
                try:
                    await _error(send, error_response(500, "internal error in the gateway", "internal_error"))
                except Exception:
                    pass
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        route = _ROUTES.get(path) or (
            _SESSION_ROUTE if path.startswith(_SESSIONS_PATH) else _MODEL_ROUTE if path.startswith(_MODELS_PATH) else None
        )
        # Every answer names its request, as OpenAI's and vLLM's do (`x-request-id`): the
        # client's own ID where it sent one (of the form `CLIENT_ID`), else one of the gateway's;
        # a vLLM server gets the same ID for the call.
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID_HEADER)
        named, usable = request_id(None if given is None else given.decode("latin-1"))
        send = _with_headers(send, [(REQUEST_ID_HEADER, named.encode())])
        if not usable:
            await _error(send, _invalid(f"X-Request-Id: {CLIENT_ID_FORM}", "X-Request-Id"))
            return
        if route is None:
            await _error(send, error_response(404, f"no such endpoint: {scope['path']}", "not_found"))
            return
        method, endpoint = route
        allowed = f"{method}, HEAD" if method == "GET" else method
        if scope["method"] != method and not (scope["method"] == "HEAD" and method == "GET"):  # the server drops HEAD's body
            await _send(
                send, 405, error_response(405, f"{scope['path']} takes {allowed}", "method_not_allowed").content,
                headers=[(b"allow", allowed.encode())],
            )  # fmt: skip
            return
        if endpoint == "health":
            if self.scheduler is None:
                await _send(send, 503, b'{"status":"starting"}')
                return
            # Still 200 without Redis: calls of tenants without limits are served, and every
            # instance shares the one Redis (a 503 would take all of them out of the pool).
            problem = await self.state.unavailable()
            health = {"status": "ok"} if problem is None else {"status": "degraded", "shared_state": problem}
            await _send(send, 200, _dumps(health))
            return
        if len(headers) < len(scope["headers"]):  # a header sent twice: the last would win unseen
            names = [name for name, _ in scope["headers"]]
            for name, param in ((b"authorization", "Authorization"), (SESSION_HEADER, "X-Session-ID"), (REQUEST_ID_HEADER, "X-Request-Id")):
                if names.count(name) > 1:
                    await _error(send, _invalid(f"{param}: sent more than once; send it once", param))
                    return
        identity = self.keys.identify_header(headers.get(b"authorization"))
        if identity is None:
            self.metrics.record("", endpoint, 401)
            await _error(
                send,
                error_response(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer <key>` with a key of your tenant",
                    "invalid_api_key",
                ),
            )
            return
        if endpoint == "models":
            await _send(send, 200, _dumps(model_list(self.model, self.max_context)))
        elif endpoint == "model":
            await self._model(path.removeprefix(_MODELS_PATH), send)
        elif endpoint == "session":
            await self._end_session(identity, path.removeprefix(_SESSIONS_PATH), send)
        elif endpoint == "metrics":
            await self._metrics(identity, send)
        else:
            await self._call(endpoint, identity, headers, named, receive, send)

    async def _end_session(self, identity: Identity, session_id: str, send: Send) -> None:
        """``DELETE /v1/sessions/{id}``: the tenant's session ends once the calls already waiting
        for it are served, its slot and memory free at once rather than after
        `gateway.session_idle_s`; 404 when this instance serves no such session of the tenant."""
        if identity.tenant is None:
            await _error(send, error_response(403, "the admin key has no sessions; use a tenant's key", "permission_denied"))
            return
        if not CLIENT_ID.fullmatch(session_id):
            await _error(send, _invalid(f"the session id: {CLIENT_ID_FORM}", "session_id"))
            return
        if self.sessions is None or not self.sessions.end(identity.tenant, session_id):
            await _error(send, error_response(404, f"no session {session_id!r} of tenant {identity.tenant!r} is open here", "not_found"))
            return
        await _send(send, 200, _dumps({"id": session_id, "object": "session", "deleted": True}))

    async def _model(self, name: str, send: Send) -> None:
        """``GET /v1/models/{model}``: the model object where `name` is the served model, else
        a 404 as OpenAI and vLLM answer a call naming another model."""
        if name != self.model:
            await _error(send, model_not_found(f"The model `{name}` does not exist: this gateway serves `{self.model}`"))
            return
        await _send(send, 200, _dumps(model_list(self.model, self.max_context)["data"][0]))

    async def _metrics(self, identity: Identity, send: Send) -> None:
        extra: list[str] = []
        if identity.admin and self.scheduler is not None:
            d = self.scheduler.dispatcher.statistics()
            s = self.scheduler.statistics()
            families = [
                ("fleetsched_dispatcher_window", "gauge", "Model calls the dispatcher lets in flight at once.", d.window),
                ("fleetsched_dispatcher_in_flight", "gauge", "Model calls in flight.", d.in_flight),
                ("fleetsched_dispatcher_queued", "gauge", "Model calls waiting for a place in the window.", d.queued),
                ("fleetsched_dispatcher_shed_total", "counter", "Model calls shed (their predicted wait exceeded their TTFT objective).", d.shed),
                ("fleetsched_scheduler_sessions_running", "gauge", "Sessions running.", s.running_total),
                ("fleetsched_scheduler_sessions_queued", "gauge", "Sessions waiting for admission.", s.queued_total),
                ("fleetsched_gateway_sessions", "gauge", "Gateway sessions open (X-Session-ID).", len(self.sessions or ())),
            ]
            for name, kind, help_text, value in families:  # typed, as every family of the page
                extra += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        text = self.metrics.render(identity.tenant, extra)
        await _send(send, 200, text.encode(), content_type=b"text/plain; version=0.0.4; charset=utf-8")

    # -- model calls -----------------------------------------------------------------------------

    async def _call(
        self, endpoint: str, identity: Identity, headers: dict[bytes, bytes], request_id: str, receive: Receive, send: Send
    ) -> None:
        start = anyio.current_time()
        tenant = identity.tenant
        if tenant is None or identity.settings is None:
            await _error(send, error_response(403, "the admin key makes no model calls; use a tenant's key", "permission_denied"))
            return
        done = _Outcome()
        status = await self._answer(endpoint, identity, headers, request_id, receive, send, done)
        if not status or done.client_left and not done.answered:  # as nginx counts it: not served, nor uncounted
            status = CLIENT_CLOSED_REQUEST
        seconds = anyio.current_time() - start
        self.metrics.record(tenant, endpoint, status, seconds, failed_mid_stream=done.failed_mid_stream, cut_mid_stream=done.cut_mid_stream)
        # Counted here, where the status is final: counted at the settling, a stream its client
        # left after its 200 (a 499 above) added its tokens as served.
        if status == 200:
            self.metrics.add_tokens(tenant, done.prompt_tokens, done.completion_tokens)

    async def _answer(
        self,
        endpoint: str,
        identity: Identity,
        headers: dict[bytes, bytes],
        request_id: str,
        receive: Receive,
        send: Send,
        done: _Outcome,
    ) -> int:
        """Serve one model call, noting its outcome in `done`; returns the status sent (0: the
        client went away)."""
        tenant, tenant_settings = identity.tenant, identity.settings
        assert tenant is not None and tenant_settings is not None
        # The body is read as sent, never decompressed: a gzip body was refused as "not valid
        # JSON: 'utf-8' codec can't decode byte 0x8b", which named no cause (RFC 9110: a 415).
        encoding = headers.get(b"content-encoding", b"").strip().lower()
        if encoding not in (b"", b"identity"):
            message = f"Content-Encoding: {encoding.decode('latin-1')!r} is not served; send the body uncompressed"
            answer = error_response(415, message, "invalid_request_error", param="Content-Encoding")
            return await _send(send, 415, answer.content, headers=[(b"accept-encoding", b"identity")])
        raw = await _read_body(receive, self.settings.gateway.max_body_bytes)
        if raw is None:
            return 0
        if isinstance(raw, httpx.Response):
            return await _error(send, raw)
        try:
            body = (check_chat if endpoint == "chat" else check_completion)(json.loads(raw))
            check_text(raw, body)
        except Invalid as exc:
            return await _error(send, _invalid(str(exc), exc.param))
        except (ValueError, RecursionError) as exc:
            return await _error(send, _invalid(f"the body is not valid JSON: {exc}", None))
        # The session header is checked with the body, before the rate limits are taken: a call
        # refused for it must not use up one of the tenant's requests per minute.
        raw_id = headers.get(SESSION_HEADER)
        session_id = None if raw_id is None else raw_id.decode("latin-1")
        if session_id is not None and not CLIENT_ID.fullmatch(session_id):
            return await _error(send, _invalid(f"X-Session-ID: {CLIENT_ID_FORM}", "X-Session-ID"))
        streaming = bool(body.pop("stream", False))
        for private in (*PRIVATE_KEYS, ENDPOINT_KEY, "priority"):
            body.pop(private, None)
        body[REQUEST_ID_KEY] = request_id
        prompt = estimate_prompt_tokens(body)
        max_tokens = requested_max_tokens(body, default=0)
        if self.max_context is not None:
            try:  # refused as vLLM refuses it; a max_tokens the prompt leaves no room for is cut there
                completion_room(self.max_context, prompt if self._prompts_counted_here else 0, max_tokens, max_tokens_field(body))
            except ContextTooLong as exc:
                message = f"{exc} (gateway.max_context_tokens; the prompt is about {prompt} tokens)"
                param = exc.param if prompt < self.max_context else "messages" if endpoint == "chat" else "prompt"
                return await _error(send, _invalid(message, param, code="context_length_exceeded"))
        tokens = prompt + requested_max_tokens(body)
        try:
            taken = await self.state.take(tenant, tokens)
        except Exception as exc:  # the shared state (Redis) is unreachable: a 503, not our 500
            logger.warning("shared state unavailable for tenant %r: %s: %s", tenant, type(exc).__name__, exc)
            return await _error(send, _answer_for(StateUnavailable.from_error(exc)))
        # The buckets as the answer's headers show them: after the take, or, for an error answer,
        # after what its settling gave back (`_settling_first` settles those before their start).
        shown = [taken]
        send = _with_headers(send, lambda: ratelimit_headers(shown[-1]))
        if taken.wait_s > 0:
            return await _error(
                send,
                error_response(
                    429, _over_limits(tenant, taken, tokens), "rate_limit_exceeded", retry_after_s=taken.wait_s, code="rate_limit_exceeded"
                ),
            )
        if endpoint == "completions":
            body[ENDPOINT_KEY] = "completions"
        settled = False

        async def settle(status: int) -> None:
            nonlocal settled
            if not settled:
                settled = True
                after = await self._settle(tenant, prompt, max_tokens or requested_max_tokens(body), done, status)
                if after is not None:
                    shown.append(after)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, done)
            send = _bounded(send, self.settings.gateway.send_timeout_s, tg.cancel_scope, tenant, request_id, done)
            send = _settling_first(send, settle)
            try:
                if session_id is None:
                    tier = int(tenant_settings.tier)
                    ttft = tenant_settings.sla.ttft_p99_s
                    due = anyio.current_time() + ttft if ttft else math.inf
                    await self._dispatch(endpoint, body, streaming, tenant, tier, 0, due, math.inf, send, done)
                else:
                    await self._session_call(endpoint, body, streaming, identity, session_id, send, done)
            except Exception as exc:
                if done.started:
                    done.status, done.failed_mid_stream = 200, True
                else:
                    done.status = await _error(send, _answer_for(exc))
                # A shed call (503 with Retry-After) is a refusal, as a 429 is: counted in the
                # dispatcher's shed_total, not logged once per call under the very load that sheds.
                if not isinstance(exc, FleetschedError) or (
                    isinstance(exc, BackendError) and not isinstance(exc, Overloaded) and done.status >= 500
                ):
                    logger.warning("call %s of tenant %r failed: %r", request_id, tenant, exc)
            finally:
                tg.cancel_scope.cancel()
        await settle(done.status)  # where no answer was sent in full (the client left)
        return done.status

    async def _session_call(
        self, endpoint: str, body: dict[str, Any], streaming: bool, identity: Identity, session_id: str, send: Send, done: _Outcome
    ) -> None:
        assert self.sessions is not None and identity.tenant is not None and identity.settings is not None
        async with self.sessions.call(identity.tenant, session_id) as session:
            handle = session.handle
            assert handle is not None
            ttft = identity.settings.sla.ttft_p99_s
            due = anyio.current_time() + ttft if ttft else math.inf
            # The replica goes to the dispatcher, not into the body (where the backend takes it as
            # the caller's choice, without failover): the dispatcher sends the call there, and
            # to another replica if that one is down before the first chunk. It is the one the
            # session's memory is reserved on, as for an in-process agent (read at each call: a
            # re-admission may place it elsewhere), else the placement's (devices not named
            # after the replicas).
            tier, deadline = int(handle.tier), handle.deadline
            reservation = handle.reservation
            replica = session.placement.replica
            if reservation is not None and reservation.device in self.backend.replicas:
                replica = reservation.device
            try:
                await self._dispatch(endpoint, body, streaming, handle.tenant, tier, handle.id, due, deadline, send, done, replica)
            except BaseException as exc:
                # Cut short at the engine (its client gone, the session's deadline): a call made, as
                # its record has it, with what the engine made for it. Left out, a session's counts
                # fell short of its calls' records by every call its client left.
                if done.sent and isinstance(exc, (anyio.get_cancelled_exc_class(), DeadlineExceeded)):
                    _count(handle, done)
                raise
            if not done.read_failed:  # a stream its backend broke off (a 200, then an error event)
                _count(handle, done)

    async def _dispatch(
        self,
        endpoint: str,
        body: dict[str, Any],
        streaming: bool,
        tenant: str,
        tier: int,
        session: int,
        due: float,
        deadline: float,
        send: Send,
        done: _Outcome,
        replica: str | None = None,
    ) -> None:
        if self.scheduler is None:
            raise SchedulerClosed("the gateway is not running")
        dispatcher = self.scheduler.dispatcher
        in_flight = self.metrics.in_flight
        in_flight[tenant] = in_flight.get(tenant, 0) + 1
        try:
            # A session's deadline bounds its calls under way too (the scheduler ends the session
            # then; a call runs in the request's task): past it, a 408, or an error event.
            if endpoint == "chat" and not streaming:
                received = Received()
                try:
                    with anyio.CancelScope(deadline=deadline) as budget:
                        response = await dispatcher.chat(
                            body, tenant=tenant, tier=tier, session=session, due=due, deadline=deadline, replica=replica, received=received
                        )
                finally:  # cut short (the deadline, the client gone) too: what the engine made counts
                    done.sent = received.sent
                    done.prompt_tokens, done.completion_tokens = received.prompt_tokens, received.output_tokens
                _check_budget(budget)
                done.note(response)
                done.status = await _send(send, 200, _dumps(response))
                return
            async with AsyncExitStack() as stack:
                with anyio.CancelScope(deadline=deadline) as budget:  # the wait for a place included
                    stream = dispatcher.stream(
                        body, tenant=tenant, tier=tier, session=session, due=due, deadline=deadline, replica=replica
                    )
                    chunks = await stack.enter_async_context(stream)
                    done.sent = True
                    if not streaming:
                        collected = []
                        async for chunk in chunks:  # noted as they come: a call cut short is charged them
                            done.note(chunk)
                            collected.append(chunk)
                    else:  # the first chunk before the headers: a failure up to here is still an HTTP error
                        first = await anext(chunks, None)
                _check_budget(budget)
                if not streaming:
                    response = collect_completion(collected)
                    done.note(response)
                    done.status = await _send(send, 200, _dumps(response))
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                done.started, done.status = True, 200
                options = body.get("stream_options") or {}
                usage = UsageShape(bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))
                try:
                    with anyio.CancelScope(deadline=deadline) as budget:
                        chunk = first
                        while chunk is not None:
                            done.note(chunk)  # the tokens are counted whatever the client sees of them
                            shown = usage(chunk)
                            if shown is not None:
                                await send({"type": "http.response.body", "body": b"data: " + _dumps(shown) + b"\n\n", "more_body": True})
                            try:
                                chunk = await anext(chunks, None)
                            except Exception:
                                done.read_failed = True  # the backend broke off (a cut is a cancellation, no Exception)
                                raise
                    _check_budget(budget)
                    last = usage.end()
                    tail = (b"" if last is None else b"data: " + _dumps(last) + b"\n\n") + b"data: [DONE]\n\n"
                except Exception as exc:  # mid-stream: the error travels as an event, the stream ends
                    if isinstance(exc, DeadlineExceeded):  # the session's own limit, no failure
                        done.cut_mid_stream = True
                    else:
                        logger.warning("stream %s of tenant %r failed: %r", body.get(REQUEST_ID_KEY), tenant, exc)
                        done.failed_mid_stream = True
                    error = json.loads(_answer_for(exc).content)
                    tail = b"data: " + _dumps(error) + b"\n\ndata: [DONE]\n\n"  # [DONE] after it, as vLLM ends one
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            in_flight[tenant] -= 1

    async def _settle(self, tenant: str, prompt: int, max_tokens: int, done: _Outcome, status: int) -> Taken | None:
        """After a call answered `status`: refund the tokens it did not use to the tenant's
        tokens per minute (whatever its outcome: a call refused or failed gets its prompt back
        too; one whose prompt the engine counted longer than the estimate `prompt` is charged
        the difference), and share the service the engine gave
        (with Redis: the other instances' fair share counts it). Returns the tenant's buckets
        after it (None: nothing given back, or the shared state did not answer).

        What the engine counted is charged whatever the status: a call cut short by its deadline
        (408) or its client made tokens. A call whose client left before it was sent (queued in
        the dispatcher, its session waiting for admission) used nothing: all goes back."""
        if done.prompt_tokens or done.completion_tokens:
            used_prompt = done.prompt_tokens
        elif status >= 400 or not done.sent:
            used_prompt = 0
        else:  # sent, and cut before any count came: the engine may have read the prompt
            used_prompt = prompt
        unused = prompt + max_tokens - used_prompt - done.completion_tokens
        # A call refused as invalid (a session that can never run, a field the engine refuses)
        # gets its request back too, as one refused for its X-Session-ID never takes it: else
        # a tenant's bad field locked it out for up to a minute. Refusals for load or time (429,
        # 503, 408) keep theirs: they were made, and retried at once they would hammer. So
        # does a call whose client left before it was sent: nothing was made of it.
        invalid = status in _REFUSED_AS_INVALID or (status == 0 and not done.sent)
        # The service the engine counted is shared whatever the status: a call cut short by its
        # deadline or its client (408, 499) left the other instances unaware of it. Counted in
        # memory: the fair-share sync writes it for them, off the answer's path (written here, it
        # held every answer's end for REDIS_TIMEOUT_S while Redis hung, tenants without limits'
        # too, which need nothing of Redis).
        cost = done.prompt_tokens * INPUT_WEIGHT + done.completion_tokens * OUTPUT_WEIGHT
        if cost:
            self.state.count_usage(tenant, cost)
        # Shielded (a client that leaves must not lose the refund) but bounded: a Redis that
        # stops answering held the end of every answer.
        after = None
        with anyio.CancelScope(shield=True), anyio.move_on_after(SETTLE_TIMEOUT_S) as settling:
            try:
                after = await self.state.refund(tenant, unused, request=invalid)
            except Exception as exc:
                logger.warning("could not settle a call of tenant %r in the shared state: %s: %s", tenant, type(exc).__name__, exc)
        if settling.cancelled_caught:
            logger.warning("could not settle a call of tenant %r in the shared state: no answer in %g s", tenant, SETTLE_TIMEOUT_S)
        return after


#: The status a call is counted under in the metrics when its client left before its answer's
#: end (nginx's "client closed request"): such calls went uncounted, or counted as served.
CLIENT_CLOSED_REQUEST = 499

#: Seconds a call's settling (its refund, in Redis, for a tenant with rate limits) may take before
#: it is given up (and logged): the answer's end waits for it.
SETTLE_TIMEOUT_S = 2.0

#: The statuses of a call refused as invalid: it used none of the tenant's requests per minute.
_REFUSED_AS_INVALID = frozenset({400, 404, 413, 422})


class _Outcome:
    __slots__ = ("status", "sent", "started", "failed_mid_stream", "cut_mid_stream", "read_failed", "client_left", "answered", "prompt_tokens", "completion_tokens")

    def __init__(self) -> None:
        self.status = 0
        #: The call left the dispatcher's queue for the backend.
        self.sent = False
        self.started = False
        #: The stream failed after its 200 was sent: it ended in an error event.
        self.failed_mid_stream = False
        #: ... because a read of its answer failed (the backend broke off: a replica's error),
        #: as the call's record says (its error names the failure). A failed call is no call made
        #: in its session's counters (`_count`), as `SessionContext.stream` counts.
        self.read_failed = False
        #: The stream's session's deadline cut it after its 200 was sent (an error event with
        #: code 408): no failure, as the call's record says cancelled.
        self.cut_mid_stream = False
        #: The client went away (or took nothing for `send_timeout_s`); its answer was `answered`
        #: in full or not.
        self.client_left = False
        self.answered = False
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def note(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or 0
            self.completion_tokens = usage.get("completion_tokens") or 0


def _over_limits(tenant: str, taken: Taken, tokens: int) -> str:
    """A 429's message: which of the tenant's per-minute limits keeps the call out, as the take
    read its buckets (it named every limit the tenant has, joined by "or")."""
    return f"tenant {tenant!r} is over its {shortfall_text(taken.requests, taken.tokens, tokens) or 'rate limits'}"


def _count(handle: SessionHandle, done: _Outcome) -> None:
    """Count a call made in its session's counters."""
    handle.counters.calls += 1
    handle.counters.prompt_tokens += done.prompt_tokens
    handle.counters.completion_tokens += done.completion_tokens


def _check_budget(budget: anyio.CancelScope) -> None:
    if budget.cancelled_caught:
        raise DeadlineExceeded("the session passed its deadline during this call")


def _invalid(message: str, param: str | None, *, code: str = "invalid_request_error") -> httpx.Response:
    return error_response(400, message, "invalid_request_error", code=code, param=param)


#: A replica's address in an error's message ("vLLM replica r0 (http://10.0.0.5:8000)").
_REPLICA_ADDRESS = re.compile(r"(vLLM replica \S+) \([a-z][a-z0-9+.-]*://[^)\s]*\)")


def _answer_for(exc: BaseException) -> httpx.Response:
    """The HTTP answer for an exception raised by a call. A tenant's client is told which
    replica failed by its name (``backend.urls`` maps names to addresses), not where the
    operator's servers are; the failures the gateway logs keep the address."""
    answer = _answer_with_addresses(exc)
    body = json.loads(answer.content)
    message = body.get("error", {}).get("message")
    if not isinstance(message, str) or "://" not in message:
        return answer
    body["error"]["message"] = _REPLICA_ADDRESS.sub(r"\1", message)
    headers = {name: answer.headers[name] for name in ("retry-after", "x-should-retry") if name in answer.headers}
    return httpx.Response(answer.status_code, json=body, headers=headers)


def _answer_with_addresses(exc: BaseException) -> httpx.Response:
    cause = exc.__cause__
    status = getattr(cause, "status_code", None)
    refused = isinstance(exc, BackendError) and not isinstance(exc, InvalidRequest)  # those: 400 below
    if refused and isinstance(status, int) and 400 <= status < 500 and status != 429:
        return error_response(status, str(exc), "invalid_request_error")  # the engine refused the call
    if isinstance(exc, SessionRejected):
        return error_response(400, str(exc), "invalid_request_error")
    if isinstance(exc, SchedulerClosed):
        return error_response(503, str(exc), "unavailable", retry_after_s=1)
    if isinstance(exc, StateUnavailable):
        return error_response(503, f"{exc}; retry shortly", "state_unavailable", retry_after_s=1)
    answer = response_for(exc)
    if answer is None:
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
    if answer.status_code == 500:  # a backend failure is a bad gateway, not ours
        return error_response(502, str(exc), "backend_error")
    return answer


async def _send(send: Send, status: int, payload: bytes, *, content_type: bytes = b"application/json", headers: list[tuple[bytes, bytes]] | None = None) -> int:
    out = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
    if headers:
        out += headers
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": payload})
    return status


async def _error(send: Send, response: httpx.Response) -> int:
    extra = [(name.encode(), response.headers[name].encode()) for name in ("retry-after", "x-should-retry") if name in response.headers]
    return await _send(send, response.status_code, response.content, headers=extra or None)


async def _read_body(receive: Receive, limit: int) -> bytes | httpx.Response | None:
    """The whole request body; an error answer when over `limit`; None when the client left."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return error_response(413, f"the request body is over {limit} bytes (gateway.max_body_bytes)", "invalid_request_error")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts) if len(parts) != 1 else parts[0]


def ratelimit_headers(taken: Taken) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for the tenant's buckets after a take: each limit per
    minute, what is left of it (whole requests and tokens, never below 0) and when it is full
    again ("1m30s", "250ms"). Empty for a tenant without limits."""
    headers = []
    for kind, level in (("requests", taken.requests), ("tokens", taken.tokens)):
        if level is not None:
            headers += [
                (b"x-ratelimit-limit-" + kind.encode(), f"{level.limit:.15g}".encode()),
                (b"x-ratelimit-remaining-" + kind.encode(), f"{max(0, math.floor(level.left))}".encode()),
                (b"x-ratelimit-reset-" + kind.encode(), duration_text(level.reset_s).encode()),
            ]
    return headers


def duration_text(seconds: float) -> str:
    """`seconds` as OpenAI writes a reset time (Go's duration format): "0s", "250ms", "6s",
    "1.5s", "1m30s", "1h0m0s"."""
    ms = math.ceil(seconds * 1000 - 1e-6)  # never early: a client that waits this is served
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def _with_headers(send: Send, headers: list[tuple[bytes, bytes]] | Callable[[], list[tuple[bytes, bytes]]]) -> Send:
    """`send`, adding `headers` to the response's start (whatever answer it turns out to be);
    a callable gives them as they are when the start goes out."""
    if not headers:
        return send

    async def with_headers(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            extra = headers() if callable(headers) else headers
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return with_headers


def _settling_first(send: Send, settle: Callable[[int], Awaitable[None]]) -> Send:
    """`send`, settling the call (`settle`, with the status answered) before the last bytes of
    its answer go out: a client that makes its next call as soon as it has this answer finds
    the tokens and the request this one gave back (it was refused with 429 for the request
    that a refusal had not yet given back). An error answer (sent whole) is settled before its
    start, so that its x-ratelimit-* headers count what it gave back: a 404 read
    remaining-requests 0 while its request was given back, and a client pacing itself by them
    waited for nothing."""
    status = 0
    held: MutableMapping[str, Any] | None = None

    async def settling_first(message: MutableMapping[str, Any]) -> None:
        nonlocal status, held
        if message["type"] == "http.response.start":
            status = message["status"]
            if status >= 400:
                held = message
                return
        elif message["type"] == "http.response.body":
            if not message.get("more_body"):
                await settle(status)
            if held is not None:
                start, held = held, None
                await send(start)
        await send(message)

    return settling_first


def _bounded(send: Send, timeout_s: float, gone: anyio.CancelScope, tenant: str, request_id: str, done: _Outcome) -> Send:
    """`send`, each message taken by the client within `timeout_s`, else the call is cancelled
    (`gone`) as if the client had left (`GatewaySettings.send_timeout_s`)."""

    async def bounded(message: MutableMapping[str, Any]) -> None:
        with anyio.move_on_after(timeout_s) as writing:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.answered = True
        if writing.cancelled_caught:
            logger.warning("a client of tenant %r took nothing of call %s for %g s: the call is ended", tenant, request_id, timeout_s)
            done.client_left = True
            gone.cancel()
            await anyio.sleep(0)  # the cancellation, here

    return bounded


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope, done: _Outcome) -> None:
    """Cancel the call when the client goes away (ASGI says so with ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            done.client_left = True
            scope.cancel()
            return
