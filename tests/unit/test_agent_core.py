"""The agent's decisions (:mod:`tfelastic.daemon.agent.core`), driven input by input on a fake clock: no sockets,
no processes, no sleeps. Each test names a decision and checks the actions it produces."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from tfelastic.daemon.agent.api import (
    Action,
    Announce,
    Connection,
    CoordinatorLost,
    DropSession,
    DumpStacks,
    EndStopSoon,
    ExitAgent,
    ExtendStop,
    HangUp,
    HostUntilJobEnds,
    Identity,
    KeepMetricsUp,
    Launch,
    ListenForProbe,
    ObserveEtcd,
    PrepareStandby,
    ProbeServer,
    RemoveLocalTier,
    RetryAfter,
    RunNodeCheck,
    ScanSnapshots,
    Send,
    Stop,
    StopResult,
    StopRetrying,
    Timing,
    WaitGpusReleased,
    WaitPortFree,
    WorkerPolicy,
)
from tfelastic.daemon.agent.core import AgentCore
from tfelastic.daemon.agent.replacements import ReplacementPolicy
from tfelastic.daemon.agent.trainer_watch import STACKS_PATIENCE, WAITING_HANG_DELAY
from tfelastic.daemon.agent.worker_core import (
    EXIT_PATIENCE,
    FAILURE_EXIT_PATIENCE,
    SURVIVOR_SAVE_PATIENCE,
    SURVIVOR_WINDOW_MAX,
    SURVIVOR_WINDOW_STEPS,
    SURVIVOR_WINDOW_UNKNOWN,
)
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.metrics.agent import AgentMetrics
from tfelastic.daemon.rendezvous import api
from tfelastic.daemon.version import PROTOCOL, VERSION
from tfelastic.daemon.worker.stall import WARMUP_GAPS, StallLimits
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import Phase, ProgressMessage

from tests.fakes import FakeClock

SPEC = api.JobSpec("job", b"\x01" * 32, 1, 2, 3, 3600.0, 10.0, "/backup", 0.5, 2.0)
HEARTBEAT, NODE_TIMEOUT, STALL = 0.5, 2.0, 10.0
FIXED_STALL = StallLimits(fixed=STALL)


class Harness:
    def __init__(self, join_timeout: float = 600.0, failover: bool = False,
                 stall: StallLimits = FIXED_STALL, standby_at_launch: bool = False,
                 step_mark: Callable[[int], int | None] | None = None, worker_port: int = 0) -> None:
        self.clock = FakeClock(100.0)
        self.registry = CollectorRegistry()
        identity = Identity("n1", "10.0.0.1", SPEC, "incarnation-1", worker_port)
        timing = Timing(HEARTBEAT, NODE_TIMEOUT, join_timeout, stall, stop_grace=10.0)
        self.core = AgentCore(identity, timing, Connection("head:29400", failover=failover),
                              AgentMetrics(self.registry, "job", "n1"), self.clock, pick_port=lambda host: 5555,
                              step_mark=step_mark, policy=WorkerPolicy(standby_at_launch=standby_at_launch))

    def running(self, generation: int = 1, rank: int = 0) -> None:
        """Session open, assignment received, worker started."""
        if not self.core._contact.open:
            self.core.session_opened()
        actions = self.core.received(assignment(generation, rank))
        assert Launch(assignment(generation, rank)) in actions
        self.core.worker_started(generation, 4000 + generation)
        assert self.worker_state() is WorkerState.RUNNING

    def worker_state(self) -> WorkerState:
        """Read through a call, so that mypy does not narrow it between two inputs."""
        return self.core.worker_core.worker.state

    def gpu_holders(self) -> tuple[int, ...]:
        """Read through a call, so that mypy does not narrow it between two inputs."""
        return self.core.gpu_holders

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def assignment(generation: int = 1, rank: int = 0, world: int = 2) -> api.Assignment:
    members = tuple(api.Member(f"n{i + 1}", i, f"10.0.0.{i + 1}", 5555) for i in range(world))
    return api.Assignment(generation, rank, world, members, restart_count=generation - 1)


def sent(actions: list[Action]) -> list[api.AgentMessage]:
    return [a.message for a in actions if isinstance(a, Send)]


def reports(actions: list[Action]) -> list[api.WorkerReport]:
    return [m for m in sent(actions) if isinstance(m, api.WorkerReport)]


def stalled(actions: list[Action], core: AgentCore) -> list[api.WorkerReport]:
    """The hang reports among ``actions``, each DumpStacks answered first (with no stacks: a pure test)."""
    answers = [answer for a in actions if isinstance(a, DumpStacks)
               for answer in core.stacks_dumped(a.generation, [], "no trainer in a unit test")]
    return [r for r in reports([*actions, *answers]) if r.status is api.WorkerStatus.STALLED]


def verdict(core: AgentCore) -> ExitCode | None:
    """How the agent ends between sessions (its ExitAgent), None to try the coordinator again."""
    exits = [a.code for a in core.next_attempt() if isinstance(a, ExitAgent)]
    assert len(exits) <= 1
    return exits[0] if exits else None


def etcd_patience(core: AgentCore) -> float:
    [observe] = core.between_sessions()
    assert isinstance(observe, ObserveEtcd)
    return observe.within


def stops(actions: list[Action]) -> list[Stop]:
    return [a for a in actions if isinstance(a, Stop)]


def joins(actions: list[Action]) -> list[api.Join]:
    return [m for m in sent(actions) if isinstance(m, api.Join)]


# ------------------------------------------------------------------------------------------ session and join


def test_a_session_opens_with_a_join_that_describes_the_node() -> None:
    h = Harness()
    [join] = joins(h.core.session_opened())
    assert join.spec == SPEC
    assert join.node == api.NodeInfo("n1", "10.0.0.1", 5555, "incarnation-1", last_generation=0, last_rank=-1,
                                     version=VERSION, protocol=PROTOCOL)
    assert h.worker_state() is WorkerState.WAITING


def test_an_assignment_launches_the_worker_and_says_ready() -> None:
    h = Harness()
    h.core.session_opened()
    actions = h.core.received(assignment(1, rank=1))
    assert actions[0] == Announce("launching generation 1 as rank 1 of 2", ready=True)
    assert actions[1] == Launch(assignment(1, rank=1))
    assert h.core.worker_started(1, 4242) == [Announce("running generation 1 as rank 1 of 2")]
    assert h.metric("tfelastic_rank") == 1.0 and h.metric("tfelastic_generation") == 1.0


def test_the_trainer_pid_is_reported_while_it_runs() -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.trainer_pid(1, 4343))
    assert (report.status, report.pid, report.generation) == (api.WorkerStatus.RUNNING, 4343, 1)
    assert h.core.trainer_pid(0, 4343) == []  # an older generation's


# ---------------------------------------------------------------------------------- restart on worker exit


def test_a_failed_worker_is_reported_and_the_stop_order_restarts_it_after_every_process_is_gone() -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.worker_exited(1, 3))
    assert (report.status, report.exit_code, report.detail) == (api.WorkerStatus.FAILED, 3,
                                                                "trainer exited with code 3")
    assert h.worker_state() is WorkerState.FAILED
    h.clock.now += 0.04
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert stops(actions) == [Stop("worker_exit", planned=False)]  # a failure: the short grace
    assert joins(actions) == []  # not before every process of the old worker is gone
    assert h.worker_state() is WorkerState.STOPPING
    [join] = joins(h.core.worker_stopped(StopResult(3, exited_before_stop=True)))
    assert (join.node.last_generation, join.node.last_rank) == (1, 0)
    assert h.worker_state() is WorkerState.WAITING
    assert Launch(assignment(2)) in h.core.received(assignment(2))
    assert h.metric("tfelastic_restarts_total", reason="worker_exit") == 1.0
    assert h.metric("tfelastic_failure_detection_seconds_count") == 1.0
    assert h.metric("tfelastic_failure_detection_seconds_sum") == pytest.approx(0.04)


def test_a_killed_trainer_names_its_signal() -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.worker_exited(1, -signal.SIGKILL))
    assert report.detail == "trainer was killed by SIGKILL"


def test_a_trainer_that_exits_0_is_reported_as_succeeded() -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.worker_exited(1, 0))
    assert report.status is api.WorkerStatus.SUCCEEDED
    assert h.worker_state() is WorkerState.SUCCEEDED


def test_an_exit_during_a_stop_is_expected_and_not_reported() -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.NODE_LOST))
    assert h.core.worker_exited(1, -signal.SIGTERM) == []


def test_a_stop_order_for_another_generation_is_ignored() -> None:
    h = Harness()
    h.running(generation=2)
    assert stops(h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))) == []
    assert h.worker_state() is WorkerState.RUNNING


def test_a_launch_failure_is_a_failure_of_this_worker_not_a_lost_session() -> None:
    h = Harness()
    h.running()
    actions = h.core.launch_failed(1, "OSError: [Errno 24] Too many open files")
    [report] = reports(actions)
    assert report.status is api.WorkerStatus.FAILED
    assert report.detail == "cannot start the trainer: OSError: [Errno 24] Too many open files"
    assert not any(isinstance(a, DropSession) for a in actions)


def test_a_join_meant_for_a_lost_session_is_not_sent_on_the_next() -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    h.core.session_ended("UNAVAILABLE: connection reset")
    assert joins(h.core.worker_stopped(StopResult(-15, False))) == []  # the session it was for is gone
    assert len(joins(h.core.session_opened())) == 1  # the new session's own Join


# ---------------------------------------------------------------------------------------- hang detection


def test_no_progress_for_the_stall_timeout_is_reported_once() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=5))
    h.clock.now += STALL  # exactly the timeout: not yet
    h.core.received(api.Heartbeat())
    assert stalled(h.core.tick(), h.core) == []
    h.clock.now += 0.25
    h.core.received(api.Heartbeat())
    [report] = stalled(h.core.tick(), h.core)
    assert report.detail == "no progress for 10.2s (stall_timeout=10s); no Python stacks: no trainer in a unit test"
    h.clock.now += 0.25
    h.core.received(api.Heartbeat())
    assert stalled(h.core.tick(), h.core) == []  # the coordinator decides; one report is enough


def test_training_completed_pauses_the_stall_check_until_the_next_report() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=100, done=True))
    for _ in range(100):  # 50 s of silent evaluation and export, far past the stall timeout
        h.clock.now += 0.5
        h.core.received(api.Heartbeat())
        assert stalled(h.core.tick(), h.core) == []
    h.core.progress(ProgressMessage(1, 4001, step=0))  # another fit: watched again
    h.clock.now += STALL + 0.25
    h.core.received(api.Heartbeat())
    assert len(stalled(h.core.tick(), h.core)) == 1


def test_a_learned_limit_reports_a_live_hang_after_the_floor_and_names_where_it_came_from() -> None:
    h = Harness(stall=StallLimits(allowance=600.0))  # the default floor
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 600.0
    for step in range(1, WARMUP_GAPS + 4):
        h.clock.now += 0.25
        h.core.progress(ProgressMessage(1, 4001, step=step))
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 5.0
    silent = 0.0
    while not (found := stalled(h.core.tick(), h.core)):
        h.clock.now += 0.25
        silent += 0.25
        h.core.received(api.Heartbeat())
    assert silent == 5.25
    assert found[0].detail == ("no progress for 5.2s (learned limit 5.0s: 8 x the longest step gap 0.25s, "
                               "floor 5s); no Python stacks: no trainer in a unit test")


def test_a_save_reported_by_the_trainer_is_not_a_stall() -> None:
    h = Harness(stall=StallLimits(floor=20.0, allowance=600.0))
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))
    for step in range(1, WARMUP_GAPS + 4):
        h.clock.now += 0.25
        h.core.progress(ProgressMessage(1, 4001, step=step))
    h.core.progress(ProgressMessage(1, 4001, step=WARMUP_GAPS + 3, phase=Phase.SAVE))
    for _ in range(400):  # 100 s of saving
        h.clock.now += 0.25
        h.core.received(api.Heartbeat())
        assert stalled(h.core.tick(), h.core) == []


def test_the_stall_limit_gauge_is_zero_while_nothing_is_watched() -> None:
    h = Harness(stall=StallLimits())
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 0.0
    h.running()
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 0.0  # never reported: not watched
    h.core.progress(ProgressMessage(1, 4001, step=3, phase=Phase.SETUP))
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 300.0
    h.core.progress(ProgressMessage(1, 4001, step=9, done=True))  # training completed: the check pauses
    assert h.registry.get_sample_value("tfelastic_stall_limit_seconds") == 0.0


def hung(h: Harness) -> list[Action]:
    """A running trainer that reported step 5 and then nothing for longer than the stall timeout."""
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=5))
    h.clock.now += STALL + 0.25
    h.core.received(api.Heartbeat())
    return h.core.tick()


DUMP = ["Current thread 0x00007f0000000001 (most recent call first):",
        '  File "/srv/job/train.py", line 12 in wedged_step',
        '  File "/srv/job/train.py", line 20 in <module>']


def test_a_hang_asks_for_the_trainers_stacks_first_and_its_report_names_where_it_hangs() -> None:
    h = Harness()
    actions = hung(h)
    # Asked of the process that reported: the trainer, not a wrapper or a fork of it.
    assert [a for a in actions if isinstance(a, DumpStacks)] == [DumpStacks(1, 4001)] and reports(actions) == []
    h.clock.now += 0.25
    again = h.core.tick()
    assert not any(isinstance(a, DumpStacks) for a in again) and reports(again) == []  # asked once; it waits
    [report] = reports(h.core.stacks_dumped(1, ["input pipeline: hanging", *DUMP]))
    assert report.status is api.WorkerStatus.STALLED
    assert report.detail == ("no progress for 10.2s (stall_timeout=10s); hung in wedged_step "
                             "(/srv/job/train.py:12)")
    assert h.core.stacks_dumped(1, DUMP) == []  # one report per hang


# The main thread waits in TensorFlow: maybe for a peer that hangs in its own code.
WAITING = ["Current thread 0x00007f0000000001 (most recent call first):",
           '  File "/venv/lib/python3.11/site-packages/tensorflow/python/eager/execute.py", line 53 in quick_execute',
           *DUMP[1:]]


def test_a_trainer_found_waiting_in_a_library_reports_its_hang_a_moment_later() -> None:
    h = Harness()
    hung(h)
    assert h.core.stacks_dumped(1, WAITING) == []  # held: a peer hung in its own code reports first
    h.clock.now += WAITING_HANG_DELAY - 0.25
    assert reports(h.core.tick()) == []
    h.clock.now += 0.25
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.status is api.WorkerStatus.STALLED and report.cause is api.FailureCause.HANG
    assert report.detail == ("no progress for 10.2s (stall_timeout=10s); hung in wedged_step (/srv/job/train.py:12), "
                             "waiting in quick_execute (tensorflow/python/eager/execute.py:53)")
    assert reports(h.core.tick()) == []  # once


def test_a_held_hang_report_is_dropped_when_the_peers_report_stopped_the_generation_first() -> None:
    h = Harness()
    hung(h)
    assert h.core.stacks_dumped(1, WAITING) == []
    assert stops(h.core.received(api.StopWorkers(1, api.RestartReason.STALLED)))
    h.clock.now += WAITING_HANG_DELAY
    h.core.received(api.Heartbeat())
    assert reports(h.core.tick()) == []
    assert h.registry.get_sample_value("tfelastic_trainer_failures_total", {"cause": "hang"}) == 0.0  # not its failure


def test_stacks_that_never_come_do_not_hold_the_hangs_report_back() -> None:
    h = Harness()
    hung(h)
    h.clock.now += STACKS_PATIENCE - 0.25
    h.core.received(api.Heartbeat())
    assert reports(h.core.tick()) == []
    h.clock.now += 0.25
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.status is api.WorkerStatus.STALLED
    assert report.detail.endswith(f"; no Python stacks: they did not come within {STACKS_PATIENCE:g}s")
    assert h.core.stacks_dumped(1, DUMP) == []  # too late: reported already


def test_a_trainer_that_ends_while_its_stacks_are_read_is_reported_as_ended_not_as_hung() -> None:
    h = Harness()
    hung(h)
    [failed] = reports(h.core.worker_exited(1, -9))
    assert failed.status is api.WorkerStatus.FAILED
    assert h.core.stacks_dumped(1, DUMP) == []


def test_a_trainer_that_never_reports_is_not_checked() -> None:
    h = Harness()
    h.running()
    h.clock.now += 10 * STALL
    h.core.received(api.Heartbeat())
    assert stalled(h.core.tick(), h.core) == []


# ------------------------------------------------------------------------------ completion during a stop


@pytest.mark.parametrize(("said_done", "exited_before_stop", "completed"), [
    (True, False, True),  # it said training completed, then exited 0 on SIGTERM
    (False, True, True),  # it exited 0 by itself just before the stop
    (False, False, False),  # exit 0 in answer to SIGTERM: it may only have checkpointed and stopped
])
def test_a_trainer_that_completes_while_it_is_stopped_completes_the_job(
        said_done: bool, exited_before_stop: bool, completed: bool) -> None:
    h = Harness()
    h.running()
    if said_done:
        h.core.progress(ProgressMessage(1, 4001, step=200, done=True))
    h.core.received(api.StopWorkers(1, api.RestartReason.SCALE_UP))
    actions = h.core.worker_stopped(StopResult(0, exited_before_stop))
    succeeded = [r for r in reports(actions) if r.status is api.WorkerStatus.SUCCEEDED]
    assert len(succeeded) == (1 if completed else 0)
    assert len(joins(actions)) == 1
    if completed:  # the report comes first: the coordinator must see the success before the Join
        assert sent(actions).index(succeeded[0]) < sent(actions).index(joins(actions)[0])


# --------------------------------------------------------------------------------- graceful stop (exit 42)


@pytest.mark.parametrize(("code", "exited_before_stop", "outcome"), [
    (42, False, "checkpointed"), (-signal.SIGKILL, False, "killed"), (0, False, "exited"), (1, True, "exited"),
])
def test_a_planned_stop_is_counted_by_how_the_trainer_ended(code: int, exited_before_stop: bool,
                                                             outcome: str) -> None:
    h = Harness()
    h.running()
    assert stops(h.core.received(api.StopWorkers(1, api.RestartReason.OPERATOR_RESTART))) == [
        Stop("operator_restart", planned=True)]  # planned: stop_grace, time to checkpoint
    h.core.worker_stopped(StopResult(code, exited_before_stop))
    assert h.metric("tfelastic_worker_graceful_stops_total", outcome=outcome) == 1.0


def test_a_trainer_that_announces_its_exit_during_a_stop_is_ended_a_second_later_and_counted_as_that_exit() -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.OPERATOR_RESTART))
    announced = ProgressMessage(1, 4001, step=120, exit_code=42)
    assert h.core.progress(announced) == [EndStopSoon(EXIT_PATIENCE)]
    assert EXIT_PATIENCE == 1.0  # "within 1 s" of its save (docs/trainer.md)
    assert h.core.progress(announced) == []  # one end per stop
    assert h.core.progress(ProgressMessage(0, 4001, step=120, exit_code=42)) == []  # an older generation's
    h.core.worker_stopped(StopResult(-signal.SIGKILL, False))  # its teardown was cut short
    assert h.metric("tfelastic_worker_graceful_stops_total", outcome="checkpointed") == 1.0
    assert not h.metric("tfelastic_worker_graceful_stops_total", outcome="killed")


def test_an_exit_announced_before_the_stop_ends_the_stop_that_follows_and_not_one_of_the_next_trainer() -> None:
    """A peer's stop request reached this trainer first (TensorFlow's agreement): it saved and announced while its
    agent still ran it."""
    h = Harness()
    h.running()
    assert h.core.progress(ProgressMessage(1, 4001, step=120, exit_code=42)) == []  # no stop to cut short yet
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.NODE_LEFT))
    assert stops(actions) == [Stop("node_left", planned=True)] and EndStopSoon(EXIT_PATIENCE) in actions
    h.core.worker_gone(())
    h.core.worker_stopped(StopResult(-signal.SIGKILL, False))
    assert h.metric("tfelastic_worker_graceful_stops_total", outcome="checkpointed") == 1.0
    assert Launch(assignment(2)) in h.core.received(assignment(2))  # the next trainer has said nothing
    h.core.worker_started(2, 4002)
    actions = h.core.received(api.StopWorkers(2, api.RestartReason.NODE_LEFT))
    assert stops(actions) == [Stop("node_left", planned=True)] and EndStopSoon(EXIT_PATIENCE) not in actions


def test_only_the_process_that_reports_the_trainers_progress_speaks_for_it() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=5))
    h.core.received(api.StopWorkers(1, api.RestartReason.OPERATOR_RESTART))
    assert h.core.progress(ProgressMessage(1, 4999, step=5, exit_code=42)) == []  # a child of the trainer
    assert h.core.progress(ProgressMessage(1, 4001, step=5, exit_code=42)) == [EndStopSoon(EXIT_PATIENCE)]


@pytest.mark.parametrize(("result", "outcome"), [
    (StopResult(1, False), "exited"),  # it failed in its teardown: that is what it did
    (StopResult(-signal.SIGSEGV, False), "exited"),
    (StopResult(-signal.SIGKILL, True), "killed"),  # it had ended by itself (the OOM killer, say) before the stop
])
def test_an_announced_exit_does_not_hide_another_end(result: StopResult, outcome: str) -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.OPERATOR_RESTART))
    h.core.progress(ProgressMessage(1, 4001, step=120, exit_code=42))
    h.core.worker_stopped(result)
    assert not h.metric("tfelastic_worker_graceful_stops_total", outcome="checkpointed")
    if result.exited_before_stop:
        return  # an exit before the stop is not counted as the stop's outcome at all
    assert h.metric("tfelastic_worker_graceful_stops_total", outcome=outcome) == 1.0


def test_a_failure_stop_is_cut_short_too_but_is_no_graceful_stop() -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.NODE_LOST))
    # The next generation waits for this stop: a quarter of a second, as a failure stop's grace gives any trainer.
    assert h.core.progress(ProgressMessage(1, 4001, step=120, exit_code=42)) == [EndStopSoon(FAILURE_EXIT_PATIENCE)]
    assert FAILURE_EXIT_PATIENCE < EXIT_PATIENCE
    h.core.worker_stopped(StopResult(-signal.SIGKILL, False))
    for outcome in ("checkpointed", "killed", "exited"):
        assert not h.metric("tfelastic_worker_graceful_stops_total", outcome=outcome)


# ----------------------------------------------------------------- the survivors' save (a peer failed)


def test_a_survivors_save_announced_during_a_failure_stop_keeps_the_stop_waiting_then_its_exit_ends_it() -> None:
    h = Harness()
    h.running()
    assert stops(h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))) == [
        Stop("worker_exit", planned=False)]  # failure_stop_grace: a quarter of a second
    assert h.core.progress(ProgressMessage(1, 4001, step=37, survivor_save=37)) == [
        ExtendStop(SURVIVOR_SAVE_PATIENCE)]
    assert h.core.progress(ProgressMessage(1, 4001, step=37, survivor_save=37)) == []  # one per trainer
    assert h.core.progress(ProgressMessage(1, 4001, step=37, exit_code=1)) == [EndStopSoon(FAILURE_EXIT_PATIENCE)]


def test_a_survivors_save_announced_before_the_stop_keeps_the_stop_that_follows_waiting() -> None:
    """The usual order: the trainer's collective fails the moment its peer dies, before the coordinator's stop
    order reaches this agent."""
    h = Harness()
    h.running()
    assert h.core.progress(ProgressMessage(1, 4001, step=37, survivor_save=37)) == []  # no stop to keep yet
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert stops(actions) == [Stop("worker_exit", planned=False)]
    assert ExtendStop(SURVIVOR_SAVE_PATIENCE) in actions
    h.core.worker_gone(())
    h.core.worker_stopped(StopResult(1, False))
    h.core.received(assignment(2))
    h.core.worker_started(2, 4002)  # the next trainer has said nothing
    assert ExtendStop(SURVIVOR_SAVE_PATIENCE) not in h.core.received(api.StopWorkers(2, api.RestartReason.WORKER_EXIT))


def on_the_fast_tier(h: Harness, steps_per_second: float = 0.0, saves_as_survivor: bool = True) -> None:
    """The trainer restores on the fast tier (its report says from where, and whether it saves as a survivor and
    listens for the agent's word), then trains at a steady rate."""
    h.core.progress(ProgressMessage(1, 4001, step=10, restored_tier="local", restored_step=10,
                                    hears_peer_failure=saves_as_survivor))
    if steps_per_second:
        for i in range(1, 8):
            h.clock.now += 1.0 / steps_per_second
            h.core.progress(ProgressMessage(1, 4001, step=10 + i))


def survivor_waits(actions: list[Action]) -> list[float]:
    """How long each stop among ``actions`` holds its SIGTERM for the trainer's survivors' save."""
    return [a.hold for a in actions if isinstance(a, Stop) and a.hold]


def test_a_failure_stop_of_a_fast_tier_trainer_holds_its_sigterm_two_of_its_steps_for_a_survivors_save() -> None:
    """Its step's compute comes before the collective that the peer's failure breaks: the save can only start
    once the trainer reaches it, and a SIGTERM first would start a graceful stop that waits for the lost peer."""
    h = Harness()
    h.running()
    on_the_fast_tier(h, steps_per_second=2.0)
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert survivor_waits(actions) == [pytest.approx(SURVIVOR_WINDOW_STEPS / 2.0)]
    assert SURVIVOR_WINDOW_STEPS == 2.0


@pytest.mark.parametrize("steps_per_second", [0.0, 0.1])
def test_the_wait_for_a_survivors_save_is_bounded(steps_per_second: float) -> None:
    h = Harness()
    h.running()
    on_the_fast_tier(h, steps_per_second)
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert survivor_waits(actions) == [SURVIVOR_WINDOW_UNKNOWN if not steps_per_second else SURVIVOR_WINDOW_MAX]


def test_no_wait_for_a_survivors_save_in_a_planned_stop_from_a_trainer_that_does_not_save_or_alone() -> None:
    planned = Harness()
    planned.running()
    on_the_fast_tier(planned)
    assert survivor_waits(planned.core.received(api.StopWorkers(1, api.RestartReason.OPERATOR_RESTART))) == []
    unknown = Harness()  # a trainer that says nothing of a restore: not the library's loops
    unknown.running()
    unknown.core.progress(ProgressMessage(1, 4001, step=10))
    assert survivor_waits(unknown.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))) == []
    # Keras's own BackupAndRestore, survivors_save=False, a rank of 2 or more: restored, but it does not save
    writes_not = Harness()
    writes_not.running()
    on_the_fast_tier(writes_not, saves_as_survivor=False)
    assert survivor_waits(writes_not.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))) == []
    alone = Harness()
    alone.core.session_opened()
    alone.core.received(assignment(1, 0, world=1))
    alone.core.worker_started(1, 4001)
    on_the_fast_tier(alone)
    assert survivor_waits(alone.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))) == []


