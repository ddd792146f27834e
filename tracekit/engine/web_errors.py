"""The engine's JSON error response (OpenAI's error envelope, protocol.error_body), one home for
every route module."""

from __future__ import annotations

from aiohttp import web

from .protocol import error_body


def json_error(status: int, message: str, err_type: str = "invalid_request_error", param=None, code=None):
    return web.json_response(error_body(message, err_type, param, code), status=status)
