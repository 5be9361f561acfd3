"""A relay's options as one object (kernel_ext.relay.relay_settings.RelaySettings) and the
delivery its server's manager supplies (kernel_ext.relay.delivery): the keywords and the
object make the same relay, keywords win over the object, a bad bound is refused by name,
and the namespace asks the manager, not its type, how blocks reach the browsers."""

from __future__ import annotations

import dataclasses

import pytest
import socketio
from support.relay_helpers import SECRET

from kernel_ext.errors import ConfigError
from kernel_ext.relay import ChatRelay, RelayRedisManager, create_app, mount_relay
from kernel_ext.relay.relay_settings import RelaySettings

# Constructing a manager connects nothing; no Redis is reached in this module.
_NO_REDIS = "redis://127.0.0.1:1/0"


def test_the_settings_object_and_the_keywords_make_the_same_relay() -> None:
    by_keywords = ChatRelay(SECRET, catch_up=False, max_frame_blocks=7, hold_terminals=9)
    by_object = ChatRelay(
        SECRET, settings=RelaySettings(catch_up=False, max_frame_blocks=7, hold_terminals=9)
    )
    assert by_keywords.settings == by_object.settings
    assert by_object.catch_up_memory is None
    assert by_object.catch_up is None
    assert by_object.max_frame_blocks == 7
    assert by_object.hold_terminals == 9  # held for late joiners: no catch-up memory


def test_keywords_win_over_the_settings_object() -> None:
    relay = ChatRelay(SECRET, settings=RelaySettings(max_frame_blocks=5), max_frame_blocks=8)
    assert relay.max_frame_blocks == 8
    assert relay.settings == RelaySettings(max_frame_blocks=8)


def test_with_catch_up_no_terminal_is_held_for_late_joiners() -> None:
    relay = ChatRelay(SECRET, hold_terminals=9)
    assert relay.catch_up_memory is not None
    assert relay.hold_terminals == 0


def test_the_defaults_are_the_relays() -> None:
    assert ChatRelay(SECRET).settings == RelaySettings()


@pytest.mark.parametrize(
    "field", ["max_block_bytes", "max_frame_blocks", "max_pending_frames", "max_cursors"]
)
def test_a_frame_bound_that_is_not_positive_is_refused_by_name(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RelaySettings(**{field: 0})
    with pytest.raises(ConfigError, match=field):
        ChatRelay(SECRET, **{field: 0})


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        ChatRelay(SECRET, no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        create_app(SECRET, no_such_option=1)


def test_create_app_takes_a_settings_object_and_gives_the_manager_its_watch() -> None:
    settings = RelaySettings(worker_grace=7.0, max_workers=3, catch_up=False)
    ready = create_app(SECRET, redis_url=_NO_REDIS, settings=settings, max_worker_streams=11)
    assert ready.relay.settings == dataclasses.replace(settings, max_worker_streams=11)
    manager = ready.sio.manager
    assert isinstance(manager, RelayRedisManager)
    assert manager.worker_grace == 7.0
    assert manager.worker_sizes() == {"redis_workers_tracked": 0, "redis_worker_streams": 0}


@pytest.mark.parametrize(
    ("manager", "reserves", "concurrent", "holds_here"),
    [
        (None, True, False, True),  # the in-process manager: send_local, in order
        (socketio.AsyncRedisManager(_NO_REDIS, write_only=True), False, False, True),
        (RelayRedisManager(_NO_REDIS), False, False, False),  # the manager holds
    ],
    ids=["in-process", "python-socketio-redis", "relay-redis"],
)
def test_the_delivery_is_the_managers(
    manager: object, reserves: bool, concurrent: bool, holds_here: bool
) -> None:
    sio = socketio.AsyncServer(async_mode="asgi", client_manager=manager)
    relay = mount_relay(sio, SECRET)
    delivery = relay.delivery
    assert delivery is not None
    assert (delivery.reserves, delivery.concurrent) == (reserves, concurrent)
    assert delivery.memory is relay.catch_up_memory
    # Held for catch-up before the emit by the delivery itself, or by the Redis manager for
    # what it emits to this process's browsers: through the relay's delivery, attached.
    attached = getattr(sio.manager, "_relays", {}).get("/chat")
    assert (attached is None) == holds_here
    assert attached in (None, delivery)


def test_a_relay_not_mounted_has_no_delivery_and_says_so() -> None:
    relay = ChatRelay(SECRET)
    assert relay.delivery is None
    assert relay.readiness().reasons == ("namespace /chat not mounted",)
