"""A job: one training run's schedule, cursor and fencing on top of a store.

A job is named by its trainers. Its identity (dataset fingerprint, schedule
config hash, world size) is stored the first time it is opened; a server on
another dataset or config is refused with an error naming what differs. The
schedule of every epoch is derived (``build_schedule``) and cached, never
stored: the state in the store is a few integers per rank.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .dataset import TokenDataset
from .errors import ConfigError, WorldSizeMismatchError
from .schedule import ALGORITHM_VERSION, Schedule, ScheduleConfig, build_schedule
from .store.base import CursorStore, JobSpec, JobState, Position, RankState

__all__ = ["BatchRef", "Job", "JobRegistry", "schedule_fingerprint"]


def schedule_fingerprint(dataset_fp: str, config_fp: str, world_size: int) -> str:
    """Names the schedule every epoch of a job follows (changes with any input or the algorithm)."""
    text = f"ladle-schedule:v{ALGORITHM_VERSION}:{dataset_fp}:{config_fp}:{world_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BatchRef:
    """Where one batch comes from: its position and the rows to assemble."""

    epoch: int
    step: int
    rank: int
    bucket: int
    rows: npt.NDArray[np.int64]
    padded_len: int
    steps_in_epoch: int

    @property
    def next(self) -> Position:
        """The position after this batch (step 0 of the next epoch after the last step)."""
        if self.step + 1 < self.steps_in_epoch:
            return Position(self.epoch, self.step + 1)
        return Position(self.epoch + 1, 0)


class Job:
    """One job's schedules and cursor operations (thread-safe)."""

    def __init__(
        self, name: str, dataset: TokenDataset, config: ScheduleConfig, world_size: int, store: CursorStore
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.config = config
        self.world_size = world_size
        self.store = store
        self.spec = JobSpec(name, dataset.fingerprint, config.fingerprint(), world_size)
        self.fingerprint = schedule_fingerprint(dataset.fingerprint, config.fingerprint(), world_size)
        self._schedules: OrderedDict[int, Schedule] = OrderedDict()
        self._building: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def schedule(self, epoch: int) -> Schedule:
        """The schedule of ``epoch``, built once however many streams ask at the same time.

        The three most recent epochs are kept (a slow rank may still be in the
        previous one while the next is being prepared).
        """
        while True:
            with self._lock:
                sched = self._schedules.get(epoch)
                if sched is not None:
                    self._schedules.move_to_end(epoch)
                    return sched
                pending = self._building.get(epoch)
                if pending is None:
                    pending = self._building[epoch] = threading.Event()
                    break
            pending.wait()  # another stream is building it; then look again
        try:
            sched = build_schedule(self.dataset.lengths, self.config, epoch=epoch, world_size=self.world_size)
            with self._lock:
                self._schedules[epoch] = sched
                while len(self._schedules) > 3:
                    self._schedules.popitem(last=False)
            return sched
        finally:
            with self._lock:
                del self._building[epoch]
            pending.set()

    def has_schedule(self, epoch: int) -> bool:
        with self._lock:
            return epoch in self._schedules

    def warm(self, epoch: int) -> None:
        """Build ``epoch``'s schedule in the background, so streams do not pause at the boundary."""
        with self._lock:
            if epoch in self._schedules or epoch in self._building:
                return
        threading.Thread(target=self.schedule, args=(epoch,), name=f"ladle-plan-{epoch}", daemon=True).start()

    def steps(self, epoch: int) -> int:
        return self.schedule(epoch).num_steps

    def normalise(self, position: Position) -> Position:
        """A position past an epoch's last step is the start of the next epoch."""
        epoch, step = position.epoch, position.step
        while step >= self.steps(epoch):
            step -= self.steps(epoch)
            epoch += 1
        return Position(epoch, step)

    def batch(self, position: Position, rank: int) -> BatchRef:
        sched = self.schedule(position.epoch)
        if position.step == 0 or position.step == sched.num_steps // 2:
            self.warm(position.epoch + 1)
        return BatchRef(
            epoch=position.epoch,
            step=position.step,
            rank=rank,
            bucket=sched.bucket(position.step, rank),
            rows=sched.samples(position.step, rank),
            padded_len=sched.padded_len(position.step, rank),
            steps_in_epoch=sched.num_steps,
        )

    def check_rank(self, rank: int, world_size: int) -> None:
        """Refuse a rank outside the job or a world size other than the job's."""
        if world_size != self.world_size:
            raise WorldSizeMismatchError(self.name, self.world_size, world_size)
        if not 0 <= rank < world_size:
            raise ConfigError("rank", f"{rank} is outside 0..{world_size - 1} (world_size={world_size})")

    def join(self, rank: int) -> RankState:
        return self.store.join(self.name, rank, self.world_size)

    def state(self) -> JobState:
        return self.store.get(self.name)


class JobRegistry:
    """The jobs one server serves: one dataset and config, any number of named jobs."""

    def __init__(self, dataset: TokenDataset, config: ScheduleConfig, store: CursorStore) -> None:
        self.dataset = dataset
        self.config = config
        self.store = store
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def open(self, name: str, world_size: int, *, reset: bool = False) -> Job:
        """The job ``name``, registered in the store with this server's identity if new."""
        if world_size < 1:
            raise ConfigError("world_size", f"must be at least 1, got {world_size}")
        with self._lock:
            job = self._jobs.get(name)
            if job is not None and job.world_size == world_size and not reset:
                return job
            stored = self.store.open_job(
                JobSpec(name, self.dataset.fingerprint, self.config.fingerprint(), world_size), reset=reset
            )
            job = Job(name, self.dataset, self.config, stored.spec.world_size, self.store)
            self._jobs[name] = job
            return job

    def get(self, name: str) -> Job | None:
        with self._lock:
            return self._jobs.get(name)