def test_a_held_stop_tells_a_trainer_that_listens_that_a_peer_failed() -> None:
    """A collective that waits without a call in flight to the dead peer would learn of it only from TensorFlow's
    heartbeat timeout: the trainer that said it listens is told at once (trainer/peer_failure.py)."""
    listens = Harness()
    listens.running()
    listens.core.progress(ProgressMessage(1, 4001, step=10, restored_tier="local", restored_step=10,
                                          hears_peer_failure=True))
    [stop] = stops(listens.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT)))
    assert (stop.hold, stop.notify) == (SURVIVOR_WINDOW_UNKNOWN, 4001)
    deaf = Harness()
    deaf.running()
    on_the_fast_tier(deaf, saves_as_survivor=False)  # no signal, whose default action would end it, and no hold
    [stop] = stops(deaf.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT)))
    assert (stop.hold, stop.notify) == (0.0, 0)


def test_no_wait_for_a_survivors_save_from_a_trainer_found_hung() -> None:
    h = Harness()
    h.running()
    on_the_fast_tier(h, steps_per_second=2.0)
    h.clock.now += STALL + 0.25
    h.core.received(api.Heartbeat())
    assert any(isinstance(a, DumpStacks) for a in h.core.tick())  # found silent past its limit
    assert reports(h.core.stacks_dumped(1, DUMP))  # hung in its own code: reported
    assert survivor_waits(h.core.received(api.StopWorkers(1, api.RestartReason.STALLED))) == []


