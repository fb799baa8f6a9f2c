"""Loaders on the real shared files (small limits) and on tiny synthetic files; bad input gives clear errors."""

import gzip
import json

import pytest

from ragkv.config import data_dir
from ragkv.engine.request.segments import Passage
from ragkv.errors import RagkvError
from ragkv.eval.datasets import (
    DATASETS,
    FORMATS,
    DataFileNotFoundError,
    Example,
    MalformedDataError,
    UnknownDatasetError,
    load_dataset,
    nq_with_distractors,
)

needs_data = pytest.mark.skipif(not (data_dir() / "MANIFEST.md").is_file(),
                                reason="shared data not found; set RAGKV_DATA_DIR")


def _jsonl(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


# --- real shared files ---

@needs_data
@pytest.mark.parametrize("name, task, metric, n_passages", [
    ("musique", "qa", "f1", 10), ("hotpotqa", "qa", "accuracy", 10), ("hotpotqa-train", "qa", "accuracy", 10),
    ("multi_news", "summary", "rouge_l", None), ("samsum", "summary", "rouge_l", 1), ("nq", "qa", "accuracy", 1),
    ("nq-distractors", "qa", "accuracy", 10), ("kv-retrieval", "kv", "accuracy", 75)])
def test_real_datasets(name, task, metric, n_passages):
    examples = load_dataset(name, limit=3)
    assert len(examples) == 3
    for ex in examples:
        assert isinstance(ex, Example) and ex.task == task and ex.metric == metric
        assert ex.question and ex.answers and all(isinstance(a, str) and a for a in ex.answers)
        assert all(isinstance(p, Passage) and p.text for p in ex.passages)
        if n_passages:
            assert len(ex.passages) == n_passages
    assert len({ex.id for ex in examples}) == 3


@needs_data
def test_real_file_details():
    musique = load_dataset("musique", limit=1)[0]
    assert musique.answers == ["Exeter College"] and musique.passages[0].title == ""
    hotpot = load_dataset("hotpotqa", limit=1)[0]
    assert hotpot.answers == ["yes"] and hotpot.passages[0].title == "Ed Wood (film)"
    assert hotpot.passages[0].text.startswith("Ed Wood is a 1994") and "Tim Burton, and starring" in \
        hotpot.passages[0].text
    train = load_dataset("hotpotqa-train", limit=1)[0]
    assert train.id == "5a7a06935542990198eaf050"
    assert train.passages[0].title == "Radio City (Indian radio station)"
    assert train.passages[0].text.startswith("Radio City is India's first")  # "Title: " prefix removed
    news = load_dataset("multi_news", limit=1)[0]
    assert len(news.passages) == 3 and not any("NEWLINE_CHAR" in p.text for p in news.passages)
    assert "Photographer)\n\nAbout 100 Occupy Philly" in news.passages[0].text
    assert not any(p.text.startswith("Passage") for p in news.passages)
    samsum = load_dataset("samsum")
    assert len(samsum) == 150 and {e.meta["split"] for e in samsum} == {"test"}
    assert "\r" not in samsum[0].passages[0].text
    assert len(load_dataset("samsum", split="train")) == 50
    assert len(load_dataset("samsum", split="all")) == 250
    kv = load_dataset("kv-retrieval", limit=1)[0]
    gold = kv.passages[kv.meta["gold_index"]].text
    assert kv.answers[0] in gold and json.loads("{" + gold + "}") == {json.loads(kv.question.split("key ")[1][:-1]):
                                                                       kv.answers[0]}


@needs_data
def test_real_nq_distractors_deterministic_and_positions():
    a = load_dataset("nq-distractors", limit=12)
    b = load_dataset("nq-distractors", limit=4)
    assert a[:4] == b  # the draw does not depend on the limit
    oracle = load_dataset("nq", limit=12)
    for i, (ex, orig) in enumerate(zip(a, oracle)):
        assert ex.meta["gold_index"] == i % 10  # cycles over every position
        assert ex.passages[ex.meta["gold_index"]] == orig.passages[0]
        assert len(set(ex.passages)) == 10
    fixed = load_dataset("nq-distractors", limit=3, gold_position=9, seed=1)
    assert all(ex.meta["gold_index"] == 9 and ex.passages[9] == o.passages[0] for ex, o in zip(fixed, oracle))
    assert fixed[0].passages[:9] != a[0].passages[1:]  # another seed, other distractors


@needs_data
def test_real_limit_too_large():
    with pytest.raises(RagkvError, match="limit 151 is larger than the data.*150"):
        load_dataset("musique", limit=151)
    with pytest.raises(RagkvError, match="limit 51.*split 'train'"):
        load_dataset("samsum", split="train", limit=51)


# --- synthetic files in every format ---

def test_cacheblend_both_answer_shapes(tmp_path):
    recs = [{"question": "q1", "answers": ["a", "b"], "ctxs": [{"title": "T", "text": "x"}, {"text": "y"}]},
            {"question": "q2", "answers": [["c", "C."], ["d"]], "ctxs": [{"title": "", "text": "z"}]}]
    path = tmp_path / "set.json"
    path.write_text(json.dumps(recs))
    ex = load_dataset(data_file=path, fmt="cacheblend")
    assert [e.answers for e in ex] == [["a", "b"], ["c", "C.", "d"]]
    assert ex[0].passages == [Passage(title="T", text="x"), Passage(title="", text="y")]
    assert [e.id for e in ex] == ["0", "1"]
    # the same records as JSONL load the same
    assert load_dataset(data_file=_jsonl(tmp_path / "set.jsonl", recs), fmt="cacheblend") == ex


def test_hotpotqa_both_layouts(tmp_path):
    dev = [{"question": "q", "answer": "yes", "type": "comparison", "level": "hard",
            "supporting_facts": {"title": ["A"], "sent_id": [0]},
            "context": {"title": ["A", "B"], "sentences": [["One.", " Two."], ["Three."]]}}]
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    ex = load_dataset(data_file=tmp_path / "dev.json", fmt="hotpotqa")[0]
    assert ex.passages == [Passage(title="A", text="One. Two."), Passage(title="B", text="Three.")]
    assert ex.answers == ["yes"]
    assert ex.meta["supporting_titles"] == ["A"]
    train = [{"id": "x1", "question": "q", "answer": "Ans", "answer_aliases": ["ans alias"],
              "chunks": [{"id": "c0", "title": "A", "chunk": "A: body text"}], "supporting_facts": []}]
    ex = load_dataset(data_file=_jsonl(tmp_path / "train.jsonl", train), fmt="hotpotqa")[0]
    assert ex.id == "x1" and ex.answers == ["Ans", "ans alias"]
    assert ex.passages == [Passage(title="A", text="body text")]


def test_longbench(tmp_path):
    rec = {"context": "Passage 1:\nFirst NEWLINE_CHAR NEWLINE_CHAR line\nPassage 2:\nSecond\n", "answers": ["sum"],
           "_id": "abc"}
    ex = load_dataset(data_file=_jsonl(tmp_path / "mn.jsonl", [rec]), fmt="longbench")[0]
    assert ex.passages == [Passage(title="", text="First\n\nline"), Passage(title="", text="Second")]
    assert ex.id == "abc" and ex.answers == ["sum"] and ex.task == "summary"


def test_samsum_split(tmp_path):
    recs = [{"split": "train", "question": "A: hi\r\nB: yo", "answer": "greet"},
            {"split": "test", "question": "A: bye\r\nB: ok", "answer": "part"}]
    path = _jsonl(tmp_path / "s.jsonl", recs)
    ex = load_dataset(data_file=path, fmt="samsum")
    assert len(ex) == 1 and ex[0].passages == [Passage(title="", text="A: bye\nB: ok")] and ex[0].id == "1"
    assert [e.answers for e in load_dataset(data_file=path, fmt="samsum", split="train")] == [["greet"]]
    with pytest.raises(RagkvError, match="splits present: test, train"):
        load_dataset(data_file=path, fmt="samsum", split="dev")


def test_nq_gz_and_distractors(tmp_path):
    recs = [{"question": f"q{i}", "answers": [f"ans{i}"],
             "ctxs": [{"title": f"T{i}", "text": f"text ans{i}", "hasanswer": True, "isgold": True}]}
            for i in range(6)]
    recs[1]["ctxs"][0]["text"] += " ans2"  # contains the answer of q2: never a distractor for q2
    path = _jsonl(tmp_path / "nq.jsonl.gz", recs, gz=True)
    ex = load_dataset(data_file=path, fmt="nq")
    assert len(ex) == 6 and ex[0].passages == [Passage(title="T0", text="text ans0")]
    d = load_dataset(data_file=path, fmt="nq", num_passages=4, gold_position=3)
    assert all(len(e.passages) == 4 and e.passages[3] == ex[i].passages[0] for i, e in enumerate(d))
    assert Passage(title="T1", text="text ans1 ans2") not in d[2].passages
    assert nq_with_distractors(ex, 4, seed=5) == nq_with_distractors(ex, 4, seed=5)
    with pytest.raises(RagkvError, match="gold_position"):
        load_dataset(data_file=path, fmt="nq", num_passages=4, gold_position=4)
    with pytest.raises(RagkvError, match="distinct gold passages"):
        load_dataset(data_file=path, fmt="nq", num_passages=10)


def test_kv(tmp_path):
    rec = {"ordered_kv_records": [["k1", "v1"], ["k2", "v2"]], "key": "k2", "value": "v2"}
    ex = load_dataset(data_file=_jsonl(tmp_path / "kv.jsonl.gz", [rec], gz=True), fmt="kv")[0]
    assert ex.passages == [Passage(title="", text='"k1": "v1"'), Passage(title="", text='"k2": "v2"')]
    assert ex.answers == ["v2"] and ex.meta["gold_index"] == 1 and '"k2"' in ex.question and ex.task == "kv"


# --- bad input ---

def test_malformed_jsonl_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answers": ["a"], "ctxs": []}) + "\n\n{not json\n")
    with pytest.raises(MalformedDataError, match="line 3"):
        load_dataset(data_file=path, fmt="cacheblend")
    assert len(load_dataset(data_file=path, fmt="cacheblend", limit=1)) == 1  # stops before the bad line


def test_malformed_record_says_what_was_expected(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"question": "q", "answers": ["a"], "ctxs": []},
                                         {"question": "q", "answers": [1], "ctxs": []}])
    with pytest.raises(MalformedDataError, match=r"line 2: expected 'answers' to be a list of strings"):
        load_dataset(data_file=path, fmt="cacheblend")
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"question": "q", "answers": ["a"], "ctxs": [{"title": "t"}]}]))
    with pytest.raises(MalformedDataError, match="record 0: expected a field 'text'"):
        load_dataset(data_file=arr, fmt="cacheblend")
    with pytest.raises(MalformedDataError, match="line 1: expected a field 'key'"):
        load_dataset(data_file=_jsonl(tmp_path / "k.jsonl", [{"ordered_kv_records": []}]), fmt="kv")
    broken = tmp_path / "b.json"
    broken.write_text('[{"question": "q",\n "answers": }]')
    with pytest.raises(MalformedDataError, match="line 2: invalid JSON"):
        load_dataset(data_file=broken, fmt="cacheblend")


