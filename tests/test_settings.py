"""kernel_ext.settings: one settings object for every KERNEL_EXT_* variable."""

from __future__ import annotations

import pytest

from kernel_ext.errors import ConfigError
from kernel_ext.settings import Settings, env_name, load_settings


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
    monkeypatch.setenv("KERNEL_EXT_SECRET", "s3cret")
    monkeypatch.setenv("KERNEL_EXT_RELAY_URL", "")  # empty: unset
    settings = load_settings(max_queue=None, namespace="/other")
    assert settings.targets == ("a.b:C.run", "d.e:f")
    assert settings.max_queue == 7
    assert settings.namespace == "/other"
    assert settings.relay_url is None
    assert settings.secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


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


def test_settings_are_immutable() -> None:
    settings = Settings()
    with pytest.raises(Exception, match="frozen"):
        settings.max_queue = 1  # type: ignore[misc]