def test_a_trainer_held_as_a_peers_victim_still_gets_its_wait_for_a_survivors_save() -> None:
    """Silent because it waits in a collective for the peer that hung: its report is held, and once the peer's
    report stops the generation, the agent's word lets it abort that wait and save the step it holds."""
    h = Harness()
    h.running()
    on_the_fast_tier(h, steps_per_second=2.0)
    h.clock.now += STALL + 0.25
    h.core.received(api.Heartbeat())
    h.core.tick()
    assert h.core.stacks_dumped(1, WAITING) == []  # held
    [stop] = stops(h.core.received(api.StopWorkers(1, api.RestartReason.STALLED)))
    assert stop.hold == pytest.approx(SURVIVOR_WINDOW_STEPS / 2.0) and stop.notify == 4001


def test_only_the_trainers_own_process_announces_a_survivors_save() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=5))
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert h.core.progress(ProgressMessage(1, 4999, step=5, survivor_save=5)) == []  # a child of the trainer
    assert h.core.progress(ProgressMessage(0, 4001, step=5, survivor_save=5)) == []  # an older generation's
    assert h.core.progress(ProgressMessage(1, 4001, step=5, survivor_save=5)) == [ExtendStop(SURVIVOR_SAVE_PATIENCE)]


def test_a_stop_after_a_failure_is_not_a_graceful_stop() -> None:
    h = Harness()
    h.running()
    h.core.received(api.StopWorkers(1, api.RestartReason.NODE_LOST))
    h.core.worker_stopped(StopResult(42, False))
    for outcome in ("checkpointed", "killed", "exited"):
        assert not h.metric("tfelastic_worker_graceful_stops_total", outcome=outcome)


