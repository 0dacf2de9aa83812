"""Prefetch into L1 of conversations expected back (docs/prefetch.md).

Scheduler side. Finished requests are remembered by the chunk keys they saved. A later request
whose keys pass through the last key of the finished one's prompt is that conversation's return
(the next turn's prompt repeats the last one's, while its answer may come back tokenized
differently), and the gap between the two is learned. Once returns come at a steady pace, the
conversations expected back soonest (oldest finish first) are kept pinned in L1 up to a share of
the pool, promoted from the file tier by `prepare_load` on a thread of their own, one at a time.
The simulator of `kvtier plan` (src/planner/simulator.cc, PlanPrefetch) follows the same rule and
constants.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import kvtier

from .prefix_loader import PrefixLoader

logger = logging.getLogger("vllm.kvtier")

GAP_WINDOW = 32  # finish-to-return gaps the prediction is made from
MIN_RETURNS = 8  # returns seen before anything is prefetched
MAX_GAP_CV = 0.5  # gaps' standard deviation over their mean, at most, for a predictable order
# A conversation not back within the mean gap plus HORIZON_SDS standard deviations (at least
# HORIZON_SLACK of the mean) is given up: its pins are released. Users leave after their last
# turn, and a departed conversation, the oldest of all, would otherwise hold the first share of
# L1 until it expired. It is still remembered (for MAX_AGE_S) so that its return, if it comes,
# still teaches the gap: gaps learned under another load (a burst) must not hide every return of
# the next.
HORIZON_SDS = 3.0
HORIZON_SLACK = 0.25
# Nor while more than this share of the returns found their last prompt whole in vLLM's own
# GPU cache (it holds the rotation: reads would be wasted).
MAX_GPU_RETURNS = 0.5
# Conversations are remembered this long, and at most this many.
MAX_AGE_S = 3600.0
MAX_EXPECTED = 4096
# A promotion that got fewer chunks than asked (the pool full of chunks not yet written below,
# or a chunk in no tier) is tried again this much later.
RETRY_S = 1.0
PLAN_EVERY_S = 0.05  # how often the planning thread plans
LOG_EVERY_S = 60.0  # a kind of trouble (a failing plan, a refusing server) is logged this seldom


def predictable(gaps: list[float], on_gpu: list[bool]) -> list[float] | None:
    """The gaps to predict returns from: the whole window if its returns are steady and mostly
    missed vLLM's cache, else the newest MIN_RETURNS if theirs are (the pace changed, as from a
    burst to a paced run: the window would take GAP_WINDOW returns to forget it), else None."""
    for n in (len(gaps), MIN_RETURNS):
        if n < MIN_RETURNS:
            return None
        g = gaps[-n:]
        mean = statistics.fmean(g)
        if (statistics.pstdev(g) <= MAX_GAP_CV * mean and
                sum(on_gpu[-n:]) <= MAX_GPU_RETURNS * n):
            return g
    return None


def horizon_s(gaps) -> float:
    """How long after its finish an expected conversation is given up, from the gaps learned."""
    mean = statistics.fmean(gaps)
    return mean + max(HORIZON_SDS * statistics.pstdev(gaps), HORIZON_SLACK * mean)


def _held(pins) -> bool:
    return any(slots for _, slots in pins)


# A rank's pinned slots and the client that holds them: slot numbers mean nothing to another
# connection (a restarted server), so they are released only through the one that pinned them.
_Pins = tuple[object, list[int]]


@dataclass
class _Expected:
    keys: list[bytes]
    anchor: bytes  # the key a return passes through
    finished: float
    target: int = 0  # leading chunks it may hold pinned
    pinned: bool = False  # a promotion to `target` is done (or under way: `busy`)
    busy: bool = False
    retry_at: float = 0.0
    # Not prefetched: its read would end after its predicted return, or its return loads it
    # from the file tier anyway. Its share of L1 goes to the ones after it.
    skip: bool = False
    pins: list[_Pins] = field(default_factory=list)  # per rank


class Prefetcher:
    """`clients()` gives one client per rank (None while a rank's server is unreachable);
    `read_rate()` the file tier's read rate in bytes/s (0: unknown); `pays(chunks, resident)`
    whether a conversation of `chunks` chunks, the first `resident` in L1, would be recomputed
    rather than read from the file tier at its return (the cost model's choice): only then does
    a prefetch save anything, since a load that reads the file tier anyway would only be joined
    by the prefetch's own reads; `count(name, value)` adds to the connector's stats."""

    def __init__(self, clients: Callable[[], list], fraction: float,
                 count: Callable[[str, int], None], read_rate: Callable[[], float] = lambda: 0.0,
                 chunk_tokens: int = 0,
                 pays: Callable[[int, int], bool] = lambda chunks, resident: True,
                 autoplan: bool = True):
        self._clients = clients
        self._pays = pays
        self._chunk_tokens = chunk_tokens
        self._read_rate = read_rate
        self._loader: PrefixLoader | None = None  # made at the first promotion
        self._fraction = fraction
        self._count = count
        self._lock = threading.Lock()
        # By anchor, in finish order (a conversation that finishes again moves to the end).
        self._expected: collections.OrderedDict[bytes, _Expected] = collections.OrderedDict()
        # Conversations back, by request id: (their keys, pins) until the lookup answers.
        self._returning: dict[str, tuple[list[bytes], list[_Pins]]] = {}
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAP_WINDOW)
        self._on_gpu: collections.deque[bool] = collections.deque(maxlen=GAP_WINDOW)
        self._busy = False  # a promotion is under way
        self._budget: int | None = None  # pins the kept set may hold, all ranks together
        self._said: dict[str, float] = {}  # when each kind of trouble was last logged
        self._targeted: dict[bytes, _Expected] = {}  # by anchor: those with a target > 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefetch")
        # plan() runs on a thread of its own every PLAN_EVERY_S: an idle engine takes no steps,
        # and its idle time is when reading ahead costs nothing. (Tests drive plan() with a
        # clock of their own instead: autoplan False.)
        self._closed = threading.Event()
        if autoplan:
            threading.Thread(target=self._plan_loop, name="kvtier-prefetch-plan",
                             daemon=True).start()

    # --- what the scheduler tells it -------------------------------------------------------

    def finished(self, keys: list[bytes], prompt_chunks: int, now: float) -> None:
        """A request finished having saved `keys` (its leading chunks), the first
        `prompt_chunks` of them its prompt's."""
        anchor = min(prompt_chunks, len(keys)) - 1
        if anchor < 0:
            return
        with self._lock:
            old = self._expected.pop(keys[anchor], None)
            if old is not None:
                self._release(old.pins)
            self._expected[keys[anchor]] = _Expected(list(keys), keys[anchor], now)
            while len(self._expected) > MAX_EXPECTED:
                self._release(self._expected.popitem(last=False)[1].pins)

    def arrived(self, req_id: str, keys: list[bytes], arrival: float, gpu_chunks: int) -> None:
        """A new request's first lookup (`gpu_chunks` of its leading chunks in vLLM's own
        cache): if it continues an expected conversation, that conversation is back (its gap is
        learned, its pins wait for the lookup)."""
        with self._lock:
            if not self._expected:
                return
            for i in range(len(keys) - 1, -1, -1):
                e = self._expected.pop(keys[i], None)
                if e is not None:
                    break
            else:
                return
            if arrival >= e.finished:
                self._gaps.append(arrival - e.finished)
                self._on_gpu.append(gpu_chunks > i)
            if _held(e.pins):
                self._count("prefetched_returns", 1)
            if _held(e.pins) or e.busy:  # a promotion under way hands its pins over too
                self._returning[req_id] = (e.keys, e.pins)
            e.pins = []

    def take_pins(self, req_id: str, clients: list, first: int, end: int
                  ) -> list[list[int]] | None:
        """The pins of chunks [first, end) of a conversation that came back, per rank, if the
        prefetch holds all of them through `clients` (the caller owns them then); the
        prefetch's other pins of it are released. None otherwise (all its pins released)."""
        with self._lock:
            back = self._returning.pop(req_id, None)
        if back is None:
            return None
        pins = back[1]
        if (first < end and len(pins) == len(clients) and
                all(c is client and len(slots) >= end
                    for (c, slots), client in zip(pins, clients))):
            self._release([(c, slots[:first] + slots[end:]) for c, slots in pins])
            return [slots[first:end] for _, slots in pins]
        self._release(pins)
        return None

    def forget(self, req_id: str) -> None:
        """The request is gone: pins the prefetch still held for it go."""
        with self._lock:
            back = self._returning.pop(req_id, None)
        if back is not None:
            self._release(back[1])

    # --- planning ---------------------------------------------------------------------------

    def plan(self, now: float) -> None:
        """Sets the target of each conversation within the horizon, releases those of the ones
        past it, and starts the next promotion. Never waits on the store, and walks only the
        conversations within the horizon (the kept set is among them)."""
        with self._lock:
            while self._expected:  # forgotten: the oldest first
                oldest = next(iter(self._expected.values()))
                if now - oldest.finished <= MAX_AGE_S:
                    break
                self._release(oldest.pins)
                del self._expected[oldest.anchor]
            gaps = predictable(list(self._gaps), list(self._on_gpu))
            mean = statistics.fmean(gaps) if gaps else 0.0
            # The expected conversations within the horizon, oldest finish first.
            live: list[_Expected] = []
            if gaps:
                horizon = horizon_s(gaps)
                for anchor in reversed(self._expected):
                    e = self._expected[anchor]
                    if now - e.finished > horizon:
                        break
                    live.append(e)
                live.reverse()
            used = sum(len(slots) for _, pins in self._returning.values() for _, slots in pins)
            room = max(0, (self._slots() if live else 0) - used)
            ranks = max(1, len(self._clients())) if live else 1
            shared: set[bytes] = set()  # keys counted already (a shared system prompt)
            targets = {}
            for e in live:
                if room <= 0:
                    break
                if e.skip:
                    continue
                counted = 0
                while counted < len(e.keys) and e.keys[counted] in shared:
                    counted += 1
                target = min(len(e.keys), counted + room // ranks)
                room -= (target - counted) * ranks
                shared.update(e.keys[counted:target])
                targets[e.anchor] = target
            # Those that held a target and no longer do (past the horizon, or out of the
            # budget) give their pins back; a promotion under way finishes first.
            for anchor, e in list(self._targeted.items()):
                if self._expected.get(anchor) is not e:
                    del self._targeted[anchor]  # came back, or finished again
                elif anchor not in targets and not e.busy:
                    self._release(e.pins)
                    e.pins, e.target, e.pinned = [], 0, False
                    del self._targeted[anchor]
            start = None
            for e in live:
                target = targets.get(e.anchor, 0)
                if target != e.target and not e.busy:
                    self._release(e.pins)
                    e.pins, e.target, e.pinned = [], target, False
                if e.target > 0:
                    self._targeted[e.anchor] = e
                if (start is None and e.target > 0 and not e.pinned and not self._busy
                        and now >= e.retry_at):
                    start = e
            if start is not None:
                start.busy = start.pinned = self._busy = True
                self._pool.submit(self._promote, start, start.keys[:start.target], now,
                                  start.finished + mean)

    def _plan_loop(self) -> None:
        while not self._closed.wait(PLAN_EVERY_S):
            try:
                self.plan(time.time())
            except Exception:  # never let a bug here stop the engine; say it once a minute
                if self._may_say("plan"):
                    logger.exception("kvtier: the prefetch's plan failed")

    def _may_say(self, what: str) -> bool:
        """Whether trouble of kind `what` may be logged now: once a minute at most."""
        now = time.monotonic()
        if now - self._said.get(what, -LOG_EVERY_S) < LOG_EVERY_S:
            return False
        self._said[what] = now
        return True

    def _slots(self) -> int:
        if self._budget is None:
            clients = self._clients()
            if not clients or clients[0] is None:
                return 0
            self._budget = int(self._fraction * clients[0].pool_bytes // clients[0].chunk_bytes)
        return self._budget

    def _promote(self, e: _Expected, keys: list[bytes], now: float, back: float) -> None:
        """Runs on the prefetch thread: every rank's slots of `keys`, promoted and pinned. The
        pins of an earlier, shorter promotion of `e` are released once these are taken. Not if
        its return would read the file tier anyway (`pays`), nor if reading what L1 lacks at the
        file tier's rate would end after `back`, its predicted return: that conversation is
        skipped, and its share goes to the ones after it."""
        rate = self._read_rate()
        clients = self._clients()
        resident = len(keys)  # leading chunks already in L1 (rank 0)
        if clients and clients[0] is not None:
            try:
                resident = min(clients[0].lookup(e.keys)[1], len(keys))
            except kvtier.KvtierError:
                pass
            skip = None
            if resident < len(keys) and not self._pays(len(e.keys), resident):
                skip = "prefetches_unneeded"
            elif rate > 0 and now + (len(keys) - resident) * clients[0].chunk_bytes / rate > back:
                skip = "prefetches_late"
            if skip is not None:
                with self._lock:
                    self._busy = e.busy = False
                    e.skip, e.pinned = True, False
                    self._count(skip, 1)
                return
        pins: list[_Pins] = []
        for client in clients:
            slots: list[int] = []
            if client is not None:
                if self._loader is None:  # learns the rate itself: `rate` may be a prior
                    self._loader = PrefixLoader(client.chunk_bytes)
                try:
                    # In batches: one request for a long conversation would outlast the
                    # server's load deadline on a slow tier, and lose its tail.
                    result = self._loader.load(client, keys, len(keys) - resident,
                                               lambda _, batch: slots.extend(batch))
                    if result.chunks < len(keys):
                        self._failed(len(keys), result.message)
                except kvtier.KvtierError as err:
                    self._failed(len(keys), str(err))
            pins.append((client, slots))
        self._count("chunks_prefetched", min((len(s) for _, s in pins), default=0))
        if pins:  # what came up from the file tier: not a file-tier hit of any request
            self._count("tokens_prefetched_from_file",
                        max(0, len(pins[0][1]) - resident) * self._chunk_tokens)
        with self._lock:
            self._busy = e.busy = False
            if self._expected.get(e.anchor) is e:
                if e.target == len(keys):
                    old, e.pins = e.pins, pins
                    if any(len(slots) < len(keys) for _, slots in pins):
                        e.pinned, e.retry_at = False, now + RETRY_S
                    self._release(old)
                    return
                e.pinned = False  # its target changed meanwhile: promote again
            else:
                for req_id, (back_keys, back_pins) in self._returning.items():
                    if back_keys is e.keys and not _held(back_pins):
                        self._returning[req_id] = (back_keys, pins)  # it came back meanwhile
                        return
        self._unpin(pins)

    def _failed(self, n: int, err: str) -> None:
        """A promotion the server refused, or cut short. Its per-client limit is the one a user
        sets too low for a prefetch (the scheduler's pins count against it): said once a minute,
        with the fix. Anything else (a server gone, chunks no longer stored) is the prefetch's
        ordinary loss."""
        if "--max-client-slots" not in err:
            logger.debug("kvtier: prefetching %d chunks failed: %s", n, err)
            return
        if self._may_say("quota"):
            logger.warning(
                "kvtier: the server refused the prefetch's pins of %d chunks: %s. The prefetch's "
                "share of the pool (kvtier.prefetch_fraction, %.2f) and the layer-wise loads' "
                "pins count against it: start kvtier serve with --max-client-slots of at least "
                "%.2f of the pool's slots, or lower kvtier.prefetch_fraction", n, err,
                self._fraction, min(1.0, self._fraction + 0.25))

    def _release(self, pins: list[_Pins]) -> None:
        if _held(pins):
            try:
                self._pool.submit(self._unpin, pins)
            except RuntimeError:  # shut down: the connections' close releases every pin
                pass

    def _unpin(self, pins: list[_Pins]) -> None:
        current = self._clients()
        for client, slots in pins:
            if not slots or client is None or not any(client is c for c in current):
                continue  # a lost connection's pins went with it
            try:
                client.unpin(slots)
            except kvtier.KvtierError as err:  # the server is gone: so are its pins
                logger.debug("kvtier: releasing %d prefetch pins failed: %s", len(slots), err)

    @property
    def busy(self) -> bool:
        """A promotion is under way."""
        with self._lock:
            return self._busy

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
