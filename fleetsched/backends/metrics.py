"""Read vLLM's Prometheus ``/metrics`` page into `EngineSignals`.

vLLM labels every series with ``model_name`` (and, for data-parallel engines, ``engine``); a
server may serve several models or engines, so each signal is summed over its label sets.
``kv_cache_usage`` is the fraction of the KV cache in use, the largest over engines (a sum of
fractions would mean nothing).

The scheduling policy is not on the page: vLLM 0.32 exports ``vllm:cache_config_info`` (the
cache settings as labels) but no scheduler settings. `parse_vllm_metrics` therefore reports
``scheduling_policy`` only when some ``*_info`` series carries a ``scheduling_policy`` or
``policy`` label (forward compatible), and None otherwise; the server backend then probes it
(see `fleetsched.backends.vllm_server`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .base import EngineSignals

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
FINISHED = "vllm:request_success"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
CACHE_CONFIG = "vllm:cache_config_info"
TTFT = "vllm:time_to_first_token_seconds"

_POLICY_LABELS = ("scheduling_policy", "policy")


@dataclass(frozen=True, slots=True)
class VLLMMetrics:
    """The parts of one ``/metrics`` page fleetsched reads."""

    signals: EngineSignals
    scheduling_policy: str | None = None
    """"priority" or "fcfs" where the page says; None where it does not."""
    model_names: frozenset[str] = frozenset()
    finished: Mapping[str, float] = field(default_factory=dict)
    """Requests finished so far by reason ("stop", "length", ...). vLLM 0.32 does not count a
    request aborted by a client disconnect here."""
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    """Tokens prefilled and generated so far (throughput is the rate of these)."""
    cache_config: Mapping[str, str] = field(default_factory=dict)
    """The labels of ``vllm:cache_config_info`` (block_size, kv_cache_size_tokens, ...)."""
    ttft_sum_s: float | None = None
    ttft_count: float | None = None
    """The sum and count of vLLM's own TTFT histogram: seconds from a request's arrival in the
    engine (after the API server has parsed and tokenised it) to its first token, as the API
    server sees it. The mean over a run is the difference of the sums over that of the counts."""


def _family_key(name: str) -> str:
    # The parser strips "_total" from counter family names (OpenMetrics style); compare without it.
    return name.removesuffix("_total")


#: Families `parse_vllm_metrics` reads, as name prefixes (a superset: it matches names exactly).
_READ = (RUNNING, WAITING, KV_CACHE_USAGE, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS, FINISHED, PROMPT_TOKENS, GENERATION_TOKENS)


def _lines_read(text: str) -> str:
    """The lines of a page that `parse_vllm_metrics` reads: the families in `_READ`, the sum and
    count of the TTFT histogram (not its buckets) and every ``*_info`` series, with their comments.

    vLLM's page is mostly histogram buckets (609 lines on vLLM 0.32 CPU, 54 kB): the Prometheus
    parser took 6.8 ms over it, on the dispatcher's event loop at every scrape of the adaptive
    window. Parsing only these lines keeps the loop free.
    """
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)  # "# TYPE name type", "# HELP name text"
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(_READ) or name.endswith("_info") or name in (TTFT, TTFT + "_sum", TTFT + "_count"):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_vllm_metrics(text: str) -> VLLMMetrics:
    """Parse a Prometheus text page from a vLLM server.

    Series that are absent leave their signal None (an engine that has not started a request yet
    exports no counters on some versions). Raises ValueError on a page that is not Prometheus text.
    """
    if text.strip() and "# TYPE " not in text:
        raise ValueError(f"not a Prometheus text page (no '# TYPE' line): {text[:80]!r}")
    text = _lines_read(text)
    sums: dict[str, float] = {}
    kv_usage: float | None = None
    policy: str | None = None
    models: set[str] = set()
    finished: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        key = _family_key(family.name)
        for sample in family.samples:
            if "model_name" in sample.labels:
                models.add(sample.labels["model_name"])
            if key == CACHE_CONFIG or sample.name == CACHE_CONFIG:
                cache_config = {k: v for k, v in sample.labels.items() if k != "engine"}
            if key.endswith("_info") or sample.name.endswith("_info"):
                for label in _POLICY_LABELS:
                    if label in sample.labels:
                        policy = sample.labels[label].lower()
                continue
            # Counters carry a "_created" sample beside "_total"; only the value sample counts.
            if sample.name.endswith("_created"):
                continue
            # NaN or +-Inf is no reading (an exporter's 0/0, a proxy's page): leave the sample out,
            # so that int() of a sum cannot raise and a NaN cannot win max() of the KV usage.
            if not math.isfinite(sample.value):
                continue
            if key == KV_CACHE_USAGE:
                kv_usage = sample.value if kv_usage is None else max(kv_usage, sample.value)
            elif key == FINISHED and "finished_reason" in sample.labels:
                reason = sample.labels["finished_reason"]
                finished[reason] = finished.get(reason, 0.0) + sample.value
            elif key in (RUNNING, WAITING, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS, PROMPT_TOKENS, GENERATION_TOKENS):
                sums[key] = sums.get(key, 0.0) + sample.value
            elif key == TTFT and sample.name in (TTFT + "_sum", TTFT + "_count"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    signals = EngineSignals(
        running=_as_int(sums.get(RUNNING)),
        waiting=_as_int(sums.get(WAITING)),
        kv_cache_usage=kv_usage,
        preemptions_total=sums.get(PREEMPTIONS),
        prefix_cache_queries_total=sums.get(PREFIX_QUERIES),
        prefix_cache_hits_total=sums.get(PREFIX_HITS),
    )
    return VLLMMetrics(
        signals=signals,
        scheduling_policy=policy,
        model_names=frozenset(models),
        finished=finished,
        prompt_tokens_total=sums.get(PROMPT_TOKENS),
        generation_tokens_total=sums.get(GENERATION_TOKENS),
        cache_config=cache_config,
        ttft_sum_s=sums.get(TTFT + "_sum"),
        ttft_count=sums.get(TTFT + "_count"),
    )


def merge_signals(parts: Iterable[EngineSignals]) -> EngineSignals:
    """Sum signals over replicas (the KV cache usage is the mean of those that report it)."""
    parts = list(parts)

    def total(field: str) -> float | None:
        values = [getattr(p, field) for p in parts if getattr(p, field) is not None]
        return sum(values) if values else None

    usages = [p.kv_cache_usage for p in parts if p.kv_cache_usage is not None]
    return EngineSignals(
        running=_as_int(total("running")),
        waiting=_as_int(total("waiting")),
        kv_cache_usage=sum(usages) / len(usages) if usages else None,
        preemptions_total=total("preemptions_total"),
        prefix_cache_queries_total=total("prefix_cache_queries_total"),
        prefix_cache_hits_total=total("prefix_cache_hits_total"),
    )


def _as_int(value: float | None) -> int | None:
    # A sum of huge samples can still overflow to inf: no count either.
    return None if value is None or not math.isfinite(value) else int(round(value))
