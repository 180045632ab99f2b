"""How stages start on many devices: the process group's collective timeout is the pipeline's setting, not
NCCL's 10-minute default; each rank's engine takes its devices from the list the user made visible."""

import os
from datetime import timedelta

import pytest
from accelerate.utils import InitProcessGroupKwargs

import target.launch
from target.launch import engine_devices, make_accelerator, rank_devices
from tests.helpers import smoke_config


def test_the_process_group_waits_as_long_as_the_config_says(monkeypatch, tmp_path):
    seen = {}
    real = target.launch.Accelerator

    def recording(*args, **kwargs):
        seen["handlers"] = kwargs["kwargs_handlers"]
        return real(*args, **kwargs)

    monkeypatch.setattr(target.launch, "Accelerator", recording)
    cfg = smoke_config(tmp_path)
    assert cfg.process_group_timeout_s >= 3600  # hours of uneven regeneration between ranks
    make_accelerator(cfg.process_group_timeout_s)
    (group,) = [h for h in seen["handlers"] if isinstance(h, InitProcessGroupKwargs)]
    assert group.timeout == timedelta(seconds=cfg.process_group_timeout_s)


def test_ranks_take_their_share_of_the_users_devices():
    assert rank_devices(1, 2, "4,5,6,7") == "6,7"  # TP2: rank 1 gets the 3rd and 4th visible GPUs
    assert rank_devices(0, 1, "3") == "3"  # a run pinned to GPU 3 serves on GPU 3
    assert rank_devices(1, 4, None) == "4,5,6,7"  # nothing set: every device of the node is the user's
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=0,1,2: local rank 1 needs devices 2..3"):
        rank_devices(1, 2, "0,1,2")


@pytest.mark.parametrize("user", ["4,5,6,7", None])
def test_an_engine_sees_its_devices_and_the_user_gets_the_list_back(monkeypatch, user):
    if user is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", user)
    for rank, expected in [(1, "6,7" if user else "2,3"), (0, "4,5" if user else "0,1")]:  # two engines
        with engine_devices(rank, 2):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == user
