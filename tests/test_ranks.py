"""ranks: the one-line account of a rank whose peer process is gone."""

from __future__ import annotations

import pytest

from dapo_lightning.ranks import lost_rank

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:13747: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)


@pytest.mark.parametrize(
    ("rank", "world", "expected"),
    [
        (0, 2, "rank 0 lost rank 1 of 2"),
        (1, 2, "rank 1 lost rank 0 of 2"),
        (3, 4, "rank 3 lost the rank at 127.0.0.1:13747"),
    ],
)
def test_a_reset_connection_names_the_lost_rank(rank, world, expected):
    """The gloo text of a peer killed mid-collective (tests/test_long_runs.py makes it for
    real); with 2 ranks the lost one is the other, else the error's peer address."""
    assert lost_rank(RuntimeError(GLOO_RESET), rank, world) == expected


def test_other_errors_are_not_a_lost_rank():
    assert lost_rank(RuntimeError("CUDA out of memory"), 0, 2) is None
    assert lost_rank(ValueError("Connection reset by peer"), 0, 2) is None  # not a collective's
