"""Read documents from files and folders: .txt, .md/.markdown, and .json/.jsonl records with a `text` field.

A document's id is derived from its resolved path (plus the record key for JSON records), so re-ingesting the
same file yields the same id and, through `chunking`, the same chunk ids. Undecodable or malformed files raise
`DocumentError`; the caller decides whether to skip them.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ragkv.errors import RagkvError

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
JSON_SUFFIXES = (".json", ".jsonl")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES
MAX_FILE_BYTES = 64 << 20  # a bigger "document" is almost certainly a data dump, not a passage source

_ATX_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_SETEXT_HEADING = re.compile(r"^ {0,3}(\S[^\n]*)\n {0,3}(=+|-+)[ \t]*$", re.MULTILINE)
_FRONT_MATTER = re.compile(r"\A---[ \t]*\n(.*?)\n(?:---|\.\.\.)[ \t]*(?:\n|\Z)", re.DOTALL)


class DocumentError(RagkvError):
    """A file that cannot be read as a document; `path` and `reason` say which and why."""

    def __init__(self, path: str | Path, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot read document {self.path}: {reason}")


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str
    source: str  # file path (with "#key" for JSON records), or whatever the caller passed for inline text

    @classmethod
    def from_text(cls, text: str, title: str | None = None, source: str = "", doc_id: str | None = None) -> Document:
        """An inline document (e.g. sent to the server); its id defaults to a hash of title and text."""
        text = _normalize_newlines(text)
        if not text.strip():
            raise DocumentError(source or "<inline>", "contains no text")
        title = (title or markdown_title(text) or "").strip()
        return cls(doc_id or _digest("text", title, text), title, text, source)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


def _normalize_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def markdown_title(text: str) -> str | None:
    """Front-matter `title:`, else the first ATX (`# Title`) or setext (`Title\\n===`) heading, else None."""
    fm = _FRONT_MATTER.match(text)
    if fm:
        for line in fm.group(1).splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "title" and value.strip():
                return value.strip().strip("\"'")
        text = text[fm.end():]
    found = [m for m in (_ATX_HEADING.search(text), _SETEXT_HEADING.search(text)) if m]
    if not found:
        return None
    return min(found, key=lambda m: m.start()).group(1).strip() or None


def _decode(path: Path, data: bytes) -> str:
    """Strict UTF-8 (or UTF-16 with a BOM); binary or mis-encoded files are refused, never garbled."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        encoding = "utf-16"
    elif b"\x00" in data[:8192]:
        raise DocumentError(path, "binary file (contains NUL bytes); only UTF-8 text is supported")
    else:
        encoding = "utf-8-sig"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise DocumentError(path, f"not valid {encoding.upper().removesuffix('-SIG')} at byte {e.start}; "
                                  "convert it to UTF-8 first") from None


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise DocumentError(path, f"{size} bytes is over the {MAX_FILE_BYTES >> 20} MiB limit; split it")
        data = path.read_bytes()
    except OSError as e:
        raise DocumentError(path, e.strerror or str(e)) from None
    return _normalize_newlines(_decode(path, data))


def _record(path: Path, obj: object, where: str) -> Document:
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise DocumentError(path, f"{where}: expected an object with a string `text` field")
    if not obj["text"].strip():
        raise DocumentError(path, f"{where}: `text` is empty")
    key = str(obj["id"]) if obj.get("id") is not None else where
    title = obj.get("title")
    title = title.strip() if isinstance(title, str) and title.strip() else f"{path.stem} {key}"
    source = f"{path}#{key}"
    return Document(_digest("file", source), title, _normalize_newlines(obj["text"]), source)


def _read_json(path: Path, text: str) -> list[Document]:
    if path.suffix.lower() == ".jsonl":
        docs = []
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DocumentError(path, f"line {lineno}: invalid JSON ({e.msg})") from None
            docs.append(_record(path, obj, f"line {lineno}"))
        return docs
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DocumentError(path, f"invalid JSON at line {e.lineno} ({e.msg})") from None
    if isinstance(obj, list):
        return [_record(path, o, f"item {i}") for i, o in enumerate(obj)]
    return [_record(path, obj, "root")]


def read_document(path: str | Path) -> list[Document]:
    """Read one file into its documents (one for text files, one per record for JSON/JSONL).

    Raises:
        DocumentError: unsupported type, unreadable, undecodable, malformed or empty file.
    """
    path = Path(path).expanduser().resolve()
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DocumentError(path, f"unsupported file type {suffix or '(none)'!r}; "
                                  f"supported: {', '.join(SUPPORTED_SUFFIXES)}")
    if not path.is_file():
        raise DocumentError(path, "no such file")
    text = _read_text(path)
    if suffix in JSON_SUFFIXES:
        docs = _read_json(path, text)
    else:
        title = markdown_title(text) if suffix != ".txt" else None
        docs = [Document(_digest("file", str(path)), title or path.stem, text, str(path))]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DocumentError(path, "contains no text")
    return docs


def find_document_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand files and folders (recursively, skipping hidden entries and unsupported types) into sorted files.

    A path named explicitly must exist and, if a file, have a supported type.

    Raises:
        DocumentError: a named path is missing or a named file has an unsupported type.
    """
    found: dict[Path, None] = {}
    for p in paths:
        p = Path(p).expanduser().resolve()
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(p).parts
                if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES and not any(s.startswith(".") for s in rel):
                    found.setdefault(f)
        elif p.is_file():
            if p.suffix.lower() not in SUPPORTED_SUFFIXES:
                raise DocumentError(p, f"unsupported file type {p.suffix or '(none)'!r}; "
                                       f"supported: {', '.join(SUPPORTED_SUFFIXES)}")
            found.setdefault(p)
        else:
            raise DocumentError(p, "no such file or folder")
    return list(found)
