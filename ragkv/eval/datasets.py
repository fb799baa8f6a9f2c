"""Benchmark loaders: every shared data file (../shared/data, MANIFEST.md) and any file in the same formats
becomes a list of `Example` (question + passages + gold answers + the metric the papers report)."""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from ragkv.config import data_dir
from ragkv.engine.request.segments import Passage, PromptFormat  # Passage: one definition, frozen (text, title="")
from ragkv.errors import RagkvError


class DatasetError(RagkvError):
    """A data set cannot be loaded as asked (missing or malformed file, unknown name, bad option)."""


class DataFileNotFoundError(DatasetError):
    pass


class MalformedDataError(DatasetError):
    pass


class UnknownDatasetError(DatasetError):
    pass


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    passages: list[Passage]
    answers: list[str]          # every acceptable answer, flattened; metrics take the max over them
    task: str                   # "qa" | "summary" | "kv"
    metric: str                 # the metric the papers report: "accuracy" | "f1" | "rouge_l"
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. gold_index, split, type


FORMATS = ("cacheblend", "hotpotqa", "longbench", "samsum", "nq", "kv")


@dataclass(frozen=True)
class DatasetInfo:
    path: str                   # relative to data_dir()
    fmt: str
    description: str
    num_passages: int | None = None  # nq only: > 1 builds "NQ with distractors"
    role: str = "eval"          # "eval": reported on, never trained or tuned on | "heldout": choose checkpoints and
    #                             calibrations | "train": fine-tuning only
    records: tuple[int, int | None] = (0, None)  # the file's records [start, stop) that make up this data set
    own_distractors: bool = False  # nq with distractors: draw them only from these records (not the whole file)
    shots: int = 0              # in-context learning: this many solved training examples as blocks (nq: closed book
    #                             questions; samsum: summarized dialogues), the same for every question
    prompt: PromptFormat | None = None  # the prompt these examples need (None: the engine's RAG prompt)
    stop: tuple[str, ...] = ()  # strings that end an answer (e.g. a one-line summary), none by default


# NQ-open (Lost in the Middle's oracle file, 2,655 questions) is cut in three: the first NQ_EVAL questions are
# evaluated, the next ones up to NQ_HELDOUT choose checkpoints and calibrations, the rest may be trained on.
_NQ = "lost_in_the_middle/nq-open-oracle.jsonl.gz"
NQ_EVAL, NQ_HELDOUT = 500, 700
# in-context learning (APE section 5.2): each demonstration one block, the question after them
ICL_PROMPT = PromptFormat(system="Answer each question with a few words, as in the examples.",
                          untitled_block_template="{text}\n\n", query_template="Question: {question}\nAnswer:")
# few-shot summarization: each solved dialogue one block, the test dialogue after them; a summary is one line
SAMSUM_ICL_PROMPT = PromptFormat(system="Summarize each dialogue in one or two sentences, as in the examples.",
                                 untitled_block_template="{text}\n\n",
                                 query_template="Dialogue:\n{question}\nSummary:")

# short-answer QA scored by token F1: the instruction CacheBlend's MuSiQue evaluation gives (at most five words, the
# question not repeated), before the passages and again before the question. Under the RAG prompt an instructed
# model opens with "Based on the information provided ..." and is cut at 32 tokens, so F1 measured the preamble.
SHORT_ANSWER_PROMPT = PromptFormat(
    system="You will be asked a question after reading several passages. Answer it directly from the passages, in "
           "at most five words, without repeating the question.",
    query_template="\nAnswer the question directly from the passages above, in at most five words, without repeating "
                   "the question.\nQuestion: {question}")

