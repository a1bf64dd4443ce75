"""Gateway instances sharing tenant state through a real Redis server (Debian's redis-server).

The Redis server runs on a free loopback port for this module. Without the binary the tests are
skipped, unless FLEETSCHED_REQUIRE_REDIS=1: then they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import openai
import pytest

from fleetsched.gateway.app import FAIR_SHARE_SYNC_S
from fleetsched.gateway.auth import hash_key
from fleetsched.gateway.server import serve_in_thread
from fleetsched.gateway.state import REDIS_TIMEOUT_S, MemoryState, Placement, RedisState
from fleetsched.resources.ratelimit import RateLimit, Taken
from fleetsched.scheduler.dispatcher import INPUT_WEIGHT, OUTPUT_WEIGHT

from .test_gateway import ACME, GLOBEX, MSG, client, gateway_settings

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(*options: str, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Redis server of its own on a free loopback port, or on `port` (with its further
    command-line `options`): its URL and its process."""
    binary = shutil.which("redis-server")
    if binary is None:
        message = "no redis-server binary: apt-get install -y redis-server"
        if os.environ.get("FLEETSCHED_REQUIRE_REDIS") == "1":
            pytest.fail(f"FLEETSCHED_REQUIRE_REDIS=1 but {message}", pytrace=False)
        pytest.skip(message)
    port = port or _free_port()
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir, *options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (a password asked: up too)
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", process
        finally:
            process.send_signal(signal.SIGCONT)  # a test that froze it
            process.terminate()
            process.wait(10)


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as (url, _):
        yield url


def test_two_instances_hold_a_tenants_rate_limit_jointly(redis_url):
    tenants = {
        "acme": {"api_keys": [hash_key(ACME)]},
        "globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 4},
    }
    s = gateway_settings(tenants, gateway={"redis_url": redis_url})
    flush(redis_url)
    with serve_in_thread(s) as (one, url_one), serve_in_thread(s) as (two, url_two):
        assert one.state.shared and two.state.shared and one.instance != two.instance
        assert httpx.get(url_one + "/health").json() == {"status": "ok"}
        first, second = client(url_one, GLOBEX), client(url_two, GLOBEX)
        for c in (first, second, first, second):
            c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
        for c in (first, second):  # both instances see the bucket empty
            with pytest.raises(openai.RateLimitError) as caught:
                c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
            assert int(caught.value.response.headers["retry-after"]) >= 1
        # Another tenant's bucket is its own.
        client(url_two, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=1)


