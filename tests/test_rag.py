"""Retrieval pipeline: documents, chunking (whitespace token counter), real MiniLM embeddings, index, retriever."""

import json
import random

import numpy as np
import pytest

from ragkv.errors import RagkvError
from ragkv.rag.chunking import Chunk, ChunkConfig, chunk_document
from ragkv.rag.documents import Document, DocumentError, find_document_files, read_document
from ragkv.rag.embedding import Embedder, get_embedder
from ragkv.rag.index import VectorIndex, VectorIndexError
from ragkv.rag.pipeline import Retriever


def ws(text: str) -> int:
    return len(text.split())


def _sentence(rng: random.Random, n: int | None = None) -> str:
    words = [rng.choice("alpha beta gamma delta epsilon zeta theta kappa lambda sigma".split())
             for _ in range(n or rng.randint(4, 25))]
    return " ".join(words).capitalize() + rng.choice(".!?")


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


@pytest.fixture(scope="module")
def long_doc() -> Document:
    rng = random.Random(0)
    paras = ["# Greek Letters"] + [_paragraph(rng, rng.randint(1, 12)) for _ in range(30)]
    paras.insert(8, "## A section")
    paras.insert(12, " ".join(["unpunctuated"] * 900))  # one "sentence" longer than any budget
    return Document.from_text("\n\n".join(paras), source="greek.md")


@pytest.fixture(scope="module")
def embedder():
    return get_embedder()


# ---- chunking


@pytest.mark.parametrize("target,overlap", [(256, 0), (384, 0), (512, 0), (384, 64)])
def test_chunks_fit_the_budget_and_keep_whole_words(long_doc, target, overlap):
    chunks = chunk_document(long_doc, ws, ChunkConfig(target, overlap))
    assert len(chunks) > 3
    assert all(ws(c.passage) <= target for c in chunks)
    doc_words = long_doc.text.split()
    if overlap == 0:  # the chunks tile the document word for word: nothing lost, nothing cut mid-word
        assert [w for c in chunks for w in c.text.split()] == doc_words
    for c in chunks:
        assert c.text in long_doc.text
        start = long_doc.text.index(c.text)
        end = start + len(c.text)
        assert start == 0 or long_doc.text[start - 1].isspace()
        assert end == len(long_doc.text) or long_doc.text[end].isspace()
    sizes = [ws(c.passage) for c in chunks[:-1]]
    assert np.mean(sizes) >= 0.6 * target  # packed, not fragmented


def test_chunks_prefer_paragraph_then_sentence_boundaries():
    rng = random.Random(1)
    paras = [" ".join(_sentence(rng, 10) for _ in range(10)) for _ in range(8)]  # 100 words each
    doc = Document.from_text("\n\n".join(paras), title="T")
    chunks = chunk_document(doc, ws, ChunkConfig(256))
    # 2 paragraphs (200 words) fill more than 60% of the budget: cut there rather than mid-paragraph
    assert [c.text for c in chunks] == ["\n\n".join(paras[i:i + 2]) for i in range(0, 8, 2)]

    one_para = " ".join(_sentence(rng, 10) for _ in range(60))  # no paragraph breaks: cut at sentence ends
    chunks = chunk_document(Document.from_text(one_para, title="T"), ws, ChunkConfig(256))
    assert len(chunks) == 3 and all(c.text[-1] in ".!?" for c in chunks)


def test_overlap_repeats_the_previous_tail():
    rng = random.Random(2)
    doc = Document.from_text(" ".join(_sentence(rng, 8) for _ in range(150)), title="T")
    chunks = chunk_document(doc, ws, ChunkConfig(256, 64))
    for a, b in zip(chunks, chunks[1:]):
        shared = next(k for k in range(min(len(a.text), len(b.text)), -1, -1) if a.text.endswith(b.text[:k]))
        assert 0 < ws(b.text[:shared]) <= 64


def test_chunk_config_bounds():
    with pytest.raises(RagkvError, match="256-512"):
        ChunkConfig(128)
    with pytest.raises(RagkvError, match="overlap"):
        ChunkConfig(384, 200)


def test_titles_kept_and_ids_stable(long_doc):
    chunks = chunk_document(long_doc, ws)
    assert all(c.title == "Greek Letters" and c.passage.startswith("Greek Letters\n\n") for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.chunk_id for c in chunk_document(long_doc, ws)] == [c.chunk_id for c in chunks]
    edited = Document(long_doc.doc_id, long_doc.title, long_doc.text + "\n\nOne more paragraph.", long_doc.source)
    assert [c.chunk_id for c in chunk_document(edited, ws)][:-1] == [c.chunk_id for c in chunks][:-1]
    long_title = chunk_document(Document.from_text("body " * 10, title="a very long title " * 30), ws)[0]
    assert long_title.title.startswith("a very long title") and ws(long_title.title) == 384 // 8
    # a repeated passage inside one document still gets distinct ids
    text = "\n\n".join(["same words " * 100] * 3)
    ids = [c.chunk_id for c in chunk_document(Document.from_text(text, title="R"), ws, ChunkConfig(256))]
    assert len(ids) == 3 and len(set(ids)) == 3