DATASETS = {
    "musique": DatasetInfo("cacheblend/musique_s.json", "cacheblend", "MuSiQue as CacheBlend ships it (token F1)",
                           prompt=SHORT_ANSWER_PROMPT),
    "hotpotqa": DatasetInfo("hotpotqa/hotpot_dev_distractor_first100.json", "hotpotqa", "HotpotQA distractor dev",
                            prompt=SHORT_ANSWER_PROMPT),
    "hotpotqa-train": DatasetInfo("hotpotqa/hotpot_train_distractor_first500.jsonl", "hotpotqa",
                                  "HotpotQA train: calibration / fine-tuning only, never evaluation", role="train"),
    "multi_news": DatasetInfo("longbench/multi_news.jsonl", "longbench", "LongBench multi_news (Rouge-L)"),
    "samsum": DatasetInfo("samsum/uniprompt_samsum.jsonl", "samsum", "SAMSum dialogue summaries (Rouge-L)"),
    "nq": DatasetInfo(_NQ, "nq", "NQ-open, gold passage only", records=(0, NQ_EVAL)),
    "nq-distractors": DatasetInfo(_NQ, "nq", "NQ gold passage + 9 gold passages of other questions",
                                  num_passages=10, records=(0, NQ_EVAL)),
    "nq-distractors-heldout": DatasetInfo(_NQ, "nq", "NQ-10 built as nq-distractors from questions no evaluation "
                                          "or training uses: for choosing checkpoints and calibrations",
                                          num_passages=10, role="heldout", records=(NQ_EVAL, NQ_HELDOUT)),
    "nq-train": DatasetInfo(_NQ, "nq", "NQ-10 from the remaining questions, distractors drawn among them only: "
                            "fine-tuning only", num_passages=10, role="train", records=(NQ_HELDOUT, None),
                            own_distractors=True),
    "nq-long": DatasetInfo(_NQ, "nq", "NQ gold passage among 149 gold passages of other questions, ~19K tokens: "
                           "twice an 8K window (ape shares positions; full needs --truncate)", num_passages=150,
                           records=(0, NQ_EVAL)),
    **{f"nq-icl-{k}": DatasetInfo(_NQ, "nq", f"NQ-open closed book after {k} solved NQ questions (from the "
                                  "training records, the same for every question, each one block: in-context "
                                  "examples encoded once)", records=(0, NQ_EVAL), shots=k, prompt=ICL_PROMPT)
       for k in (8, 32, 128)},
    **{f"samsum-icl-{k}": DatasetInfo("samsum/uniprompt_samsum.jsonl", "samsum", f"SAMSum test dialogues "
                                      f"summarized after {k} summarized train/validation dialogues (each one block, "
                                      "the same for every dialogue; Rouge-L of the first line)", shots=k,
                                      prompt=SAMSUM_ICL_PROMPT, stop=("\n",))
       for k in (4, 8, 32)},
    "kv-retrieval": DatasetInfo("lost_in_the_middle/kv-retrieval-75_keys.jsonl.gz", "kv",
                                "synthetic key-value retrieval, 75 pairs"),
}
EVAL_DATASETS = tuple(name for name, info in DATASETS.items() if info.role == "eval")

SUMMARY_INSTRUCTION = {  # the question of summary tasks (LongBench / CacheBlend prompt wording)
    "longbench": "Write a one-page summary of all the news.",
    "samsum": "Summarize the dialogue into a few short sentences.",
}


