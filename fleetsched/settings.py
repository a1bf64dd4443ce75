"""Settings: one root object, read from a TOML file and ``FLEETSCHED_...`` environment variables.

Precedence, highest first: keyword arguments, environment (``FLEETSCHED_SCHEDULER__MAX_SESSIONS=8``,
``__`` for nesting), the TOML file (``fleetsched.toml`` in the working directory, or the path given
to `load_settings`). Constructors take the section they need (``settings.scheduler``); nothing else
in the library reads the environment.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from contextvars import ContextVar
from pathlib import Path
from types import UnionType
from typing import Annotated, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError, TomlConfigSettingsSource

from ._args import url_problem
from .errors import ConfigError
from .policies.fair_queue import MAX_WEIGHT, MIN_WEIGHT
from .policies.tiers import Tier

_config_path: ContextVar[Path | None] = ContextVar("fleetsched_config_path", default=None)


def _no_bool(value: object) -> object:
    # pydantic reads true as 1 byte and false as 0: a flag where a size belongs is a mistake.
    if isinstance(value, bool):
        raise ValueError(f"must be a size in bytes (a number, or a string such as '4GB'), got {str(value).lower()}")
    return value


def _no_flag(value: object) -> object:
    # pydantic reads true as 1 and false as 0: a flag where a number belongs is a mistake.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


#: An integer inside a table (the sections' own fields are checked in `_Section`): as any count,
#: also from an environment variable's text ("64"), never from a flag.
Count = Annotated[int, BeforeValidator(_no_flag)]


def _positive(value: ByteSize) -> ByteSize:
    if value <= 0:
        raise ValueError("must be > 0 bytes")
    return value


#: A size in bytes > 0: a number, or a string with a unit ("4GB", "512MiB").
Bytes = Annotated[ByteSize, BeforeValidator(_no_bool), AfterValidator(_positive)]


def _takes_a_number(annotation: object) -> bool:
    """Whether a field of this annotation takes an int or a float (or None besides), not a bool."""
    return annotation in (int, float, int | None, float | None)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_flag_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        # pydantic reads true as 1 and false as 0: `max_num_seqs = true` ran a sim of one
        # sequence at a time, without a word.
        if info.field_name is not None and _takes_a_number(cls.model_fields[info.field_name].annotation):
            return _no_flag(value)
        return value


class SlaSettings(_Section):
    """A tenant's service-level objectives. None: no objective."""

    ttft_p99_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Time to first token, 99th percentile. Orders the tenant's calls (earliest deadline first)
    and decides when batch-tier calls are shed."""
    latency_p95_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Whole call latency, 95th percentile."""
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Default deadline of a session, from submission."""
    min_tokens_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Generated tokens per second the tenant should get while backlogged."""


class TenantSettings(_Section):
    """One tenant: who pays, whose SLA applies."""

    tier: Tier = Tier.STANDARD
    """QoS band: critical, standard or batch."""
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False)
    """Share against other tenants of the same tier (1e-6 to 1e6)."""
    max_sessions: int | None = Field(None, ge=1)
    """Sessions of this tenant running at once (None: only the global limit)."""
    memory_quota: Bytes | None = None
    """Bytes this tenant's sessions may hold at once (None: no quota)."""
    session_memory: Bytes | None = None
    """Memory a session of this tenant reserves, unless submit() says (None: the scheduler's)."""
    requests_per_minute: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Model calls per minute (token bucket, burst of one minute); None: unlimited."""
    tokens_per_minute: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Prompt plus max_tokens per minute, charged at call time, output not received refunded
    (a failed call's too, and its prompt where the call failed with nothing made)."""
    sla: SlaSettings = Field(default_factory=SlaSettings)
    api_keys: list[str] = Field(default_factory=list)
    """The gateway's API keys of this tenant, stored hashed: ``sha256:<64 hex digits>`` (make one
    with ``fleetsched serve --hash-key KEY``). The key decides tenant, tier and SLA."""

    @field_validator("api_keys")
    @classmethod
    def _hashed_keys(cls, value: list[str]) -> list[str]:
        return _check_key_hashes(value)

    @field_validator("tier", mode="before")
    @classmethod
    def _parse_tier(cls, value: object) -> Tier:
        return Tier.parse(value)  # type: ignore[arg-type]


def _check_key_hashes(value: list[str]) -> list[str]:
    for i, key in enumerate(value):
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", key):
            raise ValueError(f"{i}: API keys are stored hashed as sha256:<64 lowercase hex digits>, not in clear")
    return value