# --------------------------------------------------------------------------------------------- fencing


def test_fences_one_heartbeat_before_the_coordinators_lease_runs_out() -> None:
    h = Harness()
    h.running()
    h.clock.now += NODE_TIMEOUT - HEARTBEAT  # 1.5 s of silence: not yet
    assert not any(isinstance(a, DropSession) for a in h.core.tick())
    h.clock.now += 0.01
    [drop] = [a for a in h.core.tick() if isinstance(a, DropSession)]
    assert drop.reason == "no message from the coordinator for 1.5s"
    # The session is dropped and the worker stopped before the coordinator (node_timeout 2 s) gives up on us.
    actions = h.core.session_ended(drop.reason)
    assert stops(actions) == [Stop("fencing: the coordinator is unreachable", planned=False)]
    assert verdict(h.core) is None  # and it tries the coordinator again


def test_any_message_renews_the_lease() -> None:
    h = Harness()
    h.running()
    for _ in range(10):
        h.clock.now += 1.4
        h.core.received(api.Heartbeat())
        assert not any(isinstance(a, DropSession) for a in h.core.tick())


def test_gives_up_after_join_timeout_without_the_coordinator() -> None:
    h = Harness(join_timeout=60.0)
    h.running()
    h.core.session_ended("UNAVAILABLE: connection refused")
    h.core.worker_stopped(StopResult(-15, False))
    h.clock.now += 59.0
    assert verdict(h.core) is None
    h.clock.now += 2.0
    assert verdict(h.core) is ExitCode.FAILED


def test_the_next_attempt_backs_off_while_a_grpc_server_of_another_service_answers() -> None:
    h = Harness(join_timeout=60.0)
    waits = []
    for _ in range(4):
        h.core.session_ended("UNIMPLEMENTED: unknown service tfelastic.v1.Rendezvous")
        [retry] = h.core.next_attempt()
        assert isinstance(retry, RetryAfter)
        waits.append(retry.seconds)
    assert waits == [0.2, 0.4, 0.8, 1.6]
    h.core.session_ended("UNAVAILABLE: connection refused")  # it left: a coordinator may come up any moment
    assert h.core.next_attempt() == [RetryAfter(0.2)]


# ------------------------------------------------------------------------------------------ planned leave


def test_sigterm_leaves_the_job_after_the_worker_checkpointed() -> None:
    h = Harness()
    h.running()
    actions = h.core.signal_received(signal.SIGTERM)
    assert sent(actions) == [api.Leave("agent stopped (SIGTERM)")]
    assert stops(actions) == [Stop("agent stopping", planned=True)]
    assert HangUp() not in actions  # not before the worker is gone
    assert h.core.worker_stopped(StopResult(42, False)) == [HangUp()]
    assert h.core.session_ended(None) == []
    assert verdict(h.core) is ExitCode.SUCCEEDED


def test_a_drain_is_a_leave_that_says_so() -> None:
    h = Harness()
    h.running()
    actions = h.core.received(api.DrainNode("maintenance"))
    assert sent(actions) == [api.Leave("drained: maintenance")]
    assert h.core.leaving is not None and h.core.leaving.drained


def test_only_a_drained_node_that_hosts_the_coordinator_keeps_serving_it() -> None:
    drained = Harness()
    drained.running()
    drained.core.received(api.DrainNode("maintenance"))
    assert drained.core.wind_down(hosting=True) == [
        Announce("drained: hosting the coordinator until the job ends"), HostUntilJobEnds()]
    assert drained.core.wind_down(hosting=False) == []
    stopped = Harness()  # SIGTERM leaves too, but it is not a drain: the hosted coordinator goes with the agent
    stopped.running()
    stopped.core.signal_received(signal.SIGTERM)
    assert stopped.core.wind_down(hosting=True) == []


def test_the_local_tier_is_removed_only_after_the_job_succeeded() -> None:
    """Nothing resumes from a succeeded job; a failed one, or an agent that only left, may be resumed."""
    verdicts = {}
    for state in (api.JobState.SUCCEEDED, api.JobState.FAILED):
        h = Harness()
        h.running()
        h.core.received(api.Finished(state, "over"))
        verdicts[state] = h.core.worker_closed()
    left = Harness()
    left.running()
    left.core.signal_received(signal.SIGTERM)
    assert verdicts == {api.JobState.SUCCEEDED: [RemoveLocalTier()], api.JobState.FAILED: []}
    assert left.core.worker_closed() == []


def test_a_leave_with_no_worker_hangs_up_at_once() -> None:
    h = Harness()
    h.core.session_opened()
    assert h.core.signal_received(signal.SIGINT)[-2:] == [Send(api.Leave("agent stopped (SIGINT)")), HangUp()]


def test_a_leave_between_sessions_ends_the_agent() -> None:
    h = Harness()
    assert h.core.signal_received(signal.SIGTERM) == [StopRetrying()]  # nobody to tell: the wait ends now
    assert verdict(h.core) is ExitCode.SUCCEEDED
    assert h.core.signal_received(signal.SIGTERM) == []  # once


def test_the_job_finished_ends_the_agent_with_its_verdict() -> None:
    h = Harness()
    h.running()
    actions = h.core.received(api.Finished(api.JobState.FAILED, "restart budget exhausted"))
    assert actions[-1] == HangUp()
    assert verdict(h.core) is ExitCode.FAILED


# ------------------------------------------------------------------------------------------- progress


def test_heartbeats_carry_the_latest_progress_once() -> None:
    h = Harness()
    h.running()
    h.core.tick()  # the first heartbeat
    h.core.progress(ProgressMessage(1, 4001, step=6))  # the first report goes out at once
    h.core.progress(ProgressMessage(1, 4001, step=7))  # and the first past it, the end of the start-up
    h.core.progress(ProgressMessage(1, 4001, step=7, examples=224, loss=0.5, checkpoint_step=5))
    h.clock.now += HEARTBEAT
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.progress is not None
    assert (report.progress.step, report.progress.examples, report.progress.loss,
            report.progress.checkpoint_step) == (7, 224, 0.5, 5)
    h.core.progress(ProgressMessage(1, 4001, step=8))  # keeps the checkpoint it knows
    h.clock.now += HEARTBEAT
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.progress is not None and (report.progress.step, report.progress.checkpoint_step) == (8, 5)
    h.clock.now += HEARTBEAT
    h.core.received(api.Heartbeat())
    assert sent(h.core.tick()) == [api.Heartbeat()]  # nothing new


def test_progress_of_an_older_generation_is_ignored() -> None:
    h = Harness()
    h.running(generation=2)
    h.core.progress(ProgressMessage(1, 4001, step=99))
    assert h.core.tracker.latest is None


def test_the_first_progress_after_a_failure_measures_the_recovery() -> None:
    h = Harness()
    h.running()
    h.core.worker_exited(1, 1)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    h.core.worker_stopped(StopResult(1, True))
    h.running(generation=2)
    h.clock.now += 3.0
    h.core.progress(ProgressMessage(2, 4002, step=10))
    assert h.metric("tfelastic_recovery_seconds_count") == 1.0
    assert h.metric("tfelastic_recovery_seconds_sum") == pytest.approx(3.0)


def test_progress_after_a_stop_order_is_not_recorded() -> None:
    """A trainer that reports while it is being stopped does not count as progress of the job: the stop is
    already decided, and its steps will be redone from the checkpoint."""
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=10))
    h.core.received(api.StopWorkers(1, api.RestartReason.SCALE_UP))
    h.core.progress(ProgressMessage(1, 4001, step=11))
    latest = h.core.tracker.latest
    assert latest is not None and latest.step == 10


def test_a_new_generation_has_no_checkpoint_age_until_it_reports_one() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=10, checkpoint_step=10))
    h.core.received(api.StopWorkers(1, api.RestartReason.SCALE_UP))
    h.core.worker_stopped(StopResult(42, False))
    h.running(generation=2)
    h.core.progress(ProgressMessage(2, 4002, step=11))
    [report] = reports(h.core.trainer_pid(2, 4343))
    assert report.progress is not None
    assert (report.progress.checkpoint_step, report.progress.checkpoint_at) == (-1, None)


def test_job_failed_is_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.running()
    h.core.received(api.Finished(api.JobState.FAILED, "restart budget exhausted"))
    [record] = [r for r in caplog.records if "job failed" in r.getMessage()]
    assert record.levelname == "ERROR"


def test_the_exception_a_trainer_died_of_is_in_its_report() -> None:
    h = Harness()
    h.running()
    output = ("Traceback (most recent call last):", '  File "train.py", line 3', "ZeroDivisionError: division by zero")
    [report] = reports(h.core.worker_exited(1, 1, output))
    assert report.detail == "trainer exited with code 1: ZeroDivisionError: division by zero"
    assert report.cause is api.FailureCause.EXCEPTION


@pytest.mark.parametrize(("code", "output", "cause", "detail"), [
    (1, ("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor",),
     api.FailureCause.OUT_OF_MEMORY, "trainer ran out of memory: exited with code 1: "
                                     "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when "
                                     "allocating tensor"),
    (1, ("tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is aborted by: recvmsg",),
     api.FailureCause.PEER_FAILURE, "trainer saw a peer fail (not its own fault): exited with code 1: "
                                    "tensorflow.python.framework.errors_impl.UnavailableError: Collective ops is "
                                    "aborted by: recvmsg"),
    (-9, (), api.FailureCause.SIGNAL, "trainer was killed by SIGKILL"),
], ids=["oom", "peer", "signal"])
def test_a_failures_cause_goes_with_its_report_and_is_counted(code: int, output: tuple[str, ...],
                                                              cause: api.FailureCause, detail: str) -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.worker_exited(1, code, output))
    assert (report.cause, report.detail) == (cause, detail)
    counted = {c.value: h.registry.get_sample_value("tfelastic_trainer_failures_total", {"cause": c.value})
               for c in api.FailureCause if c is not api.FailureCause.OTHER}
    assert counted == {c: (1.0 if c == cause.value else 0.0) for c in counted}


