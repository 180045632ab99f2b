"""The process group's collective timeout is the pipeline's setting, not NCCL's 10-minute default."""

from datetime import timedelta

from accelerate.utils import InitProcessGroupKwargs

import target.launch
from target.launch import make_accelerator
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
