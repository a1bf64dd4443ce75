"""Fitting a step-cost profile: closed loops on the synchronous engine, then non-negative least squares.

A step costs ``t = a + b*tokens + c*context + d*sequences``; each request spends ``f`` in the
serving front end, one request at a time (the API server's parsing and tokenising), then ``e``
side by side (the hand-off, the way back) outside the engine, and ``g`` more for each request
the engine is running as it is sent (a loaded server takes new requests in later than an idle
one); the profile is ``theta = (a, b, c, d, e, f, g)``. A closed loop (each client sends its
next request the moment the last one comes back) runs on the engine with its clock kept as
features: every time in it (a step's end, a request's arrival, its first token) is a sum of
steps, tokens, context, sequences, overheads, front-end turns and delays, so it is linear in
``theta``. One run gives:

- total time = ``F_total . theta``;
- a request's time to first token = ``F_ttft . theta``.

The run's schedule (which request joins which step, which waits for the front end) depends on
``theta`` only through the order of arrivals and step ends, so it holds for every profile that
orders them alike (every multiple of ``theta`` among them). Matching a measured throughput or
TTFT (the mean, or the median request's: which request is the median is part of the schedule)
is one linear equation in ``theta`` on a given schedule; a sweep of measurements is solved by
non-negative least squares on relative errors, and the fit alternates between solving and
running the loops under the new profile until the schedules stop changing. Pure Python, no event
loop, no numpy.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from fleetsched.settings import SimSettings

from ._engine import FINISHED, SimEngine, check_request_fits

#: The profile's fields, in the order of the feature vectors.
PARAMS = (
    "step_base_s", "step_per_token_s", "step_per_context_token_s", "step_per_seq_s",
    "request_overhead_s", "request_serial_s", "request_delay_per_running_s",
)  # fmt: skip

Vector = tuple[float, float, float, float, float, float, float]


def _dot(features: Sequence[float], theta: Sequence[float]) -> float:
    return sum(f * t for f, t in zip(features, theta))


def theta_of(settings: SimSettings) -> Vector:
    """The step-cost profile of `settings` as a vector in `PARAMS` order."""
    return tuple(getattr(settings, name) for name in PARAMS)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Workload:
    """A closed loop: `concurrency` clients, each sending `rounds` requests back to back."""

    concurrency: int
    prompt_tokens: int
    max_tokens: int
    rounds: int = 2
    shared_prefix_tokens: int = 0
    """Leading prompt tokens every request shares (a system prompt), served from the prefix cache."""
    prefix_caching: bool = True
    """False: the engine runs without a prefix cache (shared blocks are recomputed)."""
    max_tokens_spread: int = 0
    """Answers of `max_tokens` +- this many tokens, uniform, each request's drawn from `seed`
    (`answer_lengths`): a closed loop of equal answers moves in waves, every client sending at
    once, and varied ones spread out as real traffic does."""
    seed: int = 0

    def answer_lengths(self) -> list[list[int]]:
        """Each client's answer lengths, in the order it sends its requests."""
        draws = answer_draws(self.max_tokens, self.max_tokens_spread, self.seed)
        return [[next(draws) for _ in range(self.rounds)] for _ in range(self.concurrency)]


def answer_draws(max_tokens: int, spread: int, seed: int = 0) -> Iterator[int]:
    """Answer lengths without end: `max_tokens` +- `spread`, uniform, drawn from `seed`."""
    rng = random.Random(seed)
    low, high = max(1, max_tokens - spread), max_tokens + spread
    while True:
        yield rng.randint(low, high) if spread else max_tokens


@dataclass(slots=True)
class LoopFeatures:
    """What one run of a closed loop costs, as feature sums (see the module docstring)."""

    total: list[float] = field(default_factory=lambda: [0.0] * len(PARAMS))
    ttft: list[list[float]] = field(default_factory=list)
    """One feature vector per request: the steps from its arrival to its first token."""
    generated_tokens: int = 0
    requests: int = 0
    preemptions: int = 0

    def duration_s(self, theta: Sequence[float]) -> float:
        return _dot(self.total, theta)

    def throughput(self, theta: Sequence[float]) -> float:
        """Output tokens per second under `theta`."""
        return self.generated_tokens / self.duration_s(theta)

    def ttft_s(self, theta: Sequence[float]) -> list[float]:
        return sorted(_dot(f, theta) for f in self.ttft)

    def ttft_p50_s(self, theta: Sequence[float]) -> float:
        return _dot(self.p50_ttft_features(theta), theta)

    def mean_ttft_features(self) -> list[float]:
        n = len(self.ttft)
        return [sum(f[i] for f in self.ttft) / n for i in range(len(PARAMS))]

    def p50_ttft_features(self, theta: Sequence[float]) -> list[float]:
        """The features of the median TTFT under `theta` (the mean of the middle two when even)."""
        ranked = sorted(self.ttft, key=lambda f: _dot(f, theta))
        middle = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
        return [sum(f[i] for f in middle) / len(middle) for i in range(len(PARAMS))]