def test_missing_file_and_unknown_names(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="nope.json not found"):
        load_dataset(data_file=tmp_path / "nope.json", fmt="nq")
    with pytest.raises(UnknownDatasetError, match="known datasets: musique, hotpotqa"):
        load_dataset("squad")
    with pytest.raises(UnknownDatasetError, match="known formats: " + ", ".join(FORMATS)):
        load_dataset(data_file=tmp_path / "x.json", fmt="csv")
    with pytest.raises(UnknownDatasetError, match="format missing"):
        load_dataset(data_file=tmp_path / "x.json")
    with pytest.raises(RagkvError, match="dataset name"):
        load_dataset()
    with pytest.raises(RagkvError, match="positive integer"):
        load_dataset("musique", limit=0)
    with pytest.raises(RagkvError, match="samsum format only"):
        load_dataset("musique", split="test")


def test_missing_shared_data_says_where_to_point(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_DATA_DIR", str(tmp_path))
    with pytest.raises(DataFileNotFoundError, match="RAGKV_DATA_DIR"):
        load_dataset("musique")


def test_limit_larger_than_synthetic_data(tmp_path):
    path = _jsonl(tmp_path / "kv.jsonl", [{"ordered_kv_records": [["k", "v"]], "key": "k", "value": "v"}])
    with pytest.raises(RagkvError, match="limit 2 is larger than the data.*holds 1 examples"):
        load_dataset(data_file=path, fmt="kv", limit=2)


def test_every_named_dataset_has_a_known_format():
    assert all(info.fmt in FORMATS for info in DATASETS.values())


# --- NQ-open with 10 passages at a fixed gold position ("lost in the middle" per mode) ---

@needs_data
def test_real_nq10_gold_positions_0_4_9():
    from ragkv.eval.metrics import normalize_answer

    oracle = load_dataset("nq", limit=200)
    whole = load_dataset(data_file=data_dir() / DATASETS["nq"].path, fmt="nq")  # the file, past the eval records
    golds = {ex.passages[0] for ex in whole}  # every question's gold passage
    sets = {g: load_dataset("nq-distractors", limit=200, gold_position=g) for g in (0, 4, 9)}
    assert load_dataset("nq-distractors", limit=200, gold_position=4) == sets[4]  # deterministic
    for g, examples in sets.items():
        assert len(examples) == 200 and len({ex.id for ex in examples}) == 200
        for ex, orig in zip(examples, oracle):
            assert ex.question == orig.question and ex.answers == orig.answers
            assert len(ex.passages) == 10 and len(set(ex.passages)) == 10
            assert ex.meta["gold_index"] == g and ex.passages[g] == orig.passages[0]
            distractors = ex.passages[:g] + ex.passages[g + 1:]
            assert orig.passages[0] not in distractors  # never the question's own gold passage
            assert all(d in golds for d in distractors)  # gold passages of other questions
            answers = [normalize_answer(a) for a in ex.answers if normalize_answer(a)]
            assert not any(f" {a} " in f" {normalize_answer(d.title + ' ' + d.text)} " for a in answers
                           for d in distractors)  # and none of them holds the answer
    # the same distractors in the same order at every position: the three sets differ only in where the gold is
    for e0, e4, e9 in zip(sets[0], sets[4], sets[9]):
        assert e0.passages[1:] == e4.passages[:4] + e4.passages[5:] == e9.passages[:9]


def test_nq_distractors_skip_a_duplicate_of_the_own_gold(tmp_path):
    recs = [{"question": f"q{i}", "answers": [f"ans{i}"],
             "ctxs": [{"title": f"T{i}", "text": f"body {i}", "hasanswer": True, "isgold": True}]}
            for i in range(8)]
    recs[5]["ctxs"][0] = dict(recs[0]["ctxs"][0])  # question 5 shares question 0's gold passage
    path = _jsonl(tmp_path / "nq.jsonl", recs)
    for pos in (0, 2, 4):
        for seed in range(5):
            d = load_dataset(data_file=path, fmt="nq", num_passages=5, gold_position=pos, seed=seed)
            assert all(e.passages[pos] == Passage(title=f"T{0 if i == 5 else i}", text=f"body {0 if i == 5 else i}")
                       for i, e in enumerate(d))
            for e in d:
                others = e.passages[:pos] + e.passages[pos + 1:]
                assert e.passages[pos] not in others and len(set(e.passages)) == 5


@needs_data
def test_real_nq_is_cut_into_evaluation_heldout_and_training_records():
    from ragkv.eval.datasets import EVAL_DATASETS, NQ_EVAL, NQ_HELDOUT

    path = data_dir() / DATASETS["nq"].path
    whole = load_dataset(data_file=path, fmt="nq", num_passages=10, limit=NQ_HELDOUT)  # the file, as before the cut
    evaluated = load_dataset("nq-distractors")
    heldout = load_dataset("nq-distractors-heldout")
    train = load_dataset("nq-train")
    assert evaluated == whole[:NQ_EVAL]  # results files written before the cut stay valid
    assert heldout == whole[NQ_EVAL:]  # built exactly like the evaluated questions
    assert load_dataset("nq-distractors-heldout", limit=20, gold_position=4) == \
        load_dataset(data_file=path, fmt="nq", num_passages=10, gold_position=4, limit=NQ_EVAL + 20)[NQ_EVAL:]
    ids = [{ex.id for ex in part} for part in (evaluated, heldout, train)]
    assert [len(i) for i in ids] == [NQ_EVAL, NQ_HELDOUT - NQ_EVAL, len(train)] and len(train) > 1900
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    # training never reads a gold passage of an evaluated or held-out question, not even as a distractor
    train_golds = {ex.passages[ex.meta["gold_index"]] for ex in train}
    assert all(p in train_golds for ex in train for p in ex.passages)
    assert [ex.meta["gold_index"] for ex in train[:12]] == [i % 10 for i in range(12)]
    assert "nq-distractors" in EVAL_DATASETS and "nq-train" not in EVAL_DATASETS
    with pytest.raises(RagkvError, match=f"limit {NQ_EVAL + 1} is larger.*records 0..{NQ_EVAL - 1}.*--limit {NQ_EVAL}"):
        load_dataset("nq-distractors", limit=NQ_EVAL + 1)


@needs_data
def test_icl_sets_give_every_question_the_same_solved_training_questions():
    from ragkv.eval.datasets import dataset_prompt

    evals = load_dataset("nq", limit=20)
    held_back = {ex.question for name in ("nq", "nq-distractors-heldout") for ex in load_dataset(name)}
    for k in (8, 32, 128):
        examples = load_dataset(f"nq-icl-{k}", limit=20)
        assert [ex.question for ex in examples] == [ex.question for ex in evals]  # the evaluation questions
        demos = examples[0].passages
        assert len(demos) == k and all(ex.passages == demos for ex in examples)  # one set: blocks encoded once
        assert all(p.text.startswith("Question: ") and "\nAnswer: " in p.text for p in demos)
        asked = {p.text.split("\n")[0][len("Question: "):] for p in demos}
        assert not asked & held_back  # never an evaluation or calibration question
        assert dataset_prompt(f"nq-icl-{k}").query_template.endswith("Answer:")


@needs_data
def test_samsum_icl_summarizes_test_dialogues_after_solved_train_and_validation_dialogues():
    from ragkv.eval.datasets import dataset_prompt, dataset_stop

    tests = load_dataset("samsum", limit=5)
    held = {ex.passages[0].text for split in ("train", "validation") for ex in load_dataset("samsum", split=split)}
    for k in (4, 8, 32):
        examples = load_dataset(f"samsum-icl-{k}", limit=5)
        assert [ex.question for ex in examples] == [ex.passages[0].text for ex in tests]  # the dialogue is asked
        assert [ex.answers for ex in examples] == [ex.answers for ex in tests]
        assert all(ex.metric == "rouge_l" and ex.meta["split"] == "test" for ex in examples)
        demos = examples[0].passages
        assert len(demos) == k and all(ex.passages == demos for ex in examples)  # one set: blocks encoded once
        dialogues = {p.text[len("Dialogue:\n"):p.text.rindex("\nSummary: ")] for p in demos}
        assert len(dialogues) == k and dialogues <= held  # solved dialogues, never a test one
        assert dataset_prompt(f"samsum-icl-{k}").query_template.endswith("Summary:")
        assert dataset_stop(f"samsum-icl-{k}") == ("\n",)  # a summary is one line
    assert dataset_stop("samsum") == () and dataset_stop(None) == ()
