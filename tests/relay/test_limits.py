"""The relay's admission caps (issue 36, item 4): browsers per web process and per identity,
conversations per browser, joins per second per browser — each at its bound and one past
it, against a real relay on 127.0.0.1 with python-socketio clients as browsers whose
tokens the test's ``authenticate`` hook maps to identities. A refusal is answered clearly
and counted; everything a browser held is released when it disconnects. The bucket's
arithmetic and the identity key rule are checked on their own with a clock the test
moves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import aiohttp
import pytest
import socketio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.network import serve_asgi
from support.relay_helpers import (
    NS,
    SECRET,
    Browser,
    block,
    frame,
    join,
    relay_server,
    seqs,
    worker,
)
from support.timing import CALL_TIMEOUT, FakeClock, wait_until

from kernel_ext.errors import ConfigError
from kernel_ext.observability import otel_metrics
from kernel_ext.relay import ChatRelay, allow_all, create_app
from kernel_ext.relay.limits import (
    DEFAULT_JOIN_RATE,
    DEFAULT_MAX_BROWSER_ROOMS,
    DEFAULT_MAX_BROWSERS,
    DEFAULT_MAX_PER_IDENTITY,
    Admission,
    identity_key,
)


class MixedKeys(dict[Any, Any]):
    """A dict identity JSON cannot sort (keys of two types)."""


def authenticate(auth: Any, environ: Any) -> Any:
    """``{"token": "user:<name>"}`` is ``<name>``; ``"dict:<name>"`` a fresh dict each time
    (unhashable; equal for one name); ``"list:<name>"`` a list; ``"mixed"`` a dict whose
    keys JSON cannot sort; ``"yes"`` is ``True``; anything else is refused."""
    token = auth.get("token") if isinstance(auth, dict) else None
    if not isinstance(token, str):
        return None
    kind, _, name = token.partition(":")
    if kind == "user":
        return name
    if kind == "dict":
        return {"user": name, "roles": ["viewer"]}
    if kind == "list":
        return [name, {"team": "a"}]
    if kind == "mixed":
        return MixedKeys({1: "one", "two": 2})
    return True if token == "yes" else None


def forbid_secret_rooms(identity: Any, room: str) -> bool:
    return not room.startswith("secret-")


@contextlib.asynccontextmanager
async def browsers_of(port: int, *tokens: str) -> AsyncIterator[list[Browser]]:
    """One connected browser per token (``token`` ``None``: no auth), closed at the end."""
    made: list[Browser] = []
    try:
        for i, token in enumerate(tokens):
            browser = Browser(f"browser-{i}", reconnect=False)
            made.append(browser)
            await browser.connect(port, auth=None if token is None else {"token": token})
        yield made
    finally:
        for browser in made:
            await browser.close()


async def refusal(port: int, token: str | None) -> dict[str, Any]:
    """What the relay answers a browser it refuses (its ``connect_error`` data); fails when
    the browser is accepted."""
    client = socketio.AsyncClient(reconnection=False)
    errors: list[Any] = []
    client.on("connect_error", errors.append, namespace=NS)
    try:
        with pytest.raises(socketio.exceptions.ConnectionError):
            await asyncio.wait_for(
                client.connect(
                    f"http://127.0.0.1:{port}",
                    namespaces=[NS],
                    auth=None if token is None else {"token": token},
                    transports=["websocket"],
                    wait_timeout=CALL_TIMEOUT,
                ),
                timeout=2 * CALL_TIMEOUT,
            )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.shutdown(), timeout=CALL_TIMEOUT)
    assert len(errors) == 1, errors
    answer: dict[str, Any] = errors[0]
    return answer


def record_frames(monkeypatch: pytest.MonkeyPatch) -> InMemoryMetricReader:
    """Point ``kernel_ext.relay.frames`` at an SDK meter read in memory (for this test)."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter(otel_metrics.METER_NAME)
    monkeypatch.setattr(
        otel_metrics, "relay_frames", meter.create_counter("kernel_ext.relay.frames")
    )
    return reader


def frames_by_outcome(reader: InMemoryMetricReader) -> dict[str, int]:
    data = reader.get_metrics_data()
    found: dict[str, int] = {}
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found[str(point.attributes["outcome"])] = int(getattr(point, "value", 0))
    return found