def test_a_hang_and_a_failed_launch_have_their_causes() -> None:
    h = Harness()
    [hang] = stalled(hung(h), h.core)
    assert hang.cause is api.FailureCause.HANG
    h = Harness()
    h.running()
    [failed] = reports(h.core.launch_failed(1, "OSError: [Errno 2] No such file or directory"))
    assert failed.cause is api.FailureCause.LAUNCH_FAILED
    assert h.registry.get_sample_value("tfelastic_trainer_failures_total", {"cause": "launch_failed"}) == 1.0


def test_the_first_progress_of_a_generation_is_reported_at_once() -> None:
    h = Harness()
    h.running()
    [report] = reports(h.core.progress(ProgressMessage(1, 4001, step=100)))
    assert report.progress is not None and report.progress.step == 100
    assert reports(h.core.progress(ProgressMessage(1, 4001, step=101)))  # the first step past it: start-up ended
    assert h.core.progress(ProgressMessage(1, 4001, step=102)) == []  # the rest ride on heartbeats


# ------------------------------------------------------------------------------ with etcd: failover, not fencing


def test_with_etcd_a_lost_coordinator_does_not_fence_while_etcd_says_the_generation_is_current() -> None:
    h = Harness(failover=True)
    h.running()
    actions = h.core.session_ended("UNAVAILABLE: the coordinator went away")
    assert stops(actions) == []  # its successor takes the generation over
    h.clock.now += 1.0
    assert h.core.etcd_observed(recorded=1, leader_known_for=None) == []
    h.clock.now += 5.0  # the election takes a lease TTL; etcd keeps saying generation 1
    assert h.core.etcd_observed(recorded=1, leader_known_for=None) == []
    [join] = joins(h.core.session_opened())  # the new coordinator: attach, keeping the worker
    assert join.attached_generation == 1 and join.node.worker_port == 5555
    assert h.worker_state() is WorkerState.RUNNING


@pytest.mark.parametrize(("recorded", "leader_known_for", "silent_for", "running", "fences"), [
    (2, None, 0.1, True, "the job is at generation 2 in etcd"),
    (None, None, 1.6, True, "neither a coordinator nor etcd answered"),
    (None, None, 1.4, True, None),
    (1, 1.6, 1.6, True, "the new coordinator has not taken this node in"),
    (1, 1.4, 10.0, True, None),
    (1, None, 0.6, False, "etcd records generation 1 as stopping"),
], ids=["newer-generation", "etcd-silent-too", "etcd-silent-briefly", "not-taken-in", "taking-over",
        "restarting-without-it"])
def test_with_etcd_fencing_follows_what_etcd_says(recorded: int | None, leader_known_for: float | None,
                                                  silent_for: float, running: bool, fences: str | None) -> None:
    h = Harness(failover=True)
    h.running()
    h.core.session_ended("UNAVAILABLE")
    h.clock.now += silent_for
    actions = h.core.etcd_observed(recorded=recorded, leader_known_for=leader_known_for, recorded_running=running)
    if fences is None:
        assert stops(actions) == []
    else:
        [stop] = stops(actions)
        assert fences in stop.reason and not stop.planned


def test_with_etcd_a_worker_that_ended_meanwhile_is_reported_again_after_the_join() -> None:
    h = Harness(failover=True)
    h.running()
    h.core.session_ended("UNAVAILABLE")
    h.core.worker_exited(1, 3)  # the report goes nowhere: no session
    actions = h.core.session_opened()
    assert [type(m).__name__ for m in sent(actions)] == ["Join", "WorkerReport"]
    [report] = reports(actions)
    assert (report.status, report.exit_code) == (api.WorkerStatus.FAILED, 3)


def test_with_etcd_a_member_that_attaches_to_a_new_coordinator_tells_it_its_trainer() -> None:
    h = Harness(failover=True)
    h.running()
    h.core.trainer_pid(1, 4242)
    h.core.session_ended("UNAVAILABLE")
    actions = h.core.session_opened()
    assert [type(m).__name__ for m in sent(actions)] == ["Join", "WorkerReport"]
    [join] = [m for m in sent(actions) if isinstance(m, api.Join)]
    [report] = reports(actions)
    assert join.attached_generation == 1
    assert (report.generation, report.status, report.pid) == (1, api.WorkerStatus.RUNNING, 4242)


def test_without_etcd_a_lost_coordinator_fences_at_once() -> None:
    h = Harness()
    h.running()
    assert stops(h.core.session_ended("UNAVAILABLE")) == [Stop("fencing: the coordinator is unreachable",
                                                              planned=False)]
    assert h.core.etcd_observed(recorded=1, leader_known_for=None) == []  # etcd plays no part


def test_only_a_session_that_had_opened_and_broke_makes_the_shell_look_for_the_coordinator_anew() -> None:
    h = Harness(failover=True)
    h.running()
    assert CoordinatorLost() in h.core.session_ended("UNAVAILABLE: connection reset")
    assert CoordinatorLost() not in h.core.session_ended("UNAVAILABLE: connection refused")  # it never opened
    h.core.session_opened()
    assert CoordinatorLost() not in h.core.session_ended(None)  # ended as planned


def test_metrics_stay_up_after_a_failure_or_a_hosted_verdict_not_after_a_plain_success() -> None:
    h = Harness()
    h.running()
    h.core.received(api.Finished(api.JobState.SUCCEEDED, "every trainer exited 0"))
    assert h.core.hosting_ended(verdict_hosted=False) == []
    assert h.core.hosting_ended(verdict_hosted=True) == [KeepMetricsUp("succeeded")]
    failed = Harness()
    failed.running()
    failed.core.received(api.Finished(api.JobState.FAILED, "restart budget exhausted"))
    assert failed.core.hosting_ended(verdict_hosted=False) == [KeepMetricsUp("failed")]


def test_with_etcd_the_agent_waits_for_etcd_only_until_it_must_decide_whether_to_fence() -> None:
    """The coordinator counts a silent node lost at node_timeout (2 s): with 1.5 s of silence already, etcd has a
    quarter of a second to answer, not the seconds its client would retry."""
    h = Harness(failover=True)
    h.running()
    h.core.received(api.Heartbeat())  # heard now
    assert Harness().core.between_sessions() == []  # without etcd nothing to ask
    assert etcd_patience(h.core) == pytest.approx(1.75)
    h.clock.now += 1.5
    assert etcd_patience(h.core) == pytest.approx(0.25)
    h.clock.now += 5.0
    assert etcd_patience(h.core) == 0.1


# ------------------------------------------------------------------------------------------------ node check


def test_the_first_join_carries_the_node_check_and_listens_for_the_coordinators_probe() -> None:
    h = Harness()
    assert h.core.coordinator_found() == [RunNodeCheck("a node check is owed before the next Join")]
    assert h.core.node_checked("") == []  # no session yet: it goes out with the first Join
    assert h.core.coordinator_found() == []
    assert h.core.session_opened() == [ListenForProbe(5555)]
    assert h.core.probe_listening("") == [Send(api.Join(
        api.NodeInfo("n1", "10.0.0.1", 5555, "incarnation-1", version=VERSION, protocol=PROTOCOL), SPEC,
        checked=True))]
    assert h.core.probe_listening("") == []  # that Join went out
    h.core.received(api.Heartbeat())  # on its way before the coordinator read the Join: not an answer
    h.core.received(api.Waiting(1, 1, 2, "waiting for the round to close"))  # answered
    h.core.session_ended("lost")
    assert joins(h.core.session_opened())[0].checked is False  # a later session: no check


def test_a_checked_join_on_a_session_that_breaks_before_an_answer_is_sent_again() -> None:
    h = Harness()
    h.core.node_checked("")
    assert h.core.session_opened() == [ListenForProbe(5555)]
    assert joins(h.core.probe_listening(""))[0].checked
    h.core.session_ended("UNAVAILABLE: Connection refused")  # the coordinator was not up yet
    assert h.core.session_opened() == [ListenForProbe(5555)]
    assert joins(h.core.probe_listening(""))[0].checked
    h.core.received(api.Waiting(1, 1, 2, "waiting for the round to close"))  # answered
    h.core.session_ended("lost")
    assert not joins(h.core.session_opened())[0].checked


