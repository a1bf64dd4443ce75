"""``fleetsched calibrate --url URL --out profile.toml``: fit a sim profile to a real vLLM server.

Sweeps closed loops (N clients sending requests back to back, ``ignore_eos`` so every request
generates exactly ``max_tokens``) over concurrency and prompt / answer lengths, measures output
throughput and time to first token, and fits the step costs of `SimSettings` by non-negative
least squares on relative errors of throughput and TTFT p50 (`fleetsched.backends.sim._fit`),
with the API server's share as three more costs: each request's turn in it (one at a time), its
time outside the engine besides, and how much later it reaches the engine for each request the
engine is running. Each point is the median of `--repeats` passes over the sweep. Prints the
fit's error per point and writes the profile as TOML (load it with
``backend.sim.profile = "profile.toml"``).

The engine's shape (max_num_seqs, token budget, block size, KV cache) is not measured: pass the
server's values (the defaults are vLLM's CPU server defaults with a 1 GiB cache for the tiny model).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from pydantic import ValidationError

from ._args import http_url, positive_float, positive_int, writable_file
from .backends.sim._engine import SimEngine, check_request_fits
from .backends.sim._fit import PARAMS, Fit, Measurement, Workload, fit_profile
from .backends.sim._profiles import dump_profile
from .backends.vllm_server import first_listed_model
from .settings import SimSettings, first_error

_FILLER = " ".join(f"{w}{i % 97}" for i, w in enumerate("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split() * 8)) + " "
_ids = itertools.count()


#: How long a measuring client keeps an idle connection to a vLLM server. The server closes one
#: idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), as long as httpx keeps one by default: a
#: request sent on a connection the server is closing fails with ``httpx.ReadError`` (a sweep
#: failed so at c=48 after a few seconds at c=1-16).
KEEPALIVE_EXPIRY_S = 2.0


def client_limits(connections: int) -> httpx.Limits:
    """Connection limits for a measuring client of a vLLM server (`KEEPALIVE_EXPIRY_S`)."""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


#: Tokens per streamed chunk the sweep asks for (vLLM's per-request ``stream_interval``; the first
#: token still comes at once). Coarse chunks keep the API server's and this client's per-token work
#: (detokenising, SSE, parsing) from setting the pace: the profile models the engine. On this
#: project's 2-core machine, with every token streamed, identical runs' TTFT p50 ranged from 32 to
#: 57 ms.
STREAM_INTERVAL = 16


#: Seconds a measuring client waits for the server's next bytes (connecting, the first chunk of
#: an answer, the next one) before it gives up. A server that takes the connection and then never
#: answers would otherwise hold the sweep without a word; a busy CPU server at concurrency 128
#: sends the next chunk within seconds.
READ_TIMEOUT_S = 60.0


#: Characters of `prompt_of` text that one prompt token may span at most. Its words are 6 to 9
#: characters ("alpha12 "), which any tokenizer splits into one token at least; a server that
#: counts fewer tokens than this allows is not counting the prompt (0 from a server that is not
#: vLLM), and rescaling the prompt by its count would grow it without bound.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class Sample:
    """One closed loop measured on the server."""

    concurrency: int
    prompt_tokens: int
    """Mean prompt tokens the server counted (chat template included)."""
    max_tokens: int
    rounds: int
    throughput: float
    ttft_mean_s: float
    ttft_p50_s: float

    def measurement(self) -> Measurement:
        workload = Workload(self.concurrency, self.prompt_tokens, self.max_tokens, self.rounds)
        return Measurement(workload, self.throughput, self.ttft_mean_s, self.ttft_p50_s)


def prompt_of(chars: int) -> str:
    """A unique prompt of `chars` characters (unique first, so no prefix cache hits)."""
    head = f"request {next(_ids)}: "
    return (head + _FILLER * (chars // len(_FILLER) + 1))[:chars]


async def one_request(
    client: httpx.AsyncClient, model: str, content: str, max_tokens: int, stream_interval: int = STREAM_INTERVAL
) -> tuple[float, int, int]:
    """Stream one completion; (time to first token, prompt tokens, completion tokens).

    The completions endpoint, not chat: the prompt is counted as sent, whatever the chat template
    does with it (the tiny test model's template drops list-form content, which vLLM may pass it).
    Raises RuntimeError with the server's message when it refuses the request.
    """
    body = {
        "model": model,
        "prompt": content,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if stream_interval > 1:
        body["stream_interval"] = stream_interval
    start = anyio.current_time()
    ttft = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 401:
            raise RuntimeError(_unauthorized(client, "POST /v1/completions"))
        if response.is_error:
            await response.aread()
            raise RuntimeError(
                f"the server refused a {len(content)}-character prompt with {max_tokens} max_tokens "
                f"(HTTP {response.status_code}): {_excerpt(response.text)}"
            )
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            has_text, chunk_usage = _read_chunk(line[6:])
            if ttft is None and has_text:
                ttft = anyio.current_time() - start
            usage = chunk_usage or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"the server answered no tokens or no usage for a {max_tokens}-token request")
    prompt_tokens, completion_tokens = usage
    return ttft, prompt_tokens, completion_tokens


def _read_chunk(data: str) -> tuple[bool, tuple[int, int] | None]:
    """A streamed completion chunk: whether it carries text, and its usage's (prompt tokens,
    completion tokens) when it has one.

    Raises RuntimeError quoting the chunk when it is not JSON of OpenAI's shape: a server that
    is not vLLM may stream anything, and a KeyError from deep in the sweep says nothing of it.
    """
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RuntimeError(f"the server streamed a line that is not JSON: {_excerpt(data)}") from None
    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
        # vLLM reports a failure mid-stream so (its engine died, say), then [DONE]: it was told
        # "the server answered no tokens or no usage", and vLLM's own message was lost.
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise RuntimeError(f"the server streamed an error: {_excerpt(str(message))}")
    not_openai = f"the server streamed a chunk that is not an OpenAI completion chunk: {_excerpt(data)}"
    try:
        has_text = any(choice.get("text") for choice in chunk.get("choices") or [])
        usage = chunk.get("usage")
        counts = (usage["prompt_tokens"], usage["completion_tokens"]) if usage else None
    except (AttributeError, TypeError, KeyError):  # a list or a string where OpenAI has an object, a key missing
        raise RuntimeError(not_openai) from None
    if counts is not None and not all(type(n) is int and n >= 0 for n in counts):  # "5", 2.5, -1, true
        raise RuntimeError(not_openai)
    return has_text, counts


def _excerpt(text: str) -> str:
    """The start of a server's answer, on one line."""
    return " ".join(text[:300].split())


