"""Fine-tuning configuration, validated on construction; saved with every checkpoint to check a resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ragkv.errors import RagkvError

METHODS = ("block", "vanilla", "block-local")
SCHEDULES = ("cosine", "linear", "constant")


class TrainConfigError(RagkvError):
    pass


@dataclass(frozen=True)
class TrainConfig:
    method: str = "block"          # block: Block-Attention mask; vanilla: causal mask; block-local: the
    #                                Block-Attention mask with each passage at positions 0..n-1 (no re-encoding)
    steps: int = 100               # optimizer steps
    lr: float = 5e-5
    warmup_steps: int | None = None  # None: 10% of steps
    schedule: str = "cosine"       # decay after warmup, to 0 at the last step
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0     # 0 disables clipping
    batch_size: int = 1            # examples per micro-batch (padded)
    grad_accum: int = 1            # micro-batches per optimizer step
    seed: int = 0
    bf16: bool = False             # bf16 autocast, fp32 master weights
    max_length: int = 2048
    save_every: int = 0            # steps between checkpoints; 0 = only the final model
    keep_states: int = 1           # checkpoints that keep their optimizer state (weights are always kept)

    def __post_init__(self):
        if self.method not in METHODS:
            raise TrainConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.schedule not in SCHEDULES:
            raise TrainConfigError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for name in ("steps", "batch_size", "grad_accum", "max_length"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise TrainConfigError(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise TrainConfigError(f"--warmup-steps must be in [0, --steps], got {self.warmup_steps}")
        if self.save_every < 0 or self.keep_states < 1 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise TrainConfigError("--save-every, --weight-decay and --max-grad-norm must be >= 0; "
                                   "--keep-states >= 1")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    def to_dict(self) -> dict:
        return asdict(self)

    # fields a resumed run may change without breaking exactness
    RESUMABLE_CHANGES = ("save_every", "keep_states")
