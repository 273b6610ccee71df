"""The progress channel: wire format (:mod:`tfelastic.trainer.progress`), the trainer's reporter and the agent's
listener (:mod:`tfelastic.daemon.worker.progress`), over real Unix datagram sockets. No sleeps: the reporter's
clock is replaced, and the listener is awaited on an event."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from tfelastic.daemon.worker.progress import ProgressListener
from tfelastic.trainer import progress
from tfelastic.trainer.progress import MAX_DATAGRAM, Phase, ProgressMessage, ProgressReporter, decode, encode

# ------------------------------------------------------------------------------------------------ wire format


@pytest.mark.parametrize("message", [
    ProgressMessage(generation=3, pid=4242, step=120),
    ProgressMessage(generation=3, pid=4242, step=120, examples=7680, loss=0.125, checkpoint_step=100),
    ProgressMessage(generation=0, pid=1, step=0, examples=0, loss=0.0, checkpoint_step=0),
    ProgressMessage(generation=2**40, pid=99999, step=2**53, loss=-1.5e-300),
    *(ProgressMessage(generation=1, pid=2, step=3, phase=phase) for phase in Phase),
    ProgressMessage(generation=1, pid=2, step=40, checkpoint_step=40, stall=0.012),
    ProgressMessage(generation=1, pid=2, step=40, restored_tier="local", restored_step=40),
    ProgressMessage(generation=1, pid=2, step=0, restored_tier="none"),
    ProgressMessage(generation=1, pid=2, step=40, exit_code=42),
    ProgressMessage(generation=1, pid=2, step=0, exit_code=0),
])
def test_encode_decode_round_trip(message: ProgressMessage) -> None:
    assert decode(encode(message)) == message


def test_encode_uses_the_documented_short_keys() -> None:
    data = encode(ProgressMessage(generation=3, pid=42, step=7, examples=70, loss=0.5, checkpoint_step=5))
    assert json.loads(data) == {"g": 3, "pid": 42, "step": 7, "examples": 70, "loss": 0.5, "ckpt": 5}
    assert json.loads(encode(ProgressMessage(1, 2, 3))) == {"g": 1, "pid": 2, "step": 3}
    assert json.loads(encode(ProgressMessage(1, 2, 3, phase=Phase.SAVE))) == {"g": 1, "pid": 2, "step": 3,
                                                                              "ph": "save"}


def test_fast_tier_fields_use_short_keys() -> None:
    saved = encode(ProgressMessage(1, 2, 40, checkpoint_step=40, stall=0.0123456789))
    assert json.loads(saved) == {"g": 1, "pid": 2, "step": 40, "ckpt": 40, "st": 0.012346}
    restored = encode(ProgressMessage(1, 2, 40, restored_tier="shared", restored_step=40))
    assert json.loads(restored) == {"g": 1, "pid": 2, "step": 40, "rt": "shared", "rs": 40}


@pytest.mark.parametrize("fields", [{"st": -1}, {"st": "0.1"}, {"st": True}, {"rt": "disk"}, {"rt": 1},
                                    {"rt": "local", "rs": 1.5}])
def test_decode_rejects_malformed_fast_tier_fields(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"'(st|rt|rs)'"):
        decode(json.dumps({"g": 1, "pid": 2, "step": 3, **fields}).encode())


def test_an_announced_exit_uses_its_short_key_and_refuses_what_no_exit_status_can_carry() -> None:
    assert json.loads(encode(ProgressMessage(1, 2, 40, exit_code=42))) == {"g": 1, "pid": 2, "step": 40, "x": 42}
    for code in ("42", 4.2, True):
        with pytest.raises(ValueError, match="'x' must be an integer"):
            decode(json.dumps({"g": 1, "pid": 2, "step": 3, "x": code}).encode())


def test_a_survivors_save_uses_its_short_key_and_refuses_what_is_no_step() -> None:
    message = ProgressMessage(1, 2, 37, survivor_save=37)
    assert json.loads(encode(message)) == {"g": 1, "pid": 2, "step": 37, "sv": 37}
    assert decode(encode(message)) == message
    for step in ("37", 3.7, True, -1, 2**53 + 1):
        with pytest.raises(ValueError, match="'sv'"):
            decode(json.dumps({"g": 1, "pid": 2, "step": 3, "sv": step}).encode())
    with pytest.raises(ValueError, match=r"^step -1 is not an integer in 0\.\."):
        ProgressReporter(None, 1).announce_survivor_save(-1)


def test_reporter_refuses_an_unknown_restore_tier_and_sends_a_restore_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'disk' is not one of local, none, shared, survivors"):
        ProgressReporter(None, 1).report(3, restored_tier="disk")


@pytest.mark.parametrize("phase", ["nap", 1, None, "TRAIN", [], {}])
def test_decode_rejects_an_unknown_phase_naming_the_known_ones(phase: object) -> None:
    with pytest.raises(ValueError, match="progress field 'ph' must be one of eval, save, setup, train, got"):
        decode(json.dumps({"g": 1, "pid": 2, "step": 3, "ph": phase}).encode())


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_encode_drops_a_loss_that_is_not_finite(loss: float) -> None:
    data = encode(ProgressMessage(generation=1, pid=2, step=3, loss=loss))
    assert json.loads(data) == {"g": 1, "pid": 2, "step": 3}
    assert decode(data) == ProgressMessage(generation=1, pid=2, step=3, loss=None)


def test_decode_accepts_an_integer_loss_as_a_float() -> None:
    message = decode(b'{"g":1,"pid":2,"step":3,"loss":2}')
    assert message.loss == 2.0
    assert isinstance(message.loss, float)


@pytest.mark.parametrize("data", [
    b"",
    b"not json",
    b'{"g":1,"pid":2,"step":',
    b"\xff\xfe\x00",
])
def test_decode_rejects_what_is_not_json(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


@pytest.mark.parametrize("data", [b"[1,2,3]", b"42", b'"step"', b"null", b"true"])
def test_decode_rejects_json_that_is_not_an_object(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"^progress datagram is not a JSON object$"):
        decode(data)


@pytest.mark.parametrize(("payload", "field"), [
    ({"pid": 2, "step": 3}, "g"),
    ({"g": 1, "step": 3}, "pid"),
    ({"g": 1, "pid": 2}, "step"),
    ({"g": None, "pid": 2, "step": 3}, "g"),
    ({}, "g"),
])
def test_decode_rejects_missing_required_fields(payload: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^progress field '{field}' must be an integer, got None$"):
        decode(json.dumps(payload).encode())


@pytest.mark.parametrize(("field", "value"), [
    ("g", True),
    ("g", "1"),
    ("pid", False),
    ("step", "3"),
    ("step", 3.0),
    ("step", [3]),
    ("examples", True),
    ("examples", "70"),
    ("ckpt", True),
    ("ckpt", "5"),
    ("ckpt", 5.5),
])
def test_decode_rejects_non_integers_where_integers_are_needed(field: str, value: object) -> None:
    payload: dict[str, object] = {"g": 1, "pid": 2, "step": 3, field: value}
    expected = f"progress field '{field}' must be an integer, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        decode(json.dumps(payload).encode())


@pytest.mark.parametrize("loss", [True, False, "0.5", [0.5], {"v": 1}])
def test_decode_rejects_a_loss_that_is_not_a_number(loss: object) -> None:
    payload = {"g": 1, "pid": 2, "step": 3, "loss": loss}
    with pytest.raises(ValueError, match=r"^progress field 'loss' must be a number"):
        decode(json.dumps(payload).encode())


def test_decode_rejects_an_oversized_datagram() -> None:
    base = b'{"g":1,"pid":2,"step":3}'
    exactly = base[:-1] + b"," + b'"pad":"' + b"x" * (MAX_DATAGRAM - len(base) - 9) + b'"}'
    assert len(exactly) == MAX_DATAGRAM
    assert decode(exactly) == ProgressMessage(1, 2, 3)  # unknown keys are ignored; the limit is inclusive
    oversized = exactly[:-2] + b'x"}'
    assert len(oversized) == MAX_DATAGRAM + 1
    with pytest.raises(ValueError, match=rf"^progress datagram of {MAX_DATAGRAM + 1} bytes exceeds {MAX_DATAGRAM}$"):
        decode(oversized)


# ------------------------------------------------------------------------------------------------ reporter


class FakeTime:
    """Stands in for the ``time`` module inside tfelastic.trainer.progress."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(progress, "time", fake)
    return fake