class GatewaySettings(_Section):
    """`fleetsched serve`: the OpenAI-compatible HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    redis_url: str | None = None
    """Share tenant state (rate limits, fair-share counters, session placement) between gateway
    instances through this Redis (``redis://host:port/db``); None keeps it in memory."""
    redis_prefix: str = "fleetsched"
    """The start of every key the gateway writes in Redis: deployments that share one Redis
    database keep their buckets, counters and sessions apart by their prefixes."""
    admin_api_keys: list[str] = Field(default_factory=list)
    """Hashed keys (``sha256:<hex>``) that see every tenant's metrics."""
    session_idle_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    """A session named by ``X-Session-ID`` ends after this long without a call."""
    max_context_tokens: int | None = Field(None, ge=1)
    """The backend's context (max model length) in tokens: a request whose prompt fills it, or
    whose max_tokens exceeds it, is refused before it is queued, as vLLM refuses it (a longer
    max_tokens than the prompt leaves is cut by the engine). A vLLM backend's prompts are left to
    the engine, which counts them with its tokenizer (the gateway's estimate is 4 characters a
    token). None: taken from the backend
    settings where they say it, else unchecked."""
    max_body_bytes: int = Field(4 << 20, ge=1)
    """Largest request body accepted (413 above)."""
    send_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """Longest a client may leave the next bytes of its answer untaken. A client that stops
    reading a stream holds its call's place in the dispatcher's window for as long as its
    connection stays open, and every tenant's calls wait behind such places: past this, the call
    ends as if the client had left."""

    @field_validator("admin_api_keys")
    @classmethod
    def _hashed_keys(cls, value: list[str]) -> list[str]:
        return _check_key_hashes(value)

    @field_validator("redis_prefix")
    @classmethod
    def _key_prefix(cls, value: str) -> str:
        # No ":": it ends the prefix in every key ("blue" and "blue:session" shared keys).
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", value):
            raise ValueError("1 to 64 letters, digits and _ . - (the start of the gateway's Redis keys)")
        return value


class SchedulerSettings(_Section):
    max_sessions: int = Field(256, ge=1)
    """Sessions running at once, all tenants together."""
    aging_s: float = Field(60.0, gt=0)
    """A queued session is promoted one tier band for every this many seconds it waits (inf:
    never)."""
    drain_grace_s: float = Field(30.0, ge=0)
    """On leaving the scheduler, running sessions get this long to finish before cancellation
    (inf: as long as they take)."""
    session_memory: Bytes = ByteSize(1 << 30)
    """Memory a session reserves when neither submit() nor its tenant says (with
    ``[resources.kv_cache]``, the KV bytes of its ``context_tokens`` instead: not set then)."""
    tool_policy: Literal["keep", "release", "adaptive"] = "adaptive"
    """While a session is in a tool: keep its slot and memory, release them to waiting sessions,
    or decide per call from the tool's learned durations and the admission pressure."""
    tool_keep_s: float = Field(2.0, ge=0)
    """Adaptive: under pressure, tools expected to last at most this long keep slot and memory
    (inf: every tool with a history of its own)."""
    learn_session_ends: bool = True
    """Tell the memory pool when each session is expected to give its memory back (its placement
    hint), from how long the sessions of its `kind` held theirs (to their end, or to parking in a
    tool), when submit() gives no `expected_s`: memory expected back together is placed side
    by side."""


class DispatchSettings(_Section):
    """How model calls are let through to the backend."""

    min_share: dict[str, float] = Field(default_factory=lambda: {"standard": 0.1, "batch": 0.05})
    """Least share of the engine's service (tokens) a backlogged lower tier gets, by tier name."""
    adaptive_window: bool = True
    """Size the in-flight window from the engine's signals (starts at backend.max_in_flight,
    held to min_window..max_window)."""
    min_window: int = Field(4, ge=1)
    """Adaptive: the window never shrinks below this."""
    max_window: int = Field(512, ge=1)
    """Adaptive: the window never grows above this (the engine's max_num_seqs, say)."""
    window_interval_s: float = Field(0.5, ge=0.001, allow_inf_nan=False)
    """Adaptive: seconds between the window's adjustments (at least a millisecond)."""
    waiting_target: int = Field(2, ge=0)
    """Calls waiting inside the engine tolerated before the window shrinks."""
    critical_reserve: int = Field(0, ge=0)
    """Places of the in-flight window only critical-tier calls may take (lower tiers use at most
    window - reserve, and at least 1). With max_window at the engine's max_num_seqs, a critical call
    then finds a free slot in the engine's running batch at once instead of waiting for a call to
    end: vLLM never preempts a running request for a waiting one. Costs lower tiers that many
    places of the batch, unless the engine's max_num_seqs is raised by as many."""
    stream_interval: dict[str, Count] = Field(default_factory=dict)
    """Tokens per streamed chunk asked of vLLM per tier (its per-request ``stream_interval``; the
    first token always comes at once), e.g. ``{batch = 64}``: lower tiers streamed coarser leave
    the API server and this process more time for the calls whose every token is awaited."""

    @field_validator("stream_interval")
    @classmethod
    def _intervals(cls, value: dict[str, int]) -> dict[str, int]:
        _tiers_once(value)
        for tier, tokens in value.items():
            if tokens < 1:
                raise ValueError(f"stream interval of {tier!r} must be >= 1, got {tokens}")
        return value
    shed_batch: bool = True
    """Refuse batch-tier calls with Overloaded when their predicted wait exceeds the tenant's TTFT SLA."""

    @field_validator("min_share")
    @classmethod
    def _shares(cls, value: dict[str, float]) -> dict[str, float]:
        _tiers_once(value)
        for tier, share in value.items():
            if not 0 <= share < 1:
                raise ValueError(f"share of {tier!r} must be in [0, 1), got {share}")
        if sum(value.values()) >= 1:
            raise ValueError("shares must add up to less than 1")
        return value

    @model_validator(mode="after")
    def _window_bounds(self) -> DispatchSettings:
        if self.min_window > self.max_window:
            raise ValueError(f"min_window ({self.min_window}) is above max_window ({self.max_window})")
        return self


def _tiers_once(value: dict[str, object]) -> None:
    """Each key a tier's name, and no tier named twice (in two spellings: the last would win)."""
    seen: dict[Tier, str] = {}
    for name in value:
        tier = Tier.parse(name)
        if tier in seen:
            raise ValueError(f"tier {tier} is named twice ({seen[tier]!r} and {name!r})")
        seen[tier] = name


class DeviceSettings(_Section):
    name: str
    memory: Bytes
    """Memory this device offers to sessions (a GPU's, or a vLLM replica's KV cache)."""


class KVCacheSettings(_Section):
    """Size the memory pool from the backend's KV caches: when the scheduler starts, each vLLM
    replica's cache, read from its ``/metrics`` (backend kind "vllm-server"), the in-process
    engine's (kind "vllm-engine", one device ``engine``), or the sim engine's (kind "sim", one
    device ``sim``), becomes the pool's device of the replica's name (``r0``, ``r1``, ...: a
    session's calls go where its memory is); a page is one of its blocks; and a
    session reserves the KV bytes of `context_tokens` (``resources.kv_sizing.session_bytes``)
    unless its tenant or agent mix says otherwise. Admitted sessions then never hold more than
    the caches do, so vLLM does not preempt."""

    config: Path
    """The served model's ``config.json``, or the directory that holds it (for its KV bytes a
    token; a relative path is read from the working directory)."""
    context_tokens: int = Field(ge=1)
    """A session's context budget in tokens: its prompts and answers, every turn."""
    dtype: str | None = None
    """The KV cache's dtype when it is not what the config says (vLLM's ``--kv-cache-dtype``, e.g.
    "fp8", or its ``--dtype`` where that sets one): by default the FP8 cache a quantized checkpoint
    declares, else the model's dtype, 16 bits for one vLLM serves no model in (see
    `resources.kv_sizing.kv_bytes_per_token`)."""
    in_flight_tokens: int | None = Field(None, ge=1)
    """For sliding-window models: the server's ``max_num_batched_tokens`` times its batches in
    flight (None: a sliding layer is counted for the whole context, never less than it holds)."""

    @model_validator(mode="after")
    def _readable_model(self) -> KVCacheSettings:
        # Read now, so that a missing file or field is a config error at load, not at start.
        from .resources.kv_sizing import kv_bytes_per_token, layer_windows

        try:
            kv_bytes_per_token(self.config, dtype=self.dtype)
            layer_windows(self.config)
        except OSError as exc:  # the file it looked for: the directory's config.json
            raise ValueError(f"config: cannot read {exc.filename or self.config}: {exc.strerror or exc}") from None
        return self


class ResourceSettings(_Section):
    strategy: str = "frag-aware"
    """Placement strategy of the memory pool: frag-aware (default), first-fit, best-fit, buddy,
    size-class, or counting (byte counters only, no address space)."""
    page_size: Bytes = ByteSize(2 << 20)
    """Granule of the allocators' address space; reservations round up to whole pages."""
    devices: list[DeviceSettings] = Field(
        default_factory=lambda: [DeviceSettings(name="gpu0", memory=ByteSize(80 * 10**9))],
        validate_default=True,  # the default device must hold a page of page_size too
    )
    compact: bool = True
    """Move movable reservations (sessions idle or in a tool call) to keep memory in one piece:
    before refusing a request for fragmentation, open a hole for it; and as memory comes free or
    a session next to a hole goes idle, slide sessions across the hole towards the largest free
    run, or move an idle session at an edge of that run into the best-fitting hole (settling, at
    most 2 moves a call). Address-space strategies only. In the allocator bench settling took
    the mean fragmentation rate from 0.38 to 0.13, at 0.8-3.6 bytes copied per byte granted
    depending on the trace (0.2 with on-demand compaction alone)."""
    kv_cache: KVCacheSettings | None = None
    """Devices, page size and session memory from the backend's KV caches (see
    `KVCacheSettings`); `devices` and `page_size` are then refused, and so are the strategies that
    round sizes up beyond a page (buddy, size-class)."""
    compact_threshold: float | None = Field(None, ge=0.0, le=1.0)
    """Compact a device whenever its fragmentation rate, (free - largest free) / free, passes this
    after memory comes free (None: never). Moves only movable reservations. It works apart from
    `compact`: with ``compact = false`` the pool still compacts past it, and moves sessions no other
    way (no settling, no room opened for a request). Address-space strategies only. In the allocator bench
    (all traces, seed 0) 0.3 beside settling, which is on by default, gave 1 % more fragmentation
    failures (2,763 against 2,741) and moved 1.40 bytes per byte granted instead of 1.26 (with
    on-demand compaction alone, no settling: 3,562 failures, 0.19 bytes)."""

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        # Checked here so that a misspelt name is a config error at load, not a traceback from
        # create_pool once the run starts. Imported late: fleetsched.resources imports this module.
        from .resources.strategies import STRATEGIES

        if value != "counting" and value not in STRATEGIES:
            raise ValueError(f"unknown strategy {value!r}; known: {', '.join(['counting', *STRATEGIES])}")
        return value

    @model_validator(mode="after")
    def _kv_cache_alone(self) -> ResourceSettings:
        # Both were taken, and the devices and page size given left unused without a word.
        given = [key for key in ("devices", "page_size") if key in self.model_fields_set]
        if self.kv_cache is not None and given:
            raise ValueError(
                f"{given[0]} is not used with [resources.kv_cache], which takes the devices and the page size "
                "from the backend's KV caches; leave one of them out"
            )
        if self.kv_cache is not None and self.strategy in ("buddy", "size-class"):
            # Their rounding (a power of two; a class of the device's size) went on top of the
            # engine's blocks: 20 sessions admitted where the cache held 78.
            raise ValueError(
                f"strategy {self.strategy!r} rounds a session's blocks up beyond what the engine allocates; "
                "with [resources.kv_cache] use frag-aware, first-fit, best-fit or counting"
            )
        return self

    @model_validator(mode="after")
    def _threshold_needs_pages(self) -> ResourceSettings:
        if self.compact_threshold is not None and self.strategy == "counting":
            # Taken without a word: a counting pool has no address space, and never compacted.
            raise ValueError(
                "compact_threshold is not used with strategy 'counting', which keeps byte counts and no "
                "address space to compact; leave compact_threshold out or use an address-space strategy"
            )
        return self

    @field_validator("devices")
    @classmethod
    def _unique(cls, devices: list[DeviceSettings], info: ValidationInfo) -> list[DeviceSettings]:
        if not devices:
            raise ValueError("at least one device is needed")
        names = [d.name for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        # An address-space pool cuts each device into pages and cannot be built over a device
        # without one whole page (ExtentPool's ValueError once the scheduler starts). strategy and
        # page_size are declared above, so they are in info.data unless they were invalid.
        page = info.data.get("page_size")
        if info.data.get("strategy", "counting") != "counting" and page is not None:
            for device in devices:
                if device.memory < page:
                    raise ValueError(
                        f"device {device.name!r} ({int(device.memory):,} B) is smaller than one page "
                        f"(resources.page_size: {int(page):,} B)"
                    )
        return devices


#: The least time a simulated engine step of one token may take, in seconds (a microsecond).
MIN_STEP_S = 1e-6
#: The most KV blocks a simulated engine holds: each costs about 150 bytes, and the engine builds
#: them all when it starts (2**22 blocks: 0.4 s and 600 MB). A GPU's vLLM holds far fewer (an 8B
#: model on 141 GB: about 70,000 blocks of 16 tokens).
MAX_SIM_BLOCKS = 2**22


class SimSettings(_Section):
    """The embedded continuous-batching engine model (backend kind "sim").

    The defaults mimic the tiny CPU vLLM measured on this project's machines (vLLM 0.32 CPU build,
    OpenAI server defaults, 1 GiB KV cache): about 480 / 4,600 / 8,200 / 9,400 output tok/s at
    concurrency 1 / 16 / 64 / 128 with 128-token completions, against 500 / 4,300 / 8,600 / 8,900
    measured. A step costs t = a + b*tokens + c*context + d*sequences.
    """

    max_num_seqs: int = Field(128, ge=1)
    """Sequences in the running batch at most (vLLM's max_num_seqs; 128 is its CPU server default)."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Tokens scheduled in one engine step at most (prefill chunks plus one per decode); at least
    `max_num_seqs`, as vLLM requires."""
    kv_cache_tokens: int = Field(524288, ge=16)
    """KV cache capacity in tokens (1 GiB at 2 KiB a token: the tiny model, float32)."""
    block_size: int = Field(128, ge=1)
    """Tokens per KV block, the prefix cache's granularity (vLLM CPU: 128; on GPU it is 16)."""
    step_base_s: float = Field(0.002, ge=0, allow_inf_nan=False)
    """Fixed cost of one engine step (a)."""
    step_per_token_s: float = Field(0.000002, ge=0, allow_inf_nan=False)
    """Cost per token computed in the step (b); prefill chunks are cheap per token."""
    step_per_context_token_s: float = Field(0.00000002, ge=0, allow_inf_nan=False)
    """Cost per token of context attended in the step (c); `fleetsched calibrate` fits it."""
    step_per_seq_s: float = Field(0.000085, ge=0, allow_inf_nan=False)
    """Cost per sequence in the step, whatever its token count (d: sampling, bookkeeping)."""
    request_overhead_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Time a request spends outside the engine (e): the API server's parsing, tokenising and
    hand-off to the engine before it is scheduled, and its last answer's way back to the
    client. The sim delays each request's arrival at the engine by it, so it adds to the time to
    first token and to every request's turn-around, but costs the engine nothing."""
    request_serial_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Work the serving front end does for each request one at a time (f): vLLM's API server
    parses and tokenises on one event loop, so requests that come back together reach the engine
    this far apart, in arrival order. Before the overhead (e), which requests spend side by side.
    It spreads the closed loops' requests over the engine's steps, as on a real server, instead
    of every client's next request landing in the same step."""
    request_delay_per_running_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Time a request takes to reach the engine, beyond the overhead, for each request the
    engine is running as it is sent (g): a loaded server takes new requests in later than an idle
    one. On the real CPU vLLM (nine calibration sweeps, each beside a closed loop at
    concurrency 24 it did not see), profiles fitted without it put that loop's TTFT p50 3-31 %
    low (15 % on average), and with it 0.3-18 % off either way (7.9 % on average).
    `fleetsched calibrate` fits it; 0 leaves it out."""
    enable_prefix_caching: bool = True
    """Whether the engine reuses the KV blocks of a prompt prefix it has computed before (vLLM's
    --enable-prefix-caching / --no-enable-prefix-caching, on by default). Off, every prompt is
    computed in full, and the prefix cache counters stay at 0, as vLLM counts no lookups then."""
    policy: Literal["fcfs", "priority"] = "priority"
    """Waiting-queue order (vLLM's --scheduling-policy): "priority" honours the body's `priority`."""
    max_model_len: int = Field(8192, ge=1)
    """Prompt plus completion tokens of one request at most; longer requests are refused at once."""
    stream_interval: int = Field(1, ge=1)
    """Tokens per streamed chunk once the first is out (vLLM's stream_interval); higher is cheaper.
    `fleetsched simulate` raises it to 8 unless set: hours of a large fleet at 1 cost minutes."""
    profile: str | None = None
    """A calibrated profile whose values become this section's defaults: a shipped name
    ("tiny-cpu-vllm", "hermes3-70b-4xa100", "qwen2-7b-a100-40gb") or a path to a TOML file
    (a relative path is read from the working directory, not the config file's). Fields set
    beside it override the profile's."""

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data: object) -> object:
        # `is not None`, not truth: an empty name (`--profile "$PROFILE"` with the variable unset,
        # or `profile = ""`) ran the default engine without a word, its report naming profile "".
        if isinstance(data, dict) and data.get("profile") is not None:
            from .backends.sim._profiles import load_profile

            profile = load_profile(str(data["profile"]))
            try:  # a bad value of the file's own is named there, not as if the config had it
                cls.model_validate(profile.sim)
            except ValidationError as exc:
                for error in exc.errors():
                    if error["loc"]:  # one field's (checks across fields are the merged section's)
                        field = ".".join(map(str, error["loc"]))
                        raise ValueError(f"sim profile {profile.path}: {field}: {error['msg']} (got {error.get('input')!r:.80})") from None
            return {**profile.sim, **data}
        return data

    @model_validator(mode="after")
    def _engine_can_work(self) -> SimSettings:
        # The cache holds whole blocks only: none would hold no request (and the cache's usage
        # gauge divided by zero). A step that costs no time would never let virtual time pass:
        # a simulation with a duration ran forever.
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block of block_size ({self.block_size}) tokens"
            )
        blocks = self.kv_cache_tokens // self.block_size
        if blocks > MAX_SIM_BLOCKS:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) makes {blocks:,} blocks of block_size ({self.block_size}) tokens: "
                f"the sim holds {MAX_SIM_BLOCKS:,} at most (about 600 MB); lower it or raise block_size"
            )
        # vLLM refuses this at start-up (`SchedulerConfig.verify_max_model_len`); the sim ran it,
        # a step decoding only max_num_batched_tokens of its running requests and the rest waiting.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal to "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires: raise max_num_batched_tokens or lower max_num_seqs"
            )
        if not (self.step_base_s or self.step_per_token_s or self.step_per_seq_s):
            raise ValueError("step_base_s, step_per_token_s and step_per_seq_s are all 0: an engine step would take no time")
        # A step of 1e-300 s does not move a clock that reads seconds (now + 1e-300 == now).
        one_token = self.step_base_s + self.step_per_token_s + self.step_per_seq_s
        if one_token < MIN_STEP_S:
            raise ValueError(
                f"step_base_s + step_per_token_s + step_per_seq_s is {one_token:g} s: an engine step must take at least "
                f"{MIN_STEP_S:g} s, or virtual time cannot pass"
            )
        return self


