import os
import threading

import pytest
import pytest_timeout
import trio.testing

pytest_plugins = ["fleetsched.testing.fixtures"]


@pytest.fixture
def anyio_backend():
    """Default: trio on virtual time, so tests that wait hours finish at once and time exactly."""
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})



@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method, naming the test that ran out of time: its dump of every
    thread's stack alone does not (a test's coroutine is on no thread's stack). Written to file
    descriptor 2, which the dump prints among the captured output."""
    if settings.method != "thread":
        return None

    def expire() -> None:
        os.write(2, f"\n{item.nodeid} ran past its time limit ({settings.timeout:g} s)\n".encode())
        pytest_timeout.timeout_timer(item, settings)

    timer = threading.Timer(settings.timeout, expire)
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True
