"""Token-aware chunking: cut a document into passages of at most `target_tokens` tokens of the caller's tokenizer.

The text is split into the smallest units needed (sentences; words only inside a sentence that is alone over
budget; characters only inside a "word" that is, e.g. a base64 blob) and packed greedily. Each unit remembers
how strong the boundary before it is (heading > paragraph > sentence > word), and a chunk is cut at the strongest
boundary that still leaves it at least `_MIN_FILL` of the budget, so chunks end on paragraphs when they can and
never inside a word. Chunk text is an exact slice of the document, so its formatting is kept.

A chunk's passage (what is embedded and prefilled) is the document title, a blank line, then the text; the
budget applies to the whole passage.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable

from ragkv.errors import RagkvError
from ragkv.rag.documents import Document

CountTokens = Callable[[str], int]

MIN_TARGET_TOKENS, MAX_TARGET_TOKENS = 256, 512
_MIN_FILL = 0.6  # prefer a stronger boundary only if the chunk keeps at least this share of the budget

WORD, SENTENCE, PARAGRAPH, HEADING = 0, 1, 2, 3  # strength of the boundary before a unit

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*|\n(?=[ \t]{0,3}#{1,6}[ \t])")
_SENTENCE_END = re.compile(r"[.!?\u2026\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*\s+")
_WORD = re.compile(r"\S+")
_HEADING_START = re.compile(r"[ \t]{0,3}#{1,6}[ \t]")


@dataclass(frozen=True)
class ChunkConfig:
    target_tokens: int = 384
    overlap_tokens: int = 0

    def __post_init__(self):
        if not MIN_TARGET_TOKENS <= self.target_tokens <= MAX_TARGET_TOKENS:
            raise RagkvError(f"chunk size {self.target_tokens} is outside {MIN_TARGET_TOKENS}-{MAX_TARGET_TOKENS} "
                             "tokens; pick a size in that range")
        if not 0 <= self.overlap_tokens <= self.target_tokens // 2:
            raise RagkvError(f"chunk overlap {self.overlap_tokens} must be between 0 and half the chunk size "
                             f"({self.target_tokens // 2})")


@dataclass(frozen=True)
class Chunk:
    chunk_id: str  # content hash of (doc_id, passage): stable across re-ingests of the same file
    doc_id: str
    title: str
    text: str
    index: int     # position within its document
    source: str = ""

    @property
    def passage(self) -> str:
        """The text to embed and prefill: title and body, so each passage says where it comes from."""
        return f"{self.title}\n\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class _Unit:
    start: int
    end: int
    strength: int  # boundary strength before this unit


def _spans(pattern: re.Pattern, text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Split text[start:end] at the matches of `pattern` (separators dropped), trimmed, empty pieces skipped."""
    out, pos = [], start
    for m in pattern.finditer(text, start, end):
        out.append((pos, m.start() if pattern is _PARAGRAPH_BREAK else m.end()))
        pos = m.end()
    out.append((pos, end))
    trimmed = []
    for s, e in out:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if s < e:
            trimmed.append((s, e))
    return trimmed


def _hard_split(text: str, start: int, end: int, budget: int, count: CountTokens) -> list[tuple[int, int]]:
    """Last resort for a single "word" over budget: the longest prefixes that fit, found by bisection."""
    out = []
    while start < end:
        lo, hi = start + 1, end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(text[start:mid]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append((start, lo))
        start = lo
    return out


def _units(text: str, budget: int, count: CountTokens) -> tuple[list[_Unit], list[int]]:
    """Sentence units (words, then character pieces, only where one alone is over budget) and their counts."""
    units, counts = [], []

    def add(s: int, e: int, strength: int, n: int) -> None:
        units.append(_Unit(s, e, strength))
        counts.append(n)

    for ps, pe in _spans(_PARAGRAPH_BREAK, text, 0, len(text)):
        strength = HEADING if _HEADING_START.match(text, ps) else PARAGRAPH
        for ss, se in _spans(_SENTENCE_END, text, ps, pe):
            n = count(text[ss:se])
            if n <= budget:
                add(ss, se, strength, n)
            else:
                for ws, we in (m.span() for m in _WORD.finditer(text, ss, se)):
                    n = count(text[ws:we])
                    if n <= budget:
                        add(ws, we, strength, n)
                    else:
                        for hs, he in _hard_split(text, ws, we, budget, count):
                            add(hs, he, strength, count(text[hs:he]))
                            strength = WORD
                    strength = WORD
            strength = SENTENCE
    return units, counts


def _pack(units: list[_Unit], counts: list[int], budget: int, overlap: int,
          fits: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """Greedy packing into [first, last) unit ranges; cut at the strongest boundary keeping _MIN_FILL of budget."""
    ranges, i, n = [], 0, len(units)
    while i < n:
        total, j = counts[i], i + 1
        while j < n and total + counts[j] <= budget:
            total += counts[j]
            j += 1
        if j < n:  # not the last chunk: back off to a stronger boundary if one keeps the chunk full enough
            best, best_strength, size = j, units[j].strength, total
            for k in range(j - 1, i, -1):
                size -= counts[k]
                if size < _MIN_FILL * budget:
                    break
                if units[k].strength > best_strength:
                    best, best_strength = k, units[k].strength
            j = best
        # unit counts are summed; tokenizers are not exactly additive, so check the real count and shrink
        while j - i > 1 and not fits(i, j):
            j -= 1
        ranges.append((i, j))
        if j >= n:
            break
        nxt, carried = j, 0
        while overlap and nxt - 1 > i and carried + counts[nxt - 1] <= overlap:
            nxt -= 1
            carried += counts[nxt]
        i = nxt
    return ranges


def chunk_id(doc_id: str, passage: str, occurrence: int = 0) -> str:
    h = hashlib.sha256(f"{doc_id}\x1f{passage}".encode())
    if occurrence:
        h.update(f"\x1f{occurrence}".encode())
    return h.hexdigest()[:24]


def chunk_document(doc: Document, count_tokens: CountTokens, config: ChunkConfig = ChunkConfig()) -> list[Chunk]:
    """Cut `doc` into chunks whose passage (title + text) has at most `config.target_tokens` tokens.

    Args:
        doc: the document.
        count_tokens: tokens in a string under the LLM's tokenizer (no special tokens).
        config: target size and overlap.
    Returns:
        Chunks in document order; ids are stable content hashes.
    """
    words = doc.title.split()
    while words and count_tokens(" ".join(words)) > config.target_tokens // 8:  # a title, not a passage
        words.pop()
    title = " ".join(words)
    budget = config.target_tokens - (count_tokens(f"{title}\n\n") if title else 0)
    text = doc.text
    units, counts = _units(text, budget, count_tokens)
    body = lambda a, b: text[units[a].start:units[b - 1].end]
    passage = lambda a, b: f"{title}\n\n{body(a, b)}" if title else body(a, b)
    fits = lambda a, b: count_tokens(passage(a, b)) <= config.target_tokens
    chunks, seen = [], {}
    for i, (a, b) in enumerate(_pack(units, counts, budget, config.overlap_tokens, fits)):
        base = chunk_id(doc.doc_id, passage(a, b))
        occurrence = seen.get(base, 0)
        seen[base] = occurrence + 1
        cid = chunk_id(doc.doc_id, passage(a, b), occurrence)
        chunks.append(Chunk(cid, doc.doc_id, title, body(a, b), i, doc.source))
    return chunks
