"""Parallel drafting (P-EAGLE) for training: the K depths of every anchor in one forward, as vLLM feeds them.

Pure functions on tensors (no I/O, no Accelerator). DESIGN.md section 8: in one draft forward of a round,
the verified slot at anchor t reads (embedding of x_{t+1}, `fc(aux_t)`) at RoPE position t, exactly as in
EAGLE-3; the K-1 mask slots that vLLM appends read (embedding of `mask_token_id`, `fc(mask_hidden)`) at
positions t+1..t+K-1. Every slot attends causally: to the real keys at positions <= t and to the slots of
the same round before it (and itself). Depth d at anchor t predicts x_{t+2+d} against the target's
distribution at t+1+d restricted to the draft vocabulary - the same teacher, loss and metrics as TTT
(`train/ttt.py`), and the same attention shape: causal over depth 0 plus a per-anchor diagonal of the
earlier depths, never a dense (T*K)^2 mask. Unlike TTT, a slot's input does not depend on the outputs of
earlier slots, so every depth of a layer is computed before the next layer.

COD (the P-EAGLE paper's anchor subsampling): with `cod_ratio` r < 1, depth d >= 1 is computed only at
~T*r^d anchors, a random subset nested in depth d-1's (answer positions first), so long sequences cost
about T / (1 - r) slot computations instead of T*K.

    total_loss, metrics = parallel_loss(draft, batch, num_depths=3, gamma=0.8, target_lm_head=w_VH,
                                        draft_to_target=vocab.draft_to_target, chunk_size=1024)

Shape legend:
    B batch, T positions, M anchors kept at a depth, H hidden, A aux layers, N query heads, G key/value
    heads, D head dim, J depths on the diagonal, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from heads.eagle3 import Eagle3Draft
from train.ttt import batch_teacher, depth_losses, shift_left, ttt_attention


def cod_anchors(
    loss_mask_BT: Tensor, num_depths: int, ratio: float, generator: torch.Generator | None = None
) -> list[Tensor | None]:
    """Anchor indices [B, M_d] per depth (None at depth 0: every position), nested: depth d keeps the first
    M_d = ceil(n * ratio^d) of one random order per row that puts anchors with an answer token to
    predict first (n: the most such anchors in a row). ratio >= 1 keeps every anchor at every depth."""
    if not 0 < ratio <= 1:
        raise ValueError(f"cod_ratio={ratio}: must be in (0, 1]")
    if ratio == 1:
        return [None] * num_depths
    b, t = loss_mask_BT.shape
    wanted_BT = shift_left(loss_mask_BT.bool(), 2, False)
    noise_BT = torch.rand(b, t, generator=generator, device="cpu").to(loss_mask_BT.device)
    order_BT = torch.argsort(noise_BT + (~wanted_BT).float(), dim=1)  # wanted anchors first, shuffled
    n = max(1, int(wanted_BT.sum(1).max()))
    return [None] + [order_BT[:, : max(1, math.ceil(n * ratio**d))] for d in range(1, num_depths)]


def parallel_forward(
    model: Eagle3Draft, input_ids_BT: Tensor, aux_BTAH: Tensor, anchors: list[Tensor | None]
) -> list[Tensor]:
    """The last layer's pre-norm outputs per depth: depth 0 [B, T, H]; depth d >= 1 [B, M_d, H] at the
    anchors `anchors[d]` ([B, M_d] indices, nested; None: all T positions)."""
    b, t = input_ids_BT.shape
    device = input_ids_BT.device
    positions_T = torch.arange(t, device=device)
    index = [a if a is not None else positions_T.expand(b, t) for a in anchors]
    ropes = [model.rope(index[d] + d) for d in range(len(anchors))]  # depth d of anchor t sits at t + d
    # Layer-0 inputs: depth 0 is EAGLE-3's (the next token beside the aux states); mask slots share one
    # token and one hidden state.
    mask_embed_11H = model.embed(torch.tensor([[model.config.mask_token_id]], device=device))
    mask_hidden_11H = model.mask_state()
    hiddens = [model.combine_aux(aux_BTAH)] + [
        mask_hidden_11H.expand(b, index[d].shape[1], -1) for d in range(1, len(anchors))
    ]
    embeds = [model.embed(shift_left(input_ids_BT, 1))] + [
        mask_embed_11H.expand(b, index[d].shape[1], -1) for d in range(1, len(anchors))
    ]
    for layer_index, layer in enumerate(model.layers):
        outs, diag_k, diag_v = [], [], []
        for d, hidden_BMH in enumerate(hiddens):
            cos_BMD, sin_BMD = ropes[d]
            if layer_index == 0:
                q_BNMD, k_BGMD, v_BGMD, residual_BMH = layer.project(embeds[d], hidden_BMH, cos_BMD, sin_BMD)
            else:
                q_BNMD, k_BGMD, v_BGMD, residual_BMH = layer.project(hidden_BMH, cos_BMD, sin_BMD)
            if d == 0:
                k0_BGTD, v0_BGTD = k_BGMD, v_BGMD
                attn_BNMD = ttt_attention(q_BNMD, k0_BGTD, v0_BGTD)
            else:
                # Depth d sees the mask slots of depths 1..d at its anchor; nested anchors make those the
                # first M_d rows of each earlier depth's keys.
                m = index[d].shape[1]
                diag_k.append(k_BGMD)
                diag_v.append(v_BGMD)
                attn_BNMD = ttt_attention(
                    q_BNMD,
                    k0_BGTD,
                    v0_BGTD,
                    torch.stack([k[:, :, :m] for k in diag_k], dim=3),
                    torch.stack([v[:, :, :m] for v in diag_v], dim=3),
                    query_positions_BT=index[d],
                )
            outs.append(layer.finish(attn_BNMD, residual_BMH))
        hiddens = outs
    return hiddens


def parallel_loss(
    model: Eagle3Draft,
    batch: dict[str, Tensor],
    num_depths: int,
    gamma: float,
    target_lm_head: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    denominator: Tensor | float | None = None,
    cod_ratio: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """total = sum_d gamma^d loss_d over the K parallel depths; the batch and metrics as `ttt_loss`'s."""
    if num_depths < 1:
        raise ValueError(f"num_depths={num_depths}: parallel drafting needs at least one depth")
    if not gamma > 0:
        raise ValueError(f"gamma={gamma}: the depth weight must be positive")
    if not model.config.parallel_drafting:
        raise ValueError("parallel_loss needs a head with a mask_token_id (head.kind=peagle)")
    anchors = cod_anchors(batch["loss_mask"], num_depths, cod_ratio, generator)
    probs_BTVd, in_draft_BT = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    outs = parallel_forward(model, batch["input_ids"], batch["aux_hidden"], anchors)
    return depth_losses(model, outs, batch, probs_BTVd, in_draft_BT, gamma, denominator, anchors)
