"""Balance against affinity, in a simulated cluster (no processes): kv_events and cache_aware route a
RAG-like stream (4 shared documents of random popularity) and a multi-turn chat over 2 equally able
workers, each worker a first-come-first-served queue whose caches fill as its requests finish (the KV
events the router would receive; measured on a worker, a 48-token question sent 0.1 s after an
unrelated 1,072-token read answered with the read, 2.2 s, not beside it); a request whose next block a
running request there is computing waits for it to finish, then takes it from the cache (the engine's
prefix hold, `engine/prefix_admission.py`).
Checked: no worker gets more than 60% of the requests, and what is cached
still decides (conversation turns stay on their worker; most document tokens are served from cache).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from kvserve.events.format import BlockStored, KVEventBatch
from kvserve.prefix.hashing import block_hashes
from kvserve.router.index import WorkerEvents
from kvserve.router.keys import RouteKey
from kvserve.router.policies import CacheAwarePolicy, KvEventsPolicy, Policy
from kvserve.router.workers import PrefillStart, Worker, WorkerLoad

BLOCK = 16
NAMESPACE = ("alice", "")
OVERHEAD = 40  # work units per request beyond its uncached prompt tokens (decode, HTTP)


@dataclass(slots=True)
class Job:
    key: RouteKey
    worker: Worker
    work: float
    done: Callable[[], None]
    progress: float = 0.0
    hashes: list[bytes] = field(default_factory=list)
    waiters: list[Callable[[], None]] = field(default_factory=list)  # held for this job's blocks


@dataclass(slots=True)
class SimWorker:
    """One worker: its jobs run one after another (first come, first served), a finished job's blocks are
    cached."""

    worker: Worker
    jobs: list[Job] = field(default_factory=list)
    cached: set[bytes] = field(default_factory=set)

    def cached_prefix(self, hashes: list[bytes]) -> int:
        run = 0
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            run += 1
        return run * BLOCK

    def next_finish(self, now: float) -> tuple[float, Job]:
        job = self.jobs[0]  # first come, first served (what a worker was measured to do: module docstring)
        return now + job.work - job.progress, job


@dataclass(slots=True)
class Cluster:
    policy: Policy
    workers: list[SimWorker]
    now: float = 0.0
    arrivals: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    routed: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)  # per request: from routing to its job's end (FCFS: first token)
    _seq: int = 0

    @classmethod
    def of(cls, policy: Policy, count: int = 2) -> Cluster:
        workers = [SimWorker(Worker(url=f"http://w{i}", healthy=True,
                                    load=WorkerLoad(block_size=BLOCK, prefix_hash="sha256"))) for i in range(count)]
        for sim in workers:
            policy.on_join(sim.worker)
        return cls(policy, workers)

    def at(self, time: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.arrivals, (time, self._seq, action))

    def send(self, tokens: list[int], done: Callable[[Worker], None]) -> None:
        """Route a request now; `done(worker)` runs when it finishes."""
        key = RouteKey(tokens=tuple(tokens), namespace=NAMESPACE, exact=True)
        pool = [sim.worker for sim in self.workers]
        decision = self.policy.choose(key, pool)
        self.policy.on_routed(key, decision.worker)
        sim = next(s for s in self.workers if s.worker is decision.worker)
        self.routed[sim.worker.url] = self.routed.get(sim.worker.url, 0) + 1
        sim.worker.begin_request()
        pending = PrefillStart(decision.uncached(key))  # the proxy's count: the policy's estimate, until the answer
        sim.worker.starts.append(pending)
        sent = self.now

        def finished() -> None:
            self.ttfts.append(self.now - sent)
            sim.worker.end_request()
            sim.worker.starts.remove(pending)
            done(sim.worker)

        self._admit(sim, key, block_hashes(list(tokens), BLOCK, NAMESPACE, "sha256"), finished)

    def _admit(self, sim: SimWorker, key: RouteKey, hashes: list[bytes], finished: Callable[[], None]) -> None:
        """Start the request's job, or hold it until a running job publishes the block past its hit."""
        cached = sim.cached_prefix(hashes)
        following = hashes[cached // BLOCK] if cached // BLOCK < len(hashes) else None
        lead = next((job for job in sim.jobs if following is not None and following in job.hashes), None)
        if lead is not None:
            lead.waiters.append(lambda: self._admit(sim, key, hashes, finished))
            return
        assert key.tokens is not None
        self.prompt_tokens += len(key.tokens)
        self.cached_tokens += cached

        def computed() -> None:
            new = [h for h in hashes if h not in sim.cached]
            sim.cached.update(new)
            if isinstance(self.policy, KvEventsPolicy) and new:  # the worker's BlockStored event
                WorkerEvents(self.policy.index, sim.worker.url, self.policy.pending).apply(
                    KVEventBatch(ts=self.now, events=[BlockStored(new, None, [], BLOCK)]))
            finished()

        sim.jobs.append(Job(key, sim.worker, len(key.tokens) - cached + OVERHEAD, computed, hashes=hashes))

    def run(self) -> None:
        """Advance time: the next arrival or job completion, whichever comes first, until both run out."""
        while True:
            finish = min(((sim.next_finish(self.now), sim) for sim in self.workers if sim.jobs),
                         key=lambda pair: pair[0][0], default=None)
            arrival = self.arrivals[0][0] if self.arrivals else None
            if finish is None and arrival is None:
                return
            if finish is not None and (arrival is None or finish[0][0] <= arrival):
                (when, job), sim = finish
                self._advance(when)
                sim.jobs.remove(job)
                job.done()
                for waiter in job.waiters:
                    waiter()
            else:
                assert arrival is not None
                self._advance(arrival)
                heapq.heappop(self.arrivals)[2]()

    def _advance(self, to: float) -> None:
        for sim in self.workers:
            if sim.jobs:
                sim.jobs[0].progress += to - self.now
        self.now = to

    def busiest_share(self) -> float:
        return max(self.routed.values()) / sum(self.routed.values())


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 48000) for _ in range(count)]


