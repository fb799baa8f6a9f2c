"""Requests as segments: prefix (system + instructions), blocks (passages), query (question + template tail).

Each segment is tokenized on its own and `full` sees the concatenation of the same ids. With a chat template,
the segments are cut from one rendered chat prompt, so their concatenated text is exactly the normal prompt:
    prefix = <template head up to the user message> ; blocks = passages ; query = question + <template tail>
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ragkv.errors import InvalidRequestError

log = logging.getLogger(__name__)

_SENTINEL = "\u2063RAGKV_USER_CONTENT\u2063"


@dataclass(frozen=True)
class Passage:
    text: str
    title: str = ""


@dataclass(frozen=True)
class PromptFormat:
    """Default: the Block-Attention prompt, taken from "Lost in the Middle" (instruction, titled passages, question)."""
    system: str = ("You are an intelligent AI assistant. Please answer questions based on the user's "
                   "instructions. Below are some reference documents that may help you in answering the "
                   "user's question.")
    block_template: str = "- Title: {title}\n{text}\n"
    untitled_block_template: str = "- {text}\n"
    query_template: str = ("\nPlease write a high-quality answer for the given question using only the provided "
                           "search documents (some of which might be irrelevant).\nQuestion: {question}")
    use_chat_template: bool = True


@dataclass
class Segments:
    prefix: list[int]
    blocks: list[list[int]]
    query: list[int]
    block_titles: list[str] = field(default_factory=list)
    history: bool = False  # the blocks are earlier chat turns, in order (engine/blocks/history.py: exact prefix first)
    next_turn: list[int] = field(default_factory=list)  # history: the last user message as the block it becomes
    passages: int = 0  # history with documents: the first `passages` blocks are passages, the rest turns

    def all_ids(self) -> list[int]:
        return self.prefix + [t for b in self.blocks for t in b] + self.query

    @property
    def num_tokens(self) -> int:
        return len(self.prefix) + sum(len(b) for b in self.blocks) + len(self.query)


def split_blocks(segs: Segments, max_tokens: int) -> Segments:
    """Blocks longer than `max_tokens` cut into consecutive pieces of at most that many tokens (a document longer
    than the window as APE section 6.3 encodes it: segments that each fit, sharing one position range)."""
    if max_tokens < 1:
        raise InvalidRequestError(f"cannot cut blocks into pieces of {max_tokens} tokens")
    blocks, titles = [], []
    for i, ids in enumerate(segs.blocks):
        title = segs.block_titles[i] if i < len(segs.block_titles) else ""
        for a in range(0, len(ids), max_tokens):
            blocks.append(ids[a:a + max_tokens])
            titles.append(title)
    pieces = sum(-(-len(ids) // max_tokens) for ids in segs.blocks[:segs.passages])
    return Segments(segs.prefix, blocks, segs.query, titles, segs.history, segs.next_turn, pieces)


def chat_template_parts(tokenizer, system: str | None) -> tuple[str, str]:
    """Text before and after the user message in the tokenizer's chat template (empty without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return (system + "\n\n" if system else ""), "\n"
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_SENTINEL)
    return head, tail


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def render_passage(p: Passage | str, fmt: PromptFormat) -> str:
    if isinstance(p, str):
        p = Passage(text=p)
    if p.title:
        return fmt.block_template.format(title=p.title, text=p.text)
    return fmt.untitled_block_template.format(text=p.text)


def render_turn(turn: dict) -> str:
    """An earlier chat message in a prompt with passages: "User: ...", "Assistant: ...", "Tool: ..." on its line."""
    return f"{str(turn['role']).capitalize()}: {turn['content']}\n"


