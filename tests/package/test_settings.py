"""kernel_ext.settings: one settings object for every KERNEL_EXT_* variable, and the two
rules that hold wherever a value is taken (issue 23, part 3): an internal secret of at least
16 bytes of UTF-8 (exactly 16 accepted, 15 refused, saying how to make one and never showing
it) and a Redis URL redis-py parses (shown without its password); every bad value named at
once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import socketio
from support.network import free_port

import kernel_ext
from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import LoopbackEmitter, RedisEmitter
from kernel_ext.errors import ConfigError
from kernel_ext.relay import ChatRelay, RelayRedisManager, create_app, mount_relay
from kernel_ext.settings import (
    MIN_SECRET_BYTES,
    Settings,
    check_redis_url,
    check_secret,
    env_name,
    load_callable,
    load_settings,
    read_settings,
    redacted_url,
)


def test_defaults_without_any_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RELAY_URL", "SECRET", "TARGETS", "MAX_QUEUE", "NAMESPACE"):
        monkeypatch.delenv(env_name(name), raising=False)
    settings = load_settings()
    assert settings.relay_url is None
    assert settings.secret_value() is None
    assert settings.targets == ()
    assert (settings.max_running_per_second, settings.max_streams, settings.max_queue) == (
        10.0,
        10_000,
        10_000,
    )
    assert settings.namespace == "/chat"


def test_variables_are_parsed_and_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNEL_EXT_TARGETS", " a.b:C.run , d.e:f ,, ")
    monkeypatch.setenv("KERNEL_EXT_MAX_QUEUE", "7")
    monkeypatch.setenv("KERNEL_EXT_SECRET", "s3cret-for-settings-tests")
    monkeypatch.setenv("KERNEL_EXT_RELAY_URL", "")  # empty: unset
    settings = load_settings(max_queue=None, namespace="/other")
    assert settings.targets == ("a.b:C.run", "d.e:f")
    assert settings.max_queue == 7
    assert settings.namespace == "/other"
    assert settings.relay_url is None
    assert settings.secret_value() == "s3cret-for-settings-tests"
    assert "s3cret-for-settings-tests" not in repr(settings)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KERNEL_EXT_MAX_QUEUE", "many"),
        ("KERNEL_EXT_MAX_QUEUE", "0"),
        ("KERNEL_EXT_MAX_RUNNING_PER_SECOND", "-1"),
        ("KERNEL_EXT_MAX_RUNNING_PER_SECOND", "nan"),
        ("KERNEL_EXT_NAMESPACE", "chat"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        load_settings()


def test_a_bad_argument_is_named_as_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"^max_streams"):
        load_settings(max_streams=-3)


def test_the_relay_caps_are_read_and_only_the_ones_set_reach_the_relay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MAX_BROWSERS", "MAX_PER_IDENTITY", "MAX_BROWSER_ROOMS", "JOIN_RATE"):
        monkeypatch.delenv(env_name(name), raising=False)
    assert load_settings().relay_caps() == {}
    monkeypatch.setenv("KERNEL_EXT_MAX_BROWSERS", "300")
    monkeypatch.setenv("KERNEL_EXT_JOIN_RATE", "0.5")
    settings = load_settings(max_per_identity=2)
    assert settings.relay_caps() == {"max_browsers": 300, "max_per_identity": 2, "join_rate": 0.5}
    assert load_settings(max_browsers="7").relay_caps()["max_browsers"] == 7  # a flag's text
    relay = ChatRelay("s3cret-for-settings-tests", **settings.relay_caps())
    assert (relay.limits.max_browsers, relay.limits.max_per_identity) == (300, 2)
    assert (relay.limits.max_browser_rooms, relay.limits.join_rate) == (100, 0.5)


def test_the_handshake_bounds_are_read_and_only_the_ones_set_reach_create_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MAX_HANDSHAKES", "MAX_HANDSHAKE_WAITING"):
        monkeypatch.delenv(env_name(name), raising=False)
    assert load_settings().handshake_bounds() == {}
    monkeypatch.setenv("KERNEL_EXT_MAX_HANDSHAKE_WAITING", "20")
    settings = load_settings(max_handshakes="2")  # a flag's text
    assert settings.handshake_bounds() == {"max_handshakes": 2, "max_handshake_waiting": 20}
    ready = create_app("s3cret-for-settings-tests", **settings.handshake_bounds())
    assert ready.turnstile is not None
    assert (ready.turnstile.max_handshakes, ready.turnstile.max_waiting) == (2, 20)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KERNEL_EXT_MAX_BROWSERS", "0"),
        ("KERNEL_EXT_MAX_PER_IDENTITY", "many"),
        ("KERNEL_EXT_MAX_BROWSER_ROOMS", "1.5"),
        ("KERNEL_EXT_JOIN_RATE", "inf"),
        ("KERNEL_EXT_JOIN_RATE", "0"),
    ],
)
def test_a_bad_relay_cap_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"^{variable} \("):
        load_settings()


def test_settings_are_immutable() -> None:
    settings = Settings()
    with pytest.raises(Exception, match="frozen"):
        settings.max_queue = 1  # type: ignore[misc]


def test_a_bad_variable_names_the_variable_and_the_field_it_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERNEL_EXT_MAX_STREAMS", "0")
    with pytest.raises(ConfigError, match=r"^KERNEL_EXT_MAX_STREAMS \(max_streams\): "):
        load_settings()


def test_load_callable_finds_a_function_or_a_dotted_attribute() -> None:
    assert load_callable("kernel_ext.settings:load_settings", "--hook") is load_settings
    assert load_callable("kernel_ext.settings:Settings.secret_value", "--hook") is (
        Settings.secret_value
    )


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("kernel_ext.settings", "must look like 'package.module:function'"),
        ("a:b:c", "must look like 'package.module:function'"),
        ("kx_no_such_module:f", "cannot be loaded \\(ModuleNotFoundError"),
        ("kernel_ext.settings:no_such_name", "cannot be loaded \\(AttributeError"),
        ("kernel_ext.settings:ENV_PREFIX", "is a str, not callable"),
    ],
)
def test_load_callable_names_what_and_the_spec_when_it_cannot_load(spec: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"^--hook '{spec}' {problem}|^--hook {problem}"):
        load_callable(spec, "--hook")


def test_the_describe_hook_is_loaded_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNEL_EXT_DESCRIBE", raising=False)
    assert load_settings().describe_hook() is None
    monkeypatch.setenv("KERNEL_EXT_DESCRIBE", " kernel_ext.settings:env_name ")
    assert load_settings().describe_hook() is env_name
    monkeypatch.setenv("KERNEL_EXT_DESCRIBE", "kernel_ext.settings:nothing_here")
    with pytest.raises(ConfigError, match=r"^KERNEL_EXT_DESCRIBE 'kernel_ext\.settings:nothing"):
        load_settings().describe_hook()


# -- the secret rule: 16 bytes of UTF-8, the same wherever a secret is taken ----------------

SIXTEEN_BYTES = ["0123456789abcdef", "a" * 14 + "é", "é" * 8, "😀" * 4]
FIFTEEN_BYTES = ["0123456789abcde", "a" * 13 + "é", "é" * 7 + "a", "😀" * 3 + "abc"]
HOW_TO = 'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'


def test_the_secret_rule_counts_utf8_bytes_not_characters() -> None:
    assert MIN_SECRET_BYTES == 16
    for secret in SIXTEEN_BYTES:
        assert len(secret.encode("utf-8")) == 16
        assert check_secret(secret) == secret
    for secret in FIFTEEN_BYTES:
        assert len(secret.encode("utf-8")) == 15
        with pytest.raises(ConfigError) as refused:
            check_secret(secret)
        assert str(refused.value) == (f"secret must be at least 16 bytes (UTF-8), got 15; {HOW_TO}")
    for bad in (None, 1234567890123456789, b"0123456789abcdef", "\ud800" * 16):
        with pytest.raises(ConfigError, match=r"^secret must be "):
            check_secret(bad)


def _enable(secret: str) -> None:
    kernel_ext.enable(relay_url=f"http://127.0.0.1:{free_port()}", secret=secret, tap=Tap())
    kernel_ext.disable(timeout=1)


def _from_environment(secret: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNEL_EXT_SECRET", secret)
    load_settings()


TAKERS: dict[str, Callable[[str, pytest.MonkeyPatch], object]] = {
    "KERNEL_EXT_SECRET": _from_environment,
    "load_settings(secret=)": lambda secret, _: load_settings(secret=secret),
    "enable(secret=)": lambda secret, _: _enable(secret),
    "ChatRelay": lambda secret, _: ChatRelay(secret),
    "mount_relay": lambda secret, _: mount_relay(socketio.AsyncServer(async_mode="asgi"), secret),
    "create_app": lambda secret, _: create_app(secret),
    "LoopbackEmitter": lambda secret, _: LoopbackEmitter("http://127.0.0.1:1", secret),
}


@pytest.mark.parametrize("take", TAKERS.values(), ids=TAKERS.keys())
def test_every_taker_of_the_secret_accepts_16_bytes_and_refuses_15_without_showing_it(
    take: Callable[[str, pytest.MonkeyPatch], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for secret in SIXTEEN_BYTES:
        take(secret, monkeypatch)
    for secret in FIFTEEN_BYTES:
        with pytest.raises(ConfigError, match="at least 16 bytes") as refused:
            take(secret, monkeypatch)
        assert secret not in str(refused.value)
        assert HOW_TO in str(refused.value)
    assert kernel_ext.enabled() is None


# -- Redis URLs -------------------------------------------------------------------------------

GOOD_REDIS_URLS = [
    "redis://127.0.0.1:6379/0",
    "redis://:hunter2@127.0.0.1:6379/1",
    "rediss://redis.example:6380",
    "unix:///var/run/redis/redis.sock?db=2",
]
BAD_REDIS_URLS = {
    "notaurl": "redis://, rediss://, unix://",
    "http://127.0.0.1:6379/0": "redis://, rediss://, unix://",
    "redis://:hunter2@127.0.0.1:notaport/0": "notaport",
    "redis://:hunter2@127.0.0.1:99999/0": "Port out of range",
}
REDIS_TAKERS: dict[str, Callable[[str, pytest.MonkeyPatch], object]] = {
    "KERNEL_EXT_REDIS_URL": lambda url, patch: (
        patch.setenv("KERNEL_EXT_REDIS_URL", url),
        load_settings(),
    ),
    "load_settings(redis_url=)": lambda url, _: load_settings(redis_url=url),
    "RelayRedisManager": lambda url, _: RelayRedisManager(url),
    "create_app(redis_url=)": lambda url, _: create_app(SIXTEEN_BYTES[0], redis_url=url),
    "RedisEmitter": lambda url, _: RedisEmitter(url),
}


def test_a_redis_url_is_one_redis_py_parses_and_is_shown_without_its_password() -> None:
    for url in GOOD_REDIS_URLS:
        assert check_redis_url(url) == url
    for url, problem in [*BAD_REDIS_URLS.items(), ("", "redis://, rediss:// or unix://")]:
        with pytest.raises(ConfigError, match=r"^url ") as refused:
            check_redis_url(url)
        assert problem in str(refused.value)
        assert "hunter2" not in str(refused.value)
    assert redacted_url("redis://:hunter2@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"
    assert redacted_url("redis://user:hunter2@[::1]:1/0") == "redis://user:***@[::1]:1/0"
    assert redacted_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    assert redacted_url("redis://:hunter2@[::1") == "<a URL that does not parse>"


@pytest.mark.parametrize("take", REDIS_TAKERS.values(), ids=REDIS_TAKERS.keys())
def test_every_taker_of_a_redis_url_refuses_one_that_does_not_parse(
    take: Callable[[str, pytest.MonkeyPatch], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for url in BAD_REDIS_URLS:
        with pytest.raises(ConfigError) as refused:
            take(url, monkeypatch)
        assert "hunter2" not in str(refused.value)
    for url in GOOD_REDIS_URLS:
        take(url, monkeypatch)


def test_enable_refuses_a_redis_url_that_does_not_parse_and_changes_nothing() -> None:
    with pytest.raises(ConfigError, match=r"^redis_url: is not a Redis URL .*'notaurl'"):
        kernel_ext.enable(redis_url="notaurl", tap=Tap())
    assert kernel_ext.enabled() is None


def test_every_bad_value_is_named_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNEL_EXT_SECRET", "short-secret")
    monkeypatch.setenv("KERNEL_EXT_MAX_QUEUE", "0")
    monkeypatch.setenv("KERNEL_EXT_REDIS_URL", "redis://:hunter2@127.0.0.1:notaport/0")
    with pytest.raises(ConfigError) as refused:
        load_settings(max_streams=-3)
    message = str(refused.value)
    assert message.startswith("4 problems: (1) KERNEL_EXT_SECRET (secret): must be at least 16")
    for number, where in enumerate(
        ["KERNEL_EXT_SECRET", "KERNEL_EXT_REDIS_URL", "max_streams", "KERNEL_EXT_MAX_QUEUE"], 1
    ):
        assert f"({number}) {where}" in message
    assert "short-secret" not in message
    assert "hunter2" not in message
    settings, problems = read_settings(max_streams=-3)
    assert sorted(problems) == ["max_queue", "max_streams", "redis_url", "secret"]
    assert (settings.secret_value(), settings.redis_url, settings.max_queue) == (None, None, 10_000)