def closed_loop(settings: SimSettings, workload: Workload, theta: Sequence[float] | None = None) -> LoopFeatures:
    """Run `workload` on a fresh `SimEngine` under the profile `theta` (default: the one of
    `settings`); feature sums of the run (see the module docstring).

    Each client sends its next request the moment its last one finishes; the front end takes
    the requests one at a time, ``request_serial_s`` each, in the order they were sent; the
    engine sees a request ``request_overhead_s`` after the front end is done with it (and
    ``request_delay_per_running_s`` more for each request it was running as the request was
    sent), at the first step that starts after that (as the backend does), and idles when
    nothing has arrived.
    Prompts are unique past `workload.shared_prefix_tokens`; every request generates exactly
    its answer length (`Workload.answer_lengths`). Raises `ContextTooLong` (a ValueError) when
    the longest request does not fit the engine (`check_request_fits`).
    """
    lengths = workload.answer_lengths()  # each client's, popped as it sends
    check_request_fits(settings, workload.prompt_tokens, max(map(max, lengths)), whole=True)
    theta = theta_of(settings) if theta is None else tuple(theta)
    engine = SimEngine(settings)
    out = LoopFeatures()
    blocks = workload.prompt_tokens // settings.block_size
    serial = itertools.count(1)
    sent: dict[object, list[float]] = {}
    left = {}
    # The clock is kept as features, so that every time is linear in the profile.
    now = [0.0] * len(PARAMS)
    # (arrival time, order, arrival as features, send time as features, client)
    arrivals: list[tuple[float, int, list[float], list[float], int]] = []
    front_free = now  # when the front end is done with the last request sent

    def send(client: int, at: list[float]) -> None:
        nonlocal front_free
        start = front_free if _dot(front_free, theta) > _dot(at, theta) else at
        front_free = [*start[:5], start[5] + 1.0, start[6]]  # one front-end turn
        # One request overhead later, and the delay for each request the engine is running.
        arrival = [*front_free[:4], front_free[4] + 1.0, front_free[5], front_free[6] + len(engine.running)]
        heapq.heappush(arrivals, (_dot(arrival, theta), next(serial), arrival, at, client))

    def arrive() -> None:
        _, n, _, at, client = heapq.heappop(arrivals)
        shared = workload.shared_prefix_tokens // settings.block_size if workload.prefix_caching else 0
        hashes = [hash(("fit", 0 if i < shared else n, i)) for i in range(blocks)]
        request = engine.new_request(workload.prompt_tokens, lengths[client].pop(0), hashes)
        sent[request] = at
        left[request] = client

    for client in range(workload.concurrency):
        send(client, now)
    while True:
        clock = _dot(now, theta) + 1e-12  # arrivals due by now (to rounding) join this step
        while arrivals and arrivals[0][0] <= clock:
            arrive()
        step = engine.schedule()
        if step is None:
            if not arrivals:
                break
            now = list(arrivals[0][2])  # idle until the next request arrives
            continue
        now = [now[0] + 1, now[1] + step.tokens, now[2] + step.context, now[3] + step.seqs, *now[4:]]
        for request in engine.complete(step):
            if request.num_output == 1 and request in sent:
                out.ttft.append([t - s for t, s in zip(now, sent.pop(request))])
            if request.status == FINISHED:
                out.requests += 1
                client = left.pop(request)
                if lengths[client]:
                    send(client, now)
    out.total = now
    out.generated_tokens = engine.generated_tokens
    out.preemptions = engine.preemptions
    return out


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured point of a sweep: a closed loop's throughput and (optionally) TTFT."""

    workload: Workload
    throughput: float
    """Output tokens per second, all clients together."""
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    """Seconds; None or 0 when not measured."""

    def __post_init__(self) -> None:
        # The fit divides by each figure: a NaN never let it settle, a 0 or inf divided by zero.
        if not 0 < self.throughput < math.inf:
            raise ValueError(f"measurement: throughput must be a finite number > 0, got {self.throughput!r}")
        for name in ("ttft_mean_s", "ttft_p50_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"measurement: {name} must be a finite number >= 0 (or None), got {value!r}")


@dataclass(frozen=True, slots=True)
class PointError:
    workload: Workload
    measured_throughput: float
    predicted_throughput: float
    measured_ttft_p50_s: float | None
    predicted_ttft_p50_s: float

    @property
    def throughput_rel_err(self) -> float:
        return abs(self.predicted_throughput - self.measured_throughput) / self.measured_throughput

    @property
    def ttft_p50_rel_err(self) -> float | None:
        if not self.measured_ttft_p50_s:
            return None
        return abs(self.predicted_ttft_p50_s - self.measured_ttft_p50_s) / self.measured_ttft_p50_s


@dataclass(frozen=True, slots=True)
class Fit:
    theta: Vector
    points: list[PointError]

    @property
    def max_throughput_rel_err(self) -> float:
        return max(p.throughput_rel_err for p in self.points)

    @property
    def max_ttft_rel_err(self) -> float | None:
        errs = [e for p in self.points if (e := p.ttft_p50_rel_err) is not None]
        return max(errs) if errs else None

    def as_settings(self, base: SimSettings) -> SimSettings:
        return base.model_copy(update=dict(zip(PARAMS, self.theta)))


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float], free: Sequence[bool] = (True,) * len(PARAMS)) -> list[float]:
    """Least squares ``rows . x = targets`` with ``x >= 0``, by trying every active set.

    Only for a handful of unknowns (2^n subsets). Parameters with ``free[i] == False`` stay 0.
    """
    n = len(rows[0])
    best: tuple[float, list[float]] | None = None
    candidates = [i for i in range(n) if free[i]]
    for size in range(1, len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            x_sub = _solve_ls([[row[i] for i in subset] for row in rows], targets)
            if x_sub is None or any(v < 0 for v in x_sub):
                continue
            x = [0.0] * n
            for i, v in zip(subset, x_sub):
                x[i] = v
            residual = sum((_dot(row, x) - y) ** 2 for row, y in zip(rows, targets))
            if best is None or residual < best[0]:
                best = (residual, x)
    if best is None:
        raise ValueError("no non-negative profile fits these measurements")
    return best[1]


def _solve_ls(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float] | None:
    """Normal equations by Gaussian elimination with partial pivoting; None when singular."""
    k = len(rows[0])
    # Scale columns so that seconds-per-token and seconds-per-step are comparable.
    scale = [max(abs(row[j]) for row in rows) or 1.0 for j in range(k)]
    a = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, targets)) / scale[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]