# ---- documents


def test_read_documents(tmp_path):
    (tmp_path / "notes.txt").write_text("# not a title in txt\nplain text")
    (tmp_path / "guide.md").write_text("Intro line\n\n## Install Guide\n\nRun it.\n")
    (tmp_path / "front.md").write_text("---\ntitle: From Front Matter\n---\n# Heading\nbody\n")
    (tmp_path / "recs.jsonl").write_text(json.dumps({"id": "a1", "title": "Rec A", "text": "alpha"}) + "\n\n"
                                         + json.dumps({"text": "beta"}) + "\n")
    (tmp_path / "skip.csv").write_text("a,b")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.md").write_text("# hidden")
    files = find_document_files([tmp_path])
    assert [f.name for f in files] == ["front.md", "guide.md", "notes.txt", "recs.jsonl"]
    docs = [d for f in files for d in read_document(f)]
    assert [d.title for d in docs] == ["From Front Matter", "Install Guide", "notes", "Rec A", "recs line 3"]
    assert docs[2].text == "# not a title in txt\nplain text"
    assert docs[2].source == str(tmp_path / "notes.txt")
    assert [d.doc_id for f in files for d in read_document(f)] == [d.doc_id for d in docs]  # stable
    assert len({d.doc_id for d in docs}) == 5


@pytest.mark.parametrize("name,data,reason", [
    ("blob.txt", bytes(range(256)) * 4, "binary"),
    ("latin.md", "caf\u00e9 cr\u00e8me".encode("latin-1"), "UTF-8 at byte 3"),
    ("empty.txt", b"  \n\n", "no text"),
    ("bad.jsonl", b'{"text": "ok"}\n{"title": "no text"}\n', "line 2"),
    ("bad.json", b"{not json", "invalid JSON"),
])
def test_unreadable_files_raise_naming_file_and_reason(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DocumentError, match=reason) as e:
        read_document(tmp_path / name)
    assert name in str(e.value) and isinstance(e.value, RagkvError)


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(DocumentError, match="no such file"):
        find_document_files([tmp_path / "nope"])
    (tmp_path / "a.pdf").write_bytes(b"%PDF")
    with pytest.raises(DocumentError, match="unsupported"):
        find_document_files([tmp_path / "a.pdf"])


# ---- embedding (the real all-MiniLM-L6-v2)


def test_embeddings_unit_norm_and_similarity(embedder):
    texts = ["A cat is sleeping on the sofa.", "A kitten naps on the couch.",
             "The central bank raised interest rates.", "Inflation pushed the Fed to hike rates."]
    v = embedder.encode(texts, batch_size=3)  # batches of unequal lengths, sorted internally
    assert v.shape == (4, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[0, 1] > sim[0, 3] + 0.3
    assert sim[2, 3] > sim[2, 0] + 0.3 and sim[2, 3] > sim[2, 1] + 0.3
    np.testing.assert_allclose(embedder.encode([texts[2]])[0], v[2], atol=1e-5)  # order restored
    assert embedder.encode([]).shape == (0, 384)
    # reference values from sentence-transformers 6.2 (SentenceTransformer(<package model dir>).encode)
    np.testing.assert_allclose(v[:2, :6], [[0.15908, -0.07851, -0.05525, 0.03127, 0.00850, 0.02722],
                                           [0.05127, -0.02365, -0.04089, 0.07321, 0.02201, 0.03099]], atol=1e-4)
    np.testing.assert_allclose(sim, [[1.0, 0.73735, -0.03188, -0.00419], [0.73735, 1.0, -0.05151, 0.04145],
                                     [-0.03188, -0.05151, 1.0, 0.58440], [-0.00419, 0.04145, 0.58440, 1.0]],
                               atol=1e-4)


def test_long_text_truncated_and_bf16_close(embedder):
    texts = ["word " * 400, "A short sentence about boats."]
    v = embedder.encode(texts)
    assert v.shape == (2, 384) and np.isfinite(v).all()
    assert (Embedder(dtype="bfloat16").encode(texts) * v).sum(1).min() > 0.999


# ---- index


def _chunk(i: int, doc: str) -> Chunk:
    return Chunk(f"c{i}", doc, f"Title {doc}", f"text {i}", i, f"/{doc}.md")


def _unit(rng: np.random.Generator, n: int, dim: int = 8) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_index_add_search_remove():
    rng = np.random.default_rng(0)
    chunks = [_chunk(i, "a" if i < 6 else "b") for i in range(10)]
    vecs = _unit(rng, 10)
    index = VectorIndex()
    assert index.search(vecs[0]) == []
    assert len(index.add(chunks[:7], vecs[:7])) == 7
    assert len(index.add(chunks, vecs)) == 3  # dedupe by chunk_id
    hits = index.search(vecs[3] * 2.0, top_k=3)  # query need not be normalized
    assert hits[0][0] == chunks[3] and hits[0][1] == pytest.approx(1.0, abs=1e-5)
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True) and len(hits) == 3
    assert {c.doc_id for c, _ in index.search(vecs[3], top_k=10, doc_ids=["b"])} == {"b"}
    assert [(d.doc_id, d.title, d.chunks) for d in index.documents()] == [("a", "Title a", 6), ("b", "Title b", 4)]
    np.testing.assert_array_equal(index.vectors(["c4"]), vecs[4:5])

    assert index.remove("a") == 6 and index.remove("a") == 0
    assert all(c.doc_id == "b" for c, _ in index.search(vecs[3], top_k=10))
    assert [d.doc_id for d in index.documents()] == ["b"]
    with pytest.raises(VectorIndexError, match="dim"):
        index.add([_chunk(99, "c")], _unit(rng, 1, dim=4))


