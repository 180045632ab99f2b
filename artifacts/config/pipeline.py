"""The whole config: `PipelineConfig` (one node per stage's settings), its registration in Hydra's
ConfigStore, `check_config` (every check, before any stage starts work) and `compose` (the config a stage's
main.py gets, for tests and scripts).

A run is one experiment file plus a few overrides, e.g.
`python data_prep/main.py experiment=smoke run_dir=/tmp/smoke`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from artifacts.config.checks import POSITIVE, checked, field_errors, unknown_keys
from artifacts.config.combinations import check_combinations
from artifacts.config.schema_data_prep import (
    CacheConfig,
    CaptureConfig,
    DataConfig,
    RegenConfig,
    RenderConfig,
    TargetConfig,
)
from artifacts.config.schema_export_eval import EvalConfig, ExportConfig, WatchConfig
from artifacts.config.schema_train import GridConfig, HeadConfig, OnPolicyConfig, OptimConfig, TrainConfig


@dataclass
class PipelineConfig:
    """One config for every stage, so one experiment file and the same overrides drive them all."""

    run_dir: str = MISSING  # run directory shared by all stages (cache/, ckpt/, head/, report/)
    seed: int = 0  # seed for anything random
    # how long a rank waits for the others at a collective: ranks finish hours of regeneration or caching
    # minutes to hours apart, and NCCL's default (10 minutes) would kill the job at the barrier
    process_group_timeout_s: float = checked(6 * 3600.0, POSITIVE)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)


def check_config(cfg: DictConfig) -> None:
    """Refuse, naming the key, what the schema does not know (an override added with `+` is otherwise
    accepted and silently ignored), values no stage can use (each field's check, declared beside it) and
    settings wrong together - before any stage starts work."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError(
            f"unknown config keys {unknown}: not settings of any stage (a typo? every key is in "
            "artifacts/config/)"
        )
    field_errors(cfg)
    check_combinations(cfg)


def register_configs() -> None:
    """Register the schemas so YAML under conf/ is type-checked against them."""
    cs = ConfigStore.instance()
    cs.store(name="pipeline_schema", node=PipelineConfig)


CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a stage's main.py would get for these command-line overrides (for tests and scripts)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
