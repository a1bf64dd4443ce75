import pytest
import trio.testing

pytest_plugins = ["fleetsched.testing.fixtures"]


@pytest.fixture
def anyio_backend():
    """Default: trio on virtual time, so tests that wait hours finish at once and time exactly."""
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    """Name the test in its captured output: a test past its time limit (pytest-timeout's thread
    method) is reported by a dump of every thread's stack and that output, and a test's coroutine
    is on no thread's stack."""
    print(f"[test {item.nodeid}]")
    return (yield)