#: Rounds of fitting at most: run the loops under the profile, solve for a new one, repeat.
FIT_ROUNDS = 8


def fit_profile(
    base: SimSettings,
    measurements: Sequence[Measurement],
    *,
    fit: Sequence[str] = PARAMS,
    ttft_weight: float = 1.0,
) -> Fit:
    """Fit the `fit` parameters to `measurements` (relative errors; throughput and TTFT rows, the
    TTFT p50 where measured, else the mean).

    `base` gives the engine's shape (max_num_seqs, token budget, block size, cache), the values
    of the costs not in `fit` (a cost known from the hardware, or one a table cannot tell apart
    from another) and the profile the first round's loops run under. Each round runs the loops
    under the last round's profile and solves for a new one; the best of the rounds (least
    squared relative error, each judged on its own loops) is returned, usually after 2-4 rounds,
    once the schedules stop changing. Raises ValueError when no non-negative profile fits, or
    when the one that fits gives an engine step no time.

    The front-end turn (``request_serial_s``) changes the schedules more than it changes any sum:
    a round that solves it to 0 lines every request up again, and no later round can see it. The
    delay per running request (``request_delay_per_running_s``) is alike: on a busy engine a
    request's delay passes during the steps it waits through, and shows only in which step it
    joins. So each is searched on a grid (`SERIAL_GRID`; `DELAY_GRID`, in shares of the quickest
    measured TTFT over the largest loop's clients) narrowed by golden-section search, the other
    costs fitted at each point and the other searched one held at its best so far, in turn and
    twice over (`SEARCH_SWEEPS`: searched once, the delay settled beside a turn the truth had not,
    in a test); then all are set free from the best point.
    """
    if not measurements:
        raise ValueError("fit_profile: no measurements to fit")
    unknown = set(fit) - set(PARAMS)
    if unknown:
        raise ValueError(f"fit: unknown parameters {sorted(unknown)}; known: {', '.join(PARAMS)}")
    fixed = [0.0 if name in fit else getattr(base, name) for name in PARAMS]
    free = [name in fit for name in PARAMS]
    start = list(theta_of(base))
    if free[4] and not start[4]:
        # With no overhead every request arrives at once, its overhead never shows in a loop's
        # schedule, and no round could find one: start from one step's fixed cost instead.
        start[4] = start[0] or 0.001
    ttfts = [t for m in measurements if (t := m.ttft_p50_s or m.ttft_mean_s)]
    searched: list[tuple[int, list[float]]] = []
    if ttfts:
        quickest, clients = min(ttfts), max(m.workload.concurrency for m in measurements)
        grids = {SERIAL: [share * quickest for share in SERIAL_GRID], DELAY: [share * quickest / clients for share in DELAY_GRID]}
        searched = [(i, grid) for i, grid in grids.items() if free[i]]
    if not searched:
        return _steps_take_time(_alternate(base, measurements, start, fixed, free, ttft_weight)[1])
    pinned = [f and i not in (SERIAL, DELAY) for i, f in enumerate(free)]
    held = list(fixed)  # the searched parameters' values, each the best found once searched
    best: tuple[float, Fit | None] = (math.inf, None)
    for i, grid in searched * SEARCH_SWEEPS:

        def at(value: float) -> tuple[float, Fit | None]:
            try:
                return _alternate(base, measurements, start, [*held[:i], value, *held[i + 1 :]], pinned, ttft_weight)
            except ValueError:  # a turn (or delay) longer than the times measured: no profile has it
                return math.inf, None

        best = min(best, _search(at, grid), key=lambda fit: fit[0])
        if best[1] is None:
            raise ValueError("no non-negative profile fits these measurements")
        held[i] = best[1].theta[i]
    # Last, every cost free, from the best schedule found.
    assert best[1] is not None
    return _steps_take_time(min(best, _alternate(base, measurements, list(best[1].theta), fixed, free, ttft_weight), key=lambda fit: fit[0])[1])


