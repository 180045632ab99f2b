"""Typed config schemas for every stage, registered in Hydra's ConfigStore, with the checks a composed
config goes through before any stage starts work.

YAML under `conf/` holds values only; these dataclasses say what each field is and check its type.
A run is one experiment file plus a few overrides, e.g.
`python data_prep/main.py experiment=smoke run_dir=/tmp/smoke`.

Where each concern lives (every public name is re-exported here: `from artifacts.config import X`):
- `checks.py`: the check machinery - `Check`, `checked(...)` (a field with its check beside it), the
  validators (`POSITIVE`, `NON_NEGATIVE`, `one_of`, `within`, ...), train.loss's grammar (`loss_terms`),
  `refuse` (how a bad value is reported), and the walkers `field_errors` and `unknown_keys`.
- `schema_data_prep.py`: data_prep's schemas - `TargetConfig`, `DataConfig` / `DataSourceConfig`,
  `RenderConfig`, `RegenConfig`, `CaptureConfig`, `CacheConfig` (and `DEFAULT_ROLE_MAP`).
- `schema_train.py`: `HeadConfig`, `OptimConfig`, `TrainConfig`, `GridConfig`.
- `schema_export_eval.py`: `ExportConfig`, `EvalHeadConfig`, `WorkloadConfig`, `EvalConfig`, `WatchConfig`.
- `combinations.py`: checks across settings (`check_combinations`, `check_data`) and the facts they rest
  on (`trained_ks`, `dflash_trained_ks`, `export_format_setting`, `sglang_refusal`, ...).
- `resolvers.py`: the `${...}` resolvers of conf/ (`machine_dtype`, `machine_precision`, `plus_one`,
  `smoke_data`, `sharegpt_json`), registered with OmegaConf once, when this package is imported.
- `pipeline.py`: `PipelineConfig` (the root schema), `register_configs` (Hydra's ConfigStore),
  `check_config` (every check) and `compose` (the config a stage's main.py would get).

Imports point down: the schemas and combinations import checks; pipeline imports them all; nothing in the
package imports this file's names.
"""

from artifacts.config.checks import (
    DIVERGENCES,
    DTYPE,
    HEAD_KINDS,
    NON_EMPTY,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_LIST,
    RECORD_FORMAT,
    RECORD_FORMATS,
    REPORT_TO,
    RESUME,
    TEMPERATURES,
    WANDB_MODE,
    Check,
    checked,
    field_errors,
    loss_terms,
    one_of,
    optional,
    refuse,
    unknown_keys,
    within,
)
from artifacts.config.combinations import (
    EAGLE3_NORMS,
    EAGLE3_ONLY,
    ROLES,
    check_combinations,
    check_data,
    dflash_trained_ks,
    export_format_setting,
    sglang_refusal,
    source_entries,
    trained_block_lengths,
    trained_depths,
    trained_ks,
)
from artifacts.config.pipeline import CONF_DIR, PipelineConfig, check_config, compose, register_configs
from artifacts.config.resolvers import (
    half_precision_computes_here,
    machine_dtype,
    machine_precision,
    plus_one,
)
from artifacts.config.schema_data_prep import (
    DEFAULT_ROLE_MAP,
    CacheConfig,
    CaptureConfig,
    DataConfig,
    DataSourceConfig,
    RegenConfig,
    RenderConfig,
    TargetConfig,
)
from artifacts.config.schema_export_eval import (
    EvalConfig,
    EvalHeadConfig,
    ExportConfig,
    WatchConfig,
    WorkloadConfig,
)
from artifacts.config.schema_train import GridConfig, HeadConfig, OptimConfig, TrainConfig

__all__ = [
    "CONF_DIR",
    "DEFAULT_ROLE_MAP",
    "DIVERGENCES",
    "DTYPE",
    "EAGLE3_NORMS",
    "EAGLE3_ONLY",
    "HEAD_KINDS",
    "NON_EMPTY",
    "NON_NEGATIVE",
    "POSITIVE",
    "POSITIVE_LIST",
    "RECORD_FORMAT",
    "RECORD_FORMATS",
    "REPORT_TO",
    "RESUME",
    "ROLES",
    "TEMPERATURES",
    "WANDB_MODE",
    "CacheConfig",
    "CaptureConfig",
    "Check",
    "DataConfig",
    "DataSourceConfig",
    "EvalConfig",
    "EvalHeadConfig",
    "ExportConfig",
    "GridConfig",
    "HeadConfig",
    "OptimConfig",
    "PipelineConfig",
    "RegenConfig",
    "RenderConfig",
    "TargetConfig",
    "TrainConfig",
    "WatchConfig",
    "WorkloadConfig",
    "check_combinations",
    "check_config",
    "check_data",
    "source_entries",
    "checked",
    "compose",
    "dflash_trained_ks",
    "export_format_setting",
    "field_errors",
    "half_precision_computes_here",
    "loss_terms",
    "machine_dtype",
    "machine_precision",
    "one_of",
    "optional",
    "plus_one",
    "refuse",
    "register_configs",
    "sglang_refusal",
    "trained_block_lengths",
    "trained_depths",
    "trained_ks",
    "unknown_keys",
    "within",
]
