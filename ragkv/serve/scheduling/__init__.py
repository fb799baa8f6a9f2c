"""Continuous batching for the server: one worker drives the model (scheduler), waiting generations queue per tenant
(lanes), admission reserves their KV (admission), prefills advance in units beside the decode steps (prefills)."""

from ragkv.serve.scheduling.jobs import (Cancelled, Job, JobTimeout, KVTooLarge, LongPrefillsBusy, QueueFull,
                                         ShuttingDown)
from ragkv.serve.scheduling.lanes import LongLane, TenantQueues
from ragkv.serve.scheduling.scheduler import Scheduler

__all__ = ["Cancelled", "Job", "JobTimeout", "KVTooLarge", "LongLane", "LongPrefillsBusy", "QueueFull", "Scheduler",
           "ShuttingDown", "TenantQueues"]