def _unauthorized(client: httpx.AsyncClient, request: str) -> str:
    """What a 401 to `request` means: a key wanted, or the key given refused (it said "wants an
    API key (give --api-key" to a user who gave one, and "refused a prompt" with --model)."""
    if "authorization" in client.headers:
        return f"{request} answered 401 Unauthorized: the server refused the API key given (--api-key, or VLLM_API_KEY)"
    return f"{request} answered 401 Unauthorized: the server wants an API key (give --api-key, or set VLLM_API_KEY)"


async def _listed(client: httpx.AsyncClient) -> httpx.Response:
    """GET /v1/models, its whole answer within the read timeout: the client's timeout bounds each
    read alone, and a server (or a proxy in front of it) that sent its list a byte a second held
    calibrate before its first request, without a word, for as long as it lasted."""
    timeout_s = client.timeout.read
    try:
        with anyio.fail_after(timeout_s):
            return await client.get("/v1/models")
    except TimeoutError:
        raise RuntimeError(f"GET /v1/models did not answer whole within {timeout_s:g} s (is it stuck? --read-timeout waits longer)") from None


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model the server lists (GET /v1/models); RuntimeError when it lists none."""
    response = await _listed(client)
    if response.status_code == 401:
        raise RuntimeError(_unauthorized(client, "GET /v1/models"))
    try:
        return first_listed_model(response)
    except (httpx.HTTPStatusError, ValueError):  # not JSON, or not OpenAI's shape
        raise RuntimeError(
            f"GET /v1/models answered {response.status_code} with no model ({_excerpt(response.text)}): "
            "is this a vLLM server? (give --model to skip the question)"
        ) from None


async def server_max_model_len(client: httpx.AsyncClient, model: str) -> int | None:
    """The context length the server lists for `model` (vLLM's ``max_model_len`` in GET
    /v1/models), or None when it lists none."""
    try:
        listed = (await _listed(client)).json()["data"]
        lengths = [entry.get("max_model_len") for entry in listed if entry.get("id") == model]
    except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError):
        return None
    return lengths[0] if lengths and type(lengths[0]) is int and lengths[0] > 0 else None


async def prompt_chars(client: httpx.AsyncClient, model: str, tokens: int) -> int:
    """Characters of `prompt_of` text that the server counts as about `tokens` prompt tokens.

    The tokenizer is unknown, so probe (max_tokens 1) and rescale. The first probe has one
    character a token: no tokenizer makes more tokens than characters of this ASCII text, so it
    cannot pass the model's context length when `tokens` does not. Raises RuntimeError when the
    server counts fewer tokens than any tokenizer would (`MAX_CHARS_PER_TOKEN`).
    """
    chars = tokens
    for _ in range(4):
        _, counted, _ = await one_request(client, model, prompt_of(chars), 1)
        if counted * MAX_CHARS_PER_TOKEN < chars:  # rescaling by it would send gigabytes
            raise RuntimeError(
                f"the server counted {counted} prompt tokens for a {chars}-character prompt "
                f"(a token is {MAX_CHARS_PER_TOKEN} characters at most): is it vLLM?"
            )
        if abs(counted - tokens) <= max(2, tokens // 50):
            break
        chars = max(8, round(chars * tokens / max(1, counted)))
    return chars


async def measure(
    client: httpx.AsyncClient,
    model: str,
    concurrency: int,
    prompt_chars: int,
    max_tokens: int,
    rounds: int,
    stream_interval: int = STREAM_INTERVAL,
    lengths: list[list[int]] | None = None,
) -> Sample:
    """One closed loop of `concurrency` clients, `rounds` requests each, each of `max_tokens`
    unless `lengths` gives each client's answer lengths (`Workload.answer_lengths`)."""
    ttfts: list[float] = []
    prompts: list[int] = []
    completion = 0

    async def worker(answers: list[int]) -> None:
        nonlocal completion
        for answer in answers:
            ttft, prompt, tokens = await one_request(client, model, prompt_of(prompt_chars), answer, stream_interval)
            ttfts.append(ttft)
            prompts.append(prompt)
            completion += tokens

    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for answers in lengths or [[max_tokens] * rounds] * concurrency:
            tg.start_soon(worker, answers)
    elapsed = anyio.current_time() - start
    return Sample(
        concurrency,
        round(statistics.mean(prompts)),
        max_tokens,
        rounds,
        completion / elapsed,
        statistics.mean(ttfts),
        statistics.median(ttfts),
    )