def test_a_failed_check_goes_out_with_the_join(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.core.node_checked("backup dir /backup is not writable: Read-only file system")
    h.core.session_opened()
    [join] = joins(h.core.probe_listening(""))
    assert (join.checked, join.check_failure) == (True, "backup dir /backup is not writable: Read-only file system")
    assert "node check failed: backup dir /backup is not writable" in caplog.text


def test_a_worker_port_it_cannot_listen_on_fails_the_check_in_the_join(caplog: pytest.LogCaptureFixture) -> None:
    """The trainer could not bind it either: the Join names both failures, the check's and the port's."""
    h = Harness()
    h.core.node_checked("no space left")
    h.core.session_opened()
    [join] = joins(h.core.probe_listening("cannot listen on the worker port 5555: Address already in use"))
    assert join.check_failure == "no space left; cannot listen on the worker port 5555: Address already in use"
    assert "node check failed: cannot listen on the worker port 5555" in caplog.text
    h.core.received(api.CheckNode("readmitted by an operator"))
    h.core.node_checked("")
    [join] = joins(h.core.probe_listening(""))  # a later check that listens: passed
    assert (join.checked, join.check_failure) == (True, "")


def test_a_quarantined_node_asked_for_a_check_runs_it_and_joins_again_with_its_result() -> None:
    h = Harness()
    h.core.node_checked("")
    h.core.session_opened()
    assert h.core.received(api.Waiting(1, 1, 2, "quarantined for 600s more: ...")) != []
    assert h.core.received(api.CheckNode("the quarantine's cooldown is over")) == [
        RunNodeCheck("the quarantine's cooldown is over")]
    assert h.core.node_checked("") == [ListenForProbe(5555)]
    assert [(j.checked, j.check_failure) for j in joins(h.core.probe_listening(""))] == [(True, "")]


def test_a_check_order_is_ignored_while_a_worker_runs() -> None:
    h = Harness()
    h.running()
    assert h.core.received(api.CheckNode("readmitted by an operator")) == []


def test_a_start_up_report_before_the_restore_is_not_where_the_generation_resumed() -> None:
    """The library's trainers announce start-up at step 0, then restore: the coordinator must hear the restored
    step as the resume point (else a restart looks like every step lost), and the step counter must not count
    the jump from 0 to it as steps made."""
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))  # before the restore
    assert h.core.tracker.latest is None
    actions = h.core.progress(ProgressMessage(1, 4001, step=2906, phase=Phase.SETUP, restored_step=2906,
                                              restored_tier="local"))
    [report] = reports(actions)  # the first report that counts goes out at once
    assert report.progress is not None and report.progress.step == 2906
    h.core.progress(ProgressMessage(1, 4001, step=2910))
    assert h.metric("tfelastic_training_steps_total") == 4.0


def test_the_first_report_past_the_resume_step_goes_out_at_once_and_the_next_at_the_heartbeat() -> None:
    """It ends the generation's start-up in the coordinator's goodput ledger: half a heartbeat later, those
    seconds of training would count as start-up (and a generation shorter than that would show no training)."""
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))
    assert [r.progress.step for r in reports(h.core.progress(ProgressMessage(  # type: ignore[union-attr]
        1, 4001, step=60, phase=Phase.SETUP, restored_step=60, restored_tier="local")))] == [60]
    assert h.core.progress(ProgressMessage(1, 4001, step=60)) == []  # not past it yet
    past = reports(h.core.progress(ProgressMessage(1, 4001, step=61)))
    assert [r.progress.step for r in past] == [61]  # type: ignore[union-attr]
    assert reports(h.core.progress(ProgressMessage(1, 4001, step=62))) == []  # the heartbeat carries it


def test_a_trainer_that_announces_no_restore_resumes_at_its_first_training_report() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))
    [report] = reports(h.core.progress(ProgressMessage(1, 4001, step=301)))
    assert report.progress is not None and report.progress.step == 301


# -------------------------------------------------------------------------------------------- the standby


def standbys(actions: list[Action]) -> list[int]:
    """The generations whose assignment a standby is to be built for."""
    return [a.assignment.generation for a in actions if isinstance(a, PrepareStandby)]


def tick(h: Harness) -> list[Action]:
    """A tick on a session that hears its coordinator's heartbeats."""
    h.core.received(api.Heartbeat())
    return h.core.tick()


def test_the_standby_is_built_ten_seconds_after_the_first_progress_report() -> None:
    """Not while the trainer starts up and compiles its first steps: the two would compete for the CPU."""
    h = Harness()
    h.running()
    h.clock.now += 5.0
    assert standbys(h.core.progress(ProgressMessage(1, 4001, step=1))) == []
    h.clock.now += 9.9
    assert standbys(tick(h)) == []
    h.clock.now += 0.1
    assert standbys(tick(h)) == [1]
    h.clock.now += 60.0
    assert standbys(tick(h) + h.core.progress(ProgressMessage(1, 4001, step=50))) == []  # once


def test_a_trainer_that_never_reports_gets_its_standby_forty_seconds_after_its_launch() -> None:
    h = Harness()
    h.running()
    h.clock.now += 39.9
    assert standbys(tick(h)) == []
    h.clock.now += 0.1
    assert standbys(tick(h)) == [1]


def test_a_node_with_cores_to_spare_builds_the_standby_at_the_launch() -> None:
    """So that a failure early in a generation, and every one of a crash loop, relaunches warm too."""
    h = Harness(standby_at_launch=True)
    h.running()
    assert standbys(tick(h)) == [1]
    h.core.worker_exited(1, 1)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    h.core.worker_stopped(StopResult(1, True))
    h.running(generation=2)
    assert standbys(tick(h)) == [2]


def test_a_report_that_comes_due_builds_the_standby_without_waiting_for_a_tick() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=1))
    h.clock.now += 10.0
    assert standbys(h.core.progress(ProgressMessage(1, 4001, step=20))) == [1]


def test_a_new_generation_schedules_its_own_standby_and_a_leaving_agent_none() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=1))
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    h.core.worker_stopped(StopResult(-9, False))
    h.clock.now += 5.0
    h.running(generation=2)
    h.clock.now += 5.0
    assert standbys(tick(h)) == []  # generation 1's was due now; generation 2 has not reported yet
    h.clock.now += 35.0
    assert standbys(tick(h)) == [2]
    h = Harness()
    h.running()
    h.core.signal_received(signal.SIGTERM)
    h.clock.now += 40.0
    assert standbys(tick(h)) == []
    h = Harness()
    h.running()
    h.core.received(api.Finished(api.JobState.SUCCEEDED, "every member's trainer exited 0"))
    h.clock.now += 40.0
    assert standbys(h.core.progress(ProgressMessage(1, 4001, step=1))) == []  # the job is over


# ------------------------------------------------------------------------------------- what the shell reads


def test_reports_carry_the_gpu_summary_the_shell_read_last() -> None:
    h = Harness()
    h.running()
    h.core.node_read(gpus=(8, 73.5))
    [report] = reports(h.core.trainer_pid(1, 4343))
    assert (report.gpus, report.gpu_utilization) == (8, 73.5)


def test_the_shell_reads_the_restorable_steps_before_each_join_that_may_start_a_generation() -> None:
    h = Harness()
    assert h.core.session_starting() == [ScanSnapshots()]  # no worker: the first Join may start one
    h.running()
    assert h.core.session_starting() == []  # (etcd) the Join attaches the running worker
    assert h.core.node_check_ended() == []  # a check now would not end in a Join: the worker runs
    h.core.worker_exited(1, 1)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert h.core.worker_gone(()) == [ScanSnapshots()]  # the Join after the stop reports them
    h.core.worker_stopped(StopResult(1, True))
    assert h.core.node_check_ended() == [ScanSnapshots()]  # waiting on an open session: the result goes out now


def test_a_node_check_owed_runs_before_the_session_that_carries_it() -> None:
    h = Harness()
    assert h.core.coordinator_found() == [RunNodeCheck("a node check is owed before the next Join")]
    h.core.node_checked("")
    assert h.core.coordinator_found() == []  # its result waits for the session


def test_a_fixed_worker_port_is_awaited_free_before_a_join_after_the_gpus() -> None:
    h = Harness(worker_port=5555)
    h.running()
    h.core.worker_exited(1, -signal.SIGKILL)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert h.core.worker_gone((4001,)) == [ScanSnapshots(), WaitGpusReleased((4001,)), WaitPortFree(5555)]


def test_a_launch_counts_as_warm_or_cold() -> None:
    h = Harness()
    h.core.session_opened()
    h.core.received(assignment(1))
    h.core.worker_started(1, 4001, warm=True)
    h.core.worker_started(2, 4002)  # a launch the core no longer expects is counted all the same
    assert h.metric("tfelastic_worker_launches_total", start="warm") == 1.0
    assert h.metric("tfelastic_worker_launches_total", start="cold") == 1.0


def test_a_join_after_a_generation_names_its_size_for_a_coordinator_that_starts_without_state() -> None:
    h = Harness()
    h.running(generation=3, rank=1)
    h.core.worker_exited(3, 1)
    h.core.received(api.StopWorkers(3, api.RestartReason.WORKER_EXIT))
    [join] = joins(h.core.worker_stopped(StopResult(1, True)))
    assert (join.node.last_generation, join.node.last_rank, join.node.last_world_size) == (3, 1, 2)


def test_reports_carry_the_time_the_trainer_spent_in_its_saves_and_evaluations() -> None:
    """For the goodput ledger: a save lasts from its announcement to the next report, or what the fast tier says
    it held training up; an evaluation from its announcement to the next report."""
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=0, phase=Phase.SETUP))
    h.core.progress(ProgressMessage(1, 4001, step=10))
    h.core.progress(ProgressMessage(1, 4001, step=20, phase=Phase.SAVE))
    h.clock.now += 2.0
    h.core.progress(ProgressMessage(1, 4001, step=20))  # a save without a measure of its own: 2 s
    h.core.progress(ProgressMessage(1, 4001, step=30, phase=Phase.SAVE))
    h.clock.now += 1.0
    h.core.progress(ProgressMessage(1, 4001, step=30, stall=0.25, checkpoint_step=30))  # the tier's own: 0.25 s
    h.core.progress(ProgressMessage(1, 4001, step=40, phase=Phase.EVAL))
    h.clock.now += 5.0
    h.core.progress(ProgressMessage(1, 4001, step=40))
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.progress is not None
    assert (report.progress.save_seconds, report.progress.other_seconds) == (2.25, 5.0)


def test_reports_say_from_when_the_trainer_finished_training() -> None:
    """For the goodput ledger: what follows the end of training (a final save, evaluation, export) is not
    training; the reports after it still say so, until a step past it (another fit)."""
    h = Harness()
    h.running()
    [first] = reports(h.core.progress(ProgressMessage(1, 4001, step=10)))  # the first goes out at once
    assert first.progress is not None and not first.progress.training_done
    h.core.progress(ProgressMessage(1, 4001, step=20, done=True))
    h.core.progress(ProgressMessage(1, 4001, step=20, phase=Phase.SAVE))  # the final save comes after it
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.progress is not None and report.progress.training_done
    h.core.progress(ProgressMessage(1, 4001, step=21))  # a second fit trains on
    h.clock.now += 1.0
    h.core.received(api.Heartbeat())
    [report] = reports(h.core.tick())
    assert report.progress is not None and not report.progress.training_done