async def all_gone(relay: ChatRelay, browsers: int = 0) -> None:
    """Wait (with a deadline) until the relay has ``browsers`` browsers."""
    await wait_until(lambda: relay.stats()["browsers"] == browsers, 10, lambda: f"{relay.stats()}")


LIVE = "bystanders-room"


async def send_live(w: socketio.AsyncClient, seq: int) -> None:
    """One live block of ``LIVE`` (task ``live``), for a bystander of another identity."""
    await w.call("kx_blocks", frame(LIVE, [block(seq, task_id="live")]), namespace=NS)


async def got_every_live_block(bystander: Browser, n: int) -> None:
    """The bystander received live blocks 1 … ``n`` of ``LIVE``, each once, in order."""
    await bystander.wait_for(lambda blocks: len(blocks) >= n)
    assert seqs(bystander.blocks, "live") == list(range(1, n + 1))


def held(relay: ChatRelay) -> tuple[int, int, int]:
    stats = relay.stats()
    return stats["browsers"], stats["browser_identities"], stats["browser_rooms"]


# -- browsers of one identity ------------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_browsers_of_one_identity_are_capped_and_a_disconnect_frees_a_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A browser of another identity (a bystander, in another conversation) gets every live
    block, in order, while the refusals go on."""
    reader = record_frames(monkeypatch)
    async with (
        relay_server(authenticate=authenticate, max_per_identity=3) as (port, relay),
        worker(port) as w,
        browsers_of(port, "user:carol") as (bystander,),
        browsers_of(port, "user:alice", "user:alice", "user:alice") as alices,
    ):
        assert await join(bystander, LIVE) == {"ok": True}
        assert held(relay) == (4, 2, 1)
        await send_live(w, 1)
        answer = await refusal(port, "user:alice")
        await send_live(w, 2)
        assert answer == {
            "message": "too many browsers of this identity on this web process (at most 3)",
            "data": {"reason": "identity_limit", "limit": 3},
        }
        assert relay.stats()["rejected_identity_limit"] == 1
        # The refusal, and the two live frames so far.
        assert frames_by_outcome(reader) == {"identity_limit": 1, "accepted": 2}
        async with browsers_of(port, "user:bob"):  # another identity is not held back
            assert held(relay) == (5, 3, 1)
        await alices[0].close()
        await all_gone(relay, 3)
        async with browsers_of(port, "user:alice"):  # the freed slot
            assert held(relay) == (4, 2, 1)
            assert relay.stats()["rejected_identity_limit"] == 1
        await send_live(w, 3)
        await got_every_live_block(bystander, 3)
    assert held(relay) == (0, 0, 0)


WS_PATH = "/socket.io/?EIO=4&transport=websocket"


async def opened(session: aiohttp.ClientSession, port: int) -> aiohttp.ClientWebSocketResponse:
    """A raw Engine.IO connection over WebSocket, past its open packet."""
    ws = await session.ws_connect(f"ws://127.0.0.1:{port}{WS_PATH}")
    assert (await ws.receive_str(timeout=CALL_TIMEOUT)).startswith("0{")
    return ws


@pytest.mark.network
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cap", "reason"),
    [({"max_per_identity": 1}, "identity_limit"), ({"max_browsers": 1}, "browser_limit")],
)
async def test_a_browser_refused_by_a_cap_has_its_connection_closed(
    cap: dict[str, int], reason: str
) -> None:
    """Regression: a browser refused by a cap kept its Engine.IO connection open, so one
    token's 2,000 connections, 64 admitted, held all 2,000 (about 40 KiB each). A raw
    client that ignores its refusal is told why, then closed; the admitted one is not."""
    async with (
        relay_server(authenticate=authenticate, **cap) as (port, relay),
        aiohttp.ClientSession() as session,
    ):
        connect = f'40{NS},{{"token":"user:alice"}}'
        admitted, refused = await opened(session, port), await opened(session, port)
        try:
            await admitted.send_str(connect)
            assert (await admitted.receive_str(timeout=CALL_TIMEOUT)).startswith(f"40{NS},")
            await refused.send_str(connect)
            answer = await refused.receive_str(timeout=CALL_TIMEOUT)
            assert answer.startswith(f"44{NS},")
            assert reason in answer
            texts = []
            while True:  # what follows the refusal, until the relay closes the socket
                message = await refused.receive(timeout=CALL_TIMEOUT)
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                texts.append(message.data)
            assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert texts in ([], ["1"])  # at most Engine.IO's CLOSE packet
            assert relay.stats()[f"rejected_{reason}"] == 1
            assert held(relay) == (1, 1, 0)
            # The admitted connection is still there: it leaves and enters again.
            await admitted.send_str(f"41{NS},")
            await all_gone(relay)
            await admitted.send_str(connect)
            assert (await admitted.receive_str(timeout=CALL_TIMEOUT)).startswith(f"40{NS},")
            assert held(relay) == (1, 1, 0)
        finally:
            await admitted.close()
            await refused.close()


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_a_refused_browser_whose_connection_another_namespace_holds_stays_connected() -> None:
    """The application's own namespace on the same connection keeps it: only the relay's
    namespace refused it."""
    ready = create_app(
        SECRET, authenticate=authenticate, authorize_join=allow_all, max_per_identity=1
    )
    ready.sio.register_namespace(socketio.AsyncNamespace("/app"))
    async with serve_asgi(ready.app) as port, aiohttp.ClientSession() as session:
        connect = f'40{NS},{{"token":"user:alice"}}'
        first, second = await opened(session, port), await opened(session, port)
        try:
            await first.send_str(connect)
            assert (await first.receive_str(timeout=CALL_TIMEOUT)).startswith(f"40{NS},")
            await second.send_str("40/app,")
            assert (await second.receive_str(timeout=CALL_TIMEOUT)).startswith("40/app,")
            await second.send_str(connect)
            answer = await second.receive_str(timeout=CALL_TIMEOUT)
            assert answer.startswith(f"44{NS},")
            assert "identity_limit" in answer
            # Still open: once the first leaves, the second is admitted on it.
            await first.close()
            await all_gone(ready.relay)
            await second.send_str(connect)
            assert (await second.receive_str(timeout=CALL_TIMEOUT)).startswith(f"40{NS},")
            assert held(ready.relay) == (1, 1, 0)
        finally:
            await first.close()
            await second.close()


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_browsers_of_an_open_relay_have_no_identity_cap() -> None:
    """``True`` — every browser of a relay without an ``authenticate`` hook, and what a hook
    that only says yes returns — is nobody in particular: only ``max_browsers`` holds."""
    async with (
        relay_server(max_per_identity=2, max_browsers=5) as (port, relay),
        browsers_of(port, None, None, None, None, None),
    ):
        assert held(relay) == (5, 0, 0)
        assert (await refusal(port, None))["data"] == {"reason": "browser_limit", "limit": 5}
    async with (
        relay_server(authenticate=authenticate, max_per_identity=2) as (port, relay),
        browsers_of(port, "yes", "yes", "yes"),
    ):
        assert held(relay) == (3, 0, 0)


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_unhashable_identities_are_capped_by_equality_and_never_raise() -> None:
    async with relay_server(authenticate=authenticate, max_per_identity=2) as (port, relay):
        async with browsers_of(port, "dict:carol", "dict:carol", "dict:dave", "list:erin"):
            assert held(relay) == (4, 3, 0)
            answer = await refusal(port, "dict:carol")
            assert answer["data"] == {"reason": "identity_limit", "limit": 2}
            async with browsers_of(port, "mixed", "mixed"):  # no JSON: keyed by its repr
                assert held(relay) == (6, 4, 0)
                assert (await refusal(port, "mixed"))["data"]["reason"] == "identity_limit"
        await all_gone(relay)
        assert held(relay) == (0, 0, 0)
        assert relay.stats()["rejected_identity_limit"] == 2
        assert relay.stats().get("rejected_connect_error", 0) == 0


# -- browsers of one web process ---------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_browsers_of_one_web_process_are_capped_and_a_disconnect_frees_a_slot() -> None:
    async with (
        relay_server(authenticate=authenticate, max_browsers=3) as (port, relay),
        browsers_of(port, "user:a", "user:b", "user:c") as three,
    ):
        answer = await refusal(port, "user:d")
        assert answer == {
            "message": "too many browsers on this web process (at most 3)",
            "data": {"reason": "browser_limit", "limit": 3},
        }
        assert relay.stats()["rejected_browser_limit"] == 1
        await three[1].close()
        await all_gone(relay, 2)
        async with browsers_of(port, "user:d"):
            assert held(relay) == (3, 3, 0)
        async with worker(port):  # internal senders are not browsers
            assert relay.stats()["internal"] == 1
    assert held(relay) == (0, 0, 0)


# -- conversations per browser -----------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_conversations_per_browser_are_capped_and_leaving_frees_a_slot() -> None:
    async with (
        relay_server(
            authenticate=authenticate,
            authorize_join=forbid_secret_rooms,
            max_browser_rooms=3,
            join_burst=100,
        ) as (port, relay),
        browsers_of(port, "user:alice", "user:alice") as (browser, other),
    ):
        for room in ("c1", "c2", "c3"):
            assert await join(browser, room) == {"ok": True}
        assert await join(browser, "c4") == {"ok": False, "error": "room_limit", "limit": 3}
        assert await join(browser, "c2") == {"ok": True}  # held already: no new slot
        assert await join(other, "c4") == {"ok": True}  # the cap is per browser
        assert relay.stats()["rejected_room_limit"] == 1
        assert held(relay) == (2, 1, 4)
        ack = await browser.client.call(
            "leave_conversation", {"conversationId": "c1"}, namespace=NS, timeout=CALL_TIMEOUT
        )
        assert ack == {"ok": True}
        assert await join(browser, "c4") == {"ok": True}
        # A join the hook refuses holds no slot: a page trying conversations it may not watch
        # never runs out of them.
        for i in range(5):
            assert await join(other, f"secret-{i}") == {"ok": False, "error": "forbidden"}
        assert held(relay) == (2, 1, 4)
        assert await join(other, "c5") == {"ok": True}
        assert held(relay) == (2, 1, 5)
        await other.client.call(
            "leave_conversation", {"conversationId": "c5"}, namespace=NS, timeout=CALL_TIMEOUT
        )
        assert held(relay) == (2, 1, 4)
        await browser.close()
        await all_gone(relay, 1)
        assert held(relay) == (1, 1, 1)
    await all_gone(relay)
    assert held(relay) == (0, 0, 0)


# -- joins per second per browser --------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_a_burst_of_joins_past_the_bucket_is_refused_until_it_refills(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renderer that reconnects and joins its few conversations again is never refused:
    a new connection starts with a full bucket."""
    async with (
        relay_server(authenticate=authenticate, join_rate=2.0, join_burst=5) as (port, relay),
        worker(port) as w,
        browsers_of(port, "user:carol") as (bystander,),
        browsers_of(port, "user:alice") as (browser,),
    ):
        assert await join(bystander, LIVE) == {"ok": True}
        calls = [
            browser.client.call(
                "join_conversation", {"conversationId": f"c{i}"}, namespace=NS, timeout=10
            )
            for i in range(60)
        ]

        async def live_meanwhile() -> None:
            for seq in range(1, 11):
                await send_live(w, seq)

        *acks, _ = await asyncio.gather(*calls, live_meanwhile())
        # A browser of another identity gets every live block, in order, meanwhile.
        await got_every_live_block(bystander, 10)
        admitted = [ack for ack in acks if ack == {"ok": True}]
        refused = [ack for ack in acks if ack != {"ok": True}]
        assert len(admitted) >= 5
        assert refused
        for ack in refused:
            assert ack["ok"] is False
            assert ack["error"] == "join_rate"
            assert isinstance(ack["retryAfterMs"], int)
            assert ack["retryAfterMs"] >= 1
        stats = relay.stats()
        assert stats["rejected_join_rate"] == len(refused)
        # A refused join holds no slot (the bystander holds one).
        assert stats["browser_rooms"] == len(admitted) + 1
        # Logged on the 1st, 2nd, 4th … time (the count is the process's, across relays).
        logged = [r for r in caplog.records if "(join_rate)" in r.getMessage()]
        assert 1 <= len(logged) <= len(refused).bit_length() + 1
        # The page reconnects (a new connection: its bucket full) and joins its few
        # conversations again at once, while the old connection's bucket is still empty.
        for _ in range(3):
            async with browsers_of(port, "user:alice") as (again,):
                for room in ("c1", "c2", "c3"):
                    assert await join(again, room, have=[]) == {
                        "ok": True,
                        "replay": {"blocks": 0, "streams": 0, "missing": []},
                    }
        assert relay.stats()["rejected_join_rate"] == len(refused)

        async def joins_again() -> bool:
            ack = await browser.client.call(
                "join_conversation", {"conversationId": "later"}, namespace=NS, timeout=10
            )
            return bool(ack == {"ok": True})

        await wait_until(joins_again, 20, "no join was admitted again", interval=0.1)


