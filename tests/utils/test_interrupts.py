"""A Ctrl-C that a finalizer swallows still stops a command at the next safe point."""
import gc
import os
import signal

import pytest

from rotarium.utils.interrupts import interrupts_recorded, raise_if_interrupted


class _Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # Python raises the KeyboardInterrupt here, and ignores it


@pytest.fixture
def foreground_sigint():
    """Python's own SIGINT handler, as in a command started in the foreground: a test runner that a shell started in
    the background passes SIGINT on ignored, and then nothing is recorded, as in any such process."""
    original = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, original)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigint_raised_inside_a_finalizer_is_raised_again_at_the_next_check(foreground_sigint):
    before = signal.getsignal(signal.SIGINT)
    with interrupts_recorded():
        _Finalized()
        gc.collect()  # the interrupt is lost here: this line returns
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # once
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


def test_without_a_sigint_nothing_is_raised_and_outside_nothing_is_recorded():
    with interrupts_recorded():
        raise_if_interrupted()
    raise_if_interrupted()
