"""The ordering policy shared by session admission and model-call dispatch.

Order, from the outside in:

1. **Tier bands.** critical before standard before batch, strictly, with two guards so that a
   lower band cannot starve: a waiting entry is promoted one band for every `aging_s` seconds its
   queue's head has waited, and a backlogged band whose `min_share` of the service (by cost) is not
   met goes next. A band's share counts the service given while a band above it waits (the
   service it competes for): a band returning from idle starts at its share, so idle time is not
   banked, and neither is service it got with no band above it waiting (alone, or ahead of the
   bands below it).
2. **Weighted fair share between tenants of a band**, by virtual counters in the manner of VTC
   (Sheng et al., "Fairness in Serving Large Language Models"): serving a tenant adds
   ``cost / weight`` to its counter, the backlogged tenant with the smallest counter goes next, and a
   tenant that returns from idle in the band (it may wait in another) is lifted to the band's
   current minimum so idle time is not banked.
3. **Within a tenant**, by key: ``(deadline, arrival)``. Admission uses no deadline (plain FIFO);
   calls use the deadline derived from the tenant's TTFT SLA (earliest deadline first).

The queue is pure: no clock, no event loop. Callers pass ``now``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting item. `item` is the caller's payload; the queue never looks inside it."""

    tenant: str
    tier: int
    arrival: float
    item: Any = None
    cost: float = 1.0
    deadline: float = 0.0
    seq: int = 0
    queued: bool = False
    """Whether it waits in a queue: set by `FairQueue.push`, cleared by `pick` and `remove`."""

    def key(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


def _live(item: tuple[float, int, Entry]) -> bool:
    """Whether a heap item stands for its entry now: `remove` leaves the item in the heap, and
    the entry may have been pushed again since (a new item, a new seq)."""
    return item[2].queued and item[1] == item[2].seq


@dataclass(slots=True)
class _SubQueue:
    heap: list[tuple[float, int, Entry]] = field(default_factory=list)
    live: int = 0

    def head(self) -> Entry | None:
        heap = self.heap
        while heap and not _live(heap[0]):
            heapq.heappop(heap)
        return heap[0][2] if heap else None


#: The weights a tenant may have. A counter grows by cost / weight: a weight of 1e-306 took its
#: counter, then the tier's last-served mark, to inf, and every tenant of the tier back from idle
#: was lifted to it, their weights no longer told apart (an infinite weight was never charged).
MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6


class FairQueue:
    """Tier bands, weighted fair share between tenants (VTC), EDF/FIFO within a tenant, aging.

    `weights` maps tenant to weight (default 1.0 for tenants not listed). `aging_s` of None or 0
    turns aging off. Raises TypeError for a weight that is no number, ValueError for a weight
    outside `MIN_WEIGHT` to `MAX_WEIGHT`, a negative aging period, or minimum shares outside
    [0, 1) or adding up to 1 or more.
    """

    def __init__(
        self,
        weights: Mapping[str, object] | None = None,
        *,
        aging_s: float | None = None,
        min_share: Mapping[int, float] | None = None,
    ) -> None:
        self._weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        if aging_s is not None and not aging_s >= 0:
            raise ValueError(f"aging period must be >= 0 s (0: no aging), got {aging_s}")
        self._aging_s = aging_s or None
        for tier, share in (min_share or {}).items():
            if not 0 <= share < 1:
                raise ValueError(f"minimum share of tier {tier} must be in [0, 1), got {share}")
        self._min_share = {int(tier): share for tier, share in (min_share or {}).items() if share > 0}
        if sum(self._min_share.values()) >= 1:
            raise ValueError(f"minimum shares must add up to less than 1, got {self._min_share}")
        self._served: dict[int, float] = {}
        #: Per band with a minimum share, [its service, all service], counted while a band above
        #: it waits (see `_count_share`): what its share is checked against.
        self._ledgers: dict[int, list[float]] = {tier: [0.0, 0.0] for tier in self._min_share}
        #: The queues of the (tenant, tier) pairs with live entries, and of those alone.
        self._queues: dict[tuple[str, int], _SubQueue] = {}
        # Live entries per band: "is it backlogged?" in O(1) on every push.
        self._live_by_band: dict[int, int] = {}
        self._counters: dict[str, float] = {}
        self._last_served: dict[int, float] = {}
        self._seq = itertools.count()
        self._len = 0
        #: Sum of the costs of the live entries (the work waiting, for predicting waits).
        self.queued_cost = 0.0
        self._queued_cost_by_band: dict[int, float] = {}

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    @property
    def ages(self) -> bool:
        """Whether waiting promotes entries (aging is on): only then does `pick` need the time."""
        return self._aging_s is not None

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (weighted service received)."""
        return self._counters.get(tenant, 0.0)

    def cost_ahead(self, tier: int) -> float:
        """The queued cost served before an entry of `tier` pushed now would be picked (aging
        left out): that of its band and the bands above it, or, where its band has a minimum
        share, what is served while its band's queued cost is, if less. A band with a share is
        picked as soon as it is behind it: an entry arriving at an empty band goes after the next
        pick or two. Counted behind all the queued work, batch calls with a share of 0.05 were
        shed with a predicted wait of 6 s where they waited 0.1 to 0.6 s. An estimate: the time
        left on the calls in flight, and places kept for critical calls, are left out (its wait
        may be longer)."""
        ahead = 0.0
        for band, queued in self._queued_cost_by_band.items():
            if band <= tier:
                ahead += queued
        share = self._min_share.get(tier)
        if share:
            # The band is picked when its service is behind its share of all of it: the entry
            # goes once the others have served enough for the band's service so far and its
            # queue to be its share. A band served past its share (each of its picks puts it
            # ahead by that call's cost) waits that off first: left out, batch calls found one
            # call queued, predicted 5 s and waited 10 s, 28 of 33 past their 5 s objective.
            own_queue = self._queued_cost_by_band.get(tier, 0.0)
            own, total = self._ledgers[tier]
            owed = (own + own_queue) / share - total
            ahead = min(ahead, max(0.0, owed))
        return ahead

    def head(self, tenant: str, tier: int) -> Entry | None:
        """The live entry of `tenant` in band `tier` that goes first (the one whose wait ages
        that queue), or None if none waits."""
        queue = self._queues.get((tenant, tier))
        return queue.head() if queue is not None and queue.live else None

    def queued_by(self) -> dict[tuple[str, int], int]:
        """Number of live entries per (tenant, tier)."""
        return {key: q.live for key, q in self._queues.items() if q.live}

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def set_weight(self, tenant: str, weight: object) -> None:
        # Checked here, not by the annotation: a Decimal passed the bounds, then could not divide a
        # float counter, and the tenant's first call raised TypeError from inside the dispatcher,
        # keeping its place in the window for good; True passed as a weight of 1.
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"weight of tenant {tenant!r} must be a number, got {weight!r:.40}")
        value = float(weight)
        if not MIN_WEIGHT <= value <= MAX_WEIGHT:
            raise ValueError(f"weight of tenant {tenant!r} must be from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got {value}")
        self._weights[tenant] = value

    # -- updates ---------------------------------------------------------------------------

    def push(self, entry: Entry) -> Entry:
        """Queue `entry`. A tenant returning from idle is lifted to its band's minimum counter.

        Raises ValueError if `entry` is queued already (pushed and neither picked nor removed)."""
        if entry.queued:
            raise ValueError(f"entry {entry.item!r:.80} of tenant {entry.tenant!r} is already queued")
        key = (entry.tenant, entry.tier)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _SubQueue()
        # Idle in this band, even if it waits in another: entries waiting in a lower band, unserved
        # while this one is, must not keep its counter low here.
        if not queue.live:
            self._lift(entry.tenant, entry.tier)
        if entry.tier in self._min_share and not self._band_backlogged(entry.tier):
            self._lift_band(entry.tier)
        entry.seq = next(self._seq)
        entry.queued = True
        heapq.heappush(queue.heap, (entry.deadline, entry.seq, entry))
        self._count(entry, queue, 1)
        return entry

    def remove(self, entry: Entry) -> bool:
        """Withdraw a queued entry (a cancelled waiter). Returns False if it was not queued."""
        if not entry.queued:
            return False
        entry.queued = False
        self._count(entry, self._queues[(entry.tenant, entry.tier)], -1)
        return True

    def charge(self, tenant: str, cost: float, tier: int | None = None) -> None:
        """Add `cost` (weighted by the tenant's weight) to the tenant's counter.

        Dispatch charges a call's prompt estimate and predicted output at pick time, output beyond
        the prediction as it streams, and corrects both when the call ends (a negative cost
        corrects an over-estimate). With `tier`, the band's service (for minimum shares) is
        charged too, while another band waits: service a band gets alone denies nobody, and
        counted, it was banked (a batch band that ran alone for 10 s then got none of its 5 %
        for 189 s of contention).
        """
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / self._weights.get(tenant, 1.0)
        if tier is not None and self._len > self._live_by_band.get(tier, 0):  # another band has entries waiting
            self._served[tier] = max(0.0, self._served.get(tier, 0.0) + cost)
        if tier is not None and self._ledgers:
            self._count_share(tier, cost)

    def served(self, tier: int) -> float:
        """Service (cost) given to a band so far while another band waited (see `charge`). A
        figure to read: minimum shares are checked against the service counted while a band
        above waits (`_count_share`)."""
        return self._served.get(tier, 0.0)

    def serve_direct(self, tenant: str, tier: int, cost: float) -> None:
        """Account for an item served without ever being queued (nothing was waiting).

        Keeps the counters and the band's last-served mark as if it had been pushed and picked,
        so a later backlog starts from fair counters.
        """
        queue = self._queues.get((tenant, tier))
        if queue is None or not queue.live:
            self._lift(tenant, tier)
        self.charge(tenant, cost, tier)
        self._last_served[tier] = self.counter(tenant)

    def pick(
        self, now: float, eligible: Callable[[str], bool] | None = None, max_tier: int | None = None
    ) -> Entry | None:
        """Remove and return the next entry, charging its cost; None if nothing eligible waits.

        `eligible(tenant)` lets the caller skip tenants that cannot proceed now (at their
        concurrency cap, say) without disturbing their place. `max_tier` leaves out the entries
        of lower tiers (greater values): places kept for the critical tier are handed out so.
        """
        entry = self.peek(now, eligible, max_tier)
        if entry is not None:
            self._pop(entry)
            self.charge(entry.tenant, entry.cost, entry.tier)
            self._last_served[entry.tier] = self.counter(entry.tenant)
        return entry

    def peek(
        self, now: float, eligible: Callable[[str], bool] | None = None, max_tier: int | None = None
    ) -> Entry | None:
        """The entry `pick` would return, left in place and uncharged."""
        best: dict[int, tuple[tuple[int, float, float, int], Entry]] = {}  # per tier, for minimum shares
        shares = bool(self._min_share)
        winner: tuple[tuple[int, float, float, int], Entry] | None = None
        counters, aging_s = self._counters, self._aging_s
        for (tenant, tier), queue in self._queues.items():
            if not queue.live or (max_tier is not None and tier > max_tier):
                continue
            if eligible is not None and not eligible(tenant):
                continue
            # Every pick of every queued model call runs this loop: the usual cases are spared
            # their method calls (a live queue whose top entry is live; a head not yet waiting
            # an aging period, which `_band` would not promote).
            top = queue.heap[0]
            head = top[2]
            if not head.queued or top[1] != head.seq:
                live = queue.head()
                assert live is not None
                head = live
            band = tier
            if aging_s is not None and tier and now - head.arrival >= aging_s:
                band = self._band(head, now)
            ranked = ((band, counters.get(tenant, 0.0), head.deadline, head.seq), head)
            if shares and (tier not in best or ranked[0] < best[tier][0]):
                best[tier] = ranked
            if winner is None or ranked[0] < winner[0]:
                winner = ranked
        if winner is None:
            return None
        if len(best) > 1:
            ledgers = self._ledgers
            for tier in sorted(best):
                ledger = ledgers.get(tier)
                if ledger is not None and tier != winner[1].tier and ledger[0] < self._min_share[tier] * ledger[1]:
                    return best[tier][1]  # the band is owed its minimum share
        return winner[1]

    def __iter__(self) -> Iterator[Entry]:
        """Live entries in no particular order."""
        for queue in self._queues.values():
            for item in queue.heap:
                if _live(item):
                    yield item[2]

    # -- internals ---------------------------------------------------------------------------

    def _band(self, head: Entry, now: float) -> int:
        if self._aging_s is None or head.tier == 0:
            return head.tier
        # Capped before the floor: a wait of many periods (a tiny aging_s) overflows to inf.
        promoted = math.floor(min(float(head.tier), max(0.0, now - head.arrival) / self._aging_s))
        return head.tier - promoted

    def _pop(self, entry: Entry) -> None:
        queue = self._queues[(entry.tenant, entry.tier)]
        top = heapq.heappop(queue.heap)
        assert top[2] is entry and top[1] == entry.seq
        entry.queued = False
        self._count(entry, queue, -1)

    def _count(self, entry: Entry, queue: _SubQueue, delta: int) -> None:
        """Add `delta` (1 or -1) to every live count `entry` is part of."""
        queue.live += delta
        if not queue.live:
            # An idle tenant's queue goes (what is left in its heap is dead): every pick and every
            # tenant back from idle scans the queues, and kept, each tenant that ever waited cost
            # them its queue for good (10,000 tenants that had waited once: a push and pick of
            # three tenants took 1 to 2 ms, not 10 to 20 us).
            del self._queues[(entry.tenant, entry.tier)]
        self._len += delta
        self.queued_cost += delta * entry.cost
        self._live_by_band[entry.tier] = self._live_by_band.get(entry.tier, 0) + delta
        band_cost = self._queued_cost_by_band.get(entry.tier, 0.0) + delta * entry.cost
        self._queued_cost_by_band[entry.tier] = band_cost if self._live_by_band[entry.tier] else 0.0

    def _band_backlogged(self, tier: int) -> bool:
        return self._live_by_band.get(tier, 0) > 0

    def _lift_band(self, tier: int) -> None:
        """A band returning from idle starts exactly at its share: no credit for idle time."""
        share = self._min_share[tier]
        ledger = self._ledgers[tier]
        others = ledger[1] - ledger[0]
        floor = share * others / (1 - share)  # so that its service / all == share exactly
        if ledger[0] < floor:
            ledger[0], ledger[1] = floor, others + floor

    def _count_share(self, tier: int, cost: float) -> None:
        """Count `cost` served to band `tier` in the ledger of each band with a minimum share
        while a band above that one waits (or was just served while it waits: the pick that
        emptied the band above). Service a band gets with no band above it waiting (alone, or
        ahead of the bands below it) denies none of the bands it is owed a share against, and
        is not counted in its ledger: counted, standard served beside batch alone (95 % of the
        service) then got nothing for 9 times as long once critical calls came, its 10 %
        already had. While the band is idle the others' service counts, and `_lift_band` lifts
        it to its share on its return."""
        live = self._live_by_band
        for band, ledger in self._ledgers.items():
            above = tier < band and live.get(band, 0) > 0
            if not above:
                for other, n in live.items():
                    if n and other < band:
                        above = True
                        break
            if not above:
                continue
            if band == tier:
                own = max(0.0, ledger[0] + cost)  # a correction below 0 banks no credit
                ledger[1] += own - ledger[0]
                ledger[0] = own
            else:
                ledger[1] = max(ledger[0], ledger[1] + cost)

    def _lift(self, tenant: str, tier: int) -> None:
        backlogged = [
            self.counter(t) for (t, band), q in self._queues.items() if q.live and band == tier and t != tenant
        ]
        floor = min(backlogged) if backlogged else self._last_served.get(tier, 0.0)
        if self.counter(tenant) < floor:
            self._counters[tenant] = floor