# -- the rules on their own --------------------------------------------------------------


def refusals() -> tuple[Admission, list[tuple[str, str, str]], FakeClock]:
    rejected: list[tuple[str, str, str]] = []
    clock = FakeClock()

    def reject(sid: str, reason: str, what: str) -> None:
        rejected.append((sid, reason, what))

    admission = Admission(
        max_browser_rooms=100, join_rate=4.0, join_burst=3, reject=reject, clock=clock
    )
    return admission, rejected, clock


def test_the_bucket_admits_its_burst_then_its_rate() -> None:
    admission, rejected, clock = refusals()
    admission.connect("s1", "alice")
    assert [admission.join("s1", f"c{i}") for i in range(3)] == [None] * 3
    assert admission.join("s1", "c3") == {"ok": False, "error": "join_rate", "retryAfterMs": 250}
    clock.advance(0.1)
    assert admission.join("s1", "c3") == {"ok": False, "error": "join_rate", "retryAfterMs": 150}
    clock.advance(0.15)
    assert admission.join("s1", "c3") is None
    clock.advance(100)  # refills to the burst, no further
    assert [admission.join("s1", f"d{i}") for i in range(4)][-1] == {
        "ok": False,
        "error": "join_rate",
        "retryAfterMs": 250,
    }
    assert [reason for _, reason, _ in rejected] == ["join_rate"] * 3
    admission.disconnect("s1")
    assert admission.sizes() == {"browser_identities": 0, "browser_rooms": 0}
    admission.connect("s1", "alice")  # a new connection starts with a full bucket
    assert [admission.join("s1", f"e{i}") for i in range(3)] == [None] * 3