def _steps_take_time(fit: Fit | None) -> Fit:
    """`fit`, unless its engine steps take no time (the sim refuses such a profile: calibrate
    wrote one and exited 0, and the profile then failed to load): measurements in which every
    request took its first token's time and no more, as from a server that sends a whole answer
    in one chunk, fit every step cost to 0."""
    assert fit is not None
    base, per_token, per_context, per_seq, *_ = fit.theta
    if not (base or per_token or per_seq) and per_context:
        # Decoding was seen, and put on the context alone: one prompt length at one load cannot
        # tell a step's fixed cost from its context's (the context grows with the tokens).
        raise ValueError(
            "the profile that fits these measurements puts an engine step's whole cost on its context (step_base_s, "
            "step_per_token_s and step_per_seq_s all 0), which the sim cannot run: the sweep cannot tell one from the "
            "other; sweep more prompt lengths (--shapes) or loads (--concurrency)"
        )
    if not (base or per_token or per_seq):
        raise ValueError(
            "the profile that fits these measurements gives an engine step no time (step_base_s, step_per_token_s "
            "and step_per_seq_s all 0): each request took about its first token's time and no more, so nothing was "
            "seen of decoding; does the server stream the tokens as it makes them?"
        )
    return fit


def _search(at: Callable[[float], tuple[float, Fit | None]], grid: Sequence[float]) -> tuple[float, Fit | None]:
    """The best of `at` over `grid`, then golden-section search between the best point's neighbours."""
    fits = [at(value) for value in grid]
    i = min(range(len(grid)), key=lambda i: fits[i][0])
    best = fits[i]
    if best[1] is None:
        return best
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for _ in range(SEARCH_ROUNDS):
        left, right = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
        left_fit, right_fit = at(left), at(right)
        best = min(best, left_fit, right_fit, key=lambda fit: fit[0])
        if left_fit[0] <= right_fit[0]:
            hi = right
        else:
            lo = left
    return best


