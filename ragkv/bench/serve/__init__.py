"""`ragkv bench serve`: load benchmark of the OpenAI-compatible server over a shared passage pool, optionally side
by side with a peer on the same requests and the same model: llama.cpp's (`--peer llama-cpp`: llama-cpp-python's
server; `--peer llama-server`: upstream's) or vLLM's CPU backend (`--peer vllm-cpu`).

The workload follows CacheBlend's "Musique extended" (EuroSys'25, section 7.1): many questions over one pool of
real MuSiQue passages; each request is a question plus k passages drawn from the pool (seeded), sent inline
through the official `openai` client. Per mode: a warm-up pass sends every pool passage once (a steady-state
server has seen them), then each concurrency level runs N streamed, greedy requests (up to `max_tokens` new
tokens) from C client threads. TTFT is measured client-side (request sent -> first streamed content chunk),
queueing included.

The peer gets the same text in plain chat messages: the same system prompt, and one user message holding the
passages and the question rendered exactly as ragkv renders its blocks and query (`ragkv.engine.request.segments`), so
both see the same chat prompt. The two servers never run at the same time. The peer reports no usage in its
streams: its prompt and answer tokens are counted client-side with the model's own tokenizer.

The parts: `config` (ServeBenchConfig), `workload` (the passage pool and the requests), `clients` (timed
streamed requests, cells and their figures), `servers` (`ragkv serve` as a subprocess), `peer` (llama.cpp's
server, what it is sent and the ratios to it), `run` (the benchmark) and `report` (the figure and the markdown).
"""

from ragkv.bench.serve.config import PEERS, ServeBenchConfig
from ragkv.bench.serve.peer import DEFAULT_PEER_PYTHON, PEER_PACKAGE, LlamaCppServer
from ragkv.bench.serve.run import run_serve_bench
from ragkv.bench.serve.servers import ServerProcess, started_together

__all__ = ["ServeBenchConfig", "run_serve_bench", "ServerProcess", "started_together", "LlamaCppServer", "PEERS",
           "PEER_PACKAGE", "DEFAULT_PEER_PYTHON"]