def test_the_defaults_and_the_burst_default_to_the_rooms_cap() -> None:
    admission = Admission(reject=lambda *_: None)
    assert (
        admission.max_browsers,
        admission.max_per_identity,
        admission.max_browser_rooms,
        admission.join_rate,
        admission.join_burst,
    ) == (
        DEFAULT_MAX_BROWSERS,
        DEFAULT_MAX_PER_IDENTITY,
        DEFAULT_MAX_BROWSER_ROOMS,
        DEFAULT_JOIN_RATE,
        DEFAULT_MAX_BROWSER_ROOMS,
    )
    assert Admission(max_browser_rooms=7, reject=lambda *_: None).join_burst == 7
    assert Admission(max_browser_rooms=None, reject=lambda *_: None).join_burst == 100
    relay = ChatRelay(SECRET, max_browsers=None, join_rate=None, max_browser_rooms=2)
    assert (relay.limits.max_browsers, relay.limits.join_rate) == (None, None)
    assert relay.limits.join_burst == 2


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_browsers", 0),
        ("max_per_identity", -1),
        ("max_browser_rooms", 2.5),
        ("join_burst", True),
        ("join_rate", 0),
        ("join_rate", float("nan")),
    ],
)
def test_a_bad_cap_is_a_config_error_naming_it(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=option):
        ChatRelay(SECRET, **{option: value})