@pytest.fixture
def server(tmp_path: Path) -> Iterator[socket.socket]:
    """An agent-side socket: bound in tmp_path, non-blocking, so 'nothing was sent' is BlockingIOError."""
    path = tmp_path / "p.sock"
    assert len(str(path)) < 100, "AF_UNIX paths are limited to 107 bytes"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[ProgressMessage]:
    """Every datagram waiting on the socket. Unix datagrams are queued by sendto itself, so no wait is needed."""
    messages: list[ProgressMessage] = []
    while True:
        try:
            data = sock.recv(MAX_DATAGRAM + 1)
        except BlockingIOError:
            return messages
        messages.append(decode(data))


def test_reporter_without_a_socket_path_is_disabled() -> None:
    for path in (None, ""):
        reporter = ProgressReporter(path, generation=1)
        assert reporter.enabled is False
        assert reporter.report(1) is False
        assert reporter.report(2, force=True) is False
        assert reporter.report(3, checkpoint_step=3) is False


def test_reporter_from_env_without_the_agent_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.SOCKET_ENV, raising=False)
    monkeypatch.delenv(progress.GENERATION_ENV, raising=False)
    reporter = ProgressReporter.from_env()
    assert reporter.enabled is False
    assert reporter.report(1, force=True) is False


def test_reporter_from_env_reads_the_socket_and_generation(
        monkeypatch: pytest.MonkeyPatch, server: socket.socket) -> None:
    monkeypatch.setenv(progress.SOCKET_ENV, server.getsockname())
    monkeypatch.setenv(progress.GENERATION_ENV, "7")
    reporter = ProgressReporter.from_env()
    assert reporter.enabled is True
    assert reporter.report(5, examples=50, loss=0.75) is True
    assert received(server) == [ProgressMessage(7, os.getpid(), 5, 50, 0.75, None)]


