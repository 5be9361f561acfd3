"""kernel_ext.settings: one settings object for every KERNEL_EXT_* variable."""

from __future__ import annotations

import pytest

from kernel_ext.errors import ConfigError
from kernel_ext.settings import Settings, env_name, load_callable, load_settings


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