class BackendSettings(_Section):
    kind: Literal["sim", "instant", "vllm-server", "vllm-engine"] = "sim"
    max_in_flight: int = Field(64, ge=1)
    """Calls at the engine at once (the dispatcher's window) to start with: with
    ``dispatch.adaptive_window`` (on by default) the window then moves between ``min_window``
    and ``max_window`` with the engine's signals."""
    model: str = "fleetsched-tiny"
    """The model name calls ask for. Left unset with kind "vllm-server", the one the servers
    list first (``GET /v1/models``: their ``--served-model-name``), asked at start."""
    sim: SimSettings = Field(default_factory=SimSettings)
    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"], min_length=1)
    """vLLM server replicas (kind "vllm-server"): root URLs, without the ``/v1`` suffix."""
    api_key: str = "EMPTY"
    """Bearer token sent to the vLLM servers (vLLM's ``--api-key``)."""
    retry_attempts: int = Field(4, ge=1)
    """Attempts per call before giving up, the first included; only connection errors, 429 and 5xx
    are retried, and only before the first chunk arrived."""
    retry_initial_s: float = Field(0.25, gt=0, allow_inf_nan=False)
    """First retry backoff; it doubles per attempt, with random jitter of the same size."""
    retry_max_s: float = Field(8.0, gt=0, allow_inf_nan=False)
    """Longest single retry backoff."""
    breaker_failures: int = Field(5, ge=1)
    """Consecutive failed calls (unreachable, or a 5xx but 503; not 429 or 503, busy) that open a
    replica's circuit breaker."""
    breaker_reset_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """How long an open breaker rejects calls before letting one probe call through. Finite:
    a breaker that never lets a probe through takes its replica out for good."""
    read_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Longest wait for a vLLM server's next bytes: its first chunk, then each one after. A replica
    that accepts the call and then says nothing (paused, hung) fails it as unreachable: it is
    retried and fails over before its first chunk, and ends the call after it."""
    engine_model_path: str | None = None
    """Model directory or name for kind "vllm-engine" (None: `model`)."""
    engine_max_num_seqs: int = Field(64, ge=1)
    """vllm-engine: sequences in the running batch at most."""
    engine_max_num_batched_tokens: int = Field(2048, ge=1)
    """vllm-engine: tokens scheduled in one engine step at most."""
    engine_max_model_len: int = Field(4096, ge=16)
    """vllm-engine: prompt plus completion tokens of one request at most."""
    engine_scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """vllm-engine: the scheduler's queue policy (priority honours the request's ``priority``)."""

    @field_validator("retry_max_s")
    @classmethod
    def _max_not_below_initial(cls, value: float, info: ValidationInfo) -> float:
        # A backoff is min(initial * 2**n, max) plus jitter of up to initial. Initial above max
        # contradicts itself: the first backoff is cut to max, and the jitter then dwarfs it
        # (initial 10, max 1: backoffs of 1 to 11 s).
        initial = info.data.get("retry_initial_s")
        if initial is not None and value < initial:
            raise ValueError(f"must be at least retry_initial_s ({initial}): it bounds every backoff")
        return value

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        servers: dict[tuple[object, ...], str] = {}
        for url in value:
            problem = url_problem(url)
            if problem is not None:
                raise ValueError(f"{url!r} {problem}")
            parts = urlsplit(url)
            # One server given twice would be two replicas, its engine signals summed twice. The
            # backend strips a trailing / and /v1; the host's case and a default port change nothing.
            port = parts.port or (443 if parts.scheme == "https" else 80)
            server = (parts.scheme, parts.hostname, port, parts.path.rstrip("/").removesuffix("/v1"))
            if server in servers:
                raise ValueError(f"{url!r} is the server of {servers[server]!r} again: give each replica once")
            servers[server] = url
        return value


#: The most sessions a workload's agent mixes may hold in all.
MAX_WORKLOAD_SESSIONS = 1_000_000


class AgentMix(_Section):
    """One kind of agent in a workload: how many, for which tenant, how it paces itself."""

    tenant: str
    kind: str | None = None
    """A name for this kind of agent in reports (default: tenant and index)."""
    count: int = Field(ge=1)
    """Sessions of this kind submitted over the run."""
    turns: int = Field(3, ge=1)
    """Model calls per session."""
    prompt_tokens: int = Field(256, ge=1, le=10_000_000)
    """Tokens of each session's first prompt (at most ten million: its text is made in memory, four
    characters a token)."""
    max_tokens: int = Field(64, ge=1)
    tool_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds spent in a tool between turns: the value ("fixed"), the mean ("exponential"), or
    the low end ("uniform", up to `tool_s_max`)."""
    tool_dist: Literal["fixed", "exponential", "uniform"] = "fixed"
    tool_s_max: float | None = Field(None, gt=0, allow_inf_nan=False)
    tool_name: str = "tool"
    """The tool's name, under which its durations are learned."""
    think_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds of agent-side work between turns."""
    session_memory: Bytes | None = None
    """Memory each session of this mix reserves (None: its tenant's, else the scheduler's)."""


    @model_validator(mode="after")
    def _uniform_needs_max(self) -> AgentMix:
        if self.tool_dist == "uniform" and (self.tool_s_max is None or self.tool_s_max < self.tool_s):
            raise ValueError(f"tool_s_max: a uniform tool time needs tool_s_max >= tool_s ({self.tool_s})")
        if self.tool_dist != "uniform" and self.tool_s_max is not None:
            raise ValueError(f'tool_s_max: applies to tool_dist = "uniform" only (this mix\'s is "{self.tool_dist}")')
        return self


class WorkloadSettings(_Section):
    arrival_rate: float | None = Field(None, gt=0)
    """Sessions submitted per second (Poisson); None submits all at once."""
    seed: int = 0
    agents: list[AgentMix] = Field(default_factory=list)
    trace: Path | None = None
    """A JSONL trace to replay: one session a line, an `AgentMix` without `count` plus `at`
    (seconds from the start), e.g. ``{"at": 1.5, "tenant": "acme", "turns": 3, "tool_s": 4}``.
    A relative path is read from the working directory."""


class Settings(BaseSettings):
    """The root of all settings."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETSCHED_", env_nested_delimiter="__", extra="forbid", frozen=True, toml_file="fleetsched.toml"
    )

    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    resources: ResourceSettings = Field(default_factory=ResourceSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)
    tenants: dict[str, TenantSettings] = Field(default_factory=lambda: {"default": TenantSettings()})
    workload: WorkloadSettings = Field(default_factory=WorkloadSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)

    @model_validator(mode="after")
    def _workload_tenants_declared(self) -> Settings:
        if not self.tenants:
            raise ValueError("tenants: at least one tenant must be declared")
        if "" in self.tenants:  # the gateway's metrics label requests without a valid key tenant=""
            raise ValueError("tenants: a tenant's name must not be empty")
        total = sum(mix.count for mix in self.workload.agents)
        if total > MAX_WORKLOAD_SESSIONS:
            raise ValueError(
                f"workload.agents: {total:,} sessions in all; at most {MAX_WORKLOAD_SESSIONS:,} are run "
                "(each is a task and a session held in memory from the start)"
            )
        # The window's largest size: max_window, or max_in_flight where the window is fixed.
        window, named = (
            (self.dispatch.max_window, "dispatch.max_window")
            if self.dispatch.adaptive_window
            else (self.backend.max_in_flight, "backend.max_in_flight (the window is fixed)")
        )
        if self.dispatch.critical_reserve >= window:
            raise ValueError(
                f"dispatch.critical_reserve: {self.dispatch.critical_reserve} places for critical calls leave none of the "
                f"window of at most {window} ({named}) to lower tiers; keep it below {window}"
            )
        if self.resources.kv_cache is not None and self.backend.kind == "instant":
            raise ValueError("resources.kv_cache: the instant backend has no KV cache to size the memory pool from")
        if self.resources.kv_cache is not None and "session_memory" in self.scheduler.model_fields_set:
            # The scheduler's default is the KV bytes of context_tokens then: the value given was
            # left unused without a word (sessions of 224 MiB where 100MB was asked).
            raise ValueError(
                "scheduler.session_memory: not used with [resources.kv_cache], where a session reserves the KV bytes "
                "of resources.kv_cache.context_tokens; set context_tokens, or a tenant's or an agent mix's session_memory"
            )
        if self.resources.kv_cache is not None and self.backend.kind == "sim":
            self._budget_fits_the_sim_cache(self.resources.kv_cache, self.backend.sim)
        for i, mix in enumerate(self.workload.agents):
            if mix.tenant not in self.tenants:
                raise ValueError(
                    f"workload.agents.{i}.tenant: {mix.tenant!r} is not a declared tenant "
                    f"(declared: {', '.join(self.tenants)})"
                )
            reason = self.inadmissible(mix, f"workload.agents.{i}")
            if reason is not None:
                raise ValueError(f"workload.agents.{i}: {reason}")
        return self

    @staticmethod
    def _budget_fits_the_sim_cache(kv: KVCacheSettings, sim: SimSettings) -> None:
        # The sim's cache is its settings': a budget it cannot hold is refused at load, not when
        # the scheduler starts (`Scheduler._use_kv_caches`, which checks the caches it learns).
        from .resources.kv_sizing import KVCacheCapacity, kv_pool

        blocks = sim.kv_cache_tokens // sim.block_size
        cache = {"sim": KVCacheCapacity(blocks, sim.block_size, {})}  # as `SimBackend.kv_capacities` reports it
        sized = kv_pool(cache, kv.config, context_tokens=kv.context_tokens, dtype=kv.dtype, in_flight_tokens=kv.in_flight_tokens)
        if sized.session_bytes > sized.devices["sim"]:
            raise ValueError(
                f"resources.kv_cache.context_tokens: a session's budget of {kv.context_tokens:,} tokens reserves "
                f"{sized.session_bytes:,} bytes, more than the sim's KV cache holds (backend.sim.kv_cache_tokens: "
                f"{blocks * sim.block_size:,} tokens, {sized.devices['sim']:,} bytes): no session could be admitted"
            )

    def session_memory_of(self, mix: AgentMix, where: str) -> tuple[int, str]:
        """The memory a session of `mix` (declared at `where`) reserves, and the key that sets
        it: the mix's own, else its tenant's, else the scheduler's."""
        tenant = self.tenants[mix.tenant]
        return next(
            (int(value), key)
            for value, key in (
                (mix.session_memory, f"{where}.session_memory"),
                (tenant.session_memory, f"tenants.{mix.tenant}.session_memory"),
                (self.scheduler.session_memory, "scheduler.session_memory"),
            )
            if value is not None
        )

    def inadmissible(
        self, mix: AgentMix, where: str, cache: tuple[str, int] | None = None, sized: int | None = None
    ) -> str | None:
        """Why every session of `mix` (declared at `where`) would be rejected at submission, or
        None: more memory than its tenant's quota or than any device holds. Such a mix is refused
        as a config error (the run would only count its sessions failed). With
        ``[resources.kv_cache]`` the devices are the servers' caches, read when the scheduler
        starts: `cache` is then the largest (its replica, its bytes), and `sized` what a session
        of ``context_tokens`` reserves in them, both unknown before."""
        tenant = self.tenants[mix.tenant]
        memory, source = self.session_memory_of(mix, where)
        held = "resources.devices"
        if self.resources.kv_cache is None:
            largest = max(int(device.memory) for device in self.resources.devices)
            if self.resources.strategy != "counting":  # an address space holds whole pages only
                largest -= largest % int(self.resources.page_size)
                held += ", in whole pages of resources.page_size"
        elif source == "scheduler.session_memory":
            if sized is None:
                return None  # sized from the servers' caches when the scheduler starts
            # Held against the caches already (the scheduler's check of context_tokens), but not
            # against the tenant's quota: every session of a tenant whose quota is smaller was
            # rejected at submission, and `run` exited 0.
            memory, source, largest = sized, "resources.kv_cache.context_tokens", None
        elif cache is None:
            largest = None  # the devices are read when the scheduler starts
        else:
            replica, largest = cache
            held = f"replica {replica!r}"
        if tenant.memory_quota is not None and memory > tenant.memory_quota:
            limit = f"the memory_quota of tenant {mix.tenant!r} ({int(tenant.memory_quota):,} bytes)"
        elif largest is not None and memory > largest:
            device = "device" if cache is None else "KV cache"
            limit = f"the largest {device} holds ({held}: {largest:,} bytes)"
        else:
            return None
        return f"a session reserves {memory:,} bytes ({source}), more than {limit}: no such session could be admitted"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _config_path.get()
        toml = TomlConfigSettingsSource(settings_cls, toml_file=path) if path else TomlConfigSettingsSource(settings_cls)
        return (init_settings, env_settings, toml)


