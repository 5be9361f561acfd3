"""``kernel-ext stop`` as a real subprocess against a stand-in for the relay's side of
``stop_call`` (``support.stop_helpers``: a real python-socketio server on 127.0.0.1 that
records each request and acknowledges it with the answer a test chose; the relay's own
handler comes later): each answer's line and exit code, answers it cannot use, no answer,
a refused join, and command lines it refuses before it connects.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from support.cli_helpers import CLI, cli_env
from support.stop_helpers import CALL, CONV, NO_ACK, stand_in_relay

from kernel_ext.protocol import STOP_ANSWERS
from kernel_ext.viewing.ask_stop import EXIT_CODES

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

TOKEN = "token-of-alice"


def stop(relay_url: str, *args: str | bytes, call: str | bytes = CALL) -> tuple[int, str, str]:
    """``kernel-ext stop`` for ``call`` of :data:`CONV`: exit code, stdout, stderr."""
    argv = [*CLI, "stop", "--url", relay_url, "--conversation", CONV, "--call-id", call]
    done = subprocess.run(
        [*argv, "--token", TOKEN, *args],
        env=cli_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def call_ids(n: int) -> list[str]:
    return [f"b{index:015x}" for index in range(n)]


# (acknowledgement, --lang, exit code, the line)
ANSWERS: list[tuple[dict[str, Any], str, int, str]] = [
    ({"answer": "stopping"}, "en", 0, "stopping {call}: Stopping…"),
    ({"answer": "stopping"}, "zh", 0, "stopping {call}：正在停止…"),
    (
        {"answer": "already_ended", "reason": "it returned"},
        "en",
        0,
        "already_ended {call}: The call had already ended (it returned)",
    ),
    ({"answer": "refused"}, "en", 1, "refused {call}: You may not stop this call"),
    ({"answer": "unknown"}, "en", 3, "unknown {call}: Unknown call"),
    ({"answer": "unreachable"}, "en", 4, "unreachable {call}: No worker reachable"),
]


def test_each_answer_is_one_line_and_its_exit_code() -> None:
    calls = call_ids(len(ANSWERS))
    answers = {call: ack for call, (ack, *_) in zip(calls, ANSWERS, strict=True)}
    with stand_in_relay(answers=answers) as relay:
        for call, (_, lang, code, line) in zip(calls, ANSWERS, strict=True):
            assert stop(relay.url, "--lang", lang, call=call) == (
                code,
                line.format(call=call) + "\n",
                "",
            )
        assert relay.stops == [{"v": 1, "room": CONV, "callId": call} for call in calls]
        assert relay.joins == [{"conversationId": CONV}] * len(calls)
        assert relay.auths == [{"token": TOKEN}] * len(calls)
    assert {ack["answer"] for ack, *_ in ANSWERS} == set(STOP_ANSWERS) == set(EXIT_CODES)


def test_a_reason_cannot_steer_the_terminal_and_is_cut() -> None:
    reason = "\x1b[31mred\ud800\n" + "x" * 1_000
    with stand_in_relay(answer={"answer": "refused", "reason": reason}) as relay:
        code, out, err = stop(relay.url, "--lang", "en")
    assert (code, err) == (1, "")
    assert out == (
        f"refused {CALL}: You may not stop this call (\\x1b[31mred\ufffd " + "x" * 190 + "…)\n"
    )


@pytest.mark.parametrize("ack", [{"answer": "yes"}, "stopping", {}, None, [1, 2]])
def test_an_answer_that_is_none_of_the_answers_is_a_failure_said_in_one_line(ack: Any) -> None:
    with stand_in_relay(answer=ack) as relay:
        code, out, err = stop(relay.url)
        assert len(relay.stops) == 1
    assert (code, out) == (5, "")
    prefix = "kernel-ext stop: the relay's answer to stop_call is not one of "
    assert err.startswith(prefix + "stopping, already_ended, unknown, refused, unreachable: ")
    assert err.count("\n") == 1


def test_no_answer_within_the_timeout_is_a_failure_said_in_one_line() -> None:
    with stand_in_relay(answer=NO_ACK) as relay:
        code, out, err = stop(relay.url, "--timeout", "1")
        assert len(relay.stops) == 1
    assert (code, out) == (5, "")
    assert err == "kernel-ext stop: the relay did not answer stop_call within 1 s\n"


def test_a_refused_join_sends_no_stop() -> None:
    with stand_in_relay(join_answer={"ok": False, "error": "forbidden"}) as relay:
        code, out, err = stop(relay.url)
        assert relay.stops == []
    assert (code, out) == (1, "")
    assert err == "kernel-ext stop: joining conversation 'conv-1' was refused: forbidden\n"


@pytest.mark.parametrize(
    ("args", "call", "message"),
    [
        ((), b"00f067aa0ba902b\xff", r"got '00f067aa0ba902b\udcff'"),
        ((), "00F067AA0BA902B7", "got '00F067AA0BA902B7'"),
        ((), "0" * 100_000, "… (100,000 characters)"),
        ((), "", "got ''"),
        (("--conversation", "c" * 513), CALL, "at most 512 characters"),
        (("--conversation", b"conv-\xff"), CALL, r"not text in this terminal's encoding"),
    ],
)
def test_hostile_ids_are_refused_in_one_line_before_connecting(
    args: tuple[str | bytes, ...], call: str | bytes, message: str
) -> None:
    with stand_in_relay() as relay:
        code, out, err = stop(relay.url, *args, call=call)
        assert relay.auths == []  # refused before it connects
    assert (code, out) == (2, "")
    assert err.startswith("kernel-ext stop: error: argument "), err
    assert message in err, err
    assert err.count("\n") == 1, err


def test_a_conversation_id_of_512_characters_is_taken() -> None:
    longest = "c" * 512
    with stand_in_relay() as relay:
        assert stop(relay.url, "--conversation", longest)[0] == 0
        assert relay.joins == [{"conversationId": longest}]
        assert relay.stops == [{"v": 1, "room": longest, "callId": CALL}]


def test_against_nothing_it_says_it_could_not_connect() -> None:
    with stand_in_relay() as relay:
        url = relay.url
    code, out, err = stop(url)  # the stand-in has stopped: nothing listens there
    assert (code, out) == (2, "")
    assert err.startswith(f"kernel-ext stop: cannot connect to {url}: nothing is listening"), err
