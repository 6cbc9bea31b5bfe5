"""The default model's shared server, its openai client and the in-process greedy reference,
as module fixtures a test module imports (`from smollm_fixtures import client, llm, srv`)."""

from __future__ import annotations

import pytest

from server_harness import openai_client, reference_llm, server


@pytest.fixture(scope="module")
def srv():
    return server("smollm")


@pytest.fixture(scope="module")
def client(srv):
    return openai_client(srv)


@pytest.fixture(scope="module")
def llm():
    """The same model in-process: the greedy reference (float32, one thread)."""
    return reference_llm()
