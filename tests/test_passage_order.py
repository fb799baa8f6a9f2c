"""Retrieved passages go in ascending relevance by default (Block-Attention 3.2): the best one next to the question."""

import pytest

from ragkv.errors import OptionError
from ragkv.rag.order import order_passages
from ragkv.settings import DEFAULT_PASSAGE_ORDER


def test_best_last_is_the_default_and_reverses_a_ranking():
    ranked = ["best", "second", "third"]
    assert DEFAULT_PASSAGE_ORDER == "best-last"
    assert order_passages(ranked) == ["third", "second", "best"]
    assert order_passages(ranked, "best-first") == order_passages(ranked, "as-given") == ranked
    with pytest.raises(OptionError, match="passage_order must be one of best-last"):
        order_passages(ranked, "random")


def test_eval_ranks_each_examples_passages_by_a_real_retriever():
    """`ragkv eval --passage-order`: MiniLM cosine ranking; the gold passage's index follows it."""
    from ragkv.cli.eval_data import rank_passages
    from ragkv.eval.datasets import load_dataset

    ex = load_dataset("nq-distractors", limit=1, gold_position=4)[0]
    last, first = rank_passages([ex], "best-last")[0], rank_passages([ex], "best-first")[0]
    assert [p.text for p in last.passages] == [p.text for p in reversed(first.passages)]
    assert sorted(p.text for p in last.passages) == sorted(p.text for p in ex.passages)
    gold = ex.passages[4].text
    assert last.passages[last.meta["gold_index"]].text == gold == first.passages[first.meta["gold_index"]].text
    assert last.meta["retrieved_gold_rank"] == first.meta["gold_index"]