def rag(cluster: Cluster, seed: int, queries: int = 64, clients: int = 8, doc_len: int = 1024,
        weights: tuple[float, ...] = (1, 1, 1, 1)) -> list[int]:
    """`clients` closed-loop clients ask `queries` questions in all; each names one document."""
    rng = random.Random(seed)
    docs = [ids(rng, doc_len) for _ in weights]
    chosen = rng.choices(range(len(docs)), weights, k=queries)
    remaining = iter(chosen)

    def ask(_: Worker | None = None) -> None:
        doc = next(remaining, None)
        if doc is not None:
            cluster.send(docs[doc] + ids(rng, 32), ask)

    for client in range(clients):
        cluster.at(client * 5.0, ask)
    cluster.run()
    return chosen


def chat(cluster: Cluster, seed: int, users: int = 16, turns: int = 6, system: int = 384, think: float = 300.0
         ) -> Iterator[tuple[int, Worker]]:
    """`users` conversations sharing one system prompt; each turn resends the history. Yields (turn, worker)."""
    rng = random.Random(seed)
    shared = ids(rng, system)
    log: list[tuple[int, int, Worker]] = []

    def user(index: int) -> Callable[[], None]:
        history = list(shared)
        turn = 0

        def next_turn() -> None:
            nonlocal history
            prompt = history + ids(rng, 24)

            def answered(worker: Worker) -> None:
                nonlocal turn, history
                log.append((index, turn, worker))
                history = prompt + ids(rng, 48)
                turn += 1
                if turn < turns:
                    cluster.at(cluster.now + rng.expovariate(1 / think), next_turn)

            cluster.send(prompt, answered)

        return next_turn

    for index in range(users):
        cluster.at(rng.uniform(0, 4 * think), user(index))
    cluster.run()
    last: dict[int, Worker] = {}
    for index, turn, worker in log:
        if turn > 0:
            yield turn, worker if worker is not last[index] else None  # None: stayed
        last[index] = worker


POLICIES = {"kv_events": KvEventsPolicy, "cache_aware": CacheAwarePolicy}
SEEDS = range(8)


def rag_shares(make: Callable[[], Policy]) -> list[tuple[float, float]]:
    """(busiest worker's share of the requests, prompt tokens served from cache) per seed."""
    runs = []
    for seed in SEEDS:
        cluster = Cluster.of(make())
        rag(cluster, seed)
        assert sum(cluster.routed.values()) == 64
        runs.append((cluster.busiest_share(), cluster.cached_tokens / cluster.prompt_tokens))
    return runs