def test_reporter_sends_what_was_reported(server: socket.socket, fake_time: FakeTime) -> None:
    reporter = ProgressReporter(server.getsockname(), generation=4, min_interval=0.0)
    assert reporter.enabled is True
    assert reporter.report(1) is True
    assert reporter.report(2, examples=64, loss=1.5) is True
    assert reporter.report(3, loss=math.nan, checkpoint_step=3) is True
    pid = os.getpid()
    assert received(server) == [
        ProgressMessage(4, pid, 1),
        ProgressMessage(4, pid, 2, examples=64, loss=1.5),
        ProgressMessage(4, pid, 3, checkpoint_step=3),
    ]


def test_an_exit_is_announced_at_once_at_the_last_step_reached_and_leaves_the_step_file_as_it_is(
        server: socket.socket, fake_time: FakeTime, tmp_path: Path) -> None:
    mark = str(tmp_path / "step")
    progress.reset_step_mark(mark)
    reporter = ProgressReporter(server.getsockname(), generation=4, step_file=mark)
    assert reporter.report(17) is True
    reporter.reached(18)  # marked, not reported: the throttle holds back what follows within 0.1 s...
    assert reporter.report(18) is False
    assert reporter.announce_exit(42) is True  # ... but not an exit
    assert reporter.announce_exit(42, step=16) is True
    pid = os.getpid()
    assert received(server) == [ProgressMessage(4, pid, 17), ProgressMessage(4, pid, 18, exit_code=42),
                                ProgressMessage(4, pid, 16, exit_code=42)]
    assert progress.read_step_mark(mark, 4) == 18  # the agent counts the steps made from the mark: never back
    assert reporter.announce_survivor_save(18) is True  # not throttled either
    assert received(server) == [ProgressMessage(4, pid, 18, survivor_save=18)]