def first_error(exc: ValidationError) -> tuple[str, str]:
    """The first error of `exc`: its field as a dotted key ("" at the root) and its message."""
    error = exc.errors()[0]
    return ".".join(str(part) for part in error["loc"]), error["msg"].removeprefix("Value error, ")


def _check_environment_sections() -> None:
    """Refuse a ``FLEETSCHED_<SECTION>__...`` variable of no section.

    pydantic-settings refuses an unknown key inside a section but passes over a variable whose
    section is unknown, so a misspelt section (``FLEETSCHED_SCHEDULR__MAX_SESSIONS``) was ignored
    without a word. Variables without ``__`` are left alone: the scripts have their own
    (``FLEETSCHED_VLLM_VENV``). Names are case-insensitive, as pydantic-settings reads them.
    """
    for name, section, _ in _nested_environment():
        if section not in Settings.model_fields:
            raise ConfigError(name, f"no section {section!r}; the sections are {', '.join(Settings.model_fields)}")
    # One '_' where '__' belongs: FLEETSCHED_SCHEDULER_MAX_SESSIONS=8 was left alone, unread.
    prefix = Settings.model_config["env_prefix"].lower()
    for name in os.environ:
        rest = name.lower().removeprefix(prefix)
        if name.lower().startswith(prefix) and "__" not in rest:
            section = next((s for s in Settings.model_fields if rest.startswith(s + "_")), None)
            if section is not None:
                cut = len(prefix) + len(section)
                raise ConfigError(name, f"a key of section {section!r} is set with '__' after the section: {name[:cut]}__{name[cut + 1 :]}")


