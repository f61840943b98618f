"""Fixtures shared by the fix unit tests."""

from __future__ import annotations

import pytest

import megatron.fixes


@pytest.fixture
def fixed(request):
    """The test module's ``FIX`` applied (status ``active``) on a reset registry for one test,
    then reset."""
    fix = request.module.FIX
    megatron.fixes.reset()
    assert fix.apply().value == "active"
    yield
    fix.reset()
