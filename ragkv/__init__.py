"""ragkv: compute each retrieved passage's KV cache once and reuse it at any position."""

__version__ = "0.1.0"
