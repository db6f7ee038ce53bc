"""The stop handlers (dapo_lightning/interrupt.py, issue 63 items 1-3) with real signals sent
to this process: every catchable stop signal is a stop request with its own exit status, a
signal while stopping never aborts the save, Ctrl-C aborts only after a Ctrl-C."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dapo_lightning import interrupt
from dapo_lightning.interrupt import (
    STOP_SIGNALS,
    AbortRequested,
    exit_on_stop,
    install_stop_handlers,
    saving,
    stop_requested,
)


def _send(sig: signal.Signals) -> None:
    """A real signal to this process; its handler runs before this returns."""
    os.kill(os.getpid(), sig)
    time.sleep(0.05)


@pytest.fixture(autouse=True)
def _handlers_put_back():
    """Each test's handlers and stop state are undone after it (pytest keeps its own)."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    interrupt.clear_stop_request()
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2],
    ids=lambda s: s.name,
)
def test_each_stop_signal_is_a_stop_request_exiting_128_plus_its_number(sig, capfd):
    """SIGHUP (a closed terminal) and SIGUSR1 outside SLURM ended the process at once (exit
    129 / 138, nothing saved); every catchable stop signal now records a request, said in one
    line, and the stopped block exits 128 + its number."""
    with pytest.raises(SystemExit) as exit_info, exit_on_stop():
        restore = install_stop_handlers()
        try:
            _send(sig)
            assert stop_requested() == sig.name
        finally:
            restore()
    assert exit_info.value.code == 128 + sig
    assert f"{sig.name} received: stopping at the next clean point" in capfd.readouterr().err


def test_a_second_signal_while_stopping_is_ignored_with_one_line(capfd):
    """A SIGTERM, then SIGTERM, SIGHUP and SIGINT (a launcher, then the user): the first
    stop stands (exit 143), a SIGINT after a SIGTERM does not abort, one line says the rest
    were ignored."""
    with pytest.raises(SystemExit) as exit_info, exit_on_stop():
        restore = install_stop_handlers()
        try:
            for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                _send(sig)
        finally:
            restore()
    assert exit_info.value.code == 143
    err = capfd.readouterr().err
    assert err.count("received while stopping: ignored; the stop goes on.") == 1, err


def test_ctrl_c_twice_aborts_but_not_inside_the_save(capfd):
    """Ctrl-C pressed again aborts the update under way (AbortRequested, exit 130); inside
    the stop's save (``saving``) it is ignored and the save goes on."""
    restore = install_stop_handlers()
    try:
        _send(signal.SIGINT)
        with saving():
            _send(signal.SIGINT)  # ignored: nothing raised inside the save
            _send(signal.SIGTERM)
        with pytest.raises(AbortRequested):
            _send(signal.SIGINT)
    finally:
        restore()
    assert "the save under way finishes first" in capfd.readouterr().err


def test_handlers_stay_after_restore_while_a_stop_is_under_way():
    """The guard gives its handlers back after its save; while the stop is under way a late
    signal must neither kill the process (SIG_DFL) nor change its exit status. After the
    block the handlers are the ones it found (Ctrl-C is Ctrl-C again)."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exit_info, exit_on_stop():
        restore = install_stop_handlers()
        _send(signal.SIGHUP)
        restore()  # the guard's teardown: the stop is under way, ours stay
        _send(signal.SIGTERM)  # SIG_DFL would end the process
        _send(signal.SIGINT)
    assert exit_info.value.code == 129
    assert signal.getsignal(signal.SIGINT) is before
