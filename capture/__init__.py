"""Capture: record per-token evidence from engines into tracekit traces.

`tracekit.capture.http` drives an OpenAI-compatible (or SGLang / TGI / llama.cpp) server
over HTTP; `tracekit.capture.teacher` recomputes logits with HF transformers under
several cache histories. Never imports `analyze`.
"""
