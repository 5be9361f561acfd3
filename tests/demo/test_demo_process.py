"""The whole ``kernel-ext demo`` as a subprocess: ``--headless`` on each kernel streams
every call to its terminal and exits 0, in the locale's language or ``--lang en``, also
``--redis``; a child that dies stops the others; Ctrl-C or SIGTERM stops every process, in
one line and without a traceback, in every phase: starting its processes, serving the page,
in the middle of a headless conversation (issue 33, item 4).

The agent needs pydantic-ai (Python ≥ 3.11): these tests skip without it.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from support.cli_helpers import assert_stopped_cleanly
from support.demo_helpers import CJK, FIRST_QUESTION, SECOND_QUESTION, Demo, alive, demo
from support.demo_helpers import skip_unless_kernel as _kernel
from support.demo_helpers import skip_without_pydantic_ai as _pydantic_ai
from support.network import RedisServer

from kernel_ext.demo.script import KERNELS, wording

CALL_HEADER = re.compile(r"^\[([0-9a-f]{8})\] ── ask_colleague ([0-9a-f]{16})$")


def _calls(lines: list[str]) -> dict[str, list[str]]:
    """The transcript's lines per callId (from each call's header line on)."""
    calls: dict[str, str] = {}
    per_call: dict[str, list[str]] = {}
    for line in lines:
        header = CALL_HEADER.match(line)
        if header:
            calls[header.group(1)] = header.group(2)
            per_call[header.group(2)] = []
            continue
        tag = line[1:9] if line.startswith("[") else None
        if tag in calls:
            per_call[calls[tag]].append(line[11:])
    return per_call


def _assert_no_child_left(running: Demo) -> None:
    pids = running.child_pids
    assert len(pids) == 4, running.err
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", KERNELS)
def test_headless_demo_streams_every_call_to_its_terminal_and_exits_0(kernel: str) -> None:
    """In Chinese: the locale's language (``LANG=zh_CN.UTF-8``, no ``--lang``)."""
    _kernel(kernel)
    from kernel_ext.demo.colleague_server import ORDERS_DESK

    argv = ("--headless", "--fast", "--kernel", kernel, "--time-limit", "60")
    with demo(*argv, locale="zh_CN.UTF-8") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        calls = _calls(running.out)
        assert len(calls) == 3  # two concurrent calls, then one
        for call_id, lines in calls.items():
            assert any(line.startswith("最终回复：") for line in lines), (call_id, lines)
            assert lines[-1] == "── 已结束 ──", (call_id, lines)
        first, second, third = calls
        assert len({first[:8], second[:8], third[:8]}) == 3
        carrier_line = "正在查询运单 1Z84F29A"
        orders = [c for c, lines in calls.items() if "▶ search_orders 开始" in lines]
        carrier = [c for c, lines in calls.items() if carrier_line in lines]
        assert len(orders) == 2
        assert len(carrier) == 1
        # Attribution: the envelope colleague's work never shows in the text colleague's
        # pane, and the other way round.
        assert carrier_line not in calls[orders[0]]
        assert "▶ search_orders 开始" not in calls[carrier[0]]
        assert "思考中…" in calls[orders[0]]
        assert running.out[0] == f"» {FIRST_QUESTION}"
        assert f"» {SECOND_QUESTION}" in running.out
        assert running.out.count("« 两位同事的答复：") == 1
        assert running.out.count("« 同事的答复：") == 1
        # The follow-up gets an answer to what it asked: the day order 42 shipped.
        answers = [line for line in running.out if line.startswith("« 订单组：")]
        assert answers == [
            f"« 订单组：{ORDERS_DESK['zh'].answer}",
            f"« 订单组：{ORDERS_DESK['zh'].reply(SECOND_QUESTION)[1]}",
        ]
        assert "周二发货" in answers[1]
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_headless_demo_with_lang_en_prints_no_chinese() -> None:
    """``--lang en`` wins over a Chinese locale."""
    _pydantic_ai()
    argv = ("--headless", "--fast", "--lang", "en", "--time-limit", "60")
    with demo(*argv, locale="zh_CN.UTF-8") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        calls = _calls(running.out)
        assert len(calls) == 3
        for call_id, lines in calls.items():
            assert any(line.startswith("Final answer: ") for line in lines), (call_id, lines)
            assert lines[-1] == "── Ended ──", (call_id, lines)
        assert "▶ search_orders started" in next(iter(calls.values()))
        assert running.out[0] == f"» {wording('en').questions[0]}"
        assert running.out.count("« Here is what my colleagues said:") == 1
        assert "« Orders desk: Order 42 shipped on Tuesday" in "\n".join(running.out)
        assert [line for line in running.out + running.err if CJK.search(line)] == []
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_headless_demo_without_lang_speaks_the_locales_language_else_english() -> None:
    _pydantic_ai()
    with demo("--headless", "--fast", "--time-limit", "60", locale="C.UTF-8") as running:
        assert running.finish() == 0, "\n".join(running.out + running.err)
        assert running.out[0] == f"» {wording('en').questions[0]}"
        assert [line for line in running.out + running.err if CJK.search(line)] == []


@pytest.mark.network
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_headless_demo_through_redis(redis_server: RedisServer) -> None:
    _pydantic_ai()
    with demo("--headless", "--redis", redis_server.url, "--fast", "--time-limit", "60") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        assert len(_calls(running.out)) == 3
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_when_a_child_dies_the_demo_stops_the_others_and_fails() -> None:
    _pydantic_ai()
    with demo("--time-limit", "90") as running:
        running.wait_for("Open http://")
        worker = next(line for line in running.err if "worker started" in line)
        os.kill(int(re.search(r"pid (\d+)", worker).group(1)), signal.SIGKILL)  # type: ignore[union-attr]
        assert running.finish() == 1
        assert any("the worker process exited" in line for line in running.err), running.err
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process(signum: int) -> None:
    _pydantic_ai()
    with demo("--time-limit", "90") as running:
        running.wait_for("Open http://")
        assert f"http://127.0.0.1:{running.port}/" in "\n".join(running.out)
        running.proc.send_signal(signum)
        assert running.finish() == {signal.SIGINT: 130, signal.SIGTERM: 143}[signum]
        _assert_no_child_left(running)
        out = "\n".join(running.out)
        assert_stopped_cleanly(running.proc.returncode, running.err, PROG, signum, BEFORE, out)


PROG = "kernel-ext demo"
BEFORE = r"kernel-ext demo: (\S+ started \(pid \d+\)|ready at .*)"
"""The demo's lines on stderr before a stop signal: its processes started, ready."""
PHASES = {
    "starting": ((), "colleague-orders started"),
    "headless, starting": (("--headless",), "colleague-orders started"),
    "headless, mid-call": (("--headless",), "▶"),  # a tool call's first line
}
"""Where a stop signal reaches the demo: its options, and the output it waits for first."""


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_stop_signal_in_any_phase_stops_every_process_in_one_line(
    phase: str, signum: int
) -> None:
    """At the colleagues' default pace a call lasts seconds: the signal comes mid-call."""
    _pydantic_ai()
    options, first = PHASES[phase]
    with demo(*options, "--time-limit", "90", locale="C.UTF-8") as running:
        running.wait_for(first)
        running.proc.send_signal(signum)
        code = running.finish()
        _assert_no_child_left(running)
        out = "\n".join(running.out)
        assert_stopped_cleanly(code, running.err, PROG, signum, BEFORE, out)
