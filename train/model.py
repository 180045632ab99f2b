"""The model train fits: a draft head of `head.kind` (heads/), sized from the target and the cache and
initialised as the recipe says, wrapped with its loss (train/losses/) in one module so that DDP and
DeepSpeed see a single forward.

    draft = build_draft(cfg, target_config, cache_manifest, vocab)
    model = DraftWithLoss(draft, target_lm_head_VH, vocab.draft_to_target, cfg)
    loss, metrics = model(batch, denominators)    # denominators [K]: each depth's predictions
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

import heads.attention
from artifacts.config import trained_block_lengths, trained_depths
from heads.dflash import DFlashConfig, DFlashDraft
from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.eagle3 import NORM_FLAGS, Eagle3Config, Eagle3Draft
from heads.head_file import HeadRecord
from heads.kinds import head_kind
from target.model import load_final_norm
from train.losses import (
    Anchors,
    Blocks,
    Dpace,
    block_loss,
    cod_anchors,
    depth_predictions,
    eagle1_loss,
    loss_weights,
    parallel_loss,
    sample_blocks,
    sample_generators,
    slot_predictions,
    ttt_loss,
)
from train.objectives import parse_objective


class DraftWithLoss(torch.nn.Module):
    """The head plus its objective in one forward, so DDP / DeepSpeed see a single module call.

    EAGLE-3: the TTT loss. P-EAGLE: the parallel-drafting loss, with COD subsampling while training only
    (held-out metrics see every anchor). DFlash: the block loss, blocks of random lengths in
    [head.min_block_size, head.block_size] while training and of the served length
    (export.num_speculative_tokens + 1) for held-out metrics. What is drawn at random (anchors, block
    lengths) is drawn per sample (`draw`) before the forward, so that the trainer can count every depth's
    predictions over the global batch first (`prediction_counts`): each depth's loss is their mean.
    `head.aux_noise` perturbs the aux states while training only.
    EAGLE-1: feature regression + soft CE, reported as one step (loss_0, acc_0) so the loop treats all
    alike. The losses: train/losses/.
    """

    def __init__(
        self, draft, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor, cfg, cache_layer_ids=None
    ):
        super().__init__()
        # The cache's aux states this head reads (head.aux_layer_ids, a subset of the cache's; None: all).
        read = getattr(draft, "target_layer_ids", None)
        self.aux_index = (
            None if not read or cache_layer_ids is None or read == list(cache_layer_ids)
            else [list(cache_layer_ids).index(i) for i in read]
        )  # fmt: skip
        self.draft, self.kind, self.head_cfg = draft, cfg.head.kind, cfg.head
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        self.register_buffer("draft_to_target", draft_to_target, persistent=False)
        self.num_steps, self.chunk_size = num_loss_steps(cfg), cfg.train.teacher_chunk_size
        self.seed = cfg.seed
        self.objective = parse_objective(
            cfg.train.loss, cfg.train.lk_eta, cfg.train.alpha_on, cfg.train.fused_loss
        )
        self.dpace = (
            Dpace(cfg.head.dpace_a, cfg.head.dpace_norm) if cfg.head.position_weights == "dpace" else None
        )
        # The attention kernel is the process's (heads/attention.py KERNEL): every head this process trains
        # or evaluates attends through the one configured here.
        heads.attention.KERNEL = cfg.train.attention
        if cfg.train.compile:
            compile_layers(draft)
        if self.kind == "dflash":
            self.trained_lengths = trained_block_lengths(cfg.head)
            self.served_length = cfg.export.num_speculative_tokens + 1

    def draw(self, batch: dict) -> list[Anchors | None] | Blocks | None:
        """The random choices of this batch's loss (P-EAGLE's COD anchors, DFlash's blocks; None for the
        others), per sample from the batch's `draw_seeds`, or from the run's seed for held-out metrics."""
        generator = None if self.training else torch.Generator().manual_seed(self.seed)
        if self.kind == "peagle":
            ratio = self.head_cfg.cod_ratio if self.training else 1.0
            return cod_anchors(batch, self.num_steps, ratio, sample_generators(batch, generator))
        if self.kind == "dflash":
            lengths = self.trained_lengths if self.training else (self.served_length,) * 2
            return sample_blocks(
                batch, self.head_cfg.num_anchors, lengths, sample_generators(batch, generator)
            )
        return None

    def prediction_counts(self, batch: dict, draws) -> torch.Tensor:
        """[K] int64: the predictions each depth's loss is a mean over (`depth_predictions`,
        `slot_predictions`), in this batch with these draws."""
        if self.kind == "dflash":
            counts = [slot_predictions(batch, draws, k)[1].sum() for k in range(self.num_steps)]
        else:
            anchors = draws if self.kind == "peagle" else [None] * self.num_steps
            counts = [depth_predictions(batch, k, anchors[k]).sum() for k in range(self.num_steps)]
        return torch.stack(counts)

    def forward(self, batch, denominators=None, draws=None):
        """(loss, metrics): each depth's loss the sum over its predictions divided by denominators[k], or
        their mean in this batch when None; `draws` from `draw` (None: drawn here)."""
        if draws is None:
            draws = self.draw(batch)
        if self.aux_index is not None:
            batch = {**batch, "aux_hidden": batch["aux_hidden"][:, :, self.aux_index]}
        if self.training and self.head_cfg.aux_noise and "aux_hidden" in batch:
            aux = batch["aux_hidden"].float()
            noise = (torch.rand_like(aux) * 2 - 1) * self.head_cfg.aux_noise
            batch = {**batch, "aux_hidden": aux + noise}
        if self.kind == "peagle":
            return parallel_loss(
                self.draft, batch, self.num_steps, self.head_cfg.gamma, self.target_lm_head,
                self.draft_to_target, self.chunk_size, denominators, draws, self.objective, self.dpace,
            )  # fmt: skip
        if self.kind == "dflash":
            return block_loss(
                self.draft, batch, loss_weights(self.head_cfg, self.num_steps), self.target_lm_head,
                self.draft_to_target, self.chunk_size, denominators, draws, self.objective, self.dpace,
            )  # fmt: skip
        if self.kind == "eagle3":
            return ttt_loss(
                self.draft, batch, self.num_steps, self.head_cfg.gamma, self.target_lm_head,
                self.draft_to_target, self.chunk_size, denominators, self.objective, self.dpace,
            )  # fmt: skip
        total, metrics = eagle1_loss(
            self.draft, batch, self.target_lm_head, self.chunk_size, noise_range=self.head_cfg.eagle1_noise,
            ce_weight=self.head_cfg.eagle1_ce_weight, add_noise=self.training, objective=self.objective,
        )  # fmt: skip
        num_valid = metrics["num_valid"]
        if (
            denominators is not None
        ):  # a mean over this batch's valid positions -> a sum over the global count
            total = total * num_valid / denominators[0]
        return total, {
            **{name: value for name, value in metrics.items() if name.endswith("_0")},  # acc, chains
            "loss_0": total.detach(),
            "loss_sum_0": metrics["loss"] * num_valid,
            "num_pred_0": num_valid,
            "num_valid_0": num_valid,
        }


def compile_layers(draft) -> None:
    """`train.compile`: each decoder layer's `project` (norms, q/k/v, RoPE) and `finish` (o_proj onto the
    residual, the norm and SwiGLU) under torch.compile, which fuses their elementwise work around the
    matmuls; the sequence length is dynamic (one graph for every batch shape). The attention between them
    (chunked or flex) and the loss rows run as they are."""
    for layer in draft.layers:
        layer.project = torch.compile(layer.project, dynamic=True)
        layer.finish = torch.compile(layer.finish, dynamic=True)


def check_rope_buffers(model: torch.nn.Module) -> None:
    """Refuse a head whose RoPE inverse frequencies are no longer fp32: DeepSpeed before 0.19.2 cast every
    buffer to bf16 with its bf16 mode, which rounds inv_freq and shifts every rotary angle (more at long
    positions) - the head would train against positions vLLM never serves."""
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq") and buffer.dtype != torch.float32:
            raise RuntimeError(
                f"{name} is {buffer.dtype} after accelerator.prepare, not float32: this DeepSpeed rounds the "
                "head's buffers to its half precision. Install deepspeed>=0.19.2 (pip install -e .[gpu])"
            )


def num_loss_steps(cfg) -> int:
    """Drafting depths the objective trains and reports: K for EAGLE-3 and P-EAGLE, a DFlash block's mask
    slots (block_size - 1), one for EAGLE-1."""
    if cfg.head.kind == "eagle1":
        return 1
    return trained_depths(cfg.head) or cfg.head.num_ttt_steps


def head_layer_ids(cfg, cache_manifest) -> list[int]:
    """The target layers the head reads: `head.aux_layer_ids`, which the cache must hold, or all the cache's
    (one cache can serve heads of several kinds: it holds the union, each head reads its own)."""
    cached = list(cache_manifest["aux_layer_ids"])
    if cfg.head.aux_layer_ids is None:
        return cached
    wanted = [int(i) for i in cfg.head.aux_layer_ids]
    if not wanted or not set(wanted) <= set(cached):
        raise ValueError(
            f"head.aux_layer_ids={wanted}: must be a non-empty subset of the cache's aux layers {cached}; "
            "change head.aux_layer_ids, or rebuild the cache with cache.aux_layer_ids holding them"
        )
    return wanted


def build_draft(cfg, target_config, cache_manifest, vocab):
    """A freshly initialised head of `head.kind`, sized from the target and the cache."""
    torch.manual_seed(cfg.seed)
    head_kind(cfg.head.kind)  # an unknown kind is refused naming head.kind
    layer_ids = head_layer_ids(cfg, cache_manifest)
    if (
        cfg.head.kind == "eagle1"
    ):  # its settings are checked with the config (artifacts/config/combinations.py)
        return Eagle1Draft(Eagle1Config.from_target_config(target_config))
    if cfg.head.kind == "dflash":
        config = DFlashConfig.from_target_config(
            target_config,
            aux_layer_ids=layer_ids,
            draft_vocab_size=vocab.draft_vocab_size,
            num_hidden_layers=cfg.head.num_layers,
            mask_token_id=mask_token_id(cfg, target_config),
            block_size=cfg.head.block_size,
            causal=cfg.head.causal,
            min_block_size=cfg.head.min_block_size,
        )
        return DFlashDraft(config)
    parallel = {}
    if cfg.head.kind == "peagle":
        parallel = {
            "num_hidden_layers": cfg.head.num_layers,
            "mask_token_id": mask_token_id(cfg, target_config),
        }
    config = Eagle3Config.from_target_config(
        target_config,
        aux_layer_ids=layer_ids,
        draft_vocab_size=vocab.draft_vocab_size,
        **{flag: bool(getattr(cfg.head, flag)) for flag in NORM_FLAGS},
        **parallel,
        sliding_window=cfg.head.sliding_window,
    )
    return Eagle3Draft(config)


@torch.no_grad()
def init_lm_head(cfg, draft, target_lm_head_VH: torch.Tensor, draft_to_target: torch.Tensor) -> None:
    """`head.lm_head_init` and `head.freeze_lm_head` (the heads with their own lm_head: all but EAGLE-1).

    `target`: the lm_head starts as the target's rows of the draft vocabulary and the final norm as the
    target's, so the head starts decoding as the target does (speculators' recipe; it freezes the rows).
    """
    if cfg.head.lm_head_init == "target":
        draft.lm_head.weight.copy_(target_lm_head_VH[draft_to_target].float())
        draft.norm.weight.copy_(load_final_norm(cfg.target))
    if cfg.head.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)


def mask_token_id(cfg, target_config) -> int:
    """P-EAGLE's and DFlash's mask token: `head.mask_token_id`, else the target's pad token, else its (first) eos token.

    An existing token, frozen: vLLM feeds the mask slots the target's own embedding of this id, so a learned
    mask embedding would mean shipping a whole embedding table; the learned `mask_hidden` (A*H wide,
    through `fc`) carries what the slots need to learn.
    """
    if cfg.head.mask_token_id is not None:
        return int(cfg.head.mask_token_id)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(target_config, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    raise ValueError(
        f"target {cfg.target.path}: its config names no pad or eos token; give P-EAGLE's mask token with "
        "head.mask_token_id=<token id>"
    )


CACHE_IDENTITY = ("aux_layer_ids", "tokenizer_hash", "dataset_fingerprint", "data_source", "num_samples",
                  "num_tokens", "regeneration", "chat_template_kwargs", "chat_template",
                  "num_samples_by_mode")  # fmt: skip


def head_record(
    cfg, draft, cache_dir, cache_manifest: dict, num_steps: int, steps_per_epoch: int, world: int, held_out
) -> HeadRecord:
    """draft_config.json of the final head: what it is, what it drafts for, what it was trained on and how."""
    return HeadRecord(
        kind=cfg.head.kind,
        config=draft.config,
        target={"path": str(cfg.target.path), "hash": cache_manifest["target_hash"]},
        cache={"path": str(cache_dir), **{k: cache_manifest.get(k) for k in CACHE_IDENTITY}},
        training={
            "num_steps": num_steps,
            "steps_per_epoch": steps_per_epoch,  # the epochs trained: num_steps / steps_per_epoch
            "num_processes": world,
            # Resolved within the whole config (head.block_size's default reads export.num_speculative_tokens).
            "settings": {
                key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("head", "optim", "train")
            },
            "held_out": held_out,
        },
    )