def load_dataset(name: str | None = None, data_file: str | Path | None = None, fmt: str | None = None,
                 limit: int | None = None, *, split: str | None = None, num_passages: int | None = None,
                 gold_position: int | None = None, seed: int = 0) -> list[Example]:
    """Load a named data set, or any file in one of `FORMATS`.

    Args:
        name: a key of `DATASETS` (file under `ragkv.config.data_dir()`); or None with `data_file` + `fmt`.
        data_file: a file to read instead of the named one (with `name`, it keeps that data set's format).
        fmt: the file format, required with `data_file` alone.
        limit: the first `limit` examples; more than the file holds is an error.
        split: samsum only: "test" (default), "train", "validation" or "all".
        num_passages: nq only: > 1 adds distractors (gold passages of other questions, see `nq_with_distractors`).
        gold_position: nq with distractors: index of the gold passage; None cycles it over all positions.
        seed: nq with distractors: seed of the deterministic distractor draw.
    Raises:
        DatasetError (a RagkvError) with what to do, for every bad input.
    """
    info = _resolve(name, data_file, fmt)
    path = Path(data_file).expanduser() if data_file is not None else data_dir() / info.path
    fmt = info.fmt
    if num_passages is None:
        num_passages = info.num_passages
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(f"limit must be a positive integer, got {limit!r}")
    _check_options(fmt, split=split, num_passages=num_passages, gold_position=gold_position)
    if not path.is_file():
        hint = ("set RAGKV_DATA_DIR to the folder holding the shared data (see ../shared/data/MANIFEST.md)"
                if data_file is None else "check the path passed as the data file")
        raise DataFileNotFoundError(f"data file {path} not found; {hint}")

    distract = fmt == "nq" and num_passages is not None and num_passages > 1
    whole_file_pool = distract and not info.own_distractors  # distractors may come from any record of the file
    start, stop = info.records
    if not distract and limit is not None:  # with distractors, the pool is read whatever the limit
        stop = start + limit if stop is None else min(stop, start + limit)
    read_to = None if whole_file_pool else stop
    if fmt == "samsum":
        examples = _parse_samsum(path, split or "test", read_to)
    else:
        examples = []
        for rec in _records(path):
            examples.append(_PARSERS[fmt](rec))
            if len(examples) == read_to:
                break
    if whole_file_pool:  # each question keeps the distractors of its index in the file
        end = stop if limit is None else min(stop or len(examples), start + limit)
        examples = nq_with_distractors(examples, num_passages, gold_position=gold_position, seed=seed,
                                       limit=end)[start:]
    else:
        examples = examples[start:stop]
        if distract:  # the pool is this data set's records only
            examples = nq_with_distractors(examples, num_passages, gold_position=gold_position, seed=seed,
                                           limit=limit)
    if info.shots and fmt == "samsum":  # the dialogue is the question; solved dialogues are the blocks
        demos = samsum_demonstrations(path, info.shots, seed)
        examples = [replace(ex, question=ex.passages[0].text, passages=demos, meta={**ex.meta, "shots": info.shots})
                    for ex in examples]
    elif info.shots:
        demos = icl_demonstrations(path, info.shots, seed)
        examples = [replace(ex, passages=demos, meta={"shots": info.shots}) for ex in examples]
    if limit is not None and len(examples) < limit:
        where = (f"{path} holds" if info.records == (0, None)
                 else f"{name} is records {start}..{start + len(examples) - 1} of {path}:")
        raise DatasetError(f"limit {limit} is larger than the data: {where} {len(examples)} examples"
                           + (f" in split {split or 'test'!r}" if fmt == "samsum" else "")
                           + f"; pass --limit {len(examples)} or less")
    return examples[:limit] if limit is not None else examples


def icl_demonstrations(path: Path, shots: int, seed: int = 0) -> list[Passage]:
    """`shots` solved questions ("Question: ...\nAnswer: ...") drawn from NQ's training records (after
    NQ_HELDOUT: no evaluation or calibration uses them), deterministically per seed."""
    pool = [rec for i, rec in enumerate(_records(path)) if i >= NQ_HELDOUT]
    if len(pool) < shots:
        raise DatasetError(f"{path}: {len(pool)} training records, fewer than {shots} examples")
    chosen = random.Random(f"nq-icl:{seed}").sample(range(len(pool)), shots)
    return [Passage(text=f"Question: {ex.question}\nAnswer: {ex.answers[0]}")
            for ex in (_parse_nq(pool[j]) for j in chosen)]


def samsum_demonstrations(path: Path, shots: int, seed: int = 0) -> list[Passage]:
    """`shots` summarized dialogues ("Dialogue:\n...\nSummary: ...") drawn from SAMSum's train and validation
    splits (never the test split, which is evaluated), deterministically per seed."""
    pool = [ex for ex in _parse_samsum(path, "all", None) if ex.meta["split"] != "test"]
    if len(pool) < shots:
        raise DatasetError(f"{path}: {len(pool)} train and validation dialogues, fewer than {shots} examples")
    chosen = random.Random(f"samsum-icl:{seed}").sample(range(len(pool)), shots)
    return [Passage(text=f"Dialogue:\n{pool[j].passages[0].text}\nSummary: {pool[j].answers[0]}") for j in chosen]


def dataset_prompt(name: str | None) -> PromptFormat | None:
    """The prompt a named data set needs, or None for the engine's (the RAG prompt)."""
    return DATASETS[name].prompt if name in DATASETS else None


