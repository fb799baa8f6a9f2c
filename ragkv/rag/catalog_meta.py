"""What both document libraries (the SQLite one, ragkv.rag.catalog, and the Redis one, ragkv.rag.redis_catalog)
share: their format, their error and the check of a library's meta record."""

from __future__ import annotations

from ragkv.errors import RagkvError

FORMAT = "1"


class CatalogError(RagkvError):
    pass


def check_meta(meta: dict, where: str, embedding_model: str | None, elsewhere: str) -> None:
    """A library of another format, or built with another embedding model, is refused (vectors never mix)."""
    if meta.get("format", FORMAT) != FORMAT:
        raise CatalogError(f"document library {where} has format {meta['format']}; this version reads {FORMAT}")
    stored = meta.get("embedding_model")
    if stored and embedding_model and stored != embedding_model:
        raise CatalogError(f"document library {where} was built with embedding model {stored!r}, not "
                           f"{embedding_model!r}; {elsewhere}")