def test_a_stop_order_sends_the_progress_the_coordinator_has_not_seen_first() -> None:
    h = Harness()
    h.running()
    h.core.progress(ProgressMessage(1, 4001, step=10))  # the first report goes out at once
    h.core.progress(ProgressMessage(1, 4001, step=11))  # and the first past it
    h.core.progress(ProgressMessage(1, 4001, step=17))  # waits for the next heartbeat
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    [report] = reports(actions)
    assert report.progress is not None and report.progress.step == 17
    kinds = [type(a) for a in actions]
    assert kinds.index(Send) < kinds.index(Stop)  # before the trainer is stopped


# ------------------------------------------------------------------------------------------------ GPU release

HELD = "GPU memory of the stopped worker is still held 30s after it stopped (GPU 0: pid 4002 with 4096 MiB)"


def stopped_after_failure(h: Harness, pids: tuple[int, ...] = (4001, 4002)) -> None:
    """Generation 1's trainer failed, the coordinator ordered the stop, and its processes are gone (the stop is
    not reported done yet)."""
    h.running()
    h.core.worker_exited(1, -signal.SIGKILL)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    h.core.worker_gone(pids)


def test_the_join_after_a_stop_waits_for_the_gpus_to_give_the_memory_back_and_the_wait_is_measured() -> None:
    h = Harness()
    assert h.gpu_holders() == ()
    h.running()
    h.core.worker_exited(1, -signal.SIGKILL)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    # the steps the Join reports, then these processes' memory back, before the stop is reported and the Join goes
    assert h.core.worker_gone((4001, 4002)) == [ScanSnapshots(), WaitGpusReleased((4001, 4002))]
    assert h.gpu_holders() == (4001, 4002)
    h.core.gpus_released(1.5, "")
    assert h.gpu_holders() == ()
    [join] = joins(h.core.worker_stopped(StopResult(-signal.SIGKILL, True, (4001, 4002))))
    assert not join.checked
    assert h.metric("tfelastic_gpu_release_wait_seconds_count") == 1.0
    assert h.metric("tfelastic_gpu_release_wait_seconds_sum") == 1.5


def test_without_nvml_nothing_is_awaited_or_measured() -> None:
    h = Harness()
    stopped_after_failure(h)
    h.core.gpus_released(None, "")  # no GPU, or no driver, on this node
    assert h.gpu_holders() == ()
    assert h.metric("tfelastic_gpu_release_wait_seconds_count") == 0.0


def test_memory_never_given_back_fails_the_node_check_of_the_join_after_the_stop(
        caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator sets a node whose check failed aside (the quarantine): no generation starts into that
    memory. It is awaited again before the next Join, the one after the quarantine's re-check."""
    h = Harness()
    stopped_after_failure(h)
    h.core.gpus_released(30.0, HELD)
    assert h.core.worker_stopped(StopResult(-signal.SIGKILL, True)) == [ListenForProbe(5555)]
    [join] = joins(h.core.probe_listening(""))
    assert (join.checked, join.check_failure) == (True, HELD)
    assert f"node check failed: {HELD}" in caplog.text
    assert h.metric("tfelastic_gpu_release_wait_seconds_sum") == 30.0
    assert h.gpu_holders() == (4001, 4002)
    h.core.received(api.Waiting(1, 2, 2, "quarantined for 600s: ..."))  # answered
    assert h.core.received(api.CheckNode("the quarantine's cooldown is over")) == [
        RunNodeCheck("the quarantine's cooldown is over")]
    h.core.gpus_released(0.2, "")  # the shell waited again after the check: given back by now
    assert h.core.node_checked("") == [ListenForProbe(5555)]
    [join] = joins(h.core.probe_listening(""))
    assert (join.checked, join.check_failure) == (True, "")
    assert h.gpu_holders() == ()


def test_a_release_failure_goes_out_beside_the_checks_own_result() -> None:
    h = Harness()
    stopped_after_failure(h)
    h.core.gpus_released(0.1, "")
    h.core.worker_stopped(StopResult(-signal.SIGKILL, True))
    h.core.received(api.Waiting(1, 2, 2, "quarantined for 600s: ..."))
    h.core.received(api.CheckNode("readmitted by an operator"))
    h.core.worker_gone((4001,))  # (as if a process had been found only now)
    h.core.gpus_released(30.0, HELD)
    h.core.node_checked("backup dir /backup is not writable: Read-only file system")
    [join] = joins(h.core.probe_listening(""))
    assert join.check_failure == f"backup dir /backup is not writable: Read-only file system; {HELD}"


def test_after_a_fence_the_next_session_joins_with_the_release_failure() -> None:
    h = Harness()
    h.core.node_checked("")
    h.running()
    h.core.received(api.Waiting(1, 2, 2, "..."))  # the first checked Join answered
    assert stops(h.core.session_ended("UNAVAILABLE: connection reset")) != []  # fenced
    h.core.worker_gone((4001,))
    assert h.core.worker_stopped(StopResult(-signal.SIGTERM, False, (4001,))) == []
    assert h.core.session_starting() == [ScanSnapshots(), WaitGpusReleased((4001,))]
    h.core.gpus_released(30.0, HELD)
    assert h.core.session_opened() == [ListenForProbe(5555)]
    [join] = joins(h.core.probe_listening(""))
    assert (join.checked, join.check_failure) == (True, HELD)


# ------------------------------------------------------------------------------- a parameter-server job's tasks

PS_SPEC = api.JobSpec("job", b"\x01" * 32, 3, 4, 3, 3600.0, 10.0, "/backup", 0.5, 2.0, "parameter-server", 1)
PS_TASKS = (("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1))


class PsHarness(Harness):
    """An agent of a parameter-server job whose node holds the task of ``rank`` (0 chief, 1 ps, 2-3 workers)."""

    def __init__(self, rank: int, budget: int = 3) -> None:
        self.clock = FakeClock(100.0)
        self.registry = CollectorRegistry()
        node_id = f"n{rank + 1}"
        identity = Identity(node_id, f"10.0.0.{rank + 1}", PS_SPEC, "incarnation-1", role="any")
        policy = ReplacementPolicy(budget=budget, window=3600.0, backoff=1.0, backoff_max=30.0)
        timing = Timing(HEARTBEAT, NODE_TIMEOUT, 600.0, FIXED_STALL, stop_grace=10.0)
        self.core = AgentCore(identity, timing, Connection("head:29400"), AgentMetrics(self.registry, "job", node_id),
                              self.clock, pick_port=lambda host: 5555, policy=WorkerPolicy(replacement=policy))
        self.rank = rank
        self.assignment = api.Assignment(1, rank, 4, tuple(
            api.Member(f"n{i + 1}", i, f"10.0.0.{i + 1}", 5555, *PS_TASKS[i]) for i in range(4)), 0)
        self.core.session_opened()
        assert Launch(self.assignment) in self.core.received(self.assignment)
        self.core.worker_started(1, 4001)

    def tick(self) -> list[Action]:
        """A tick while the coordinator keeps talking."""
        self.core.received(api.Heartbeat())
        return self.core.tick()

    def killed(self) -> list[Action]:
        """The worker task is SIGKILLed; the agent stops what is left of it."""
        actions = self.core.worker_exited(1, -9)
        return actions + (self.core.worker_stopped(StopResult(-9, True, (4001,))) if stops(actions) else [])


def test_a_ps_worker_that_dies_is_replaced_alone_with_the_same_assignment() -> None:
    h = PsHarness(rank=3)
    actions = h.killed()
    [replaced] = reports(actions)
    assert replaced.status is api.WorkerStatus.REPLACED and "worker 1" in replaced.detail
    assert Launch(h.assignment) in actions  # the first replacement goes at once, at the same address
    assert h.worker_state() is WorkerState.RUNNING
    assert h.metric("tfelastic_restarts_total", reason="worker_replaced") == 1.0
    assert not joins(actions)  # no Join: the generation goes on


def test_a_ps_worker_that_exits_0_is_a_failure_replaced_alone_and_a_ps_that_does_is_reported_failed() -> None:
    """A worker or a parameter server serves until the job ends: its exit 0 is no success (TensorFlow's tutorial
    left the chief waiting on a worker that exited 0, and the job restarted as stalled, blaming the chief)."""
    worker = PsHarness(rank=3)
    actions = worker.core.worker_exited(1, 0)
    assert stops(actions)  # what is left of it stops, then it is relaunched alone at its address
    actions = worker.core.worker_stopped(StopResult(0, True, (4001,)))
    [replaced] = reports(actions)
    assert replaced.status is api.WorkerStatus.REPLACED
    assert replaced.detail == "worker 1 trainer exited 0, but its task serves until the job ends: replaced alone"
    assert Launch(worker.assignment) in actions
    ps = PsHarness(rank=1)
    [failed] = reports(ps.core.worker_exited(1, 0))
    assert (failed.status, failed.exit_code) == (api.WorkerStatus.FAILED, 0)  # the coordinator restarts the job
    chief = PsHarness(rank=0)
    [done] = reports(chief.core.worker_exited(1, 0))
    assert done.status is api.WorkerStatus.SUCCEEDED  # the chief's exit 0 ends the job


def test_a_replaced_workers_gpu_memory_and_port_are_awaited_before_its_relaunch() -> None:
    """Relaunched alone at the same address, the task binds the same port, on GPUs a killed process may still hold:
    the shell waits for both before it reports the stop done, as it does before a Join."""
    h = PsHarness(rank=3)
    actions = h.core.worker_exited(1, -9)
    assert stops(actions)
    # no snapshot scan (no Join), the memory, then its own task's port (5555; a Join would pick a fresh one)
    assert h.core.worker_gone((4001, 4010)) == [WaitGpusReleased((4001, 4010)), WaitPortFree(5555)]
    h.core.gpus_released(0.4, "")
    assert h.core.gpu_holders == ()
    assert Launch(h.assignment) in h.core.worker_stopped(StopResult(-9, True, (4001, 4010)))


def test_a_stop_ordered_by_the_coordinator_is_no_relaunch() -> None:
    h = PsHarness(rank=3)
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    assert h.core.worker_gone(()) == [ScanSnapshots()]  # a Join follows (with a fresh port), not a relaunch


def test_replacements_in_a_row_back_off_and_a_spent_budget_is_reported_as_a_failure() -> None:
    h = PsHarness(rank=2, budget=3)
    h.killed()
    h.core.worker_started(1, 4002)
    actions = h.killed()  # the second in a row waits restart_backoff
    assert not [a for a in actions if isinstance(a, Launch)] and h.worker_state() is WorkerState.STOPPED
    h.clock.now += 0.9
    assert not [a for a in h.tick() if isinstance(a, Launch)]
    h.clock.now += 0.2
    assert Launch(h.assignment) in h.tick()
    h.core.worker_started(1, 4003)
    h.clock.now += 3.0
    assert not [a for a in h.killed() + h.tick() if isinstance(a, Launch)]  # the third waits 2 s
    h.clock.now += 2.0
    assert Launch(h.assignment) in h.tick()
    h.core.worker_started(1, 4004)
    actions = h.core.worker_exited(1, -9)  # the fourth: 3 within the window is the budget
    [failed] = reports(actions)
    assert failed.status is api.WorkerStatus.FAILED and "--worker-replacements 3" in failed.detail
    assert not stops(actions)  # the coordinator decides: it restarts the job


@pytest.mark.parametrize("rank", [0, 1])
def test_the_chief_and_the_parameter_servers_are_never_replaced_alone(rank: int) -> None:
    h = PsHarness(rank=rank)
    actions = h.core.worker_exited(1, -9)
    assert [r.status for r in reports(actions)] == [api.WorkerStatus.FAILED]
    assert not stops(actions)


def test_a_parameter_server_and_a_worker_are_not_watched_for_progress_but_the_chief_is() -> None:
    for rank, watched in ((0, True), (1, False), (2, False)):
        h = PsHarness(rank=rank)
        h.core.progress(ProgressMessage(1, 4001, step=5))  # a worker's sitecustomize may report too: ignored
        h.clock.now += STALL + 0.25
        assert bool(stalled(h.tick(), h.core)) is watched


def test_a_worker_whose_server_stops_answering_is_replaced() -> None:
    h = PsHarness(rank=2)
    probes = []
    for _ in range(6):
        h.clock.now += 2.0
        probes += [a for a in h.tick() if isinstance(a, ProbeServer)]
        if probes:
            assert h.core.server_probed(1, answered=True) == []
    assert probes and probes[0] == ProbeServer(1, "10.0.0.3:5555")
    actions: list[Action] = []
    for _ in range(3):
        h.clock.now += 2.0
        assert [a for a in h.tick() if isinstance(a, ProbeServer)]
        actions = h.core.server_probed(1, answered=False)
    assert stops(actions) == [Stop("replacing worker 0", False)]
    actions = h.core.worker_stopped(StopResult(-9, False, (4001,)))
    assert [r.status for r in reports(actions)] == [api.WorkerStatus.REPLACED]
    assert "did not answer 3 probes" in reports(actions)[0].detail
    assert Launch(h.assignment) in actions


def test_a_stop_order_during_a_replacement_rejoins_instead_of_relaunching() -> None:
    h = PsHarness(rank=2)
    h.killed()
    h.core.worker_started(1, 4002)
    h.core.worker_exited(1, -9)  # the second in a row: stopping, then a backoff
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))  # a ps failed meanwhile
    actions += h.core.worker_stopped(StopResult(-9, True, (4002,)))
    assert joins(actions) and not [a for a in actions if isinstance(a, Launch)]
    h.clock.now += 60.0
    assert not [a for a in h.tick() if isinstance(a, Launch)]


def test_a_join_says_which_task_the_node_may_take() -> None:
    h = Harness()
    h.core.identity = Identity("n1", "10.0.0.1", PS_SPEC, "incarnation-1", role="ps")
    [join] = joins(h.core.session_opened())
    assert join.node.role == "ps"


def test_a_mirrored_worker_is_never_relaunched_without_a_new_assignment() -> None:
    h = Harness()
    h.running()
    actions = h.core.worker_exited(1, -9)
    assert [r.status for r in reports(actions)] == [api.WorkerStatus.FAILED]
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    actions += h.core.worker_stopped(StopResult(-9, True, (4001,)))
    for _ in range(120):
        h.clock.now += 0.5
        h.core.received(api.Heartbeat())
        actions += h.core.tick()
    assert joins(actions) and not [a for a in actions if isinstance(a, Launch)]


def test_a_ps_worker_serving_counts_as_progress_for_the_next_standby() -> None:
    h = PsHarness(rank=2)
    h.clock.now += 2.0
    assert [a for a in h.tick() if isinstance(a, ProbeServer)]
    h.core.server_probed(1, answered=True)
    h.clock.now += 10.0  # AFTER_PROGRESS_SECONDS, not the 40 s of a trainer that never reports
    assert standbys(h.tick()) == [1]


@pytest.mark.parametrize("rank", [1, 2])
def test_a_leaving_parameter_server_or_worker_serves_until_the_coordinator_orders_its_stop(rank: int) -> None:
    """Every agent stopped at once (systemctl, scancel): the chief's last save still reads the variables."""
    h = PsHarness(rank=rank)
    actions = h.core.signal_received(signal.SIGTERM)
    assert sent(actions) == [api.Leave("agent stopped (SIGTERM)")] and not stops(actions)
    assert h.worker_state() is WorkerState.RUNNING
    h.clock.now += 9.0
    assert not stops(h.tick())  # no order yet, within stop_grace (10 s)
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.NODE_LEFT))  # the chief's trainer is gone
    assert stops(actions) == [Stop("leaving (node_left)", planned=True)]
    assert not h.metric("tfelastic_restarts_total", reason="node_left")  # its own leave, not a restart
    assert h.core.worker_stopped(StopResult(-15, False)) == [HangUp()]
    assert h.core.session_ended(None) == []
    assert verdict(h.core) is ExitCode.SUCCEEDED


