"""Retrieval half of RAG: documents -> chunks -> MiniLM embeddings -> persisted vector index -> top-k chunks."""

from ragkv.rag.chunking import Chunk, ChunkConfig, chunk_document
from ragkv.rag.documents import Document, DocumentError, find_document_files, read_document
from ragkv.rag.embedding import Embedder, EmbeddingModelError, get_embedder
from ragkv.rag.index import DocumentInfo, VectorIndex, VectorIndexError
from ragkv.rag.pipeline import IngestReport, Retriever

__all__ = ["Chunk", "ChunkConfig", "chunk_document", "Document", "DocumentError", "find_document_files",
           "read_document", "Embedder", "EmbeddingModelError", "get_embedder", "DocumentInfo", "VectorIndex",
           "VectorIndexError", "IngestReport", "Retriever"]
