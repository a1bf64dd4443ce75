import gc

import pytest

from fleetsched.gc_tuning import SERVING, gc_thresholds


def test_thresholds_hold_inside_the_block_and_come_back_after_it():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with gc_thresholds(SERVING):
            assert gc.get_threshold() == SERVING
            raise RuntimeError("the block failed")
    assert gc.get_threshold() == before
