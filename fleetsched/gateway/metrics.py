"""The gateway's own metrics, in the Prometheus text format, filtered by who asks.

A tenant sees only series labelled with its own name (no other tenant's name appears, not even
as a label value); the admin key sees every series, plus the dispatcher's and the scheduler's
gauges. Counters live in plain dicts: a request bumps a few integers and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.in_flight: dict[str, int] = {}
        self.stream_errors: dict[tuple[str, str], int] = {}
        self.streams_cut: dict[tuple[str, str], int] = {}
        self.latency: dict[str, list[float]] = {}  # per tenant: bucket counts, then sum, count

    def record(
        self, tenant: str, endpoint: str, status: int, seconds: float | None = None, *, failed_mid_stream: bool = False, cut_mid_stream: bool = False
    ) -> None:
        """Count one answered request. A stream that failed after its 200 was sent counts under
        code 200 (what the client got) and in ``stream_errors``, one its session's deadline cut
        then in ``streams_cut`` (the tenant's own limit, no error), and neither in the latency
        of successful calls."""
        key = (tenant, endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        if failed_mid_stream:
            self.stream_errors[tenant, endpoint] = self.stream_errors.get((tenant, endpoint), 0) + 1
        elif cut_mid_stream:
            self.streams_cut[tenant, endpoint] = self.streams_cut.get((tenant, endpoint), 0) + 1
        elif seconds is not None and status == 200:
            row = self.latency.get(tenant)
            if row is None:
                row = self.latency[tenant] = [0.0] * (len(LATENCY_BUCKETS_S) + 2)
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                if seconds <= bound:
                    row[i] += 1
            row[-2] += seconds
            row[-1] += 1

    def add_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        for kind, n in (("prompt", prompt), ("completion", completion)):
            key = (tenant, kind)
            self.tokens[key] = self.tokens.get(key, 0) + n

    def render(self, tenant: str | None, extra: Iterable[str] = ()) -> str:
        """The text exposition for `tenant` (None: the admin, everything)."""

        def mine(name: str) -> bool:
            return tenant is None or name == tenant

        lines = [
            "# HELP fleetsched_gateway_requests_total Requests, by tenant, endpoint and status (499: the client left before its answer's end).",
            "# TYPE fleetsched_gateway_requests_total counter",
        ]
        for (t, endpoint, status), n in sorted(self.requests.items()):
            if mine(t):
                lines.append(f'fleetsched_gateway_requests_total{{tenant="{_q(t)}",endpoint="{endpoint}",code="{status}"}} {n}')
        lines += [
            "# HELP fleetsched_gateway_stream_errors_total Streams that failed after their 200 was sent (an error event: the backend broke off, or the gateway failed).",
            "# TYPE fleetsched_gateway_stream_errors_total counter",
        ]
        for (t, endpoint), n in sorted(self.stream_errors.items()):
            if mine(t):
                lines.append(f'fleetsched_gateway_stream_errors_total{{tenant="{_q(t)}",endpoint="{endpoint}"}} {n}')
        lines += [
            "# HELP fleetsched_gateway_streams_cut_total Streams their session's deadline (sla.deadline_s) cut after their 200 was sent (an error event with code 408).",
            "# TYPE fleetsched_gateway_streams_cut_total counter",
        ]
        for (t, endpoint), n in sorted(self.streams_cut.items()):
            if mine(t):
                lines.append(f'fleetsched_gateway_streams_cut_total{{tenant="{_q(t)}",endpoint="{endpoint}"}} {n}')
        lines += [
            "# HELP fleetsched_gateway_tokens_total Tokens of the calls answered 200 (not 499), by tenant and kind (prompt, completion).",
            "# TYPE fleetsched_gateway_tokens_total counter",
        ]
        for (t, kind), n in sorted(self.tokens.items()):
            if mine(t):
                lines.append(f'fleetsched_gateway_tokens_total{{tenant="{_q(t)}",kind="{kind}"}} {n}')
        lines += [
            "# HELP fleetsched_gateway_in_flight Model calls in progress, by tenant.",
            "# TYPE fleetsched_gateway_in_flight gauge",
        ]
        for t, n in sorted(self.in_flight.items()):
            if mine(t):
                lines.append(f'fleetsched_gateway_in_flight{{tenant="{_q(t)}"}} {n}')
        lines += [
            "# HELP fleetsched_gateway_request_seconds Time to the whole answer of successful calls.",
            "# TYPE fleetsched_gateway_request_seconds histogram",
        ]
        for t, row in sorted(self.latency.items()):
            if not mine(t):
                continue
            for bound, n in zip(LATENCY_BUCKETS_S, row):
                lines.append(f'fleetsched_gateway_request_seconds_bucket{{tenant="{_q(t)}",le="{bound}"}} {int(n)}')
            lines.append(f'fleetsched_gateway_request_seconds_bucket{{tenant="{_q(t)}",le="+Inf"}} {int(row[-1])}')
            lines.append(f'fleetsched_gateway_request_seconds_sum{{tenant="{_q(t)}"}} {row[-2]:.6f}')
            lines.append(f'fleetsched_gateway_request_seconds_count{{tenant="{_q(t)}"}} {int(row[-1])}')
        if tenant is None:
            lines.extend(extra)
        return "\n".join(lines) + "\n"


def _q(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
