"""Observability: SLA accounting, Prometheus metrics, the run's timeline, report rendering.

- `sla`: per-tenant attainment of the SLA objectives, rolling windows, breaches with a reason.
- `feasibility`: objectives an idle engine cannot meet, flagged at start.
- `metrics`: a Prometheus collector read at scrape time, and a ``/metrics`` server on the loop.
- `timeline`: a sampler of queue depths, throughput, memory and attainment over the run.
- `render`: ``fleetsched report RUN.json --out DIR`` (plots with matplotlib and an HTML page).
"""