SERIAL, DELAY = PARAMS.index("request_serial_s"), PARAMS.index("request_delay_per_running_s")
#: Front-end turns tried by `fit_profile`, in shares of the quickest measured TTFT (which
#: holds one turn, the overhead and a step), then narrowed by golden-section search.
SERIAL_GRID = (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
#: Delays per running request tried, in shares of the quickest measured TTFT (usually an idle
#: engine's, without the delay) over the largest loop's clients: the delay with all of them running.
DELAY_GRID = (0.0, 1 / 4, 1 / 2, 1.0, 2.0)
SEARCH_ROUNDS = 12
#: Times the searched parameters are searched in turn (each from the others' best values).
SEARCH_SWEEPS = 2
GOLDEN = (5**0.5 - 1) / 2


def _alternate(
    base: SimSettings, measurements: Sequence[Measurement], start: Sequence[float], fixed: Sequence[float], free: Sequence[bool], ttft_weight: float
) -> tuple[float, Fit]:
    """Rounds of run-then-solve from `start`; the best round's squared error and fit. Raises
    ValueError when no non-negative profile fits the first round's schedules."""
    theta: Vector = tuple(v if f else x for v, f, x in zip(start, free, fixed))  # type: ignore[assignment]
    best: tuple[float, Fit] | None = None
    for round_ in range(FIT_ROUNDS):
        loops = [closed_loop(base, m.workload, theta) for m in measurements]
        error = _squared_error(theta, measurements, loops, ttft_weight)
        if best is None or error < best[0]:
            best = (error, Fit(theta, evaluate(theta, measurements, loops)))
        try:
            solved = _solve(theta, measurements, loops, fixed, free, ttft_weight)
        except ValueError:
            if not round_:
                raise
            break  # these schedules admit no non-negative profile: the earlier rounds' best stands
        if solved == theta:
            break  # the schedules it was solved on are its own
        theta = solved
    assert best is not None
    return best


def _ttft_row(theta: Sequence[float], m: Measurement, loop: LoopFeatures) -> tuple[list[float], float] | None:
    """The TTFT a fit matches for `m`, as (features on `loop` run under `theta`, seconds): the
    median when measured, else the mean; None when neither was."""
    if m.ttft_p50_s:
        return loop.p50_ttft_features(theta), m.ttft_p50_s
    if m.ttft_mean_s:
        return loop.mean_ttft_features(), m.ttft_mean_s
    return None


def _solve(
    theta: Sequence[float],
    measurements: Sequence[Measurement],
    loops: Sequence[LoopFeatures],
    fixed: Sequence[float],
    free: Sequence[bool],
    ttft_weight: float,
) -> Vector:
    """The non-negative profile that best matches `measurements` on the schedules of `loops`
    (run under `theta`)."""
    rows: list[list[float]] = []
    targets: list[float] = []

    def add(features: Sequence[float], seconds: float, weight: float) -> None:
        rows.append([weight * f / seconds for f in features])
        targets.append(weight * (1.0 - _dot(features, fixed) / seconds))

    for m, loop in zip(measurements, loops):
        add(loop.total, loop.generated_tokens / m.throughput, 1.0)
        if ttft_weight and (ttft := _ttft_row(theta, m, loop)):
            add(*ttft, ttft_weight)
    solved = nnls(rows, targets, free)
    return tuple(x if f else v for x, f, v in zip(solved, free, fixed))  # type: ignore[return-value]


def _squared_error(theta: Sequence[float], measurements: Sequence[Measurement], loops: Sequence[LoopFeatures], ttft_weight: float) -> float:
    """What the fit minimises: squared relative errors of throughput and (weighted) TTFT."""
    error = 0.0
    for m, loop in zip(measurements, loops):
        error += (loop.throughput(theta) / m.throughput - 1.0) ** 2
        if ttft_weight and (ttft := _ttft_row(theta, m, loop)):
            features, seconds = ttft
            error += (ttft_weight * (_dot(features, theta) / seconds - 1.0)) ** 2
    return error


def evaluate(theta: Sequence[float], measurements: Sequence[Measurement], loops: Sequence[LoopFeatures]) -> list[PointError]:
    return [
        PointError(m.workload, m.throughput, loop.throughput(theta), m.ttft_p50_s, loop.ttft_p50_s(theta))
        for m, loop in zip(measurements, loops)
    ]
