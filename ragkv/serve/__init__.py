"""OpenAI-compatible HTTP server over the engine, with a document library (retrieval + precomputed KV)."""
