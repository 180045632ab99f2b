"""Config schemas of the training settings: `head` (the draft head's kind and recipe), `optim`, `train`,
and `grid` (recipes trained side by side on one cache, conf/grid/).

Each field's check is declared beside it (artifacts/config/checks.py); settings wrong together are refused
by artifacts/config/combinations.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from artifacts.config.checks import (
    DIVERGENCES,
    HEAD_KINDS,
    NON_NEGATIVE,
    POSITIVE,
    REPORT_TO,
    RESUME,
    WANDB_MODE,
    Check,
    _is_loss,
    checked,
    one_of,
    optional,
    within,
)


@dataclass
class HeadConfig:
    # eagle3 | peagle (EAGLE-3 with parallel drafting) | dflash (block drafting) | eagle1
    kind: str = checked("eagle3", one_of(*HEAD_KINDS))
    # EAGLE-3 / P-EAGLE normalisation flags (speculators' names and vLLM's meaning; false = original recipe):
    norm_before_residual: bool = False  # the layer's residual is the normed hidden state, not the raw one
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc
    norm_output: bool = False  # a chain's next step reads the post-norm output (EAGLE-3 TTT; P-EAGLE: unused)
    # random | target: lm_head = the target's rows of the draft vocab, norm its
    lm_head_init: str = checked("random", one_of("random", "target"))
    freeze_lm_head: bool = False  # keep lm_head fixed (with lm_head_init=target: the target's rows)
    # training adds U(-aux_noise, aux_noise) to the aux states (speculators: 0.05)
    aux_noise: float = checked(0.0, NON_NEGATIVE)
    # EAGLE-3: training-time-test steps K of the rollout (draft positions trained)
    num_ttt_steps: int = checked(7, POSITIVE)
    # P-EAGLE: parallel depths trained (mask slots + 1); serve k <= this
    num_depths: int = checked(3, POSITIVE)
    # the loss of draft position k (TTT step or parallel depth) weighs gamma^k
    gamma: float = checked(0.8, within(0, 1, low_closed=False))
    num_layers: int = checked(1, POSITIVE)  # P-EAGLE / DFlash decoder layers (EAGLE-3's TTT drives one)
    # EAGLE-3 / P-EAGLE: sliding-window draft attention over the last N positions (vLLM 0.32 serves it from
    # the export's `layer_types` / `sliding_window`); more than the drafted k; None: full attention
    sliding_window: int | None = checked(None, optional(Check(lambda v: v >= 2, ">= 2")))
    # the cache's aux layers this head reads (vLLM ids, a subset of cache.aux_layer_ids; None: all of them):
    # one cache holding the union serves heads of several kinds (e.g. EAGLE-3's 3 layers and DFlash's 5)
    aux_layer_ids: list[int] | None = None
    # P-EAGLE / DFlash mask slots' token (None: the target's pad, else eos token)
    mask_token_id: int | None = None
    # P-EAGLE: depth d >= 1 trains on ~T*ratio^d anchors (COD); 1.0 keeps all
    cod_ratio: float = checked(1.0, within(0, 1, low_closed=False))
    # DFlash: tokens per block, the anchor and block_size - 1 mask slots (the longest block trained); by
    # default the block served at export.num_speculative_tokens (docs/dflash.md#served-k: measured best)
    block_size: int = checked(
        "${plus_one:${export.num_speculative_tokens}}", Check(lambda v: v is not None and v >= 2, ">= 2")
    )
    # DFlash: each block trained is uniformly min_block_size..block_size long, so that a bidirectional head
    # serves every k = length - 1 as trained (None: full blocks only, served at k = block_size - 1 alone)
    min_block_size: int | None = checked(None, optional(Check(lambda v: v >= 2, ">= 2")))
    num_anchors: int = checked(512, POSITIVE)  # DFlash: random anchors (blocks) per sequence and step
    # DFlash: mask slot k's loss weighs exp(-(k-1)/loss_decay) (the paper: 7 for block 16, 4 for block 8)
    loss_decay: float = checked(4.0, POSITIVE)
    # decay (DFlash slot k weighs exp(-(k-1)/loss_decay), TTT step / P-EAGLE depth k gamma^k) | dpace (each
    # prediction of a draft chain - block, TTT steps, depths - weighs the draft's chance to reach it and those
    # after it: D-PACE, train/objectives.py dpace_weights)
    position_weights: str = checked("decay", one_of("decay", "dpace"))
    dpace_a: float = checked(0.5, within(0, 1))  # D-PACE's floor a in c~ = (1 - a) c + a
    # D-PACE's total: position (each position's weighted sum over its own count of predictions, summed) | all
    # (every position's weighted sum over the count of all predictions: speculators, the D-PACE reference)
    dpace_norm: str = checked("position", one_of("position", "all"))
    causal: bool = False  # DFlash: causal attention inside a block (default: bidirectional, as served)
    eagle1_noise: float = checked(0.1, NON_NEGATIVE)  # EAGLE-1: input features get U(-noise, noise)
    # EAGLE-1: weight of the soft cross-entropy next to SmoothL1
    eagle1_ce_weight: float = checked(0.1, NON_NEGATIVE)


@dataclass
class OptimConfig:
    lr: float = checked(1e-4, POSITIVE)  # peak learning rate (SpecForge's; the official recipe uses 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = checked(0.0, NON_NEGATIVE)  # AdamW weight decay
    # fraction of the optimizer steps spent warming up linearly
    warmup_ratio: float = checked(0.015, within(0, 1, high_closed=False))
    # cosine decays towards lr * min_lr_ratio (reached after the last step)
    min_lr_ratio: float = checked(0.0, within(0, 1))
    max_grad_norm: float = checked(0.5, POSITIVE)  # gradient-norm clip


@dataclass
class TrainConfig:
    num_epochs: int = checked(1, POSITIVE)  # passes over the cache's train split
    # stop after this many optimizer steps (the schedule is sized to it)
    max_steps: int | None = checked(None, optional(POSITIVE))
    # train on the cache's first N train samples only (data-scaling runs)
    num_samples: int | None = checked(None, optional(POSITIVE))
    batch_size: int = checked(4, POSITIVE)  # rows per micro-batch per process: a sample each, or packed
    # null: one sample a row, padded to the micro-batch's longest; N: rows packing as many samples as fit in
    # N tokens (at least render.max_length), each seeing only itself: no padding between them is computed
    pack_length: int | None = checked(None, optional(POSITIVE))
    gradient_accumulation_steps: int = checked(1, POSITIVE)  # micro-batches per optimizer step
    # no | bf16 | fp16 (fp32 master weights either way); default bf16, or no on a CPU without bf16 arithmetic
    mixed_precision: str = checked("${machine_precision:bf16}", one_of("no", "bf16", "fp16"))
    # the target's hidden states: cache (read from data_prep's cache) | online (the frozen target runs on
    # each micro-batch beside the head; the cache needs cache.hidden_states=false)
    features: str = checked("cache", one_of("cache", "online"))
    # what each prediction minimises (train/objectives.py): kl | rkl | tv | nla | lk, or a weighted sum such
    # as "0.1*kl+0.9*tv"
    loss: str = checked(
        "kl", Check(_is_loss, f"one of {', '.join(DIVERGENCES)} or a weighted sum (0.1*kl+0.9*tv)")
    )
    lk_eta: float = checked(3.0, NON_NEGATIVE)  # LK: lambda = exp(-lk_eta * alpha) per token
    # the p of alpha in tv, nla and lk: target (the target's own probabilities of the draft tokens, as vLLM
    # accepts and SpecForge's LK: held out +0.4-0.8% at T=0 with nla, two seeds each) | draft_vocab (the
    # teacher renormalised over the draft vocabulary, as speculators; docs/recipe.md#temperature)
    alpha_on: str = checked("target", one_of("target", "draft_vocab"))
    # the draft's loss rows (lm_head, log-softmax, objective) computed chunk by chunk with their gradients in
    # the forward, nothing recomputed in backward (train/losses/rows.py fused_rows); false: checkpointed
    # chunks, recomputed in backward (also the path under ZeRO-3, whose sharded weights it cannot take)
    fused_loss: bool = True
    # the kernel of the head's attention calls but a plain causal pass (heads/attention.py KERNEL): chunked
    # (dense query chunks of bounded scores, checkpointed; any device) | flex (PyTorch's FlexAttention over a
    # block mask, compiled: no scores kept; CUDA only, its backward has no CPU kernel)
    attention: str = checked("chunked", one_of("chunked", "flex"))
    # each decoder layer's projections and MLP (norms, q/k/v, RoPE; o_proj, SwiGLU) under torch.compile
    # (Inductor: Triton on CUDA, C++ on a CPU), the sequence length dynamic (train/model.py compile_layers)
    compile: bool = False
    # tokens per full-vocab teacher logits chunk (memory bound)
    teacher_chunk_size: int = checked(2048, POSITIVE)
    log_every: int = checked(10, POSITIVE)  # status line (and W&B point) every N optimizer steps
    eval_every: int = checked(100, NON_NEGATIVE)  # held-out eval every N optimizer steps (0: only at the end)
    save_every: int = checked(200, NON_NEGATIVE)  # checkpoint every N optimizer steps (0: only at the end)
    keep_last: int = checked(2, POSITIVE)  # checkpoints kept
    # never | always (continue from the newest checkpoint; error without one) | auto
    resume: str = checked("never", RESUME)
    resume_changed: bool = False  # resume although trajectory settings differ from the checkpoint's (logged)
    init_from: str | None = None  # warm start: a final head directory or a checkpoint directory
    # none | wandb (W&B through accelerate; offline mode needs no account)
    report_to: str = checked("none", REPORT_TO)
    wandb_project: str = "eagle-heads"  # W&B project name
    wandb_mode: str = checked("offline", WANDB_MODE)  # offline | online
    # torch CPU threads per process (None: torch's default)
    num_threads: int | None = checked(None, optional(POSITIVE))
    # supervised (the head on the cache's target answers) | on_policy (then on its own drafts: rollouts and
    # replay from a supervised head, train/on_policy.py; settings under on_policy.*)
    stage: str = checked("supervised", one_of("supervised", "on_policy"))


@dataclass
class OnPolicyConfig:
    """train.stage=on_policy (train/on_policy.py, docs/design.md#on-policy-training): from a supervised head,
    rounds of rollouts (the target decodes training prompts with the head drafting, greedy or sampled,
    through the reference decoder) and replay (the head drafts again from the rollouts' anchors and is
    trained against the target's distribution at its drafts: train/losses/replay.py)."""

    # where the stage writes its head, checkpoints and rollouts (None: <run_dir>/on_policy); export and eval
    # read its head with export.head_dir=<out_dir>/draft_head
    out_dir: str | None = None
    # the supervised head it starts from (None: <run_dir>/draft_head)
    init_from: str | None = None
    num_iterations: int = checked(4, POSITIVE)  # rollout refreshes: roll out, then replay on those rollouts
    num_prompts: int = checked(64, POSITIVE)  # training prompts rolled out per iteration (all processes)
    num_steps: int = checked(16, POSITIVE)  # optimizer steps replayed on each iteration's rollouts
    # drafts per round in the rollouts: the k the head is served at (checked with the stage's other
    # settings, artifacts/config/combinations.py: a bad export k is named as export's)
    num_speculative_tokens: int = "${export.num_speculative_tokens}"
    max_new_tokens: int = checked(128, POSITIVE)  # tokens a rollout generates at most
    # prompts decoded together, one target forward verifying all their rounds (train/rollouts.py
    # `roll_out_batch`; 1: the reference decoder, a prompt at a time)
    rollout_batch_size: int = checked(16, POSITIVE)
    # the temperature the rollouts verify at (0: greedy; > 0: vLLM's rejection sampling, each prompt its
    # own seeded stream): the head's served temperature, its held-out acceptance measured at it too
    temperature: float = checked(0.0, within(0, 2))
    # what the accepted drafts minimise (train.loss's syntax; Draft-OPD: kl, forward KL)
    accepted_loss: str = checked("kl", Check(_is_loss, f"one of {', '.join(DIVERGENCES)} or a weighted sum"))
    # what the rejected drafts minimise (Draft-OPD: rkl, reverse KL; kl: its forward-only ablation)
    rejected_loss: str = checked("rkl", Check(_is_loss, f"one of {', '.join(DIVERGENCES)} or a weighted sum"))
    # the rejected draft i (from 0) weighs gamma^i (Draft-OPD: 0.8; 1: its no-decay ablation)
    gamma: float = checked(0.8, within(0, 1, low_closed=False))
    # held-out prompts rolled out before the first step and after every eval_every iterations (0: none)
    num_eval_prompts: int = checked(16, NON_NEGATIVE)
    eval_every: int = checked(1, POSITIVE)  # iterations between held-out rollouts (and at the end)


@dataclass
class GridConfig:
    """bench/grid.py: recipes trained side by side on one cache (conf/grid/*.yaml)."""

    name: str = "grid"  # results go to <run_dir>/grid/<name>/
    # optimizer steps of every variant (the learning-rate schedule is sized to it); null: each variant's own,
    # train.num_epochs over the cache (variants whose steps hold different numbers of samples: packing)
    max_steps: int | None = checked(300, optional(POSITIVE))
    variants: dict[str, list[str]] = field(
        default_factory=dict
    )  # variant name -> overrides of the train stage (head.*, optim.*, train.*); [] = the config as it is
    # held-out prompts the reference decoder drafts per variant (0: skip)
    acceptance_prompts: int = checked(16, NON_NEGATIVE)
    acceptance_max_new_tokens: int = checked(96, POSITIVE)  # tokens generated per prompt
    # k of the acceptance measured and of the estimate tabulated
    num_speculative_tokens: int = checked(3, POSITIVE)