@pytest.mark.parametrize("name", POLICIES)
def test_rag_stream_is_balanced_and_mostly_cached(name):
    """Requests, not load: a worker that happened to pay more cold 1,024-token prefills serves fewer
    requests in the same time, so one short run can exceed 60%; over 8 runs the mean may not, and none
    may go far past it (seen: 0.50-0.75 per run, means 0.57-0.59)."""
    runs = rag_shares(POLICIES[name])
    shares = [share for share, _ in runs]
    assert sum(shares) / len(shares) <= 0.60, shares
    assert max(shares) <= 0.75, shares
    assert min(hit for _, hit in runs) >= 0.6, runs  # each document is prefilled on a worker a few times at most


@pytest.mark.parametrize("name", POLICIES)
def test_one_hot_document_is_copied_to_the_idle_worker(name):
    """A document asked 8 times in 11 is copied to the other worker, so both serve it. Requests per worker
    again follow who paid more 1,024-token prefills (the copy is one): seen 0.53-0.75 per run, means
    0.61-0.63 with the hot-prefix guard (0.58-0.60 with the old one, which also copied the cold documents)."""
    shares, hits = [], []
    for seed in SEEDS:
        cluster = Cluster.of(POLICIES[name]())
        chosen = rag(cluster, seed=seed, weights=(8, 1, 1, 1))
        hot = max(range(4), key=chosen.count)
        assert len(cluster.routed) == 2 and min(cluster.routed.values()) > chosen.count(hot) // 4, cluster.routed
        shares.append(cluster.busiest_share())
        hits.append(cluster.cached_tokens / cluster.prompt_tokens)
    assert sum(shares) / len(shares) <= 0.65, shares
    assert min(hits) >= 0.6, hits


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_chat_turns_stay_on_their_worker_and_users_spread(name, seed):
    cluster = Cluster.of(POLICIES[name]())
    moves = list(chat(cluster, seed))
    assert len(moves) == 16 * 5
    # A move recomputes the history only its old worker holds: after the first turn that is a block or
    # two (the shared system prompt is everywhere), cheaper than queueing behind a request, so kv_events
    # may move it; later turns carry a whole question and reply per turn and should stay.
    late = [worker for turn, worker in moves if turn >= 2]
    moved = sum(1 for worker in late if worker is not None)
    # Seen: cache_aware 3-9 of 64 (the imbalance guard); kv_events 12-13 of 64 (a load gap of 2 is worth
    # more than two turns of history at its cost model), with a hit rate at or above cache_aware's here.
    assert moved <= 0.25 * len(late), f"{moved} of {len(late)} later continuations left their worker"
    assert cluster.busiest_share() <= 0.60, cluster.routed
    assert cluster.cached_tokens / cluster.prompt_tokens >= 0.7


def gated_chat(cluster: Cluster, seed: int, users: int = 16, turns: int = 6, system: int = 256,
               concurrency: int = 4, think: float = 150.0, question: int = 16, reply: int = 32) -> None:
    """The benchmark's chat: at most `concurrency` requests in flight (the rest queue at the client), so
    the workers are busy and a load gap of a request or two is the normal state, not an imbalance."""
    rng = random.Random(seed)
    shared = ids(rng, system)
    queued: list[tuple[list[int], Callable[[Worker], None]]] = []
    busy = 0

    def submit(prompt: list[int], answered: Callable[[Worker], None]) -> None:
        nonlocal busy
        if busy >= concurrency:
            queued.append((prompt, answered))
            return
        busy += 1

        def finished(worker: Worker) -> None:
            nonlocal busy
            busy -= 1
            if queued:
                submit(*queued.pop(0))
            answered(worker)

        cluster.send(prompt, finished)

    def user() -> Callable[[], None]:
        history, turn = list(shared), 0

        def next_turn() -> None:
            prompt = history + ids(rng, question)

            def answered(_: Worker) -> None:
                nonlocal history, turn
                history, turn = prompt + ids(rng, reply), turn + 1
                if turn < turns:
                    cluster.at(cluster.now + rng.expovariate(1 / think), next_turn)

            submit(prompt, answered)

        return next_turn

    for _ in range(users):
        cluster.at(rng.uniform(0, 4 * think), user())
    cluster.run()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("count", [2, 4])
