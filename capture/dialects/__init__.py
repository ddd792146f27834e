"""Engine dialects: one small module per wire format, behind one Protocol
(`base.Dialect`): build the request body, parse a non-stream response, parse
one stream event into token columns plus finish reason and usage.

| name        | route                         | ids from                              | cached_tokens                   |
|-------------|-------------------------------|---------------------------------------|---------------------------------|
| openai      | /v1/completions               | strings (tokenizer), or llama.cpp ids | usage.prompt_tokens_details     |
| openai-chat | /v1/chat/completions          | strings/bytes (tokenizer), or ids     | usage.prompt_tokens_details     |
| vllm        | /v1/completions + extras      | "token_id:N", token_ids               | same, with --enable-prompt-tokens-details |
| sglang      | /generate                     | (lp, id, text) tuples                 | meta_info.cached_tokens         |
| tgi         | /generate(_stream)            | details.tokens[].id                   | not reported                    |
| llamacpp    | /completion                   | completion_probabilities[].id         | timings.cache_n                 |
"""

from __future__ import annotations

from tracekit.errors import ConfigError

from .base import Acc, Dialect, EngineErrorEvent, RequestSpec
from .llamacpp import LlamaCppCompletion
from .openai import OpenAIChat, OpenAICompletions, VLLMCompletions
from .sglang import SGLangGenerate
from .tgi import TGIGenerate

DIALECTS: dict[str, type] = {
    "openai": OpenAICompletions,
    "openai-chat": OpenAIChat,
    "vllm": VLLMCompletions,
    "sglang": SGLangGenerate,
    "tgi": TGIGenerate,
    "llamacpp": LlamaCppCompletion,
}


def get(name: str) -> Dialect:
    try:
        return DIALECTS[name]()
    except KeyError:
        raise ConfigError(f"unknown dialect {name!r}; choose one of: auto, {', '.join(DIALECTS)}") from None


__all__ = ["Acc", "DIALECTS", "Dialect", "EngineErrorEvent", "RequestSpec", "get"]