async def sweep(
    url: str,
    model: str | None,
    concurrencies: list[int],
    shapes: list[tuple[int, int]],
    rounds: int,
    echo: Any = print,
    stream_interval: int = STREAM_INTERVAL,
    repeats: int = 1,
    after_pass: Callable[[], Awaitable[object]] | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    api_key: str | None = None,
) -> list[Sample]:
    """Measure every (concurrency, shape) point; shapes are (prompt tokens, max_tokens).

    With `repeats` > 1 the whole sweep runs that many times and each point is the median of its
    runs: on a shared machine the same point's TTFT p50 moves by a third from one sweep to the
    next, and passes spread over minutes average out the slow drifts that one pass would take
    for the workload's shape. `after_pass` is awaited after each pass: a caller measuring
    something else on the same server runs it between the passes, so both see the machine alike.
    A server silent for `read_timeout_s` (`READ_TIMEOUT_S`) ends the sweep with httpx's
    TimeoutException.
    """
    limits = client_limits(max(concurrencies) + 8)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None  # a server started with --api-key
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(read_timeout_s), limits=limits, headers=headers) as client:
        if model is None:
            model = await served_model(client)
        limit = await server_max_model_len(client, model)
        for prompt, max_tokens in shapes:  # the server refuses such a prompt, or cuts its answer
            if limit is not None and prompt + max_tokens > limit:
                raise RuntimeError(
                    f"--shapes {prompt}:{max_tokens}: {prompt} prompt + {max_tokens} completion tokens exceed the server's "
                    f"max_model_len of {limit} (give --shapes that fit it, and --max-model-len {limit})"
                )
        # Warm up (first requests pay for compilation and caches).
        await measure(client, model, 4, 200, 8, 1)
        points = list(itertools.product(shapes, concurrencies))
        chars = {prompt: await prompt_chars(client, model, prompt) for prompt, _ in shapes}
        runs: list[list[Sample]] = [[] for _ in points]
        for repeat in range(repeats):
            if repeats > 1:
                echo(f" pass {repeat + 1} of {repeats}")
            for ((prompt, max_tokens), concurrency), point_runs in zip(points, runs):
                sample = await measure(client, model, concurrency, chars[prompt], max_tokens, rounds, stream_interval)
                echo(
                    f"  c={concurrency:4d} prompt={sample.prompt_tokens:5d} max_tokens={max_tokens:4d}: "
                    f"{sample.throughput:8.0f} tok/s, TTFT p50 {sample.ttft_p50_s * 1e3:7.1f} ms"
                )
                point_runs.append(sample)
            if after_pass is not None:
                await after_pass()
        return [_median_sample(point_runs) for point_runs in runs]


