"""The NQ-10 questions a diagnostic runs on: `--gold G --first A --last B` (gold passage at G, questions A..B-1)."""
from ragkv.eval.datasets import load_dataset


def add_question_range(parser, last: int) -> None:
    parser.add_argument("--gold", type=int, default=0, help="index of the gold passage among the 10")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--last", type=int, default=last)


def nq10_questions(args) -> list:
    return load_dataset("nq-distractors", limit=args.last, num_passages=10, gold_position=args.gold)[args.first:]