class Unequal:
    """Hashable, but its equality raises."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no equality")


class Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


def test_the_identity_key_rule() -> None:
    assert identity_key(True) is None
    assert identity_key("alice") == "alice"
    assert identity_key(("alice", 1)) == ("alice", 1)
    assert identity_key({"b": [1], "a": 2}) == identity_key({"a": 2, "b": [1]})
    assert identity_key({"a": 1}) != identity_key({"a": 2})
    assert identity_key(["alice"]) != identity_key("alice")
    # A value JSON cannot hold counts by its repr.
    assert identity_key({"n": Decimal("1.5")}) == identity_key({"n": Decimal("1.5")})
    assert identity_key({"n": Decimal("1.5")}) != identity_key({"n": Decimal("2")})
    loop: list[Any] = []
    loop.append(loop)
    for odd in (loop, MixedKeys({1: "a", "b": 2}), Unhashable(), ("t", []), {"x": Unhashable()}):
        assert identity_key(odd) is not None  # never raises
    admission = Admission(max_per_identity=1, reject=lambda *_: None)
    admission.connect("s1", Unequal())
    admission.connect("s2", Unequal())  # an equality that raises: counted on its own
    admission.connect("s3", Unhashable())
    assert admission.sizes()["browser_identities"] == 3
    for sid in ("s1", "s2", "s3", "unknown"):
        admission.disconnect(sid)
    assert admission.sizes() == {"browser_identities": 0, "browser_rooms": 0}