def _median_sample(runs: list[Sample]) -> Sample:
    """One point's runs as one sample: the median of each figure."""
    first = runs[0]
    return Sample(
        first.concurrency,
        round(statistics.mean(s.prompt_tokens for s in runs)),
        first.max_tokens,
        first.rounds,
        statistics.median(s.throughput for s in runs),
        statistics.median(s.ttft_mean_s for s in runs),
        statistics.median(s.ttft_p50_s for s in runs),
    )


def fit_table(fit: Fit) -> list[str]:
    lines = [f"{'conc':>5} {'prompt':>6} {'max_tok':>7} {'tok/s meas':>10} {'sim':>8} {'err':>6} {'TTFT p50 meas':>13} {'sim':>8} {'err':>6}"]
    for p in fit.points:
        w = p.workload
        ttft = p.ttft_p50_rel_err
        lines.append(
            f"{w.concurrency:5d} {w.prompt_tokens:6d} {w.max_tokens:7d} {p.measured_throughput:10.0f} {p.predicted_throughput:8.0f} "
            f"{p.throughput_rel_err:6.1%} {(p.measured_ttft_p50_s or 0) * 1e3:11.1f}ms {p.predicted_ttft_p50_s * 1e3:6.1f}ms "
            + (f"{ttft:6.1%}" if ttft is not None else "     -")
        )
    return lines