@pytest.mark.parametrize("code", [42.0, True, "42", -1, 256])
def test_an_exit_code_that_no_exit_status_can_carry_is_refused_by_name(code: object) -> None:
    with pytest.raises(ValueError, match=rf"^exit code {re.escape(repr(code))} is not an integer in 0\.\.255$"):
        ProgressReporter(None, 1).announce_exit(code)  # type: ignore[arg-type]


def test_every_step_given_is_marked_in_the_step_file_also_between_reports(server: socket.socket,
                                                                          fake_time: FakeTime, tmp_path: Path) -> None:
    mark = str(tmp_path / "step")
    progress.reset_step_mark(mark)
    assert progress.read_step_mark(mark, 3) is None  # nothing marked before a launch's trainer writes
    reporter = ProgressReporter(server.getsockname(), generation=3, min_interval=1.0, step_file=mark)
    assert reporter.marks_steps
    assert reporter.report(5) is True
    assert reporter.report(6) is False  # throttled, but marked: the agent reads it if the trainer dies now
    assert progress.read_step_mark(mark, 3) == 6
    reporter.reached(9)  # a step with no report at all
    assert progress.read_step_mark(mark, 3) == 9
    assert progress.read_step_mark(mark, 2) is None  # another generation's trainer wrote it
    assert received(server) == [ProgressMessage(3, os.getpid(), 5)]
    progress.reset_step_mark(mark)  # the next launch
    assert progress.read_step_mark(mark, 3) is None


def test_without_a_step_file_the_reporter_marks_nothing_and_reports_on(server: socket.socket,
                                                                      tmp_path: Path) -> None:
    reporter = ProgressReporter(server.getsockname(), generation=1, step_file=str(tmp_path / "missing"))
    assert not reporter.marks_steps  # an agent older than the step file sets none: advisory
    reporter.reached(4)
    assert reporter.report(4) is True
    assert progress.read_step_mark(str(tmp_path / "missing"), 1) is None
    (tmp_path / "short").write_bytes(b"\x01")  # torn or foreign: never a step
    assert progress.read_step_mark(str(tmp_path / "short"), 1) is None


def test_reporter_throttles_unless_forced_or_checkpointed(server: socket.socket, fake_time: FakeTime) -> None:
    reporter = ProgressReporter(server.getsockname(), generation=1, min_interval=1.0)
    pid = os.getpid()
    assert reporter.report(1) is True  # the first report is never throttled
    fake_time.now += 0.5
    assert reporter.report(2) is False  # throttled: 0.5s < 1.0s
    assert received(server) == [ProgressMessage(1, pid, 1)]

    assert reporter.report(3, force=True) is True
    assert reporter.report(4, checkpoint_step=4) is True
    assert received(server) == [ProgressMessage(1, pid, 3), ProgressMessage(1, pid, 4, checkpoint_step=4)]

    with pytest.raises(ValueError, match="phase 'saving' is not one of eval, save, setup, train"):
        reporter.report(5, phase="saving")  # a typo raises: it would otherwise drop every report silently
    assert reporter.report(5, phase=Phase.SAVE) is True  # long work starts: never throttled
    assert reporter.report(5, phase="eval") is True
    assert received(server) == [ProgressMessage(1, pid, 5, phase=Phase.SAVE), ProgressMessage(1, pid, 5,
                                                                                            phase=Phase.EVAL)]

    # a forced or checkpoint report restarts the interval
    fake_time.now += 0.999
    assert reporter.report(5) is False
    fake_time.now += 0.001
    assert reporter.report(6) is True
    assert received(server) == [ProgressMessage(1, pid, 6)]


def test_reporter_to_a_missing_socket_returns_false_and_does_not_raise(tmp_path: Path, fake_time: FakeTime) -> None:
    reporter = ProgressReporter(str(tmp_path / "gone.sock"), generation=1, min_interval=0.0)
    assert reporter.enabled is True
    assert reporter.report(1) is False
    assert reporter.report(2, force=True) is False
    assert reporter.report(3, checkpoint_step=3) is False


