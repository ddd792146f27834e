"""Fixtures for the dialect tests."""

from __future__ import annotations

import pytest
from support.dialect_fields_shared import capture_cache, one_capture


# The dialect field tests (test_dialect_fields_*.py), one file per engine, share these two.
@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """captured(variant) -> the capture of a variant of dialect_fields_shared.VARIANTS, made once per module."""
    return capture_cache(tmp_path_factory.mktemp("fields"))


@pytest.fixture
def one(tmp_path):
    """one(routes, prompt, stream, **options): a capture that is not shared."""
    return one_capture(tmp_path)