def test_deployments_with_their_own_key_prefix_share_nothing_on_one_redis(redis_url):
    # Every key began "fleetsched:": two deployments on one Redis database took one bucket.
    import redis

    tenants = {"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2}}
    flush(redis_url)
    blue = gateway_settings(tenants, gateway={"redis_url": redis_url, "redis_prefix": "blue"})
    green = gateway_settings(tenants, gateway={"redis_url": redis_url, "redis_prefix": "green"})
    with serve_in_thread(blue) as (_, url_blue), serve_in_thread(green) as (_, url_green):
        for url in (url_blue, url_blue, url_green, url_green):  # two each: the buckets are apart
            client(url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
        with pytest.raises(openai.RateLimitError):
            client(url_green, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
    with redis.Redis.from_url(redis_url) as r:
        assert {key.split(b":")[0] for key in r.keys()} == {b"blue", b"green"}


def test_a_redis_key_prefix_is_letters_digits_and_separators():
    with pytest.raises(ValueError, match="gateway.redis_prefix"):
        gateway_settings(gateway={"redis_prefix": "two words"})
    with pytest.raises(ValueError, match="gateway.redis_prefix"):
        gateway_settings(gateway={"redis_prefix": ""})
    with pytest.raises(ValueError, match="gateway.redis_prefix"):  # "blue" and "blue:session" shared keys
        gateway_settings(gateway={"redis_prefix": "blue:session"})


def test_alone_an_instance_keeps_the_limit_in_memory():
    s = gateway_settings({"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2}})
    with serve_in_thread(s) as (one, url_one), serve_in_thread(s) as (_, url_two):
        assert not one.state.shared
        for url in (url_one, url_one, url_two, url_two):  # two each: the buckets are separate
            client(url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)


async def test_token_bucket_refund_and_usage_and_placement_are_shared(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    limits = {"acme": RateLimit(None, 600.0)}  # 600 tokens a minute, burst 600
    a, b = RedisState(limits, redis_url, instance="a", prefix=prefix), RedisState(limits, redis_url, instance="b", prefix=prefix)
    try:
        assert (await a.take("acme", 500)).wait_s == 0
        refused = await b.take("acme", 200)
        assert 9 < refused.wait_s <= 11  # 100 tokens short at 10 a second
        assert refused.requests is None and refused.tokens.limit == 600 and 99 < refused.tokens.left <= 101
        await a.refund("acme", 300)
        assert (await b.take("acme", 200)).wait_s == 0
        assert (await a.take("nobody", 10**9)).wait_s == 0  # no limit, no bucket

        await a.add_usage("acme", 10.5)
        await b.add_usage("acme", 2)
        await b.add_usage("globex", 1)
        assert await a.peer_usage() == {"acme": 2.0, "globex": 1.0}
        assert await b.peer_usage() == {"acme": 10.5, "globex": 0.0}

        first = await a.place("acme/s1", Placement("one", "r0"), 5)
        second = await b.place("acme/s1", Placement("two", "r1"), 5)
        assert first == second == Placement("one", "r0")
        await b.forget("acme/s1")
        assert await b.place("acme/s1", Placement("two", "r1"), 5) == Placement("two", "r1")
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_request_given_back_is_given_back_to_every_instance(redis_url):
    """A call refused as invalid gets its request back (`refund(..., request=True)`); before, only
    its tokens: one bad field used up one of the tenant's requests per minute on every instance."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    limits = {"acme": RateLimit(2.0, 600.0)}  # 2 requests and 600 tokens a minute
    a, b = RedisState(limits, redis_url, instance="a", prefix=prefix), RedisState(limits, redis_url, instance="b", prefix=prefix)
    try:
        assert (await a.take("acme", 100)).wait_s == 0 and (await b.take("acme", 100)).wait_s == 0
        assert 29 < (await a.take("acme", 100)).wait_s <= 31  # the requests are used up: one more in 30 s
        await b.refund("acme", 100)  # tokens only: still no request
        assert (await a.take("acme", 100)).wait_s > 29
        await b.refund("acme", 100, request=True)
        assert (await a.take("acme", 100)).wait_s == 0
        assert (await b.take("acme", 100)).wait_s > 29
    finally:
        await a.aclose()
        await b.aclose()


def test_a_refusal_s_rate_limit_headers_count_what_it_gave_back_in_redis_too(redis_url):
    """The refund script answers the buckets' levels after it: a 404 after the limits were taken
    shows its request and tokens given back (it read remaining-requests 0), on one instance as on
    its peer."""
    tenants = {"globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 2, "tokens_per_minute": 1000}}
    s = gateway_settings(tenants, gateway={"redis_url": redis_url}, backend={"kind": "sim"})
    flush(redis_url)
    headers = {"authorization": f"Bearer {GLOBEX}"}
    with serve_in_thread(s) as (_, url_one), serve_in_thread(s) as (_, url_two):
        served = httpx.post(url_one + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10}, headers=headers)
        assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "1"
        refused = httpx.post(url_two + "/v1/chat/completions", json={"model": "gpt-4o", "messages": MSG, "max_tokens": 10}, headers=headers)
        assert refused.status_code == 404, refused.text
        assert refused.headers["x-ratelimit-remaining-requests"] == "1"
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) >= int(served.headers["x-ratelimit-remaining-tokens"])
        again = httpx.post(url_one + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 10}, headers=headers)
        assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "0"


def test_fair_share_counters_count_the_peers_service(redis_url):
    flush(redis_url)
    s = gateway_settings(gateway={"redis_url": redis_url})
    with serve_in_thread(s) as (one, url_one), serve_in_thread(s) as (two, _):
        for _ in range(3):
            client(url_one, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=4)
        queue = two.scheduler.dispatcher._queue
        # 3 calls of about 4 prompt tokens (weight 1) and 4 completion tokens (weight 2). Each
        # instance shares its totals at its fair-share sync: a sync between the calls shows part.
        deadline = time.monotonic() + 5
        while queue.counter("acme") < 3 * (1 + 4 * 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queue.counter("acme") >= 3 * (1 + 4 * 2)


def flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushdb()


def test_unreachable_redis_is_a_503_not_a_500():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = gateway_settings(gateway={"redis_url": f"redis://127.0.0.1:{port}/0"})
    with serve_in_thread(s) as (gateway, url):
        with pytest.raises(openai.APIStatusError) as caught:
            client(url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)  # rate-limited: Redis
        # A tenant without limits needs no Redis: served. (The fair-share sync's first read once
        # took the whole gateway down when Redis was away at start.)
        reply = client(url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=1)
        # A session's placement is in Redis: a 503 too (it was a 500 "internal error").
        with pytest.raises(openai.APIStatusError) as placing:
            client(url, ACME).with_options(default_headers={"X-Session-ID": "s1"}).chat.completions.create(
                model="m", messages=MSG, max_tokens=1
            )
        assert gateway.scheduler is not None and len(gateway.sessions) == 0
        # Health says so (it said "ok"), and stays 200: tenants without limits are served.
        health = httpx.get(url + "/health")
        assert health.status_code == 200
        assert health.json() == {
            "status": "degraded",
            "shared_state": "the gateway's shared state (Redis) is unavailable: cannot connect to it",
        }
    for refused in (caught, placing):
        assert refused.value.status_code == 503 and refused.value.body["type"] == "state_unavailable"
        assert refused.value.response.headers["retry-after"] == "1"
    assert reply.usage.completion_tokens == 1


def test_concurrent_first_calls_of_a_session_make_one_session(redis_url):
    # Each call awaits Redis for the session's placement; the table was read before that await,
    # so calls arriving together each saw no session and each submitted one (slots and memory
    # held twice, the extra ones until they idled out).
    flush(redis_url)
    with serve_in_thread(gateway_settings(gateway={"redis_url": redis_url})) as (gateway, url):
        clients = [httpx.Client(base_url=url, timeout=30) for _ in range(8)]
        for c in clients:  # connections open before the race, so the calls arrive together
            c.get("/health")
        for attempt in range(5):
            start = threading.Barrier(len(clients))
            headers = {"authorization": f"Bearer {ACME}", "x-session-id": f"together-{attempt}"}

            def call(c: httpx.Client) -> int:
                start.wait()
                return c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=headers).status_code

            with ThreadPoolExecutor(len(clients)) as pool:
                assert list(pool.map(call, clients)) == [200] * len(clients)
        stats = gateway.scheduler.statistics()
        assert len(gateway.sessions) == 5
        assert stats.running_total + stats.parked + stats.queued_total == 5
        for c in clients:
            c.close()


def test_a_session_id_does_not_join_another_tenants_session(redis_url):
    # Session ids may hold '/': tenant 'a' session 'b/c' and tenant 'a/b' session 'c' were one key
    # ('a/b/c'), locally and in Redis, so the second call ran in the first tenant's session.
    flush(redis_url)
    tenants = {"a/b": {"api_keys": [hash_key(ACME)]}, "a": {"api_keys": [hash_key(GLOBEX)]}}
    with serve_in_thread(gateway_settings(tenants, gateway={"redis_url": redis_url})) as (gateway, url):
        client(url, ACME).with_options(default_headers={"X-Session-ID": "c"}).chat.completions.create(
            model="m", messages=MSG, max_tokens=1
        )
        client(url, GLOBEX).with_options(default_headers={"X-Session-ID": "b/c"}).chat.completions.create(
            model="m", messages=MSG, max_tokens=1
        )
        assert len(gateway.sessions) == 2
        assert gateway.scheduler.statistics().running == {("a/b", "standard"): 1, ("a", "standard"): 1}
    import redis

    with redis.Redis.from_url(redis_url) as r:
        assert len(r.keys("fleetsched:session:*")) == 2


def test_an_instance_does_not_count_its_own_service_as_its_peers(redis_url):
    # The sync read the totals while a call's service was counted locally but not yet in Redis
    # (held here by CLIENT PAUSE WRITE): it then counted that service as the peers' too, and the
    # tenant was charged twice on the instance that served it.
    import redis

    flush(redis_url)
    with serve_in_thread(gateway_settings(gateway={"redis_url": redis_url})) as (gateway, url):
        replies = [client(url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=3)]
        time.sleep(2 * FAIR_SHARE_SYNC_S)  # the sync has read the tenant's total
        with redis.Redis.from_url(redis_url) as r:
            r.execute_command("CLIENT", "PAUSE", int(3000 * FAIR_SHARE_SYNC_S), "WRITE")
            replies.append(client(url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=3))
            time.sleep(2 * FAIR_SHARE_SYNC_S)  # the sync reads while the call's count waits
            r.execute_command("CLIENT", "UNPAUSE")
        time.sleep(3 * FAIR_SHARE_SYNC_S)
        served = sum(r.usage.prompt_tokens * INPUT_WEIGHT + r.usage.completion_tokens * OUTPUT_WEIGHT for r in replies)
        assert gateway.scheduler.dispatcher._queue.counter("acme") == served


def test_a_redis_url_that_is_not_one_is_a_config_error(tmp_path, capsys):
    from fleetsched.gateway.server import main

    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\nredis_url = "http://127.0.0.1:6379"\n')
    assert main(["--config", str(config)]) == 2  # was a ValueError's traceback
    error = capsys.readouterr().err
    assert "config error: gateway.redis_url" in error and "redis://" in error
    # A database that is no number was read as none (database 0), without a word.
    config.write_text('[gateway]\nredis_url = "redis://127.0.0.1:6379/x"\n')
    assert main(["--config", str(config)]) == 2
    error = capsys.readouterr().err
    assert "config error: gateway.redis_url: the database is a number (redis://host:port/0), got 'x'" in error


def test_a_503_for_the_shared_state_says_what_went_wrong(redis_url):
    # It read "the gateway's shared state (Redis) is unavailable; retry shortly" whatever the
    # cause, and the log said only "server:ResponseError" (redis-py's repr drops the message).
    closed = f"redis://127.0.0.1:{_free_port()}/0"
    wrong_db = redis_url.rsplit("/", 1)[0] + "/99"
    for url, reason in ((closed, "cannot connect"), (wrong_db, "DB index is out of range")):
        with serve_in_thread(gateway_settings(gateway={"redis_url": url})) as (_, gateway_url):
            with pytest.raises(openai.APIStatusError) as caught:
                client(gateway_url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
            with pytest.raises(openai.APIStatusError) as placing:
                client(gateway_url, ACME).with_options(default_headers={"X-Session-ID": "s1"}).chat.completions.create(
                    model="m", messages=MSG, max_tokens=1
                )
        for refused in (caught, placing):
            message = refused.value.body["message"]
            assert refused.value.status_code == 503 and "shared state (Redis)" in message and reason in message
            assert "127.0.0.1" not in message  # Redis's address is the operator's, not the tenant's


def test_a_redis_that_refuses_the_password_is_not_said_to_be_unreachable():
    """A Redis that asks a password the URL lacks, or refuses the one it names: /health and the
    503 said "cannot connect to it", and the operator looked for a network fault. They say that
    Redis refused the connection, and why."""
    with redis_server("--requirepass", "s3cret") as (url, _):
        wrong = url.replace("redis://", "redis://:wrong@")
        for gateway_redis in (url, wrong):
            with serve_in_thread(gateway_settings(gateway={"redis_url": gateway_redis})) as (_, gateway_url):
                health = httpx.get(gateway_url + "/health").json()
                with pytest.raises(openai.APIStatusError) as refused:
                    client(gateway_url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
            for message in (health["shared_state"], refused.value.body["message"]):
                assert "Redis) is unavailable: it refused the connection: " in message, message
                assert "cannot connect" not in message and "s3cret" not in message and "wrong" not in message
        right = url.replace("redis://", "redis://:s3cret@")
        with serve_in_thread(gateway_settings(gateway={"redis_url": right})) as (_, gateway_url):
            assert httpx.get(gateway_url + "/health").json() == {"status": "ok"}


def test_a_session_past_its_deadline_is_refused_on_every_instance(redis_url):
    # The refusal after a session's deadline was kept in the memory of the instance that ran the
    # session: a call of the same id on another instance began a new session (a 200).
    from .test_gateway import SlowBackend

    flush(redis_url)
    tenants = {"acme": {"api_keys": [hash_key(ACME)], "sla": {"deadline_s": 1}}}
    s = gateway_settings(tenants, gateway={"redis_url": redis_url})
    with serve_in_thread(s, backend=SlowBackend()) as (_, url_one), serve_in_thread(s) as (two, url_two):

        def post(url: str) -> httpx.Response:
            headers = {"authorization": f"Bearer {ACME}", "x-session-id": "s1"}
            return httpx.post(url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 1}, headers=headers, timeout=10)

        assert post(url_one).status_code == 408  # its first call runs past the deadline
        for url in (url_one, url_two):
            refused = post(url)
            assert refused.status_code == 408 and "needs a new X-Session-ID" in refused.json()["error"]["message"]
        assert len(two.sessions) == 0


async def test_a_past_deadline_mark_is_shared_and_expires(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a, b = RedisState({}, redis_url, instance="a", prefix=prefix), RedisState({}, redis_url, instance="b", prefix=prefix)
    try:
        await a.place("s1", Placement("one"), 5)
        await a.mark_past_deadline("s1", 0.3)
        assert await b.place("s1", Placement("two"), 5) is None
        assert await b.place("s1", Placement("two"), 5) is None  # asking does not extend the mark
        time.sleep(0.4)
        assert await b.place("s1", Placement("two"), 5) == Placement("two")
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_call_that_used_more_than_its_charge_is_charged_the_rest_in_redis_too(redis_url):
    """A negative refund (a prompt the engine counted longer than its estimate) charges the
    difference, as the in-memory state does: Redis dropped it, and with such prompts a tenant
    got several times its tokens per minute."""
    limits = {"acme": RateLimit(None, 6000.0)}  # 100 tokens a second flow back
    for state in (MemoryState(limits), RedisState(limits, redis_url, instance="a", prefix=f"t-{uuid.uuid4().hex[:8]}")):
        try:
            assert (await state.take("acme", 1000)).wait_s == 0
            await state.refund("acme", -5000)
            assert 9 < (await state.take("acme", 1000)).wait_s <= 11  # 6,000 used of 6,000: 1,000 more is 10 s away
        finally:
            await state.aclose()


async def test_a_take_reads_the_buckets_alike_in_memory_and_in_redis(redis_url):
    """A take answers with the buckets' levels after it, for the x-ratelimit-* headers; Redis's
    script reads them as the in-memory buckets do, refused or taken."""
    limits = {"acme": RateLimit(2.0, 600.0)}  # 2 requests and 600 tokens a minute
    for state in (MemoryState(limits), RedisState(limits, redis_url, instance="a", prefix=f"t-{uuid.uuid4().hex[:8]}")):
        try:
            taken = await state.take("acme", 100)
            assert taken.wait_s == 0
            assert (taken.requests.limit, taken.tokens.limit) == (2, 600)
            assert 1 <= taken.requests.left < 1.01 and 500 <= taken.tokens.left < 501
            assert 29.5 < taken.requests.reset_s <= 30 and 9.9 < taken.tokens.reset_s <= 10  # 1 request, 100 tokens short
            assert (await state.take("acme", 100)).wait_s == 0
            refused = await state.take("acme", 100)
            assert refused.wait_s > 29 and refused.requests.left < 0.01 and 400 <= refused.tokens.left < 401
            assert (await state.take("nobody", 100)) == Taken(0.0)  # no limits: no levels
        finally:
            await state.aclose()


async def test_a_limit_under_one_request_a_minute_serves_a_call_once_its_bucket_is_full(redis_url):
    """requests_per_minute 0.5 (the settings take any rate above 0): one call, then the next two
    minutes later, in memory and in Redis alike (Redis asked for a whole request of a bucket that
    never holds one, and refused every call for good)."""
    limits = {"acme": RateLimit(0.5, None)}
    for state in (MemoryState(limits), RedisState(limits, redis_url, instance="a", prefix=f"t-{uuid.uuid4().hex[:8]}")):
        try:
            assert (await state.take("acme", 10)).wait_s == 0
            assert 119 < (await state.take("acme", 10)).wait_s <= 120
        finally:
            await state.aclose()


async def test_a_bucket_in_debt_outlives_the_hour_and_a_charge_on_a_bucket_not_stored_counts(redis_url):
    """Redis kept a tenant's buckets an hour whatever they owed: a 1,000-tokens-a-minute tenant
    that took 120,000 tokens owes two hours, and its bucket came back full after one. A charge
    after the call (the engine counted more than the estimate) on a bucket not stored (expired,
    or never taken) was dropped; memory counts it."""
    import redis

    prefix = f"t-{uuid.uuid4().hex[:8]}"
    limits = {"acme": RateLimit(None, 1000.0), "globex": RateLimit(None, 1000.0)}
    shared = RedisState(limits, redis_url, instance="a", prefix=prefix)
    memory = MemoryState(limits)
    try:
        for state in (memory, shared):
            assert (await state.take("acme", 120_000)).wait_s == 0
            await state.refund("globex", -300)  # no take before it: a full bucket, charged
        ttl = redis.Redis.from_url(redis_url).ttl(f"{prefix}:bucket:acme")
        assert 120 * 60 <= ttl <= 121 * 60  # 120,000 tokens short of full at 1,000 a minute: two hours, and a minute
        levels = [(await state.take("globex", 100)).tokens.left for state in (memory, shared)]
        assert all(599 < left <= 601 for left in levels), levels
    finally:
        await shared.aclose()
        await memory.aclose()


def test_a_redis_that_stops_answering_holds_no_call_for_long():
    """A frozen Redis host (SIGSTOP here): each call's end waited on its refund for redis-py's
    default timeout (5 s from redis-py 8; for ever before, and the calls hung). A tenant without
    limits is served at once; a limited one gets its 503 within the client's timeout of 1 s."""
    with redis_server() as (url, process):
        with serve_in_thread(gateway_settings(gateway={"redis_url": url})) as (_, gateway_url):
            client(gateway_url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=1)
            process.send_signal(signal.SIGSTOP)
            try:
                start = time.monotonic()
                reply = client(gateway_url, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=1)
                unlimited_s = time.monotonic() - start
                start = time.monotonic()
                with pytest.raises(openai.APIStatusError) as refused:
                    client(gateway_url, GLOBEX).chat.completions.create(model="m", messages=MSG, max_tokens=1)
                limited_s = time.monotonic() - start
            finally:
                process.send_signal(signal.SIGCONT)
    assert reply.usage.completion_tokens == 1 and refused.value.status_code == 503
    assert unlimited_s < 3.0 and limited_s < 3.0, (unlimited_s, limited_s)


def test_two_instances_ride_out_a_redis_restart():
    """Redis killed and started again on its port, its data lost: meanwhile a tenant with limits
    gets a 503 state_unavailable at once on both instances (a tenant without them is served);
    then both serve again by themselves, from full buckets, held jointly as before, and count
    the service given before, during and after the restart once."""
    tenants = {
        "acme": {"api_keys": [hash_key(ACME)], "tier": "critical"},  # alone in its band: its counter is its service
        "globex": {"api_keys": [hash_key(GLOBEX)], "requests_per_minute": 4},
    }
    headers = {"authorization": f"Bearer {GLOBEX}"}
    body = {"model": "m", "messages": MSG, "max_tokens": 1}
    with redis_server() as (url, process):
        s = gateway_settings(tenants, gateway={"redis_url": url})
        with serve_in_thread(s) as (one, url_one), serve_in_thread(s) as (two, url_two):
            replies = [client(url_one, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=3)]
            for gateway_url in (url_one, url_two, url_one):
                assert httpx.post(gateway_url + "/v1/chat/completions", json=body, headers=headers).status_code == 200
            process.kill()
            process.wait()
            for gateway_url in (url_one, url_two):
                refused = httpx.post(gateway_url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
                assert refused.status_code == 503 and refused.json()["error"]["type"] == "state_unavailable"
                assert refused.headers["retry-after"] == "1"
                assert httpx.get(gateway_url + "/health").json()["status"] == "degraded"
            replies.append(client(url_two, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=3))
            with redis_server(port=httpx.URL(url).port):  # the same port, empty
                served = httpx.post(url_two + "/v1/chat/completions", json=body, headers=headers, timeout=10)
                assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "3"
                for gateway_url in (url_one, url_two, url_one):
                    assert httpx.post(gateway_url + "/v1/chat/completions", json=body, headers=headers).status_code == 200
                for gateway_url in (url_one, url_two):
                    assert httpx.post(gateway_url + "/v1/chat/completions", json=body, headers=headers).status_code == 429
                    assert httpx.get(gateway_url + "/health").json() == {"status": "ok"}
                replies.append(client(url_one, ACME).chat.completions.create(model="m", messages=MSG, max_tokens=3))
                acme = sum(r.usage.prompt_tokens * INPUT_WEIGHT + r.usage.completion_tokens * OUTPUT_WEIGHT for r in replies)
                queues = one.scheduler.dispatcher._queue, two.scheduler.dispatcher._queue
                deadline = time.monotonic() + 10
                while any(q.counter("acme") < acme for q in queues) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(3 * FAIR_SHARE_SYNC_S)  # a second count would land by now
                assert [q.counter("acme") for q in queues] == [acme, acme]


def test_a_session_this_instance_runs_goes_on_while_redis_is_away():
    """A session's calls looked its placement up in Redis each time: with Redis frozen, a session
    already running here (of a tenant without limits) had every call refused with a 503. It goes
    on; a new session still needs the shared placement, a 503."""
    with redis_server() as (url, process):
        with serve_in_thread(gateway_settings(gateway={"redis_url": url})) as (gateway, gateway_url):
            def call(session_id: str) -> object:
                headers = {"X-Session-ID": session_id}
                return client(gateway_url, ACME).with_options(default_headers=headers).chat.completions.create(model="m", messages=MSG, max_tokens=1)

            call("s1")
            process.send_signal(signal.SIGSTOP)
            try:
                reply = call("s1")
                with pytest.raises(openai.APIStatusError) as refused:
                    call("s2")
            finally:
                process.send_signal(signal.SIGCONT)
            assert len(gateway.sessions) == 1
    assert reply.usage.completion_tokens == 1 and refused.value.status_code == 503


def test_a_frozen_redis_holds_no_answer_of_a_tenant_without_limits_and_counts_its_service_once():
    """Each call's end waited for its fair-share write to Redis: with Redis frozen (SIGSTOP), every
    answer of a tenant without limits, which needs nothing of Redis, came REDIS_TIMEOUT_S (1 s)
    late, and a session's twice that. The sync writes each instance's service since it started
    instead, a total that a write landing late or sent again never counts twice: once Redis is
    back, the peer is charged that service once, and the instance that served it not at all."""
    with redis_server() as (url, process):
        s = gateway_settings(gateway={"redis_url": url})
        with serve_in_thread(s) as (one, url_one), serve_in_thread(s) as (two, _):
            c = httpx.Client(base_url=url_one, timeout=30)

            def call(session: str | None = None) -> tuple[dict, float]:
                headers = {"authorization": f"Bearer {ACME}", **({"x-session-id": session} if session else {})}
                start = time.monotonic()
                with c.stream("POST", "/v1/chat/completions", json={"messages": MSG, "max_tokens": 3}, headers=headers) as answer:
                    answer.read()  # to the answer's end
                return answer.json(), time.monotonic() - start

            time.sleep(2 * FAIR_SHARE_SYNC_S)  # both syncs took their baseline
            replies = [call()[0], call("s1")[0]]
            process.send_signal(signal.SIGSTOP)
            try:
                plain = [call() for _ in range(3)]
                time.sleep(REDIS_TIMEOUT_S + 2 * FAIR_SHARE_SYNC_S)  # the sync found Redis away
                in_session = [call("s1") for _ in range(2)]
            finally:
                process.send_signal(signal.SIGCONT)
            replies += [reply for reply, _ in plain + in_session]
            served = sum(r["usage"]["prompt_tokens"] * INPUT_WEIGHT + r["usage"]["completion_tokens"] * OUTPUT_WEIGHT for r in replies)
            deadline = time.monotonic() + 10
            while two.scheduler.dispatcher._queue.counter("acme") < served and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(3 * FAIR_SHARE_SYNC_S)  # the writes that timed out land, and are read again
            counted = one.scheduler.dispatcher._queue.counter("acme"), two.scheduler.dispatcher._queue.counter("acme")
            c.close()
    assert max(seconds for _, seconds in plain) < 0.5, plain
    # Nor a session's: with Redis known away, it skips the placement lookup (which took
    # REDIS_TIMEOUT_S a call, to go on as it does now).
    assert max(seconds for _, seconds in in_session) < 0.5, in_session
    assert counted == (served, served)


async def test_a_bucket_stored_by_a_clock_ahead_is_not_emptied(redis_url):
    """A failover to a Redis whose clock is behind (or a step back): the level read was the stored
    one plus a negative refill, and a tenant with 59 of 60 requests left waited 61 s."""
    import redis.asyncio as redis

    prefix = f"t-{uuid.uuid4().hex[:8]}"
    state = RedisState({"acme": RateLimit(60.0, 6000.0)}, redis_url, instance="a", prefix=prefix)
    try:
        async with redis.Redis.from_url(redis_url) as r:
            seconds, micros = await r.time()
            ahead = seconds + micros / 1e6 + 119  # stored two minutes ahead of this clock
            await r.hset(f"{prefix}:bucket:acme", mapping={"r": "59", "rt": str(ahead), "k": "5000", "kt": str(ahead)})
        taken = await state.take("acme", 100)
        assert taken.wait_s == 0 and taken.requests is not None and 57.9 < taken.requests.left <= 58.0
        # One short of a request, refused: its refill starts now, not when the clock catches up.
        async with redis.Redis.from_url(redis_url) as r:
            await r.hset(f"{prefix}:bucket:acme", mapping={"r": "0.5", "rt": str(ahead)})
        assert 0.4 < (await state.take("acme", 100)).wait_s <= 0.5
        await anyio.sleep(0.6)
        assert (await state.take("acme", 100)).wait_s == 0
    finally:
        await state.aclose()


@contextlib.asynccontextmanager
async def two_instances(redis_url: str):
    """Two instances' shared state on a key prefix of their own: (prefix, a, b)."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    a = RedisState({}, redis_url, instance="a", prefix=prefix)
    b = RedisState({}, redis_url, instance="b", prefix=prefix)
    try:
        yield prefix, a, b
    finally:
        await a.aclose()
        await b.aclose()


async def test_the_peers_service_is_the_total_less_this_instance_s_own(redis_url):
    """An instance's own service was kept in a key that expired after an hour without writing
    (cut off from Redis) or under eviction: its past service then read as its peers' and its
    dispatcher charged the tenant again (720 -> 1,440 with no call). It is counted in memory."""
    import redis

    async with two_instances(redis_url) as (prefix, a, b):
        await a.add_usage("acme", 720.0)
        await b.add_usage("acme", 100.0)
        await b.add_usage("globex", 5.0)
        assert await a.peer_usage() == {"acme": 100.0, "globex": 5.0}
        assert await b.peer_usage() == {"acme": 720.0, "globex": 0.0}
        with redis.Redis.from_url(redis_url) as r:
            assert [k.decode() for k in r.keys(f"{prefix}:*")] == [f"{prefix}:usage"]  # nothing else to lose


async def test_the_peers_service_is_counted_on_after_the_usage_counters_are_lost(redis_url):
    """The counters' hash lost (a Redis restarted without persistence, flushed, or the key
    evicted): each instance's own service, counted in its memory, still held all its past
    service, so the peers' read far below 0 (-670 here) and the fair-share sync charged none of
    their service until they made up everything read before (hours of service: the instances
    no longer counted each other). The peers' service goes on from where it was."""
    import redis

    async with two_instances(redis_url) as (prefix, a, b):
        await a.add_usage("acme", 720.0)
        await b.add_usage("acme", 100.0)
        assert await a.peer_usage() == {"acme": 100.0} and await b.peer_usage() == {"acme": 720.0}
        with redis.Redis.from_url(redis_url) as r:
            r.delete(f"{prefix}:usage")
        await b.add_usage("acme", 50.0)
        assert await a.peer_usage() == {"acme": 150.0}  # read before its own first write
        await a.add_usage("acme", 10.0)
        await b.add_usage("globex", 5.0)
        assert await a.peer_usage() == {"acme": 150.0, "globex": 5.0}
        assert await b.peer_usage() == {"acme": 730.0, "globex": 0.0}


async def test_the_service_written_again_counts_once_and_an_instance_restarted_counts_anew(redis_url):
    """Each instance writes its service so far at every sync: written again (a write that timed
    out, sent again) it counts once; an instance restarted under the same name counts from 0
    again, beside what it served before (a field that is only raised would hide it)."""
    async with two_instances(redis_url) as (prefix, a, b):
        await a.add_usage("acme", 100.0)
        for _ in range(3):
            await a.peer_usage()
        assert await b.peer_usage() == {"acme": 100.0}
        again = RedisState({}, redis_url, instance="a", prefix=prefix)
        try:
            await again.add_usage("acme", 30.0)
            assert await b.peer_usage() == {"acme": 130.0}
            assert await again.peer_usage() == {"acme": 100.0}  # its former self's: the sync's baseline
        finally:
            await again.aclose()


async def test_the_fields_of_a_process_gone_silent_are_dropped_and_its_service_still_counted(redis_url, monkeypatch):
    """The usage hash held a field per tenant for every process that ever ran, read at every
    sync: it grew at each restart. A process silent for USAGE_SILENCE_S is dropped from it; its
    peers still count what they read of it, and one that was only cut off writes it back."""
    import redis.asyncio as redis

    from fleetsched.gateway import state

    monkeypatch.setattr(state, "USAGE_SILENCE_S", 1)
    async with two_instances(redis_url) as (prefix, a, b):
        await a.add_usage("acme", 100.0)
        assert await b.peer_usage() == {"acme": 100.0}
        await anyio.sleep(2.2)  # Redis's clock counts whole seconds
        assert await b.peer_usage() == {"acme": 100.0}  # a's fields dropped, what b read kept
        async with redis.Redis.from_url(redis_url) as r:
            fields = await r.hkeys(f"{prefix}:usage")
            assert not [f for f in fields if f.endswith(a._incarnation)], fields
            assert b"acme\x00" + b._incarnation not in fields  # b served none: none written
        await a.add_usage("acme", 20.0)  # back: its totals so far, written again
        assert await b.peer_usage() == {"acme": 120.0}


async def test_the_usage_counters_of_a_deployment_gone_expire(redis_url, monkeypatch):
    """Every other key expires (buckets, placements, marks); the usage hash had no expiry, and the
    one of every deployment retired (or given another redis_prefix) stayed in Redis for good. It
    expires USAGE_SILENCE_S after its last write, and the peers still count what they read of it."""
    import redis.asyncio as redis

    from fleetsched.gateway import state

    async with two_instances(redis_url) as (prefix, a, b):
        await a.add_usage("acme", 100.0)
        async with redis.Redis.from_url(redis_url) as r:
            assert 0 < await r.ttl(f"{prefix}:usage") <= state.USAGE_SILENCE_S
        monkeypatch.setattr(state, "USAGE_SILENCE_S", 1)
        assert await b.peer_usage() == {"acme": 100.0}
        await anyio.sleep(1.2)  # neither writes: both gone, say
        async with redis.Redis.from_url(redis_url) as r:
            assert not await r.exists(f"{prefix}:usage")
        await a.add_usage("acme", 20.0)  # back
        assert await b.peer_usage() == {"acme": 120.0}


async def test_the_peers_gone_are_forgotten_and_their_service_still_counted(redis_url, monkeypatch):
    """Each instance kept the highest total of every field of every peer process it ever read, for
    as long as it ran, and summed them all at every sync: a field per tenant more with each peer
    started (1,000 tenants and a peer restarted every 10 minutes: 144,000 a day, 0.6 s of the
    event loop at each sync). A peer missing from the hash for USAGE_SILENCE_S is gone: its
    service is kept per tenant."""
    import redis.asyncio as redis

    from fleetsched.gateway import state

    monkeypatch.setattr(state, "USAGE_SILENCE_S", 1)
    async with two_instances(redis_url) as (prefix, a, b):
        for i in range(3):  # three peers served acme and globex, one after the other, and went
            peer = RedisState({}, redis_url, instance=f"gone{i}", prefix=prefix)
            await peer.add_usage("acme", 10.0)
            await peer.add_usage("globex", 1.0)
            await peer.aclose()
        await a.add_usage("acme", 5.0)
        assert await b.peer_usage() == {"acme": 35.0, "globex": 3.0}
        async with redis.Redis.from_url(redis_url) as r:
            await r.delete(f"{prefix}:usage")  # a Redis restarted: every peer missing at once
        await a.add_usage("acme", 5.0)  # back at its next sync
        assert await b.peer_usage() == {"acme": 40.0, "globex": 3.0}
        await anyio.sleep(1.1)
        await a.peer_usage()
        assert await b.peer_usage() == {"acme": 40.0, "globex": 3.0}  # a's kept, the gone ones' too
        assert list(b._peers) == [a._incarnation]


async def test_the_service_of_a_call_cut_short_is_shared_with_the_peers(redis_url):
    """Only a call answered 200 added its service to Redis: one cut by its deadline (408) or its
    client after the engine made 320 tokens was charged here and left the peers unaware."""
    from fleetsched.gateway.app import Gateway, _Outcome

    flush(redis_url)
    gateway = Gateway(gateway_settings(gateway={"redis_url": redis_url}))
    peer = RedisState({}, redis_url, instance="peer")
    try:
        for status in (408, 499, 200):
            done = _Outcome()
            done.sent, done.prompt_tokens, done.completion_tokens = True, 10, 320
            await gateway._settle("acme", 10, 400, done, status)
        await gateway.state.peer_usage()  # its fair-share sync's round writes them, off the calls' path
        assert await peer.peer_usage() == {"acme": 3 * (10 * INPUT_WEIGHT + 320 * OUTPUT_WEIGHT)}
    finally:
        await gateway.state.aclose()
        await peer.aclose()


async def test_a_reading_of_the_peers_low_for_a_moment_is_not_charged_twice():
    """The sync charged every rise since its last reading: a reading low for a moment (this
    instance's service counted, its write not yet in Redis) followed by the right one charged
    the tenant that call's cost as the peers'."""
    readings = [{"acme": 100.0}, {"acme": 95.0}, {"acme": 100.0}, {"acme": 130.0}]
    assert await _charged_by_fair_share_sync(readings) == [("acme", 30.0)]


async def _charged_by_fair_share_sync(readings: list[dict[str, float]]) -> list[tuple[str, float]]:
    """What a gateway's fair-share sync charges its dispatcher as the peers' service, given
    `readings` of the peers' usage one a round, then none."""
    from types import SimpleNamespace

    from fleetsched.gateway.app import Gateway

    charged: list[tuple[str, float]] = []
    left = iter(readings)
    gateway = Gateway(gateway_settings())

    async def peer_usage():
        try:
            return next(left)
        except StopIteration:
            await anyio.sleep_forever()

    gateway.state.peer_usage = peer_usage
    gateway.scheduler = SimpleNamespace(dispatcher=SimpleNamespace(charge_external=lambda t, c: charged.append((t, c))))
    with anyio.move_on_after((len(readings) + 1) * FAIR_SHARE_SYNC_S):
        await gateway._sync_fair_share()
    return charged


async def test_each_placement_pushes_its_expiry_back(redis_url):
    """A session asked for again keeps its placement for another ttl from then, in memory and in Redis alike."""
    for state in (MemoryState({}), RedisState({}, redis_url, instance="a", prefix=f"t-{uuid.uuid4().hex[:8]}")):
        try:
            assert await state.place("s1", Placement("one"), 0.3) == Placement("one")
            assert await state.place("s1", Placement("two"), 30) == Placement("one")
            await anyio.sleep(0.5)
            assert await state.place("s1", Placement("two"), 30) == Placement("one")
        finally:
            await state.aclose()


async def test_a_past_deadline_mark_expires_in_memory_too():
    """An instance alone refuses a session past its deadline for the mark's ttl, then takes the id as a new session."""
    state = MemoryState({})
    await state.place("s1", Placement("one"), 5)
    await state.mark_past_deadline("s1", 0.3)
    assert await state.place("s1", Placement("two"), 5) is None
    await anyio.sleep(0.5)
    assert await state.place("s1", Placement("two"), 5) == Placement("two")


async def test_many_sessions_in_memory_keep_the_live_placements_and_marks():
    """Past 1,024 sessions the in-memory table drops only expired entries: a live past-deadline mark and placement stay."""
    state = MemoryState({})
    await state.place("kept", Placement("one"), 60)
    await state.mark_past_deadline("late", 60)
    for i in range(1100):
        await state.place(f"s{i}", Placement("one"), 60)
    assert await state.place("late", Placement("two"), 60) is None
    assert await state.place("kept", Placement("two"), 60) == Placement("one")


async def test_new_sessions_past_1024_live_ones_do_not_each_sweep_the_whole_table():
    """A new session sweeps the in-memory table only once it has doubled since the last sweep.
    Swept by every new session once 1,024 were live, each scanned them all: opening N sessions
    cost N squared (8,000 took 4 s of the event loop, the other calls waiting through it)."""
    state = MemoryState({})
    sweeps = 0
    table = state._placements
    for i in range(4000):
        await state.place(f"s{i}", Placement("one"), 60)
        if state._placements is not table:  # a sweep builds a new table
            sweeps += 1
            table = state._placements
    assert sweeps <= 3  # at 1,025, 2,050 and 4,100 live sessions at most
    assert len(state._placements) == 4000  # nothing live was dropped


async def test_the_peers_service_to_a_tenant_not_configured_here_is_not_charged():
    """The fair-share sync charges only tenants this instance knows; another deployment's tenant in Redis is skipped."""
    readings = [{"acme": 0.0, "ghost": 0.0}, {"acme": 10.0, "ghost": 50.0}]
    assert await _charged_by_fair_share_sync(readings) == [("acme", 10.0)]


async def test_a_ttl_under_a_millisecond_still_places_a_session_in_redis(redis_url):
    """An idle time below Redis's 1 ms resolution is rounded up, not sent as an expiry Redis refuses."""
    state = RedisState({}, redis_url, instance="a", prefix=f"t-{uuid.uuid4().hex[:8]}")
    try:
        assert await state.place("s1", Placement("one"), 0.0001) == Placement("one")
        await state.mark_past_deadline("s1", 0.0001)
    finally:
        await state.aclose()


def test_a_redis_database_that_is_no_number_is_refused_when_the_state_is_made():
    """redis://host:port/x is a config error at once (redis-py read it as database 0, another deployment's state)."""
    from fleetsched.errors import ConfigError

    with pytest.raises(ConfigError, match="the database is a number"):
        RedisState({}, "redis://127.0.0.1:6379/x", instance="a")
