"""The agent's training and control-plane metrics.

No metric carries the job or node as a label: Prometheus adds the target's own labels, and a `job` label would
clash with Prometheus's. ``tfelastic_agent_info`` carries them once, for joins in queries and dashboards.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from tfelastic.daemon.rendezvous.api import FailureCause
from tfelastic.daemon.worker.states import WorkerState
from tfelastic.trainer.progress import ProgressMessage

# Recovery on this kind of machine: about 0.06 s without TensorFlow, 3-5 s with its start-up (docs/benchmarks.md).
_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A fast-tier snapshot holds training up for milliseconds; a synchronous save of a large model for seconds.
_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STEPS_BUCKETS = (0, 1, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)
# The step and example counters grow by what a trainer did between two reports of a generation, at most this
# much per report (71 minutes at a million steps a second): a larger jump is a step counter that leapt (a bug, a
# restore inside the generation), not training, and counting goes on from it. Without the cap a few reports of a
# huge step would push a counter past 2^53, where float64 can no longer add 1 to it.
MAX_COUNTED_JUMP = 1 << 32


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry, job: str, node_id: str) -> None:
        Info("tfelastic_agent", "The agent's job and node.", registry=registry).info({"tfelastic_job": job,
                                                                                     "node": node_id})
        self.step = Gauge("tfelastic_training_step", "Global step last reported by the trainer.", registry=registry)
        self.steps = Counter("tfelastic_training_steps", "Training steps completed, for rate().", registry=registry)
        self.examples = Counter("tfelastic_training_examples", "Training examples processed, for rate().",
                                registry=registry)
        self.loss = Gauge("tfelastic_training_loss", "Loss last reported by the trainer.", registry=registry)
        self.progress_time = Gauge("tfelastic_training_last_progress_timestamp_seconds",
                                   "Unix time of the trainer's last progress report.", registry=registry)
        self.checkpoint_step = Gauge("tfelastic_checkpoint_step", "Step of the last checkpoint the trainer saved.",
                                     registry=registry)
        self.checkpoint_time = Gauge("tfelastic_checkpoint_timestamp_seconds",
                                     "Unix time of the last checkpoint the trainer saved.", registry=registry)
        self.generation = Gauge("tfelastic_generation", "Generation this node last ran.", registry=registry)
        self.world_size = Gauge("tfelastic_world_size", "Workers in this node's generation.", registry=registry)
        self.rank = Gauge("tfelastic_rank", "This node's rank in its generation.", registry=registry)
        self.worker_state = Gauge("tfelastic_worker_state", "1 for the local worker's current state.", ["state"],
                                  registry=registry)
        self.restarts = Counter("tfelastic_restarts", "Restarts of the worker set this node took part in.",
                                ["reason"], registry=registry)
        self.trainer_failures = Counter(
            "tfelastic_trainer_failures", "This node's trainer failures, by cause: 'out_of_memory', 'peer_failure' (a "
            "collective or connection to a peer failed: another worker's fault), 'exception', 'signal', 'exit_code', "
            "'hang' or 'launch_failed'.", ["cause"], registry=registry)
        for cause in FailureCause:
            if cause is not FailureCause.OTHER:  # the agent's own classification never says "other"
                self.trainer_failures.labels(cause=cause.value)  # every cause from zero: rate() sees the first
        self.graceful_stops = Counter(
            "tfelastic_worker_graceful_stops", "Planned stops of the worker, by how it ended: 'checkpointed' (it "
            "saved at an agreed step and exited 42: no work lost), 'exited' (another exit) or 'killed' (SIGKILL "
            "after stop_grace).", ["outcome"], registry=registry)
        self.rendezvous = Histogram("tfelastic_rendezvous_duration_seconds",
                                    "From sending Join to receiving an assignment.", buckets=_SECONDS_BUCKETS,
                                    registry=registry)
        self.detection = Histogram("tfelastic_failure_detection_seconds",
                                   "From this node's worker failing (exit or stall) to the coordinator's stop order.",
                                   buckets=_SECONDS_BUCKETS, registry=registry)
        self.recovery = Histogram("tfelastic_recovery_seconds",
                                  "From a stop order after a failure to the first progress of the next generation.",
                                  buckets=_SECONDS_BUCKETS, registry=registry)
        self.stall_limit = Gauge("tfelastic_stall_limit_seconds",
                                 "The silence that now makes the trainer stalled: learned from its step times, a "
                                 "phase's allowance, or --stall-timeout (0: not watched).", registry=registry)
        self.launches = Counter("tfelastic_worker_launches", "Worker launches, by start: 'warm' (through the standby "
                                "interpreter) or 'cold'.", ["start"], registry=registry)
        self.standby_memory = Gauge("tfelastic_standby_memory_bytes",
                                    "Resident memory of the warm-start standby interpreter (0: none).",
                                    registry=registry)
        self.standby_ready = Gauge("tfelastic_standby_ready", "1 while a warm-start standby interpreter has "
                                   "imported TensorFlow and waits for the next launch.", registry=registry)
        self.save_stall = Histogram("tfelastic_checkpoint_save_stall_seconds",
                                    "How long each snapshot of the fast checkpoint tier held training up.",
                                    buckets=_STALL_BUCKETS, registry=registry)
        self.restores = Counter("tfelastic_checkpoint_restores", "Trainer restores, by the tier the state came "
                                "from: 'survivors' (the step the survivors of a peer's failure held, saved to the "
                                "backup directory), 'local' (this node's memory), 'shared' (the backup directory) or "
                                "'none' (no snapshot: from the start).", ["tier"], registry=registry)
        self.steps_redone = Histogram("tfelastic_restore_steps_redone", "Steps a restored trainer trains again: the "
                                      "last step this node's previous worker reported minus the step restored.",
                                      buckets=_STEPS_BUCKETS, registry=registry)
        self.gpu_release_wait = Histogram(
            "tfelastic_gpu_release_wait_seconds", "How long the GPUs took to give back the memory of the stopped "
            "worker's processes, from its stop to the Join that may start the next generation (a wait that ran out "
            "counts its bound).", buckets=_SECONDS_BUCKETS, registry=registry)
        self._last_step: int | None = None
        self._previous_generation_step: int | None = None
        self._last_examples: int | None = None
        self.set_worker_state(WorkerState.INIT)

    def set_worker_state(self, state: WorkerState) -> None:
        for s in WorkerState:
            self.worker_state.labels(state=s.value).set(1 if s is state else 0)

    def new_generation(self, generation: int, rank: int, world_size: int) -> None:
        self.generation.set(generation)
        self.rank.set(rank)
        self.world_size.set(world_size)
        if self._last_step is not None:
            self._previous_generation_step = self._last_step
        self._last_step = self._last_examples = None  # a restored trainer starts counting from its checkpoint

    def progress(self, message: ProgressMessage, wall_time: float) -> None:
        """Counters grow by what the trainer did since its previous report of the same generation."""
        self._fast_tier(message)
        _count(self.steps, self._last_step, message.step)
        self._last_step = message.step
        if message.examples is not None:
            _count(self.examples, self._last_examples, message.examples)
            self._last_examples = message.examples
        self.step.set(message.step)
        self.progress_time.set(wall_time)
        if message.loss is not None:
            self.loss.set(message.loss)

    def _fast_tier(self, message: ProgressMessage) -> None:
        if message.stall is not None:
            self.save_stall.observe(message.stall)
        if message.restored_tier is not None:
            self.restores.labels(tier=message.restored_tier).inc()
            if self._previous_generation_step is not None:
                restored = message.restored_step or 0
                self.steps_redone.observe(max(self._previous_generation_step - restored, 0))

    def checkpoint(self, step: int, wall_time: float) -> None:
        self.checkpoint_step.set(step)
        self.checkpoint_time.set(wall_time)


def _count(counter: Counter, last: int | None, now: int) -> None:
    if last is not None and 0 < now - last <= MAX_COUNTED_JUMP:
        counter.inc(now - last)
