"""Each data_prep rank's engine takes its devices from the list the user made visible (issue 33)."""

import pytest

from data_prep.regenerate import USER_DEVICES_ENV, select_devices


@pytest.fixture
def devices(monkeypatch):
    def set_visible(value):
        monkeypatch.delenv(USER_DEVICES_ENV, raising=False)
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)

    return set_visible


def visible_after(local_rank, count=1):
    import os

    select_devices(local_rank, count)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def test_ranks_take_their_share_of_the_users_devices(devices):
    devices("4,5,6,7")
    assert visible_after(1, 2) == "6,7"  # TP2: rank 1 gets the 3rd and 4th visible GPUs
    assert visible_after(0, 2) == "4,5"  # a second engine in the same process counts from the user's list
    devices("3")
    assert visible_after(0) == "3"  # a run pinned to GPU 3 serves on GPU 3
    devices(None)
    assert visible_after(1, 4) == "4,5,6,7"  # nothing set: every device of the node is the user's


def test_too_few_visible_devices_is_refused_naming_the_list(devices):
    devices("0,1,2")
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=0,1,2: local rank 1 needs devices 2..3"):
        select_devices(1, 2)
