"""vLLM's own log lines go to a file, so the console keeps the pipeline's progress bars and summaries.

vLLM configures its `vllm` logger when it is imported, and each engine-core process it spawns does the same
from `VLLM_LOGGING_CONFIG_PATH`. Inside `vllm_log_file(path)` both write INFO and above to `path`: this
process by swapping the logger's handlers, the engine processes through the variable they inherit. On an
error the log's path is printed, so the cause is one `tail` away.

    with vllm_log_file(run_dir / "logs" / "export_verify.log"):
        llm = vllm.LLM(...)
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


@contextmanager
def vllm_log_file(path: Path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config_path = path.with_name(f".{path.name}.logging.json")
    config_path.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"vllm": {"format": FORMAT}},
                "handlers": {
                    "file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "vllm"}
                },
                "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
            }
        )
    )
    previous_env = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    logger = logging.getLogger("vllm")
    previous = (logger.handlers[:], logger.propagate, logger.level)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        yield path
    except BaseException:
        print(f"vLLM's log: {path}", file=sys.stderr, flush=True)
        raise
    finally:
        logger.handlers, logger.propagate = previous[0], previous[1]
        logger.setLevel(previous[2])
        handler.close()
        if previous_env is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        else:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = previous_env