def test_a_leaving_parameter_server_stops_after_stop_grace_or_when_the_coordinator_is_gone() -> None:
    h = PsHarness(rank=1)
    h.core.signal_received(signal.SIGTERM)
    h.clock.now += 10.0
    assert stops(h.tick()) == [Stop("leaving: stop_grace passed", planned=True)]  # an older coordinator says nothing
    gone = PsHarness(rank=3)
    gone.core.signal_received(signal.SIGTERM)
    assert stops(gone.core.session_ended("connection reset")) == [
        Stop("leaving: the coordinator's session ended", planned=True)]


def test_a_leaving_chief_stops_its_trainer_at_once() -> None:
    h = PsHarness(rank=0)
    assert stops(h.core.signal_received(signal.SIGTERM)) == [Stop("agent stopping", planned=True)]


# ------------------------------------------------------------------------------------------- the step file


def test_a_trainer_that_dies_between_reports_is_reported_at_the_step_it_marked() -> None:
    marks: dict[int, int] = {}
    h = Harness(step_mark=marks.get)
    h.running()
    h.core.progress(ProgressMessage(1, 4001, 120))
    marks[1] = 124  # four steps after its last report, then SIGKILL
    [failed] = reports(h.core.worker_exited(1, -9))
    assert failed.status is api.WorkerStatus.FAILED and failed.progress is not None
    assert failed.progress.step == 124  # the coordinator counts the next generation's redone steps from here


def test_a_stop_ordered_reports_the_steps_marked_since_the_last_report_first() -> None:
    marks: dict[int, int] = {}
    h = Harness(step_mark=marks.get)
    h.running()
    h.core.progress(ProgressMessage(1, 4001, 120))
    h.core.tick()  # the report goes out with a heartbeat
    marks[1] = 121
    actions = h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    [unsent] = reports(actions)
    assert unsent.progress is not None and unsent.progress.step == 121
    assert stops(actions)


def test_a_mark_behind_the_last_report_or_of_no_report_changes_nothing() -> None:
    marks = {1: 100}
    h = Harness(step_mark=marks.get)
    h.running()
    h.core.progress(ProgressMessage(1, 4001, 120))
    [failed] = reports(h.core.worker_exited(1, -9))
    assert failed.progress is not None and failed.progress.step == 120


def test_a_step_that_ends_while_the_trainer_is_being_stopped_is_reported_before_the_join() -> None:
    marks: dict[int, int] = {}
    h = Harness(step_mark=marks.get)
    h.running()
    h.core.progress(ProgressMessage(1, 4001, 120))
    h.core.received(api.StopWorkers(1, api.RestartReason.WORKER_EXIT))
    marks[1] = 121  # the step in flight at the order finished before SIGTERM took effect
    actions = h.core.worker_stopped(StopResult(-15, False))
    [last] = reports(actions)
    assert last.progress is not None and last.progress.step == 121
    messages = sent(actions)
    assert messages.index(last) < messages.index(joins(actions)[0])  # counted for the old generation first


def test_join_timeout_after_nothing_but_a_foreign_program_on_the_port_is_a_bad_configuration() -> None:
    """The agent's own join_timeout may run out between two tries: a port held by another program still ends the
    agent as a bad configuration (exit 78), not as an unreachable coordinator (exit 1)."""
    h = Harness(join_timeout=8.0)
    h.core.session_ended("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: "
                         "ipv4:127.0.0.1:4000: Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame)")
    h.clock.now += 8.5
    assert verdict(h.core) is ExitCode.CONFIG
    down = Harness(join_timeout=8.0)
    down.core.session_ended("UNAVAILABLE: failed to connect to all addresses; last error: UNAVAILABLE: "
                            "ipv4:127.0.0.1:4000: Connection refused")
    down.clock.now += 8.5
    assert verdict(down.core) is ExitCode.FAILED
