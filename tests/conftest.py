import pytest
import trio.testing

pytest_plugins = ["fleetsched.testing.fixtures"]


@pytest.fixture
def anyio_backend():
    """Default: trio on virtual time, so tests that wait hours finish at once and time exactly."""
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