def profile_document(base: SimSettings, samples: list[Sample], fit: Fit, url: str, description: str, repeats: int = 1) -> str:
    sim = {k: v for k, v in base.model_dump().items() if k in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size", "max_model_len")}
    sim.update({name: float(f"{value:.4g}") for name, value in zip(PARAMS, fit.theta)})
    info = {
        "description": description,
        "source": f"fleetsched calibrate --url {url}: closed loops, ignore_eos, unique prompts",
        "assumptions": "Step cost t = a + b*tokens + c*context + d*sequences; per request, f in the API server one "
        "request at a time (parsing, tokenising), then e outside the engine (the hand-off, the way back), and g more for each "
        "request the engine runs as it is sent; fitted by non-negative least squares on relative errors of throughput and TTFT p50, each point the median of "
        f"{repeats} passes. Engine shape given on the command line, not measured.",
    }
    ttft_err = fit.max_ttft_rel_err
    record = {
        "concurrency": [s.concurrency for s in samples],
        "prompt_tokens": [s.prompt_tokens for s in samples],
        "max_tokens": [s.max_tokens for s in samples],
        "measured_tok_s": [round(s.throughput, 1) for s in samples],
        "measured_ttft_p50_s": [round(s.ttft_p50_s, 5) for s in samples],
        "sim_tok_s": [round(p.predicted_throughput, 1) for p in fit.points],
        "sim_ttft_p50_s": [round(p.predicted_ttft_p50_s, 5) for p in fit.points],
        "max_throughput_rel_err": round(fit.max_throughput_rel_err, 4),
        "max_ttft_p50_rel_err": round(ttft_err, 4) if ttft_err is not None else -1.0,
    }
    return dump_profile(info, sim, record)


def _ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, one at least."""
    values = [positive_int(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected integers >= 1, comma-separated (e.g. 1,4,16)")
    return values


def _shapes(text: str) -> list[tuple[int, int]]:
    """Comma-separated PROMPT:MAX_TOKENS pairs of integers >= 1, one at least."""
    try:
        shapes = [(positive_int(p), positive_int(m)) for p, m in (item.split(":") for item in text.split(",") if item.strip())]
    except ValueError:  # not a pair
        shapes = []
    if not shapes:
        raise argparse.ArgumentTypeError("expected PROMPT:MAX_TOKENS pairs of integers >= 1, comma-separated (e.g. 64:128,384:32)")
    return shapes


def _url(text: str) -> str:
    """A server root, http://host:port or https://host:port, checked as the benches check theirs
    (`http_url`): a port past 65535 passes httpx and fails only at the connect, an OverflowError.
    A trailing / and /v1 are taken off, as the vllm-server backend takes them off its URLs: the
    OpenAI base URL (http://host:port/v1) asked for /v1/v1/models, a 404."""
    try:
        httpx.URL(text)  # first: its reason (an invalid IPv6 address) says more than urlsplit's ValueError
    except httpx.InvalidURL as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {exc}") from None
    return http_url(text).rstrip("/").removesuffix("/v1")


def _out_file(text: str) -> str:
    """A file to write the profile to (`writable_file`), not a path ending in a slash: that names
    a directory, and the profile would be written to a file of the directory's name."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text!r} ends in a slash: it names a directory, not a file")
    # `--profile` and `backend.sim.profile` read a name as a file only when it ends in .toml (else
    # it names a shipped profile): a profile written to "gpu" or "p.TOML" then failed to load
    # with "no sim profile ...: give a TOML file".
    if Path(text).suffix != ".toml":
        raise argparse.ArgumentTypeError(f"{text!r} does not end in .toml: simulate loads a profile file only by that name")
    return writable_file(text)


def _server_error(exc: BaseException, read_timeout_s: float = READ_TIMEOUT_S) -> str | None:
    """One line on what the server did to end a sweep (refused, failed, went silent, went
    away), else None.

    Exception groups are opened: each client of a closed loop fails alike when the server dies.
    """
    leaves = [exc]
    while any(isinstance(e, BaseExceptionGroup) for e in leaves):
        leaves = [leaf for e in leaves for leaf in (e.exceptions if isinstance(e, BaseExceptionGroup) else (e,))]
    if not all(isinstance(e, (httpx.HTTPError, RuntimeError)) for e in leaves):
        return None
    first = leaves[0]
    if isinstance(first, httpx.TimeoutException):
        return f"{type(first).__name__}: the server sent nothing for {read_timeout_s:g} s (is it stuck? --read-timeout waits longer)"
    if isinstance(first, httpx.HTTPError):  # httpx.ReadError says nothing of itself
        return f"{type(first).__name__}: {first}" if str(first) else f"{type(first).__name__} (the server closed the connection: did it stop?)"
    return str(first)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetsched calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, type=_url, help="the vLLM server's root URL (a trailing /v1 is taken off)")
    parser.add_argument("--out", required=True, type=_out_file, metavar="PROFILE.toml")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument(
        "--api-key", default=os.environ.get("VLLM_API_KEY"), help="the key of a server started with --api-key (default: $VLLM_API_KEY, as vLLM reads it)"
    )
    parser.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64, 128], help="clients, comma-separated")
    parser.add_argument("--shapes", type=_shapes, default=[(64, 128), (384, 32), (160, 96)], help="PROMPT:MAX_TOKENS pairs")
    parser.add_argument("--rounds", type=positive_int, default=4, help="requests per client per point")
    parser.add_argument("--repeats", type=positive_int, default=3, help="passes over the whole sweep; each point is the median of its passes")
    parser.add_argument(
        "--stream-interval", type=positive_int, default=STREAM_INTERVAL, help="tokens per streamed chunk (the first comes at once); 1 streams every token"
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--block-size", type=positive_int, default=128)
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=524288)
    parser.add_argument("--max-model-len", type=positive_int, default=1024)
    parser.add_argument("--description", default="a vLLM server measured by fleetsched calibrate")
    parser.add_argument(
        "--read-timeout", type=positive_float, default=READ_TIMEOUT_S, metavar="SECONDS", help="give up on a server silent this long"
    )
    args = parser.parse_args(argv)

    try:
        base = SimSettings(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens,
            max_model_len=args.max_model_len,
        )
    except ValidationError as exc:
        key, message = first_error(exc)
        # Each option sets the field of its name; an error of no field is one between fields.
        parser.error(f"--{key.replace('_', '-')} {getattr(args, key)}: {message}" if key else f"the engine shape: {message}")
    try:
        SimEngine(base)  # the fit builds this engine for every point: after the sweep is too late
    except (MemoryError, OverflowError):  # OverflowError: more blocks than a list can have
        blocks = args.kv_cache_tokens // args.block_size
        parser.error(f"--kv-cache-tokens {args.kv_cache_tokens}: the simulated engine cannot hold its {blocks:,} blocks in memory")
    for prompt, max_tokens in args.shapes:  # the fit runs them on this engine: after the sweep is too late
        try:
            check_request_fits(base, prompt, max_tokens, whole=True)
        except ValueError as exc:
            parser.error(f"--shapes {prompt}:{max_tokens}: {exc} (give the server's --max-model-len and --kv-cache-tokens)")
    print(f"sweeping {args.url}: concurrency {args.concurrency}, (prompt, max_tokens) {args.shapes}")
    try:
        samples = anyio.run(
            functools.partial(sweep, read_timeout_s=args.read_timeout, api_key=args.api_key),
            args.url, args.model, args.concurrency, args.shapes, args.rounds, print, args.stream_interval, args.repeats,
        )
    except Exception as exc:  # the sweep's clients run in task groups: their errors come grouped
        error = _server_error(exc, args.read_timeout)
        if error is None:
            raise
        print(f"fleetsched calibrate: {args.url}: {error}", file=sys.stderr)
        return 1
    try:
        fit = fit_profile(base, [s.measurement() for s in samples])
    except ValueError as exc:  # no profile fits, or one whose steps take no time (the sim would refuse it)
        print(f"fleetsched calibrate: {args.url}: {exc}; no profile written", file=sys.stderr)
        return 1
    print("fit: " + ", ".join(f"{n} = {v:.4g}" for n, v in zip(PARAMS, fit.theta)))
    print("\n".join(fit_table(fit)))
    ttft = fit.max_ttft_rel_err
    print(f"max relative error: throughput {fit.max_throughput_rel_err:.1%}, TTFT p50 {ttft:.1%}" if ttft is not None else "")
    document = profile_document(base, samples, fit, args.url, args.description, args.repeats)
    try:
        Path(args.out).write_text(document)
    except OSError as exc:  # checked before the sweep, yet a disk fills or a directory goes
        print(document)  # the sweep's measurements are not lost
        print(f"fleetsched calibrate: cannot write {args.out}: {exc}; the profile is printed above", file=sys.stderr)
        return 1
    print(f"profile written to {args.out}")
    return 0