# ---- retriever


CORPUS = {
    "volcanoes.md": "# Volcanoes\n\nA volcano is a rupture in the crust of a planet that lets hot lava, volcanic ash "
                    "and gases escape from a magma chamber below the surface.",
    "bread.md": "# Baking Bread\n\nKnead the dough of flour, water, yeast and salt, let it rise for two hours, then "
                "bake it in a hot oven until the crust is golden brown.",
    "chess.txt": "Chess is a board game for two players. Each player starts with sixteen pieces; the goal is to "
                 "checkmate the opponent's king.",
    "python.md": "# The Python Language\n\nPython is a programming language with dynamic typing and garbage "
                 "collection; its standard library includes modules for files, networking and threads.",
    "whales.md": "# Blue Whales\n\nThe blue whale is a marine mammal and the largest animal known to have ever "
                 "lived, reaching 30 metres in length and feeding almost only on krill.",
}


def test_retriever_ingest_retrieve_reingest(tmp_path, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in CORPUS.items():
        (docs / name).write_text(text)
    (docs / "broken.txt").write_bytes(b"\x00\x01\x02")
    retriever = Retriever(tmp_path / "index", embedder=embedder)
    seen, errors = [], []
    report = retriever.ingest([docs], ws, on_chunk=seen.append, on_error=errors.append)
    assert report.chunks_added == 5 == len(seen) and report.documents == 5
    assert [e.path for e in errors] == [str(docs / "broken.txt")] and report.errors == errors
    assert {d.title for d in retriever.documents()} == {"Volcanoes", "Baking Bread", "chess", "The Python Language",
                                                        "Blue Whales"}
    questions = {"What is the biggest animal that ever existed?": "whales.md",
                 "How long should dough rise before baking?": "bread.md",
                 "Where does lava come from?": "volcanoes.md",
                 "Which language has garbage collection?": "python.md",
                 "How do you win at chess?": "chess.txt"}
    for question, name in questions.items():
        hits = retriever.retrieve(question, top_k=3)
        assert len(hits) == 3 and hits[0][0].source == str(docs / name), (question, hits[0])

    # re-ingest: nothing new to embed; an edit re-indexes only that document's new chunk
    with pytest.raises(DocumentError, match="binary"):
        retriever.ingest([docs], ws)
    (docs / "broken.txt").unlink()
    seen.clear()
    assert retriever.ingest([docs], ws, on_chunk=seen.append).unchanged == 5 and seen == []
    (docs / "chess.txt").write_text(CORPUS["chess.txt"] + " Castling moves the king two squares.")
    report = retriever.ingest([docs / "chess.txt"], ws, on_chunk=seen.append)
    assert report.chunks_added == 1 and report.chunks_removed == 1 and "Castling" in seen[0].text

    reopened = Retriever(tmp_path / "index", embedder=embedder)
    assert len(reopened.index) == 5
    retriever.remove(retriever.documents()[0].doc_id)
    assert len(reopened.index) == 4
    retriever.ingest([docs], ws)
    assert len(reopened.index) == 5
    assert reopened.retrieve("castling the king")[0][0].chunk_id == seen[0].chunk_id
    assert reopened.remove(seen[0].doc_id) == 1 and len(Retriever(tmp_path / "index", embedder=embedder).index) == 4
    with pytest.raises(RagkvError, match="empty"):
        reopened.retrieve("  ")
