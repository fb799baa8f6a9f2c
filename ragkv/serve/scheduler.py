"""One worker thread in front of the model: a bounded queue (full -> 429), deadlines, and cancellation.

The model runs one request at a time (CPU prefill saturates the cores); requests wait in FIFO order. A job
is a function of a `Job` that checks `job.should_stop()` between tokens, so a timed-out or disconnected
request stops consuming the model at the next token.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable


class QueueFull(Exception):
    pass


class JobTimeout(Exception):
    pass


class Job:
    def __init__(self, fn: Callable[["Job"], object], timeout_s: float):
        self.fn = fn
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def cancel(self) -> None:
        self.cancelled.set()

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.expired()


class Scheduler:
    def __init__(self, max_queue: int = 64, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.worker = threading.Thread(target=self._run, name="ragkv-scheduler", daemon=True)
        self.worker.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize()

    def submit(self, fn: Callable[[Job], object]) -> Job:
        job = Job(fn, self.timeout_s)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server queue is full ({self.jobs.maxsize} requests waiting); retry later")
        return job

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                job.future.cancel()
                continue
            if job.expired():
                job.future.set_exception(JobTimeout(f"request waited longer than {job.timeout_s:.0f} s in the queue"))
                continue
            try:
                job.future.set_result(job.fn(job))
            except BaseException as e:  # the worker must survive any request
                job.future.set_exception(e)
