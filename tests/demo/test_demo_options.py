"""``kernel-ext demo``'s options and words, without starting anything: the "needs Python
3.11" message, ``--kernel`` (pydantic-ai by default, langgraph), the language (``--lang``, else
the browser's or the locale's, else English), each colleague's answers and pace (``--fast``,
``--step-delay``), and which conversations browsers may join. These run everywhere.
"""

from __future__ import annotations

import argparse
import io
import sys

import pytest
from support.demo_helpers import CJK

from kernel_ext.demo import EXIT_UNAVAILABLE, add_arguments, run
from kernel_ext.demo.script import (
    DEFAULT_BEAT,
    FAST_BEAT,
    KERNELS,
    LANGS,
    colleagues_for,
    is_conversation_id,
    wording,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_demo_on_python_3_10_exits_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    err = io.StringIO()
    assert run(_args("--headless"), err=err) == EXIT_UNAVAILABLE
    message = err.getvalue()
    assert "Python 3.11 or newer" in message
    assert "3.10.13" in message


def test_the_kernel_is_pydantic_ai_by_default_or_langgraph_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KERNELS == ("pydantic-ai", "langgraph")
    assert _args().kernel == "pydantic-ai"
    assert _args("--kernel", "langgraph").kernel == "langgraph"
    with pytest.raises(SystemExit):
        _args("--kernel", "crewai")


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="on 3.10 the demo first says it needs 3.11 (above)"
)
def test_without_langgraph_the_langgraph_kernel_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without langgraph (a fault this environment cannot cause: it is installed) the
    # langgraph kernel says what to install, and the default kernel still runs.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "langgraph" else real(name, *a),
    )
    err = io.StringIO()
    assert run(_args("--headless", "--kernel", "langgraph"), err=err) == EXIT_UNAVAILABLE
    assert "kernel-ext demo needs langgraph: install the demo extra" in err.getvalue()
    from kernel_ext.demo import missing_requirements

    assert missing_requirements() is None


@pytest.mark.parametrize("lang", LANGS)
def test_the_agent_asks_the_colleagues_a_message_names(lang: str) -> None:
    first, second = wording(lang).questions
    assert colleagues_for(first) == ["orders", "carrier"]
    assert colleagues_for(second) == ["orders"]
    assert colleagues_for("what does the carrier say?") == ["carrier"]
    assert colleagues_for("hello") == ["orders"]


@pytest.mark.parametrize(
    ("preferences", "lang"),
    [
        (["zh-CN"], "zh"),
        (["zh"], "zh"),
        (["ZH_tw.UTF-8"], "zh"),
        (["zh-Hant-TW"], "zh"),
        (["en-GB", "zh-CN"], "en"),
        (["fr-FR", "zh-CN", "en"], "zh"),  # the first the demo speaks
        (["fr-FR", "de"], "en"),  # none: the fallback
        (["zhx-CN", "english"], "en"),  # the primary language must match whole
        (["C"], "en"),
        (["", " "], "en"),
        ([], "en"),
    ],
)
def test_the_first_preferred_language_the_demo_speaks_is_chosen_else_english(
    preferences: list[str], lang: str
) -> None:
    from kernel_ext.demo.script import FALLBACK_LANG, pick_lang

    assert FALLBACK_LANG == "en"
    assert pick_lang(preferences) == lang


@pytest.mark.parametrize(
    ("environ", "lang"),
    [
        ({"LANG": "zh_CN.UTF-8"}, "zh"),
        ({"LANG": "en_US.UTF-8"}, "en"),
        ({"LC_MESSAGES": "zh_CN.UTF-8", "LANG": "en_US.UTF-8"}, "zh"),
        ({"LC_ALL": "C", "LC_MESSAGES": "zh_CN.UTF-8", "LANG": "zh_CN.UTF-8"}, "en"),
        ({"LC_ALL": "", "LANG": "zh_CN.UTF-8"}, "zh"),  # empty is unset
        ({"LANG": "POSIX"}, "en"),
        ({"LANGUAGE": "zh_CN"}, "en"),  # not a locale variable the rule reads
        ({}, "en"),
    ],
)
def test_headless_takes_the_language_of_the_locale_that_names_messages(
    environ: dict[str, str], lang: str
) -> None:
    from kernel_ext.demo.script import lang_of_locale

    assert lang_of_locale(environ) == lang


@pytest.mark.parametrize("lang", LANGS)
def test_each_colleague_answers_what_it_was_asked(lang: str) -> None:
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK

    first, follow_up = wording(lang).questions
    for script in (ORDERS_DESK[lang], CARRIER[lang]):
        assert script.reply(first) == (script.steps, script.answer)
        steps, answer = script.reply(follow_up)
        assert answer != script.answer  # not the first answer again
        assert ("Tuesday" if lang == "en" else "周二") in answer  # the day it shipped
        beats = sum(step.beats for step in steps)
        assert 10 <= beats * DEFAULT_BEAT <= 15
        assert len(steps) <= 10
        assert script.reply(follow_up.upper()) == (steps, answer)  # any case
        assert script.reply("") == (script.steps, script.answer)


def test_without_lang_the_language_is_chosen_and_lang_fixes_it() -> None:
    assert _args().lang is None  # the browser's (the page), the locale's (--headless)
    assert _args("--lang", "en").lang == "en"
    assert _args("--lang", "zh").lang == "zh"
    assert wording().tag == "zh-CN"
    assert wording("en").tag == "en"
    for words in (wording("zh"), wording("en")):
        assert set(words.page) == set(wording("zh").page)
        assert set(words.titles) == {"orders", "carrier"}
    english = wording("en")
    texts = [*english.questions, *english.titles.values(), *english.page.values()]
    assert [text for text in texts if CJK.search(text)] == []
    with pytest.raises(ValueError, match="the demo speaks zh and en"):
        wording("fr")
    with pytest.raises(SystemExit):
        _args("--lang", "fr")


def test_the_default_pace_is_watchable_and_fast_is_for_tests() -> None:
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK

    for scripts in (ORDERS_DESK, CARRIER):
        for script in scripts.values():
            beats = sum(step.beats for step in script.steps)
            assert 10 <= beats * DEFAULT_BEAT <= 15  # a person can watch the pane grow
            assert beats * FAST_BEAT < 1
            assert len(script.steps) <= 10  # within the throttle even at the fast pace
    assert set(ORDERS_DESK) == set(CARRIER) == set(LANGS)
    assert (_args().step_delay, _args().fast) == (None, False)
    assert _args("--fast").fast is True
    assert _args("--step-delay", "0.3").step_delay == 0.3
    with pytest.raises(SystemExit):
        _args("--fast", "--step-delay", "0.3")
    assert _args("--step-delay", "0").step_delay == 0.0


@pytest.mark.parametrize("value", ["-1", "-0.1", "nan", "inf", "soon"])
def test_a_negative_or_non_finite_step_delay_is_refused_with_exit_2(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel_ext.cli.entry import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", "--step-delay", value])
    assert exited.value.code == 2
    (error,) = capsys.readouterr().err.strip().splitlines()  # one line
    assert f"argument --step-delay: must be a number of seconds, 0 or more, got {value!r}" in error


@pytest.mark.parametrize(
    ("value", "ok"),
    [("demo-abc_1-2", True), ("demo-", False), ("conv-1", False), ("demo-a b", False), (3, False)],
)
def test_browsers_may_join_demo_conversations_only(value: object, ok: bool) -> None:
    assert is_conversation_id(value) is ok