def dataset_stop(name: str | None) -> tuple[str, ...]:
    """The strings that end a named data set's answers (none for most)."""
    return DATASETS[name].stop if name in DATASETS else ()


def _resolve(name: str | None, data_file: str | Path | None, fmt: str | None) -> DatasetInfo:
    if name is not None:
        if name not in DATASETS:
            raise UnknownDatasetError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)} "
                                      f"(or pass a data file with a format: {', '.join(FORMATS)})")
        info = DATASETS[name]
        if fmt is not None and fmt != info.fmt:
            raise DatasetError(f"dataset {name!r} has format {info.fmt!r}, not {fmt!r}; drop the format")
        return info
    if data_file is None:
        raise DatasetError(f"give a dataset name ({', '.join(DATASETS)}) or a data file with its format")
    if fmt is None or fmt not in FORMATS:
        what = "missing" if fmt is None else f"unknown: {fmt!r}"
        raise UnknownDatasetError(f"data file format {what}; known formats: {', '.join(FORMATS)}")
    return DatasetInfo(str(data_file), fmt, "user file")


def _check_options(fmt: str, *, split, num_passages, gold_position) -> None:
    if split is not None and fmt != "samsum":
        raise DatasetError(f"split applies to the samsum format only, not {fmt!r}")
    if fmt != "nq" and (num_passages is not None or gold_position is not None):
        raise DatasetError(f"num_passages / gold_position apply to the nq format only, not {fmt!r}")
    if num_passages is not None and num_passages < 1:
        raise DatasetError(f"num_passages must be >= 1, got {num_passages}")
    if gold_position is not None and not 0 <= gold_position < (num_passages or 1):
        raise DatasetError(f"gold_position must be in [0, {(num_passages or 1) - 1}], got {gold_position}")


# --- reading: JSON array or JSONL, gzipped or not; every record knows where it came from ---

@dataclass
class _Rec:
    obj: dict
    index: int  # 0-based ordinal among the file's records
    where: str  # "record 3" (JSON array) or "line 7" (JSONL)
    path: Path

    def fail(self, expected: str) -> MalformedDataError:
        return MalformedDataError(f"{self.path}: {self.where}: expected {expected}")

    def get(self, key: str, kind: type | tuple = str, obj: dict | None = None) -> Any:
        obj = self.obj if obj is None else obj
        if not isinstance(obj, dict):
            raise self.fail(f"an object with a field {key!r}, got {type(obj).__name__}")
        if key not in obj:
            raise self.fail(f"a field {key!r}")
        val = obj[key]
        if not isinstance(val, kind) or isinstance(val, bool) and kind is not bool:
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(f"{key!r} to be {names}, got {type(val).__name__}")
        return val