def build_segments(tokenizer, question: str | None, passages=(), fmt: PromptFormat = PromptFormat(),
                   system: str | None = None, turns: list[dict] = ()) -> Segments:
    """Tokenize prefix, passages and query separately; empty passages are skipped with a warning. With
    `question=None`, the context alone (no query segment): what warming a store caches.

    `turns`: a conversation's earlier messages, each a block after the passages (`render_turn`), in the order the
    text had when the history was folded into the question. Such segments are a history (engine/blocks/history.py): the
    start the prefix cache holds is exact, stored blocks after it fused, the newest turns computed with the
    question."""
    if question is not None and not question.strip():
        raise InvalidRequestError("the question is empty; pass a non-empty question")
    system = fmt.system if system is None else system
    if fmt.use_chat_template:
        head, tail = chat_template_parts(tokenizer, system)
    else:
        head, tail = (system + "\n\n" if system else ""), "\nAnswer:"
    blocks, titles = [], []
    for i, p in enumerate(passages):
        text = p.text if isinstance(p, Passage) else p
        if not text or not text.strip():
            log.warning("passage %d is empty; skipped", i)
            continue
        blocks.append(tokenize(tokenizer, render_passage(p, fmt)))
        titles.append(p.title if isinstance(p, Passage) else "")
    query = [] if question is None else tokenize(tokenizer, fmt.query_template.format(question=question) + tail)
    history = [tokenize(tokenizer, render_turn(t)) for t in turns]
    asked = render_turn({"role": "user", "content": question}) if history and question is not None else ""
    return Segments(prefix=tokenize(tokenizer, head), blocks=blocks + history, query=query,
                    block_titles=titles + [""] * len(history), history=bool(history),
                    next_turn=tokenize(tokenizer, asked), passages=len(blocks) if history else 0)


def chat_segments(tokenizer, prompt: str | list[dict], system: str | None = None) -> Segments:
    """A plain chat (no passages) as one query segment: a prompt, or the turns [{"role", "content"}, ...]."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not turns or not str(turns[-1].get("content") or "").strip():
        raise InvalidRequestError("the prompt is empty; pass a non-empty prompt")
    if getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + turns
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        text = (system + "\n\n" if system else "") + "\n".join(t["content"] for t in turns)
    return Segments(prefix=[], blocks=[], query=tokenize(tokenizer, text))


def _render(tokenizer, msgs: list[dict], generation_prompt: bool = False) -> str | None:
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception:  # noqa: BLE001 - some templates refuse a conversation without a user message
        return None


def history_segments(tokenizer, turns: list[dict], system: str | None = None) -> Segments:
    """A chat as blocks: the prefix is the system message's rendering, each earlier message (user, assistant, tool)
    one block, the query the last user message with the generation prompt. The pieces are cut from the template's
    own rendering of ever longer conversations, so their concatenation is exactly `chat_segments`' text; where a
    template does not render a conversation as an extension of its start (Qwen merges consecutive tool messages
    into one user turn) the messages on both sides of the cut share one block."""
    turns = list(turns)
    if not turns or not str(turns[-1].get("content") or "").strip():
        raise InvalidRequestError("the prompt is empty; pass a non-empty prompt")
    if not getattr(tokenizer, "chat_template", None):
        head = system + "\n\n" if system else ""
        pieces = [t["content"] + "\n" for t in turns[:-1]] + [turns[-1]["content"]]
        last = turns[-1]["content"] + "\n"
    else:
        sys_msgs = [{"role": "system", "content": system}] if system else []
        full = _render(tokenizer, sys_msgs + turns, generation_prompt=True)
        head = (_render(tokenizer, sys_msgs) or "") if sys_msgs else ""
        if not full.startswith(head):
            head = ""
        cuts, done = [len(head)], len(head)
        for k in range(1, len(turns)):
            text = _render(tokenizer, sys_msgs + turns[:k])
            if text is not None and len(text) > done and full.startswith(text):
                cuts.append(len(text))
                done = len(text)
        cuts.append(len(full))
        pieces = [full[a:b] for a, b in zip(cuts, cuts[1:])]
        plain = _render(tokenizer, sys_msgs + turns) or ""  # no generation prompt: the last message as a turn
        last = plain[cuts[-2]:] if plain.startswith(full[:cuts[-2]]) and len(plain) > cuts[-2] else ""
    ids = [tokenize(tokenizer, p) for p in pieces]
    return Segments(prefix=tokenize(tokenizer, head), blocks=[b for b in ids[:-1] if b], query=ids[-1],
                    block_titles=[], history=True, next_turn=tokenize(tokenizer, last))
