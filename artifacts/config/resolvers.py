"""The OmegaConf resolvers the YAML under `conf/` uses, registered once when this module is imported
(`import artifacts.config` does): `${smoke_data:..}`, `${sharegpt_json:}`, `${agent_data:num,seed}`
and `${long_data:num}` (the embedded data, artifacts/agent_data.py and artifacts/long_data.py),
`${machine_dtype:..}` and `${machine_precision:..}` (half precision only where this machine computes it)
and `${plus_one:..}` (head.block_size's default).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


def _package_file(name: str) -> str:
    return str(Path(__file__).parent.parent / "smoke_data" / name)


def _sharegpt_json() -> str:
    from artifacts.assets import sharegpt_json_path

    return str(sharegpt_json_path())


def half_precision_computes_here() -> bool:
    """Whether this machine has arithmetic for bfloat16 and float16: a GPU, a non-x86 CPU, or an x86 CPU
    with AVX512-BF16 or AMX. An x86 CPU without them (AVX2 only) emulates half precision, several times
    slower than float32: measured on a 2-core AVX2 EPYC, vLLM regenerates at ~20 tok/s in bf16 against ~100
    in fp32, and a P-EAGLE training step of the main job takes ~45 s under bf16 autocast against ~2.3 s in
    fp32 (docs/benchmarks.md#half-precision-on-a-cpu-without-it)."""
    import platform

    import torch

    if torch.cuda.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def machine_dtype(wanted: str) -> str:
    """`${machine_dtype:bfloat16}`: `wanted`, or float32 where half precision does not compute natively."""
    return wanted if half_precision_computes_here() else "float32"


def machine_precision(wanted: str) -> str:
    """`${machine_precision:bf16}` (train.mixed_precision): `wanted`, or no autocast where half precision
    does not compute natively."""
    return wanted if half_precision_computes_here() else "no"


def plus_one(value) -> int:
    """`${plus_one:${export.num_speculative_tokens}}` (head.block_size's default): the block of k + 1 (at
    least 2, so that a k below 1 is refused as export.num_speculative_tokens, not as the block it implies)."""
    return max(int(value) + 1, 2)


# `${smoke_data:conversations.jsonl}` and `${sharegpt_json:}` in conf/data/*.yaml; `${machine_dtype:bfloat16}`
# in conf/target/*.yaml, `${machine_precision:bf16}` as train.mixed_precision's default and `${plus_one:..}`
# as head.block_size's.
def _chat_template(name: str) -> str:
    """`${chat_template:smollm2_tools.jinja}`: a chat template of the project's own, under conf/templates/."""
    return str(Path(__file__).parent.parent.parent / "conf" / "templates" / name)


def _agent_data(num, seed, layout="conversations") -> str:
    from artifacts.agent_data import agent_data_path

    return agent_data_path(num, seed, layout)


def _long_data(num, kind="mixed") -> str:
    from artifacts.long_data import long_data_path

    return long_data_path(num, kind)


OmegaConf.register_new_resolver("smoke_data", _package_file, replace=True)
OmegaConf.register_new_resolver("agent_data", _agent_data, replace=True)
OmegaConf.register_new_resolver("long_data", _long_data, replace=True)
OmegaConf.register_new_resolver("chat_template", _chat_template, replace=True)
OmegaConf.register_new_resolver("sharegpt_json", _sharegpt_json, replace=True)
OmegaConf.register_new_resolver("machine_dtype", machine_dtype, replace=True)
OmegaConf.register_new_resolver("machine_precision", machine_precision, replace=True)
OmegaConf.register_new_resolver("plus_one", plus_one, replace=True)
