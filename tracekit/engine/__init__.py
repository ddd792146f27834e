"""The reference serving engine behind `tracekit serve`.

Modules: executor (model + per-slot KV, prefill, batched decode), prefix_cache
(hash-chained KV blocks, LRU), kvblock (one block's KV), engine (the owner loop), protocol (OpenAI /
vLLM completions dialect), textstream (detokenization, stop strings), server
(aiohttp routes), connections (the listening socket: header deadline,
loopback warning), faults + faults_hooks (injected engine bugs, testing only), metrics
(Prometheus text), process (start an engine in a subprocess for tests and
runners). Only `process` is light to import; the rest
pull in torch or aiohttp and are imported where used.
"""
