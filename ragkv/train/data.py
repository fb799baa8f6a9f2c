"""Training examples for block fine-tuning: RAG examples -> token ids, segment ids, labels; batching with padding.

An example is built exactly like an inference prompt (ragkv.engine.request.segments.build_segments: prefix, one block per
passage, query), then the gold answer + EOS is appended as the target. Segment ids follow the Block-Attention
layout (Ma et al., ICLR 2025, sec. 3.4): prefix = 0, passage i = i + 1, query + answer = one "open" segment that
attends to everything. Positions are sequential 0..N-1, as `reuse` inference lays the blocks out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ragkv.engine.request.segments import PromptFormat, Segments, build_segments, tokenize
from ragkv.errors import RagkvError
from ragkv.ops.attention import SegmentedMask, block_attention_mask

log = logging.getLogger(__name__)

IGNORE = -100  # label of tokens without loss (prompt, padding)


class TrainingDataError(RagkvError):
    """The training data cannot be used as given (empty, evaluation data, nothing fits the maximum length)."""


@dataclass(frozen=True)
class TrainExample:
    ids: list[int]
    segment_ids: list[int]  # non-decreasing; open_id marks query + answer
    labels: list[int]       # IGNORE except on the answer tokens (loss on answer tokens only)
    open_id: int
    example_id: str = ""

    def __post_init__(self):
        if not (len(self.ids) == len(self.segment_ids) == len(self.labels)):
            raise ValueError("ids, segment_ids and labels must have the same length")
        if not any(lab != IGNORE for lab in self.labels):
            raise ValueError("an example needs at least one target token")

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class BuildReport:
    """What building the training set did to fit `max_length` (reported by the CLI)."""
    examples: int = 0
    truncated: int = 0          # examples that lost whole passages
    dropped_passages: int = 0
    skipped: int = 0            # examples that do not fit even without passages
    tokens: int = 0
    max_tokens: int = 0
    skipped_ids: list[str] = field(default_factory=list)

    def summary(self, max_length: int) -> str:
        mean = self.tokens / self.examples if self.examples else 0
        return (f"{self.examples} training examples (mean {mean:.0f} tokens, max {self.max_tokens}); "
                f"over --max-length {max_length}: {self.truncated} truncated by dropping {self.dropped_passages} "
                f"whole passages, {self.skipped} skipped")


def example_from_segments(segs: Segments, answer_ids: list[int], example_id: str = "") -> TrainExample:
    """Prompt segments + answer tokens (EOS included) -> one example under the Block-Attention layout."""
    if not answer_ids:
        raise ValueError("answer_ids is empty")
    seg = [0] * len(segs.prefix)
    for i, block in enumerate(segs.blocks):
        seg += [i + 1] * len(block)
    open_id = len(segs.blocks) + 1
    seg += [open_id] * (len(segs.query) + len(answer_ids))
    prompt = segs.all_ids()
    return TrainExample(prompt + list(answer_ids), seg, [IGNORE] * len(prompt) + list(answer_ids), open_id,
                        example_id)


def _gold_indices(ex) -> set[int]:
    """Passages that support the answer (HotpotQA supporting titles, NQ gold index); kept last when truncating."""
    titles = set(ex.meta.get("supporting_titles") or [])
    gold = {i for i, p in enumerate(ex.passages) if p.title and p.title in titles}
    if "gold_index" in ex.meta:
        gold.add(ex.meta["gold_index"])
    return gold


def select_passages(ex, max_passages: int | None) -> list:
    """At most `max_passages` passages, in their original order: the gold ones first, then the earliest others."""
    if max_passages is None or len(ex.passages) <= max_passages:
        return list(ex.passages)
    gold = _gold_indices(ex)
    keep = sorted(gold)[:max_passages]
    for i in range(len(ex.passages)):
        if len(keep) >= max_passages:
            break
        if i not in keep:
            keep.append(i)
    return [ex.passages[i] for i in sorted(keep)]


def build_examples(examples, tokenizer, max_length: int, fmt: PromptFormat = PromptFormat(),
                   max_passages: int | None = None) -> tuple[list[TrainExample], BuildReport]:
    """Tokenize eval-format Examples as inference does, target = first gold answer + EOS.

    Over `max_length`, whole passages are dropped (distractors first, from the end) until the example fits;
    one that does not fit without any passage is skipped. Everything is counted in the returned report.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TrainingDataError("the tokenizer has no EOS token; cannot mark the end of the answer")
    out, report = [], BuildReport()
    for ex in examples:
        if not ex.answers or not ex.answers[0].strip():
            raise TrainingDataError(f"example {ex.id} has no gold answer to train on")
        answer = tokenize(tokenizer, ex.answers[0].strip()) + [eos]
        passages = select_passages(ex, max_passages)
        gold = {id(ex.passages[i]) for i in _gold_indices(ex) if 0 <= i < len(ex.passages)}
        segs = build_segments(tokenizer, ex.question, passages, fmt)
        dropped = 0
        while segs.num_tokens + len(answer) > max_length and passages:
            drop = next((j for j in range(len(passages) - 1, -1, -1) if id(passages[j]) not in gold),
                        len(passages) - 1)
            passages = passages[:drop] + passages[drop + 1:]
            dropped += 1
            segs = build_segments(tokenizer, ex.question, passages, fmt)
        if segs.num_tokens + len(answer) > max_length:
            report.skipped += 1
            report.skipped_ids.append(ex.id)
            continue
        if dropped:
            report.truncated += 1
            report.dropped_passages += dropped
        item = example_from_segments(segs, answer, ex.id)
        out.append(item)
        report.examples += 1
        report.tokens += len(item)
        report.max_tokens = max(report.max_tokens, len(item))
    return out, report


