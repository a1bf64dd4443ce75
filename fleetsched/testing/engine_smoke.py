"""Smoke check of the in-process vLLM backend, run with a python that has vLLM and fleetsched:

    .venv-vllm/bin/python -m fleetsched.testing.engine_smoke .cache/tiny-model

Starts `VLLMEngineBackend` (checking that the event loop runs meanwhile), streams one call
(priority passed), checks the chunks and usage (on every chunk when asked for), reads the
engine's signals under a load larger than its batch, leaves a call early and checks that
nothing is left in flight, then that a prompt over the context, or max_tokens past it, is
refused with `ContextTooLong` (a call naming no max_tokens, or more than the prompt leaves,
fills the context's rest), and one with bad sampling parameters (of the wrong type or out of
range) with `InvalidRequest`, the engine serving calls after them; that logit biases, banned
words, allowed tokens and structured outputs shape the answer, and the chat template's options,
echo, truncation and the answer's text options reach the engine; tools without a forced
choice, a model it does not serve and stream_options that are no object are refused, a text
completion's prompt is tokenised as it is, the answer is named after the call's request ID, and
calls past the engine's queue limit are `Overloaded`. Then: messages parsed as vLLM's server
parses them, the model's sampling defaults applied, closing with a call in flight (no error
logged, the engine freed), closing while the engine is being built, and an engine kept to the
interpreter's exit by a call's exception (nothing fails at the exit). Prints one JSON line;
exits 1 on failure. It is a script rather than a test because vLLM is not installed in the main
virtualenv.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import sys
import weakref
from contextlib import aclosing

import anyio

from fleetsched.backends.base import REQUEST_ID_KEY, TEXT_PROMPT_KEY, collect_chat, collect_stream
from fleetsched.backends.vllm_engine import VLLMEngineBackend
from fleetsched.errors import BackendUnavailable, ContextTooLong, InvalidRequest, Overloaded, UnknownModel

#: The engine's queue limit (vLLM's --max-num-queued-reqs): calls past it are turned away.
QUEUE_LIMIT = 16


async def check(model_dir: str) -> dict:
    # The model's sampling defaults, as a generation_config.json would set them: greedy.
    backend = VLLMEngineBackend(
        model_dir, served_model_name="fleetsched-tiny", max_num_seqs=4, max_num_batched_tokens=1024,
        max_model_len=1024, dtype="float32",
        engine_options={"override_generation_config": {"temperature": 0.0}, "max_num_queued_reqs": QUEUE_LIMIT},
    )  # fmt: skip
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.1)
            ticks += 1

    async with anyio.create_task_group() as ticking:
        ticking.start_soon(tick)
        began = anyio.current_time()
        await backend.start()
        started_s = anyio.current_time() - began
        ticking.cancel_scope.cancel()
    # The engine is built off the event loop: other tasks ran meanwhile (they stood still for
    # the whole start, tens of seconds).
    assert ticks >= started_s / 0.1 / 2, (ticks, started_s)
    async with backend:
        # 1 GiB of cache (VLLM_CPU_KVCACHE_SPACE) at 2,048 bytes a token of the tiny float32 model.
        cache = (await backend.kv_capacities())["engine"]
        assert cache.tokens * 2048 == 1 << 30 and cache.block_size == 128, cache
        request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "ignore_eos": True}
        chunks = [c async for c in backend.stream_chat({**request, "priority": -1})]
        folded = collect_chat(chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", chunks[0]
        # The first chunk comes with the engine's first output (a step away at least): the role
        # was sent before the request reached the engine, and every call's TTFT read about 0.
        sent = anyio.current_time()
        _, first = await collect_stream(backend.stream_chat(request))
        assert first is not None and first - sent >= 0.001, first - sent
        # A stream_interval (the dispatcher's per tier) reaches the engine: the first token at
        # once, then every 4 (it was dropped: a chunk a token).
        coarse = [c async for c in backend.stream_chat({**request, "stream_interval": 4}) if c["choices"]]
        assert len(coarse) <= 5, len(coarse)
        assert chunks[-1]["usage"]["completion_tokens"] == 12, chunks[-1]
        assert folded["choices"][0]["finish_reason"] == "length", folded
        # Usage on every chunk when asked for (as the dispatcher does): the count so far.
        options = {"include_usage": True, "continuous_usage_stats": True}
        counts = [c["usage"]["completion_tokens"] async for c in backend.stream_chat({**request, "stream_options": options}) if c.get("usage")]
        assert len(counts) > 2 and counts == sorted(counts) and counts[-1] == 12, counts
        # The engine's own signals, as its stat loggers record them (the adaptive window reads
        # them): 8 calls on a batch of 4 leave some waiting. Only the calls in flight were known.
        seen: list[tuple[int | None, int | None, float | None]] = []
        loaded = anyio.Event()

        async def load() -> None:
            async with anyio.create_task_group() as calls:
                for _ in range(8):
                    calls.start_soon(read_to_end, backend, {**request, "max_tokens": 64})
            loaded.set()

        async with anyio.create_task_group() as watching:
            watching.start_soon(load)
            while not loaded.is_set():
                signals = await backend.signals()
                seen.append((signals.running, signals.waiting, signals.kv_cache_usage))
                await anyio.sleep(0.01)
        assert max(w or 0 for _, w, _ in seen) >= 1 and max(r or 0 for r, _, _ in seen) <= 4, seen
        assert max(k or 0 for _, _, k in seen) > 0, seen
        signals = await backend.signals()
        assert signals.prefix_cache_queries_total and signals.preemptions_total is not None, signals
        async with aclosing(backend.stream_chat({**request, "max_tokens": 900})) as stream:
            async for _ in stream:
                break
        assert (await backend.signals()).running == 0
        # Refusals are the same errors as on the other backends.
        try:
            long_prompt = [{"role": "user", "content": "hi " * 3000}]  # over max_model_len (1,024)
            _ = [c async for c in backend.stream_chat({**request, "messages": long_prompt})]
        except ContextTooLong:
            pass
        else:
            raise AssertionError("a prompt over max_model_len was not refused with ContextTooLong")
        try:  # a short prompt asking for more than the context holds: refused, as vLLM's server does
            _ = [c async for c in backend.stream_chat({**request, "max_tokens": 2000})]
        except ContextTooLong as exc:
            assert "max_tokens=2000 cannot be greater than" in str(exc), exc
        else:
            raise AssertionError("max_tokens past max_model_len was not refused with ContextTooLong")
        # A max_tokens past what the prompt leaves: cut to the rest of the context, as the server does.
        cut = {"messages": [{"role": "user", "content": "hi " * 480}], "max_tokens": 1000, "ignore_eos": True}
        tail = [c async for c in backend.stream_chat(cut)][-1]["usage"]
        assert tail["prompt_tokens"] + tail["completion_tokens"] == 1024, tail
        # No max_tokens, a prompt near the context: served, the answer filling the rest of it.
        near = {"messages": [{"role": "user", "content": "hi " * 480}], "ignore_eos": True}
        tail = [c async for c in backend.stream_chat(near)][-1]["usage"]
        assert tail["prompt_tokens"] + tail["completion_tokens"] == 1024, tail
        try:
            _ = [c async for c in backend.stream_chat({**request, "temperature": "hot"})]
        except InvalidRequest as exc:
            assert not isinstance(exc, ContextTooLong), exc
        else:
            raise AssertionError("bad sampling parameters were not refused with InvalidRequest")
        # Values of the wrong type or out of range are refused naming the field, and the engine
        # serves the next call: a float seed once killed the engine core's input thread (every
        # later call hung), a seed past 64 bits was vLLM's EngineGenerateError, a number for stop
        # a TypeError, a negative temperature vLLM's own VLLMValidationError; max_tokens 0 was
        # taken for none named (the answer filled the context), n=2 gave one choice silently.
        # A priority of 2.7 was taken as 2, and 2**70 failed in the engine's client (EngineGenerateError).
        bad = (
            ("max_tokens", 0), ("n", 2), ("seed", 1.5), ("seed", 2**70), ("top_k", 2.5), ("stop", 5), ("stop_token_ids", [1.5]),
            ("temperature", -1), ("priority", 2.7), ("priority", 2**70), ("stream_interval", 0), ("logprobs", True),
        )  # fmt: skip
        for field, value in bad:
            try:
                with anyio.fail_after(30):
                    _ = [c async for c in backend.stream_chat({**request, field: value})]
            except InvalidRequest as exc:
                assert field in str(exc), exc
            else:
                raise AssertionError(f"{field}={value!r} was not refused with InvalidRequest")
        # Values vLLM's server reads as their fields' types (pydantic's lax mode) are taken, and
        # reach the engine as those types: a float seed there killed the engine core's thread.
        lax = {"priority": "5", "seed": "5", "top_k": 2.0, "temperature": "0.5", "min_tokens": "1", "stop_token_ids": [1.0], "ignore_eos": "yes"}
        with anyio.fail_after(30):
            taken = [c async for c in backend.stream_chat({**request, **lax})][-1]["usage"]
        assert taken["completion_tokens"] == 12, taken
        # A tool call forced: refused (this backend parses none), where it came back as text.
        tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
        try:
            _ = [c async for c in backend.stream_chat({**request, "tools": tools, "tool_choice": "required"})]
        except InvalidRequest as exc:
            assert "tool_choice" in str(exc), exc
        else:
            raise AssertionError("a forced tool call was not refused")
        await check_constraints(backend, request, model_dir)
        await check_chat_fields(backend, request, model_dir)
        await check_server_alike(backend, request, model_dir)
        with anyio.fail_after(30):
            after = [c async for c in backend.stream_chat(request)][-1]["usage"]
        assert after["completion_tokens"] == 12, after
        # The messages go through vLLM's parser before the template, as on its server: a bare
        # string among content parts counts (the template alone dropped it).
        parts = {**request, "messages": [{"role": "user", "content": ["hi", {"type": "text", "text": " there"}]}]}
        plain = {**request, "messages": [{"role": "user", "content": "hi there"}]}
        counted = [[c async for c in backend.stream_chat(b)][-1]["usage"]["prompt_tokens"] for b in (parts, plain)]
        assert counted[0] == counted[1], counted
        # The model's defaults fill what a call leaves out (greedy here: two answers the same),
        # as on vLLM's server; a call's own temperature still wins.
        greedy = [collect_chat([c async for c in backend.stream_chat(request)])["choices"][0]["message"]["content"] for _ in range(2)]
        assert greedy[0] == greedy[1], greedy
        hot = {**request, "temperature": 1.0}
        sampled = {collect_chat([c async for c in backend.stream_chat(hot)])["choices"][0]["message"]["content"] for _ in range(3)}
        assert len(sampled) > 1, sampled
        # Closing with a call in flight fails the call (it waited for good), and the closed
        # backend refuses the next call rather than starting a new engine.
        failure: list[BaseException] = []
        streaming = anyio.Event()

        async def long_call() -> None:
            try:
                async for _ in backend.stream_chat({**request, "max_tokens": 900}):
                    streaming.set()
            except BackendUnavailable as exc:
                failure.append(exc)

        # A clean close logs no error, and frees the engine: its output handler logged the
        # engine's death as an ERROR with a traceback, and the engine lived on until its __del__
        # failed at the interpreter's exit ("'NoneType' object is not callable").
        engine = weakref.ref(backend._engine)
        errors = _Records(logging.ERROR)
        logging.getLogger("vllm").addHandler(errors)
        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as calls:
                    calls.start_soon(long_call)
                    await streaming.wait()
                    await backend.aclose()
        finally:
            logging.getLogger("vllm").removeHandler(errors)
        assert failure and "closed" in str(failure[0]), failure
        assert not errors.records, [record.getMessage() for record in errors.records]
        failure.clear()  # (the call's exception keeps its frames, the engine's among them)
        gc.collect()
        assert engine() is None, "the engine outlived the backend's aclose"
        try:
            _ = [c async for c in backend.stream_chat(request)]
        except BackendUnavailable as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("a closed backend served a call")
    loaded_signals = {"max_waiting": max(w or 0 for _, w, _ in seen), "max_kv_cache_usage": max(k or 0 for _, _, k in seen)}
    await check_close_while_starting(model_dir)
    await keep_an_error_to_exit(model_dir)
    return {"ok": True, "engine_start_s": round(started_s, 1), "start_ticks": ticks, "signals": loaded_signals, "usage": folded["usage"]}


async def check_server_alike(backend: VLLMEngineBackend, request: dict, model_dir: str) -> None:
    """What vLLM's server refuses is refused here too, a text completion is the text's tokens,
    the answer is named as the server names it, and calls past the queue limit are overloaded."""
    from transformers import AutoTokenizer

    async def refused(extra: dict, error: type[Exception], field: str) -> None:
        try:
            with anyio.fail_after(60):
                _ = [c async for c in backend.stream_chat({**request, **extra})]
        except error as exc:
            assert field in str(exc), (extra, exc)
        else:
            raise AssertionError(f"{extra} was not refused")

    # Tools with "auto" (or no choice: "auto"): the call came back as text in the answer, which
    # an agent took for its final answer.
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    await refused({"tools": tools}, InvalidRequest, "tool_choice")
    await refused({"tools": tools, "tool_choice": "auto"}, InvalidRequest, "tool_choice")
    _ = [c async for c in backend.stream_chat({**request, "tools": tools, "tool_choice": "none"})]
    await refused({"model": "gpt-4o"}, UnknownModel, "gpt-4o")  # it was served, the answer named gpt-4o
    await refused({"stream_options": "yes"}, InvalidRequest, "stream_options")
    # A text completion (the gateway's /v1/completions) is its text's tokens, as vLLM's
    # /v1/completions counts them: through the chat template it was 17 tokens, not 4.
    text = "The quick brown fox"
    expected = len(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])
    completion = {**request, "messages": [{"role": "user", "content": text}], TEXT_PROMPT_KEY: True}
    chunks = [c async for c in backend.stream_chat(completion)]
    assert chunks[-1]["usage"]["prompt_tokens"] == expected, (chunks[-1]["usage"], expected)
    # Named after the call's request ID (the gateway's X-Request-Id), as the server and the sim
    # name it: it was fs-engine-N, created 0.
    chunks = [c async for c in backend.stream_chat({**request, REQUEST_ID_KEY: "abc123"})]
    assert {c["id"] for c in chunks} == {"chatcmpl-abc123"} and chunks[0]["created"] > 1_700_000_000, chunks[0]
    # Two calls sent with one request ID are two requests at the engine: leaving one does not
    # abort the other (they were one, which the first's abort ended).
    same = {**request, "max_tokens": 200, REQUEST_ID_KEY: "twice"}
    whole: list[dict] = []

    async def read_whole() -> None:
        whole.extend([c async for c in backend.stream_chat(same)])

    with anyio.fail_after(120):
        async with anyio.create_task_group() as pair:
            pair.start_soon(read_whole)
            async with aclosing(backend.stream_chat(same)) as stream:
                async for _ in stream:
                    break
    assert whole[-1]["usage"]["completion_tokens"] == 200, whole[-1]
    # Past the engine's queue limit: Overloaded with a wait (vLLM's QueueOverflowError escaped raw).
    outcomes: list[str] = []

    async def one() -> None:
        try:
            await read_to_end(backend, {**request, "max_tokens": 64})
            outcomes.append("served")
        except Overloaded as exc:
            assert exc.retry_after_s > 0, exc
            outcomes.append("overloaded")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as calls:
            for _ in range(3 * QUEUE_LIMIT):
                calls.start_soon(one)
    assert "overloaded" in outcomes and "served" in outcomes, outcomes


async def check_close_while_starting(model_dir: str) -> None:
    """Closed while its engine is being built: `aclose` returns once the engine is shut down (it
    returned at once, and the engine ran on for half a minute beside whatever came next), and the
    start fails with `BackendUnavailable`."""
    backend = VLLMEngineBackend(model_dir, max_num_seqs=2, max_num_batched_tokens=1024, max_model_len=1024, dtype="float32")
    start_failed = anyio.Event()

    async def start() -> None:
        try:
            await backend.start()
        except BackendUnavailable:
            start_failed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        await anyio.sleep(1.0)  # the engine is being built in its thread
        with anyio.fail_after(120):
            await backend.aclose()
        assert start_failed.is_set(), "aclose returned while the engine was still being built"


#: A call's exception, kept until the interpreter's exit (as a caller's error log may keep it).
KEPT: list[BaseException] = []


async def keep_an_error_to_exit(model_dir: str) -> None:
    """A call's exception kept past `aclose` keeps the engine (its traceback holds vLLM's
    frames), to the interpreter's exit: the engine's ``__del__`` shut it down again there, and
    failed ("Exception ignored in: <function AsyncLLM.__del__>", a TypeError on stderr). The
    test that runs this script reads its stderr."""
    backend = VLLMEngineBackend(model_dir, max_num_seqs=2, max_num_batched_tokens=1024, max_model_len=1024, dtype="float32")
    async with backend:
        try:
            await read_to_end(backend, {"messages": [{"role": "user", "content": "hi " * 3000}]})
        except ContextTooLong as exc:
            KEPT.append(exc)
        await backend.aclose()
    assert KEPT, "a prompt over max_model_len was not refused with ContextTooLong"


async def check_constraints(backend: VLLMEngineBackend, request: dict, model_dir: str) -> None:
    """Biases, banned words, allowed tokens and structured outputs shape the answer, as on vLLM's
    server (they were checked, then dropped: the answers came out as if none were asked), with
    the lax values the server's request model reads ("100" a number, "yes" true); an ID out of
    the vocabulary is refused naming its field."""
    from transformers import AutoTokenizer

    a, b, x = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(["a", "b", "x"])

    async def answer(extra: dict) -> str:
        with anyio.fail_after(60):
            chunks = [c async for c in backend.stream_chat({**request, **extra})]
        return collect_chat(chunks)["choices"][0]["message"]["content"]

    assert await answer({"logit_bias": {str(x): "100"}}) == "x" * 12
    allowed = await answer({"allowed_token_ids": [a, b]})
    assert len(allowed) == 12 and set(allowed) <= {"a", "b"}, allowed
    assert "x" not in await answer({"logit_bias": {str(x): 100}, "bad_words": ["x"]})
    free = {key: value for key, value in request.items() if key != "ignore_eos"} | {"max_tokens": 64}
    assert await answer({**free, "structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    colours = {"type": "string", "enum": ["red", "blue"]}
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": colours, "strict": "yes"}}}
    assert json.loads(await answer({**free, **schema})) in ("red", "blue")
    code = await answer({**free, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", code), code
    for field, value in (("allowed_token_ids", [5000]), ("logit_bias", {"5000": 1})):
        try:
            await answer({field: value})
        except InvalidRequest as exc:
            assert field in str(exc), exc
        else:
            raise AssertionError(f"{field}={value!r} (out of the vocabulary) was not refused")


async def check_chat_fields(backend: VLLMEngineBackend, request: dict, model_dir: str) -> None:
    """The fields that shape the prompt and the answer's text reach vLLM as its server passes
    them (each was dropped: the prompt and the answer came out as if none were sent): the
    template's options, a prefix continued and echoed, the prompt cut, a stop string kept,
    special tokens shown, a repetition ended; what vLLM's server refuses, or this backend does
    not do, is refused naming the field."""
    from transformers import AutoTokenizer

    x, header = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids(["x", "<|start_header|>"])

    async def answer(extra: dict) -> list[dict]:
        with anyio.fail_after(60):
            return [c async for c in backend.stream_chat({**request, **extra})]

    def text(chunks: list[dict]) -> str:
        return collect_chat(chunks)["choices"][0]["message"]["content"]

    xs = {"logit_bias": {str(x): 100}, "stop": "xxx"}
    assert text(await answer(xs)) == "" and text(await answer({**xs, "include_stop_str_in_output": "yes"})) == "xxx"
    special = {"logit_bias": {str(header): 100}, "max_tokens": 2}
    assert text(await answer(special)) == "" and "<|start_header|>" in text(await answer({**special, "skip_special_tokens": False}))
    # A prefix to continue: with no generation prompt the template ends with the assistant's
    # message closed; continued, it ends open (one token less), and echo puts it first (vLLM's
    # own stream fails there: this template reads content parts, which its echo cannot send).
    prefix = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]}
    forms = ({}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True})
    counted = [(await answer({**prefix, **form}))[-1]["usage"]["prompt_tokens"] for form in forms]
    assert counted[0] > counted[1] == counted[2] + 1, counted
    echoed = await answer({**prefix, **forms[2], "echo": True})
    assert echoed[0]["choices"][0]["delta"]["role"] == "assistant" and text(echoed).startswith("The answer is"), echoed[0]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    forms = ({}, {"chat_template_kwargs": {"tools": tools}}, {"truncate_prompt_tokens": 3}, {"truncate_prompt_tokens": "3"})
    plain, with_tools, cut, cut_as_text = [(await answer(form))[-1]["usage"]["prompt_tokens"] for form in forms]
    assert with_tools > plain > cut == cut_as_text == 3, (plain, with_tools, cut, cut_as_text)  # "3" is 3, as the server reads it
    # The rest reach the engine as the server passes them, and the call is served.
    rest = {"cache_salt": "tenant-a", "vllm_xargs": {"k": 1}, "documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"}
    served = await answer({**rest, "watermarking": False, "spaces_between_special_tokens": False, "add_special_tokens": True})
    assert served[-1]["usage"]["completion_tokens"] == 12, served[-1]
    # Answers of one token repeated end once the repeat is seen, not at max_tokens.
    repeated = await answer({"logit_bias": {str(x): 100}, "repetition_detection": {"max_pattern_size": "2", "min_count": 3.0}})  # read laxly
    assert repeated[-1]["usage"]["completion_tokens"] < 12, repeated[-1]
    refused = (
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true unless set false
        ({"echo": "maybe"}, "echo"), ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"), ({"use_beam_search": True}, "use_beam_search"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),  # served by an engine started with a reasoning parser
    )  # fmt: skip
    for extra, field in refused:
        try:
            await answer(extra)
        except InvalidRequest as exc:
            assert field in str(exc), (extra, exc)
        else:
            raise AssertionError(f"{extra} was not refused")


class _Records(logging.Handler):
    """The log records of `level` and above, kept."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def read_to_end(backend: VLLMEngineBackend, body: dict) -> None:
    _ = [c async for c in backend.stream_chat(body)]


def main() -> int:
    try:
        result = anyio.run(check, sys.argv[1])
    except Exception as exc:  # report, don't traceback: the caller reads one JSON line
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports __main__
    sys.exit(main())