def _nested_environment() -> list[tuple[str, str, str]]:
    """(variable, section, the rest) of every ``FLEETSCHED_<SECTION>__...`` variable, the parts
    in lower case, as pydantic-settings reads them."""
    prefix = Settings.model_config["env_prefix"].lower()
    found = []
    for name in os.environ:
        section, nested, rest = name.lower().removeprefix(prefix).partition("__")
        if name.lower().startswith(prefix) and nested:
            found.append((name, section, rest))
    return found


def _unparsed_json(section: str) -> list[str]:
    """The ``FLEETSCHED_<SECTION>__...`` variables of `section` that set a list or a table
    (which is written as JSON) with a value that is not JSON."""
    found = []
    for name, variable_section, rest in _nested_environment():
        if variable_section != section or not os.environ[name].strip():  # empty: pydantic names the key
            continue
        annotation: object = Settings.model_fields[section].annotation
        for part in rest.split("__"):
            annotation = _container(annotation)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel) and part in annotation.model_fields:
                annotation = annotation.model_fields[part].annotation
            elif get_origin(annotation) is dict:
                annotation = get_args(annotation)[1]
            else:
                break
        else:
            annotation = _container(annotation)
            if get_origin(annotation) in (list, dict) or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                try:
                    json.loads(os.environ[name])
                except ValueError:
                    found.append(name)
    return found


