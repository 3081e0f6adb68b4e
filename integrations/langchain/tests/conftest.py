"""Shared set-up of the langchain-kvmemory tests: offline, and the standard suites' async tests run
under pytest-asyncio without per-test markers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import inspect

import pytest


_HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    # The published suites define `async def test_*` without asyncio markers (their own repository runs
    # pytest-asyncio in auto mode). Mark ours as they are collected, inside pytest-asyncio's own
    # collection wrapper, rather than switching the whole project to auto mode.
    outcome = yield
    if not str(collector.path).startswith(_HERE) or not inspect.iscoroutinefunction(obj):
        return
    result = outcome.get_result()
    for node in result if isinstance(result, list) else [result] if result is not None else []:
        if isinstance(node, pytest.Function) and node.get_closest_marker("asyncio") is None:
            node.add_marker(pytest.mark.asyncio)
