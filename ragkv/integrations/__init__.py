"""Framework adapters that talk to a running `ragkv serve` over HTTP: retrieved documents travel as ragkv blocks
(`ragkv.documents`) instead of being pasted into the prompt, so each one's KV is computed once and reused.

`ragkv.integrations.langchain` needs `pip install 'ragkv[langchain]'`; `ragkv.integrations.llamaindex` needs
`pip install 'ragkv[llamaindex]'`. Neither imports the engine: they are plain HTTP clients.
"""