_ROLE = {"eval": "evaluation", "heldout": "held-out", "train": "training"}


def load_training_examples(dataset: str | None, data_file: str | None, fmt: str | None, limit: int | None = None):
    """Eval-format Examples to train on; refuses evaluation and held-out sets (by name or by path) and empty files.

    `dataset` may name several training sets, comma-separated ("hotpotqa-train,nq-train"): their examples are
    concatenated (`limit` applies to each) and the trainer shuffles them together.
    """
    from ragkv.config import data_dir
    from ragkv.eval.datasets import DATASETS, EVAL_DATASETS, load_dataset

    if dataset is not None and (data_file is not None or fmt is not None):
        raise TrainingDataError("pass --dataset NAME alone, or --data FILE with its --format")
    if dataset is None and data_file is None:
        raise TrainingDataError("no training data: pass --dataset NAME[,NAME...] or --data FILE")
    if dataset is not None:
        names = [n.strip() for n in dataset.split(",") if n.strip()]
        if not names or len(set(names)) < len(names):
            raise TrainingDataError(f"--dataset wants distinct names separated by commas, got {dataset!r}")
        for name in names:
            if name in DATASETS and DATASETS[name].role != "train":
                train = ", ".join(n for n, i in DATASETS.items() if i.role == "train")
                raise TrainingDataError(f"{name!r} is {_ROLE[DATASETS[name].role]} data, never trained on; train on "
                                        f"{train} or your own file")
        examples = [ex for name in names for ex in load_dataset(name=name, limit=limit)]
        if len({ex.id for ex in examples}) < len(examples):
            raise TrainingDataError(f"{dataset}: two examples share an id; the data sets overlap")
        return examples
    path = Path(data_file).expanduser().resolve()
    for name in EVAL_DATASETS:
        if (data_dir() / DATASETS[name].path).resolve() == path:
            raise TrainingDataError(f"{data_file} is the evaluation set {name!r}; never train on it")
    if path.is_file() and not path.read_bytes().strip():
        raise TrainingDataError(f"training file {data_file} is empty; pass a file with examples")
    examples = load_dataset(data_file=data_file, fmt=fmt or "hotpotqa", limit=limit)
    if not examples:
        raise TrainingDataError(f"no examples in {data_file}; pass a file with examples")
    return examples


# --- batching: right padding; pads form a closed segment of their own, so no real token sees them ---

@dataclass
class Batch:
    ids: torch.Tensor            # [B, T]
    labels: torch.Tensor         # [B, T], IGNORE on prompt and padding
    mask: SegmentedMask | torch.Tensor | None  # Block-Attention masks (or their `.dense()` [B, 1, T, T]); None: causal
    positions: torch.Tensor | None = None  # [B, T] for block-local; None = sequential 0..T-1

    @property
    def target_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def to(self, device) -> "Batch":
        return Batch(self.ids.to(device), self.labels.to(device), None if self.mask is None else self.mask.to(device),
                     None if self.positions is None else self.positions.to(device))


def padded_segment_ids(ex: TrainExample, length: int | None = None) -> list[int]:
    """The example's segment ids, padded to `length` with a closed segment of its own after the open one: pads
    attend causally among themselves and no real token sees them."""
    return ex.segment_ids + [ex.open_id + 1] * ((length or len(ex)) - len(ex))


def example_mask(ex: TrainExample, length: int | None = None) -> torch.Tensor:
    """Block-Attention mask [T, T] of one example, padded to `length` (the reference `SegmentedMask` is tested
    against)."""
    return block_attention_mask(torch.tensor(padded_segment_ids(ex, length)), torch.tensor([ex.open_id]))


def local_positions(ex: TrainExample, length: int | None = None) -> torch.Tensor:
    """Positions without re-encoding (`reuse:pos=local`): each closed segment restarts at 0; the open segment
    (query + answer) and the padding keep their index in the sequence, after all the blocks."""
    n = length or len(ex)
    pos = torch.arange(n)
    start = 0
    for t in range(1, len(ex) + 1):
        if t == len(ex) or ex.segment_ids[t] != ex.segment_ids[start]:
            if ex.segment_ids[start] != ex.open_id:
                pos[start:t] -= start
            start = t
    return pos


def collate(examples: list[TrainExample], method: str, pad_id: int = 0) -> Batch:
    """Pad to the longest example. `block`: per-example Block-Attention mask; `vanilla`: causal (mask None);
    `block-local`: the Block-Attention mask and per-example positions without re-encoding."""
    if method not in ("block", "vanilla", "block-local"):
        raise ValueError(f"unknown method {method!r}")
    T = max(len(e) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, :len(e)] = torch.tensor(e.ids)
        labels[i, :len(e)] = torch.tensor(e.labels)
    mask = None if method == "vanilla" else SegmentedMask.from_segment_ids(
        [padded_segment_ids(e, T) for e in examples], [e.open_id for e in examples])
    positions = torch.stack([local_positions(e, T) for e in examples]) if method == "block-local" else None
    return Batch(ids, labels, mask, positions)
