"""Pytest fixtures shared by the test suite (registered in tests/conftest.py).

``vllm_server``: one real vLLM server for the whole test session, started from the virtualenv and
tiny model that scripts/setup-vllm.sh makes. Without them the tests that use it are skipped,
unless ``FLEETSCHED_REQUIRE_VLLM=1`` (CI sets it): then they fail, so that a broken install cannot
pass as green.

The session server runs ``--scheduling-policy priority`` with ``--max-num-seqs 4`` (so that a
handful of calls already queue, which the priority tests need) and ``--max-model-len 4096`` (the tiny model's limit), with
``VLLM_SERVER_DEV_MODE=1`` so that ``/server_info`` shows its scheduler config. Its engine runs at
nice 19, so that the API server (and the tests) keep the CPU they need on 2 cores (see
`VLLMServer.engine_nice`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .vllm_server import VLLMServer, missing_setup

SESSION_SERVER_OPTIONS = dict(max_num_seqs=4, max_model_len=4096, dev_mode=True, engine_nice=19)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: needs the real CPU vLLM server (installed by scripts/setup-vllm.sh)"
    )


def require_vllm_setup() -> None:
    """Skip (or, with FLEETSCHED_REQUIRE_VLLM=1, fail) when scripts/setup-vllm.sh has not run."""
    missing = missing_setup()
    if not missing:
        return
    message = f"no vLLM install ({'; '.join(missing)} missing): run scripts/setup-vllm.sh"
    if os.environ.get("FLEETSCHED_REQUIRE_VLLM") == "1":
        pytest.fail(f"FLEETSCHED_REQUIRE_VLLM=1 but {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def vllm_server() -> Iterator[VLLMServer]:
    """A running vLLM server (priority policy, 4 sequences at once), shared by the session."""
    require_vllm_setup()
    with VLLMServer(**SESSION_SERVER_OPTIONS) as server:  # type: ignore[arg-type]
        yield server