def _container(annotation: object) -> object:
    """`annotation` without ``| None`` and ``Annotated[...]``."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        annotation = kinds[0] if len(kinds) == 1 else annotation
    return annotation


def load_settings(path: str | Path | None = None, **overrides: object) -> Settings:
    """Read settings from `path` (or ./fleetsched.toml), the environment and `overrides`.

    Raises `ConfigError` naming the first bad key (dotted) and the reason.
    """
    if path is not None:
        path = Path(path)
        # Named by the path, as a TOML syntax error is: `run` and `simulate` take it as an
        # argument, the gateway as --config, and a program as `path`.
        if path.is_dir():
            raise ConfigError(str(path), "a directory, not a TOML file")
        if not path.exists():
            raise ConfigError(str(path), "no such file")
        if not path.is_file():  # a pipe, as <(envsubst < fleet.toml) gives, was "no such file"
            raise ConfigError(str(path), "not a regular file (a pipe or a device): settings are read from a TOML file")
    _check_environment_sections()
    token = _config_path.set(path)
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        error = exc.errors()[0]
        key, message = first_error(exc)
        got = bool(key) and "input" in error  # at the root the input is the whole config
        if "api_keys" in str(error.get("loc")):  # a key written in clear goes no further (logs)
            got = False
        key = key or "(root)"
        if key == "(root)" and ": " in message:  # a check across sections names its key itself
            key, _, message = message.partition(": ")
        raise ConfigError(key, f"{message} (got {error.get('input')!r})" if got else message) from None
    except SettingsError as exc:  # an environment variable whose value is not JSON where JSON is needed
        section = re.search(r'field "(\w+)"', str(exc))  # pydantic-settings names the section so
        variable = "environment"
        if section:  # the section's own variable (the whole section as JSON), or one of its keys'
            variable = f"FLEETSCHED_{section[1].upper()}"
            if not any(name.upper() == variable for name in os.environ):
                # Named, where it can be found: "FLEETSCHED_BACKEND__..." left the reader to guess
                # which of the section's variables it was.
                variable = next(iter(_unparsed_json(section[1])), variable + "__...")
        raise ConfigError(
            variable,
            f"an environment variable of this section does not parse: {exc.__cause__ or exc} "
            "(lists and tables are written as JSON: FLEETSCHED_BACKEND__URLS='[\"http://host:8000\"]')",
        ) from None
    except ValueError as exc:  # a TOML syntax error
        file = Path(path or "fleetsched.toml")
        if _starts_with_bom(file):  # as some Windows editors save UTF-8; tomllib says "Invalid statement"
            raise ConfigError(str(file), "it starts with a byte-order mark (BOM), which TOML does not allow: save it as UTF-8 without BOM") from None
        raise ConfigError(str(file), str(exc)) from None
    finally:
        _config_path.reset(token)
    _check_environment_tenants(settings)
    return settings


def _starts_with_bom(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(3) == codecs.BOM_UTF8
    except OSError:
        return False


def _check_environment_tenants(settings: Settings) -> None:
    """Refuse a ``FLEETSCHED_TENANTS__<NAME>__...`` variable meant for a tenant whose name has
    capitals or a '-'. Environment names are read in lower case, and a shell cannot export a
    name with '-': ``FLEETSCHED_TENANTS__ACME__WEIGHT=3`` made a second tenant "acme", with no
    sessions, beside the config's "Acme", and ``..._SUPPORT_BOT__TIER=batch`` one "support_bot"
    beside "support-bot", without a word."""
    for name, section, rest in _nested_environment():
        tenant, nested, _ = rest.partition("__")
        if section != "tenants" or not nested:
            continue
        twins = [d for d in settings.tenants if d != tenant and d.lower().replace("-", "_") == tenant.replace("-", "_")]
        if twins:
            raise ConfigError(
                name,
                f"environment names are read in lower case and without '-': this sets a tenant {tenant!r} beside "
                f"the config's {twins[0]!r} (a tenant whose name has capitals or a '-' is set in the config)",
            )