def test_busy_chat_keeps_the_single_workers_hit_rate(name, count):
    """Within 5 points of one worker's hit rate (the issue's target) with the workers kept busy. kv_events'
    old score (cached fraction − load gap / 4) moved conversations on a one-request gap, since the shared
    system prompt makes every worker's fraction similar: 6.7 points below one worker at 4 workers."""
    def hit_rate(policy: Policy, workers: int, seed: int) -> float:
        cluster = Cluster.of(policy, workers)
        gated_chat(cluster, seed)
        return cluster.cached_tokens / cluster.prompt_tokens

    single, routed = [], []
    for seed in range(3):
        single.append(hit_rate(CacheAwarePolicy(), 1, seed))
        routed.append(hit_rate(POLICIES[name](), count, seed))
    assert sum(routed) / 3 >= sum(single) / 3 - 0.05, (single, routed)


def gated_rag(cluster: Cluster, seed: int, queries: int = 24, doc_len: int = 512, concurrency: int = 4) -> None:
    """The benchmark's RAG: `queries` questions over 4 shared documents of random popularity, at most
    `concurrency` in flight (a client slot is refilled as its request finishes)."""
    rng = random.Random(seed)
    docs = [ids(rng, doc_len) for _ in range(4)]
    prompts = iter([docs[rng.randrange(4)] + ids(rng, 32) for _ in range(queries)])

    def ask(_: Worker | None = None) -> None:
        prompt = next(prompts, None)
        if prompt is not None:
            cluster.send(prompt, ask)

    for slot in range(concurrency):
        cluster.at(float(slot), ask)
    cluster.run()


@pytest.mark.parametrize("name", POLICIES)
def test_rag_over_four_workers_copies_no_cold_document(name):
    """4 documents, 4 workers, 4 requests in flight: a document's requests often bunch up 3 to 1 on its
    worker, and SGLang's guard on request counts (3 − 0 > 2) then copied the document to an idle worker, a
    full prefill each time: 5-6 points of hit rate below one worker (12 seeds; the benchmark saw 8-12).
    Copying only a hot prefix keeps the single worker's hit rate (seen +0.3 points) and 2 workers' balance."""
    def hit_rate(policy: Policy, workers: int, seed: int) -> tuple[float, float]:
        cluster = Cluster.of(policy, workers)
        gated_rag(cluster, seed)
        return cluster.cached_tokens / cluster.prompt_tokens, cluster.busiest_share()

    seeds = range(12)
    single = sum(hit_rate(CacheAwarePolicy(), 1, seed)[0] for seed in seeds) / len(seeds)
    four = sum(hit_rate(POLICIES[name](), 4, seed)[0] for seed in seeds) / len(seeds)
    assert four >= single - 0.01, (single, four)
    two = [hit_rate(POLICIES[name](), 2, seed) for seed in seeds]
    assert sum(hit for hit, _ in two) / len(seeds) >= single - 0.02, (single, two)
    assert sum(share for _, share in two) / len(seeds) <= 0.60, two


def benchmark_chat(cluster: Cluster, seed: int, concurrency: int = 4) -> None:
    """`benchmarks/router.py`'s chat in work units (a token of prefill is one; ~2.8 ms on a 1-thread worker, so
    its 1 s think time is 360 and its 4 s ramp 1,440): 16 users, a 512-token system prompt, 48-token
    questions and 192-token replies, at most `concurrency` requests in flight."""
    gated_chat(cluster, seed, system=512, concurrency=concurrency, think=360.0, question=48, reply=192)


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * len(values))]


@pytest.mark.parametrize("name", POLICIES)
def test_affinity_shortens_the_simulated_chat_tail_over_two_workers(name):
    """Not a performance measurement (benchmarks/router.py is): the policies' queueing in the simulation.
    Over 2 workers a cache-aware policy's p90 must stay well under round_robin's, whose turns recompute
    their history on the other worker. Seen: 1.85× on average over these seeds (1.56-2.31), 1.26× with
    --load-weight 2 (conversations move and recompute their history). No --load-weight / --request-overhead
    setting went past ~1.85× over 10 seeds: the tail is turns queued third on the worker that holds their
    conversation, as in the benchmark's dumps. Both workers sharing one cache (no routing can) reach 2.45×."""
    from kvserve.router.policies import RoundRobinPolicy

    ratios = []
    for seed in range(6):
        spread, routed = Cluster.of(RoundRobinPolicy()), Cluster.of(POLICIES[name]())
        benchmark_chat(spread, seed)
        benchmark_chat(routed, seed)
        assert len(routed.ttfts) == 96
        ratios.append(p90(spread.ttfts) / p90(routed.ttfts))
    assert sum(ratios) / len(ratios) >= 1.6, ratios