def _open_text(path: Path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")


def _records(path: Path) -> Iterator[_Rec]:
    """Yield the records of a JSON array or a JSONL file (gzipped or not); JSONL lines are parsed lazily."""
    try:
        with _open_text(path) as f:
            text = f.read()
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise MalformedDataError(f"{path}: cannot be read as UTF-8 JSON / JSONL (optionally gzipped): {e}") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MalformedDataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
        items = ((i, f"record {i}", obj) for i, obj in enumerate(data))
    else:
        items = _jsonl_items(path, text)
    for index, where, obj in items:
        rec = _Rec(obj, index, where, path)
        if not isinstance(obj, dict):
            raise rec.fail(f"a JSON object, got {type(obj).__name__}")
        yield rec


def _jsonl_items(path: Path, text: str) -> Iterator[tuple[int, str, Any]]:
    index = 0
    for no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise MalformedDataError(f"{path}: line {no}: expected one JSON object per line ({e.msg})") from None
        yield index, f"line {no}", obj
        index += 1


def _str_list(rec: _Rec, key: str) -> list[str]:
    """A list of strings, or a list of lists of acceptable strings (CacheBlend's two shapes), flattened."""
    val = rec.get(key, (list, str))
    items = [val] if isinstance(val, str) else val
    out = []
    for item in items:
        alts = item if isinstance(item, list) else [item]
        if not all(isinstance(a, str) for a in alts):
            raise rec.fail(f"{key!r} to be a list of strings or a list of lists of strings")
        out.extend(alts)
    if not out:
        raise rec.fail(f"at least one answer in {key!r}")
    return out


def _record_id(rec: _Rec, *keys: str) -> str:
    """The record's own id where it has one, else its ordinal in the file (stable across runs, for resuming)."""
    for k in keys:
        if isinstance(rec.obj.get(k), (str, int)) and not isinstance(rec.obj.get(k), bool):
            return str(rec.obj[k])
    return str(rec.index)


# --- one parser per format ---

def _parse_cacheblend(rec: _Rec) -> Example:
    passages = []
    for c in rec.get("ctxs", list):
        title = rec.get("title", str, c) if isinstance(c, dict) and "title" in c else ""
        passages.append(Passage(title=title, text=rec.get("text", str, c)))
    return Example(_record_id(rec, "id", "_id"), rec.get("question"), passages,
                   _str_list(rec, "answers"), "qa", "f1")


def _parse_hotpotqa(rec: _Rec) -> Example:
    aliases = rec.obj.get("answer_aliases")
    answers = [rec.get("answer")] + ([a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else [])
    meta = {"type": rec.obj.get("type"), "level": rec.obj.get("level")}
    if "context" in rec.obj:  # Hugging Face hotpot_qa layout: context{title[], sentences[[str]]}
        ctx = rec.get("context", dict)
        titles, sents = rec.get("title", list, ctx), rec.get("sentences", list, ctx)
        if len(titles) != len(sents) or not all(isinstance(s, list) for s in sents):
            raise rec.fail("'context' with as many titles as sentence lists")
        passages = [Passage(title=str(t), text="".join(map(str, s)).strip()) for t, s in zip(titles, sents)]
        sf = rec.obj.get("supporting_facts")
        support = sf.get("title", []) if isinstance(sf, dict) else []
    elif "chunks" in rec.obj:  # train JSONL: chunks[{id, title, chunk = "Title: sentences"}]
        passages = []
        for c in rec.get("chunks", list):
            title, text = rec.get("title", str, c), rec.get("chunk", str, c)
            passages.append(Passage(title=title, text=text.removeprefix(f"{title}: ").strip()))
        support = [s.get("title") for s in rec.obj.get("supporting_facts") or [] if isinstance(s, dict)]
    else:
        raise rec.fail("a 'context' (HF layout) or a 'chunks' (train JSONL) field")
    meta["supporting_titles"] = sorted(set(support))
    return Example(_record_id(rec, "id", "_id"), rec.get("question"), passages, answers,
                   "qa", "accuracy", meta)


_PASSAGE_SPLIT = re.compile(r"(?m)^Passage \d+:\n")
_NEWLINE_MARK = re.compile(r"[ \t]*NEWLINE_CHAR[ \t]*")


def _parse_longbench(rec: _Rec) -> Example:
    clean = lambda s: _NEWLINE_MARK.sub("\n", s).strip()  # noqa: E731
    articles = [clean(a) for a in _PASSAGE_SPLIT.split(rec.get("context"))]
    passages = [Passage(text=a) for a in articles if a]
    if not passages:
        raise rec.fail("a non-empty 'context'")
    return Example(_record_id(rec, "_id", "id"), SUMMARY_INSTRUCTION["longbench"], passages,
                   [clean(a) for a in _str_list(rec, "answers")], "summary", "rouge_l")


def _parse_samsum(path: Path, split: str, limit: int | None) -> list[Example]:
    examples, seen = [], set()
    for rec in _records(path):
        rec_split = rec.get("split")
        seen.add(rec_split)
        if split != "all" and rec_split != split:
            continue
        dialogue = rec.get("question").replace("\r\n", "\n")
        examples.append(Example(_record_id(rec, "id"), SUMMARY_INSTRUCTION["samsum"], [Passage(text=dialogue)],
                                [rec.get("answer")], "summary", "rouge_l", {"split": rec_split}))
        if limit is not None and len(examples) == limit:
            break
    if not examples and split not in seen and split != "all":
        raise DatasetError(f"{path}: no records in split {split!r}; splits present: {', '.join(sorted(seen))} "
                           "(or 'all')")
    return examples


def _parse_nq(rec: _Rec) -> Example:
    ctxs = rec.get("ctxs", list)
    if not ctxs:
        raise rec.fail("at least one passage in 'ctxs'")
    passages = [Passage(title=rec.get("title", str, c), text=rec.get("text", str, c)) for c in ctxs]
    gold = next((i for i, c in enumerate(ctxs) if c.get("isgold")), 0)
    return Example(_record_id(rec, "id"), rec.get("question"), passages, _str_list(rec, "answers"),
                   "qa", "accuracy", {"gold_index": gold})


def _parse_kv(rec: _Rec) -> Example:
    pairs, key = rec.get("ordered_kv_records", list), rec.get("key")
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in pairs):
        raise rec.fail("'ordered_kv_records' to be a list of [key, value] string pairs")
    gold = next((i for i, (k, _) in enumerate(pairs) if k == key), None)
    if gold is None:
        raise rec.fail(f"the key {key!r} among 'ordered_kv_records'")
    # Lost in the Middle renders the records as JSON lines: "key": "value"
    passages = [Passage(text=f"{json.dumps(k)}: {json.dumps(v)}") for k, v in pairs]
    question = f"What is the value corresponding to the key {json.dumps(key)}?"
    return Example(_record_id(rec, "id"), question, passages, [rec.get("value")], "kv", "accuracy",
                   {"gold_index": gold})


_PARSERS = {"cacheblend": _parse_cacheblend, "hotpotqa": _parse_hotpotqa, "longbench": _parse_longbench,
            "nq": _parse_nq, "kv": _parse_kv}


# --- NQ with distractors (Lost in the Middle, section 2.1, with other questions' gold passages as distractors) ---

def nq_with_distractors(examples: list[Example], num_passages: int = 10, *, gold_position: int | None = None,
                        seed: int = 0, limit: int | None = None) -> list[Example]:
    """Each question's gold passage plus `num_passages - 1` gold passages of other questions.

    The draw is deterministic per (seed, example index), so it does not depend on `limit`. Distractors that
    contain one of the question's answers as whole tokens (after SQuAD normalization, like DPR's `hasanswer`)
    or repeat a chosen passage are skipped.
    The gold passage sits at `gold_position`, or at index i % num_passages for the i-th example (cycling over
    every position, as Lost in the Middle varies it).
    """
    from ragkv.eval.metrics import normalize_answer

    pool = [ex.passages[ex.meta.get("gold_index", 0)] for ex in examples]
    if len(set(pool)) < num_passages:
        raise DatasetError(f"need at least {num_passages} distinct gold passages to draw distractors from, "
                           f"the file has {len(set(pool))}")
    normalized: dict[int, str] = {}
    out = []
    for i, ex in enumerate(examples[:limit] if limit is not None else examples):
        gold = pool[i]
        answers = [f" {a} " for a in (normalize_answer(x) for x in ex.answers) if a]
        rng = random.Random(f"nq-distractors:{seed}:{i}")
        chosen: list[Passage] = []
        for _ in range(100 * num_passages):  # rejection sampling; a few draws suffice in practice
            if len(chosen) == num_passages - 1:
                break
            j = rng.randrange(len(pool))
            if j == i or pool[j] == gold or pool[j] in chosen:
                continue
            if j not in normalized:
                normalized[j] = f" {normalize_answer(pool[j].title + ' ' + pool[j].text)} "
            if not any(a in normalized[j] for a in answers):
                chosen.append(pool[j])
        if len(chosen) < num_passages - 1:
            raise DatasetError(f"example {ex.id}: found only {len(chosen)} distractors that do not contain its "
                               "answer; lower num_passages")
        pos = gold_position if gold_position is not None else i % num_passages
        passages = chosen[:pos] + [gold] + chosen[pos:]
        out.append(Example(ex.id, ex.question, passages, ex.answers, ex.task, ex.metric,
                           {**ex.meta, "gold_index": pos, "num_passages": num_passages, "seed": seed}))
    return out