def test_a_failed_send_does_not_start_the_throttle_interval(tmp_path: Path, fake_time: FakeTime) -> None:
    path = tmp_path / "late.sock"
    reporter = ProgressReporter(str(path), generation=1, min_interval=10.0)
    assert reporter.report(1) is False  # the agent is not there yet
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        assert reporter.report(2) is True  # not throttled by the send that failed
        assert received(sock) == [ProgressMessage(1, os.getpid(), 2)]


def test_reporter_to_a_closed_agent_socket_returns_false(server: socket.socket, fake_time: FakeTime) -> None:
    path = server.getsockname()
    reporter = ProgressReporter(path, generation=1, min_interval=0.0)
    server.close()  # the file stays, nobody reads it: ECONNREFUSED
    assert os.path.exists(path)
    assert reporter.report(1) is False


# ------------------------------------------------------------------------------------------------ listener


async def _listen(tmp_path: Path, datagrams: list[bytes | ProgressMessage], want: int) -> list[ProgressMessage]:
    """Starts a listener, sends the datagrams (raw bytes, or messages through a ProgressReporter) and returns
    what its callback got once ``want`` messages arrived. Checks the directory's mode and its removal."""
    got: list[ProgressMessage] = []
    enough = asyncio.Event()

    def on_message(message: ProgressMessage) -> None:
        got.append(message)
        if len(got) >= want:
            enough.set()

    listener = ProgressListener(on_message, runtime_dir=str(tmp_path))
    directory = os.path.dirname(listener.path)
    try:
        assert os.path.dirname(directory) == str(tmp_path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(listener.path).st_mode)
        listener.start()
        reporters: dict[int, ProgressReporter] = {}
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            for item in datagrams:
                if isinstance(item, bytes):
                    raw.sendto(item, listener.path)
                else:
                    reporter = reporters.setdefault(
                        item.generation, ProgressReporter(listener.path, item.generation, min_interval=0.0))
                    assert reporter.report(item.step, examples=item.examples, loss=item.loss,
                                           checkpoint_step=item.checkpoint_step) is True
        await asyncio.wait_for(enough.wait(), timeout=10.0)
    finally:
        listener.close()
    assert not os.path.exists(directory)
    return got


def test_listener_delivers_decoded_messages(tmp_path: Path) -> None:
    pid = os.getpid()
    sent: list[bytes | ProgressMessage] = [
        ProgressMessage(2, pid, 10),
        ProgressMessage(2, pid, 20, examples=640, loss=0.5),
        ProgressMessage(3, pid, 30, checkpoint_step=30),
    ]
    assert asyncio.run(_listen(tmp_path, sent, want=3)) == sent


