"""Where a hung trainer hangs, read from its faulthandler dump (daemon/worker/stacks.py): a real dump of a real
process, and the cases a real one rarely shows (no main thread found, no frame of the trainer's own code)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tfelastic.daemon.worker.stacks import (
    STACKS_SIGNAL,
    STACKS_SIGNAL_ENV,
    Frame,
    ThreadStack,
    hang_site,
    is_own_code,
    main_thread,
    parse_dump,
)
from tfelastic.trainer.stacks import register_stack_dump

# A trainer with a helper thread of its own and one in the standard library, which dumps its stacks to stderr by
# raising the agent's signal in its main thread from inside a named function, registered as tfelastic.trainer
# does; each thread is known to be where it should be before the signal.
HUNG = textwrap.dedent("""
    import os, signal, threading, time
    from tfelastic.trainer.stacks import register_stack_dump
    assert register_stack_dump()
    prefetching, idle = threading.Event(), threading.Condition()
    idling = False

    def prefetch():
        prefetching.set()  # from here on its innermost frame is its own: this loop, or the sleep it calls
        while True:
            time.sleep(60)

    def wait_idle():
        global idling
        with idle:
            idling = True
            idle.notify()
            idle.wait()  # waits in the standard library: it releases the lock only in there

    threading.Thread(target=prefetch, daemon=True).start()
    threading.Thread(target=wait_idle, daemon=True).start()

    def train_step():
        prefetching.wait()
        with idle:
            idle.wait_for(lambda: idling)  # the lock is ours again: wait_idle is inside idle.wait()
        signal.raise_signal(int(os.environ["TFELASTIC_STACKS_SIGNAL"]))  # handled before it returns

    train_step()
""")


def real_dump(tmp_path: Path) -> tuple[str, list[str]]:
    script = tmp_path / "hung_trainer.py"
    script.write_text(HUNG)
    env = {**os.environ, STACKS_SIGNAL_ENV: str(int(STACKS_SIGNAL))}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # the handler dumped and the process went on
    return str(script), done.stderr.splitlines()


def test_a_real_dump_names_the_trainers_function_file_and_line_and_its_other_thread(tmp_path: Path) -> None:
    script, lines = real_dump(tmp_path)
    threads = parse_dump(lines)
    assert len(threads) == 3
    main = main_thread(threads)
    assert main is not None and main.frames[-1] == Frame(script, main.frames[-1].line, "<module>")
    site = hang_site(lines)
    assert site is not None
    assert site.startswith(f"hung in train_step ({script}:"), site
    assert f"another thread in prefetch ({script}:" in site, site  # not wait_idle: it waits in the library


def test_the_innermost_library_frame_is_named_beside_the_trainers_own() -> None:
    lines = ["Current thread 0x00007f0000000001 (most recent call first):",
             '  File "/usr/lib/python3/dist-packages/tensorflow/python/eager/execute.py", line 53 in quick_execute',
             '  File "/opt/venv/lib/python3.11/site-packages/tf_keras/src/engine/training.py", line 1807 in fit',
             '  File "/home/ml/train.py", line 88 in main',
             '  File "/home/ml/train.py", line 99 in <module>']
    assert hang_site(lines) == ("hung in main (/home/ml/train.py:88), waiting in quick_execute "
                                "(tensorflow/python/eager/execute.py:53)")  # a library's file from its package


def test_the_main_thread_is_the_one_threading_did_not_start_even_when_another_ran_the_handler() -> None:
    lines = ["Current thread 0x00007f0000000002 (most recent call first):",
             '  File "/srv/job/loader.py", line 5 in load',
             '  File "/usr/lib/python3.11/threading.py", line 975 in run',
             '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap',
             "",
             "Thread 0x00007f0000000001 (most recent call first):",
             '  File "/srv/job/train.py", line 12 in step',
             '  File "/srv/job/train.py", line 20 in <module>']
    assert hang_site(lines) == "hung in step (/srv/job/train.py:12); another thread in load (/srv/job/loader.py:5)"


def test_a_main_thread_with_no_frame_of_the_trainers_own_says_so_and_tfelastics_frames_are_not_its_own() -> None:
    library = ("/opt/tfelastic/trainer",)
    lines = ["Current thread 0x00007f0000000001 (most recent call first):",
             '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
             '  File "/opt/tfelastic/trainer/loop.py", line 40 in run',
             '  File "<frozen runpy>", line 88 in _run_code']
    assert not is_own_code(Frame("/opt/tfelastic/trainer/loop.py", "40", "run"), library)
    # tfelastic linked into a virtual environment (tests/environments.py), or installed: not the trainer's either
    assert not is_own_code(Frame("/tmp/floor/tree/tfelastic/trainer/instrument/__init__.py", "80", "instrumented_fit"))
    assert is_own_code(Frame("/srv/job/train.py", "1", "<module>"))
    assert hang_site(lines, library) == "hung in wait (threading.py:320), in no frame of the trainer's own code"


def test_output_without_a_dump_has_no_site() -> None:
    assert hang_site(["Epoch 3/8", "Traceback (most recent call last):", '  File "x.py", line 1 in f']) is None
    assert parse_dump([]) == []
    assert main_thread([ThreadStack(True, ())]) is None


def test_outside_an_agent_nothing_is_registered() -> None:
    assert register_stack_dump({}) is False
    assert register_stack_dump({STACKS_SIGNAL_ENV: "SIGUSR2"}) is False  # the number only, as the agent sets it


def test_the_script_run_as_main_is_the_trainers_own_code_even_inside_a_package() -> None:
    """``python -m tfelastic.trainer.demo_trainer``: runpy's frames outside, the script's own file in tfelastic."""
    library = ("/opt/tfelastic/trainer",)
    lines = ["Current thread 0x00007f0000000001 (most recent call first):",
             '  File "/usr/lib/python3.11/threading.py", line 327 in wait',
             '  File "/opt/tfelastic/trainer/demo_trainer.py", line 98 in on_train_batch_end',
             '  File "/opt/venv/lib/python3.11/site-packages/tf_keras/src/callbacks.py", line 300 in _call_batch_hook',
             '  File "/opt/tfelastic/trainer/loop.py", line 40 in run',
             '  File "/opt/tfelastic/trainer/demo_trainer.py", line 150 in <module>',
             '  File "<frozen runpy>", line 88 in _run_code',
             '  File "<frozen runpy>", line 198 in _run_module_as_main']
    assert hang_site(lines, library) == ("hung in on_train_batch_end (/opt/tfelastic/trainer/demo_trainer.py:98), "
                                         "waiting in wait (threading.py:327)")


def test_registering_never_fails_an_import_and_keeps_the_trainers_own_handler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {STACKS_SIGNAL_ENV: str(int(STACKS_SIGNAL))}
    previous = signal.signal(STACKS_SIGNAL, lambda *_: None)  # the trainer's own handler
    try:
        assert register_stack_dump(env) is False
    finally:
        signal.signal(STACKS_SIGNAL, previous)
    wrapper = io.StringIO()  # a stderr with no file descriptor
    monkeypatch.setattr(sys, "stderr", wrapper)
    assert register_stack_dump(env) is False
    assert "no stack dump on signal" in wrapper.getvalue()
