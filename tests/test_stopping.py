import os
import signal

import pytest

from jaxrl.run.stopping import GracefulStop, Interrupted


def test_first_signal_asks_to_stop_second_stops_now_and_handlers_are_restored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the next bytecode of this thread
        assert stop.requested and stop.signal is signal.SIGTERM
        # The checkpoint does not exist yet: the line says it is to come.
        assert capsys.readouterr().err.strip() == ("jaxrl train: SIGTERM: stopping after this step (its checkpoint "
                                                   "will be written); again to stop now")
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)
        assert e.value.signal is signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is before