def test_listener_ignores_malformed_datagrams(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pid = os.getpid()
    good = ProgressMessage(5, pid, 1, loss=2.5)
    last = ProgressMessage(5, pid, 2)
    sent: list[bytes | ProgressMessage] = [
        b"garbage",
        b"[1,2]",
        b'{"g":1}',
        good,
        b'{"g":1,"pid":2,"step":true}',
        b"x" * (MAX_DATAGRAM + 100),  # truncated by the listener, then refused as oversized
        b"\xff",
        last,
    ]
    with caplog.at_level("WARNING", logger="tfelastic.progress"):
        assert asyncio.run(_listen(tmp_path, sent, want=2)) == [good, last]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfelastic.progress"]
    assert len(warnings) == 3  # only the first three malformed reports are logged
    assert all(w.startswith("ignored a malformed progress report: ") for w in warnings)


def test_listener_close_removes_its_directory_without_start(tmp_path: Path) -> None:
    async def main() -> str:
        listener = ProgressListener(lambda m: None, runtime_dir=str(tmp_path))
        directory = os.path.dirname(listener.path)
        assert os.path.isdir(directory)
        listener.close()
        return directory

    directory = asyncio.run(main())
    assert not os.path.exists(directory)
    assert list(tmp_path.iterdir()) == []


def test_decode_rejects_out_of_range_integers_and_nan() -> None:
    with pytest.raises(ValueError, match=r"^progress field 'step' is out of range 0\.\.9007199254740992: "
                                         r"4611686018427387905$"):
        decode(b'{"g":1,"pid":2,"step":4611686018427387905}')
    with pytest.raises(ValueError, match="NaN, which is not a number"):
        decode(b'{"g":1,"pid":2,"step":3,"loss":NaN}')


def test_done_flag_round_trips_and_numpy_like_values_are_made_plain(tmp_path: Path) -> None:
    assert decode(encode(ProgressMessage(1, 2, 3, done=True))).done is True
    assert decode(encode(ProgressMessage(1, 2, 3))).done is False

    class Scalar:  # stands in for a numpy scalar: int() and float() work, json.dumps does not
        def __int__(self) -> int:
            return 7

        def __float__(self) -> float:
            return 0.5

    path = str(tmp_path / "s")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        reporter = ProgressReporter(path, generation=4, min_interval=0)
        assert reporter.report(Scalar(), examples=Scalar(), loss=Scalar(), done=True)  # type: ignore[arg-type]
        message = decode(server.recv(MAX_DATAGRAM))
    assert (message.step, message.examples, message.loss, message.done) == (7, 7, 0.5, True)


@pytest.mark.parametrize(("field", "value"), [
    ("step", -1), ("step", 2**53 + 1), ("step", 2**62),  # 2^62 once added 4.6e18 to the steps counter
    ("ckpt", -1), ("ckpt", 2**53 + 1), ("examples", -5), ("examples", 2**53 + 1), ("g", 2**53 + 1),
    ("pid", -1), ("pid", 2**31), ("x", -1), ("x", 256),
])
def test_decode_bounds_every_integer(field: str, value: int) -> None:
    payload: dict[str, object] = {"g": 1, "pid": 2, "step": 3, field: value}
    with pytest.raises(ValueError, match=rf"^progress field '{field}' is out of range 0\.\.\d+: {value}$"):
        decode(json.dumps(payload).encode())


def test_decode_bounds_the_restored_step() -> None:
    with pytest.raises(ValueError, match="'rs' is out of range"):
        decode(b'{"g":1,"pid":2,"step":3,"rt":"local","rs":9007199254740993}')


@pytest.mark.parametrize("data", [
    b'{"g":1,"pid":2,"step":3,"ckpt":3,"st":1e400}',  # parses as infinity: the stall histogram's sum stayed +Inf
    b'{"g":1,"pid":2,"step":3,"ckpt":3,"st":86400.5}',
    b'{"g":1,"pid":2,"step":3,"loss":1e400}',
    b'{"g":1,"pid":2,"step":3,"loss":-1e400}',
])
def test_decode_refuses_numbers_that_parse_as_infinity_or_are_beyond_their_bound(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"'(st|loss)' must be a (finite number|number of seconds in 0\.\.86400)"):
        decode(data)


def test_a_stall_of_a_whole_day_is_still_a_measurement() -> None:
    assert decode(b'{"g":1,"pid":2,"step":3,"ckpt":3,"st":86400}').stall == 86400.0


def test_a_runtime_dir_too_deep_for_a_unix_socket_moves_the_socket_under_tmp(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A deep $TMPDIR (an xdist worker's tmp_path under a kept folder) made the agent die of 'AF_UNIX path too
    long' with a traceback: the socket goes to a private directory under /tmp, and the agent says so."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)

    async def main() -> tuple[str, bool]:
        listener = ProgressListener(lambda m: None, runtime_dir=str(deep))
        path, private = listener.path, os.stat(os.path.dirname(listener.path)).st_mode & 0o777 == 0o700
        listener.close()
        return path, private

    with caplog.at_level("WARNING", logger="tfelastic.progress"):
        path, private = asyncio.run(main())
    assert path.startswith("/tmp/tfelastic-") and len(path) <= 107 and private, path
    assert not os.path.exists(os.path.dirname(path)) and list(deep.iterdir()) == []
    assert "set a shorter TMPDIR" in caplog.text
