"""The fine-tuning loop: AdamW, warmup + decay, gradient accumulation, bf16 autocast, checkpoints, exact resume.

Block fine-tuning (Block-Attention, Ma et al., ICLR 2025, sec. 3.4) is ordinary SFT whose forward runs under the
Block-Attention mask with the positions `reuse` inference uses; `vanilla` is the same SFT under the causal mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ragkv.train.checkpoint import (checkpoint_dir, load_state, load_weights, prune_states, rng_state,
                                    save_model_folder, save_state, set_rng_state)
from ragkv.train.config import TrainConfig, TrainConfigError
from ragkv.train.data import IGNORE, Batch, TrainExample, collate

log = logging.getLogger(__name__)


def forward_logits(model, batch: Batch) -> torch.Tensor:
    """Training forward: logits [B, T, V] of every position; positions are sequential 0..T-1 (as `reuse`), or
    the batch's own (block-local)."""
    return model(batch.ids, positions=batch.positions, mask=batch.mask, all_logits=True)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over labelled tokens: logits at t predict labels at t + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")


def answer_loss_sum(model, batch: Batch) -> torch.Tensor:
    """`token_loss_sum(forward_logits(model, batch), batch.labels)` with the LM head applied only where a label
    follows: the answer is a few tokens of a ~2K-token prompt, and the head over every position (49K-word vocab)
    was a fifth of a step's work."""
    x = model(batch.ids, positions=batch.positions, mask=batch.mask, hidden=True)
    targets = batch.labels[:, 1:]
    where = targets != IGNORE
    return F.cross_entropy(model.logits(x[:, :-1][where]).float(), targets[where], reduction="sum")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1 over `cfg.warmup` steps, then cosine / linear decay to 0 at `cfg.steps` (or constant)."""
    w = cfg.warmup
    if step < w:
        return (step + 1) / w
    if cfg.schedule == "constant" or cfg.steps <= w:
        return 1.0
    frac = (step - w) / (cfg.steps - w)
    return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac


def data_order(n: int, count: int, seed: int) -> list[int]:
    """`count` example indices: a fresh seeded permutation of range(n) per epoch."""
    out, epoch = [], 0
    while len(out) < count:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out += torch.randperm(n, generator=g).tolist()
        epoch += 1
    return out[:count]


def data_fingerprint(examples: list[TrainExample]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.ids, e.segment_ids, e.labels]).encode())
    return h.hexdigest()[:16]


class Trainer:
    """One fine-tuning run over token-level examples; `run()` trains to `cfg.steps`, checkpointing on the way."""

    def __init__(self, model, examples: list[TrainExample], cfg: TrainConfig, output: Path | None = None,
                 source: Path | None = None, pad_id: int = 0, meta: dict | None = None):
        if not examples:
            raise TrainConfigError("no training examples")
        self.model, self.examples, self.cfg = model, examples, cfg
        self.output, self.source, self.pad_id = output, source, pad_id
        self.meta = dict(meta or {})
        if output is not None:
            if source is None:
                raise TrainConfigError("saving needs the source model folder (its config and tokenizer files)")
            output.mkdir(parents=True, exist_ok=True)
        self.model.train().requires_grad_(True)
        torch.manual_seed(cfg.seed)
        self.order = data_order(len(examples), cfg.steps * cfg.examples_per_step, cfg.seed)
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        self.data_id = data_fingerprint(examples)
        self.device = next(model.parameters()).device
        self.stop_requested = threading.Event()

    # -- one optimizer step -------------------------------------------------------------------------------
    def micro_batches(self, step: int) -> list[Batch]:
        b, first = self.cfg.batch_size, step * self.cfg.examples_per_step
        idx = self.order[first:first + self.cfg.examples_per_step]
        return [collate([self.examples[i] for i in idx[j:j + b]], self.cfg.method, self.pad_id)
                for j in range(0, len(idx), b)]

    def train_step(self) -> float:
        """Accumulate the micro-batches of the current step and update; returns the mean loss per answer token."""
        batches = self.micro_batches(self.step)
        total = sum(bt.target_tokens for bt in batches)  # token-weighted mean over the whole step
        loss_sum = 0.0
        for bt in batches:
            bt = bt.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                loss = answer_loss_sum(self.model, bt)
            (loss / total).backward()
            loss_sum += loss.item()
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum / total

    # -- the run ----------------------------------------------------------------------------------------
    def run(self, progress: bool = True, stop_after: int | None = None, until: int | None = None) -> float | None:
        """Train until `cfg.steps`; saves checkpoints and the final model. `until` stops earlier, after that step,
        with a checkpoint of it (the schedule stays that of `cfg.steps`); `stop_after` N more steps (tests)."""
        from tqdm import tqdm

        end = self.cfg.steps if stop_after is None else min(self.cfg.steps, self.step + stop_after)
        end = end if until is None else min(end, until)
        restore = self._stop_on_signals()
        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not progress, desc=f"finetune {self.cfg.method}",
                   unit="step", dynamic_ncols=True, mininterval=1.0)
        loss = None
        try:
            while self.step < end:
                t0 = time.perf_counter()
                loss = self.train_step()
                seconds = time.perf_counter() - t0
                lr = self.scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", s_step=f"{seconds:.1f}")
                bar.update(1)
                self._log({"step": self.step, "loss": round(loss, 6), "lr": lr, "seconds": round(seconds, 3)})
                if self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step < self.cfg.steps:
                    self.save_checkpoint()
                elif ((self.stop_requested.is_set() or self.step == until) and self.step < self.cfg.steps
                      and self.output is not None):
                    self.save_checkpoint()  # stopped between checkpoints: keep the steps done (--resume goes on)
                if self.stop_requested.is_set():
                    break
        finally:
            bar.close()
            restore()
        if self.step == self.cfg.steps and self.output is not None:
            self.save_checkpoint()
            save_model_folder(self.model, self.source, self.output, self._meta())
        return loss

    def request_stop(self) -> None:
        """End the run after the current step, with a checkpoint of it (SIGINT and SIGTERM call this)."""
        self.stop_requested.set()

    def _stop_on_signals(self) -> Callable[[], None]:
        """Route SIGINT/SIGTERM to `request_stop` while the run lasts (main thread only); returns the undo."""
        def stop(signum, frame):
            print(f"\nragkv finetune: {signal.Signals(signum).name}: finishing step {self.step + 1}, then saving a "
                  "checkpoint (--resume goes on from it)", file=sys.stderr, flush=True)
            self.request_stop()

        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return restore

    def _log(self, record: dict) -> None:
        if self.output is not None:
            with open(self.output / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _meta(self) -> dict:
        return {**self.meta, "config": self.cfg.to_dict(), "data_fingerprint": self.data_id, "step": self.step}

    # -- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "order": self.order, "config": self.cfg.to_dict(), "data": self.data_id}

    def save_checkpoint(self) -> Path:
        folder = checkpoint_dir(self.output, self.step)
        save_model_folder(self.model, self.source, folder, self._meta())
        save_state(folder, self.state())
        prune_states(self.output, self.cfg.keep_states)
        return folder

    def resume(self, folder: Path) -> None:
        """Restore weights, optimizer, scheduler, RNG, step and data order from a checkpoint folder."""
        state = load_state(folder)
        old = state["config"]
        changed = [k for k, v in self.cfg.to_dict().items()
                   if old.get(k) != v and k not in TrainConfig.RESUMABLE_CHANGES]
        if changed:
            diffs = ", ".join(f"{k}: {old.get(k)!r} -> {getattr(self.cfg, k)!r}" for k in changed)
            raise TrainConfigError(f"cannot resume {folder}: its run used different settings ({diffs}); "
                                   "pass the same options, or --overwrite to start over")
        if state["data"] != self.data_id:
            raise TrainConfigError(f"cannot resume {folder}: the training data differ from that run's; "
                                   "pass the same data and --max-length, or --overwrite to start over")
        load_weights(self.model, folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.order, self.step = state["order"], state["step"]
        self._truncate_log()

    def _truncate_log(self) -> None:
        """Forget log lines written after the checkpoint (a crash between checkpoints)."""
        path = self.output / "train_log.jsonl" if self.output is not None else None
        if path is None or not path.exists():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= self.step:
                    keep.append(line)
            except ValueError:  # a line cut short by the crash
                pass
        path.write_text("".join(line + "\n" for line in keep))
