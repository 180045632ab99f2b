"""The one attention of every draft head, and the key/value cache that makes its modes.

Every place a head attends - a plain causal pass (vLLM's prefill, the EAGLE-1 loss), the reference
decoder's cached decoding, the training-time-test steps of EAGLE-3, P-EAGLE's parallel depths and DFlash's
blocks (`block_attention`) - goes through `attention` (the EAGLE heads through `attend`): each query sees
the keys at positions up to its own (causal) plus, optionally, a few keys of its own (the keys of earlier
drafting steps at the same anchor, or of its DFlash block), all in one softmax (a plain causal pass without
a cache takes PyTorch's fused kernel for the same function). The caller
never builds a mask: a `KVCache` passed to the head's forward decides which keys each call adds and sees.

    cache = KVCache(num_layers)                       # decoding: every call continues the sequence
    out_BTH = draft(ids_BT, hidden_BTH, positions_BT, cache)
    cache = KVCache(num_layers, steps=True)           # training-time test / parallel depths: the first
    out_BTH = draft(ids_BT, hidden_BTH, positions_BT, cache)   # call is the sequence, each later one a
    out_BTH = draft(next_ids_BT, carried_BTH, positions_BT + 1, cache)  # step at every anchor

Memory is O(T*K) kept per call: a plain causal pass through PyTorch's fused kernel, every other call in
query chunks of bounded scores, checkpointed (`attention`); never a dense (T x K*T) mask, and no [T, S]
scores kept for backward (docs/design.md#training-time-test).

Shape legend: B batch, T queries, S key positions, M anchors, N query heads, G key/value heads,
R = N/G queries per key/value head, D head dim, J extra keys per query (earlier steps, or a block's),
Q = M*J block queries.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# The most bytes one call keeps of fp32 scores at a time. Above it, queries go in chunks that each fit, every
# chunk under activation checkpointing: training keeps each chunk's output, never its scores, and backward
# recomputes one chunk's scores at a time. Below it (tests, the reference decoder, short sequences) one dense
# pass, as before. A module setting so tests can force the chunked path at tiny shapes.
SCORE_BUDGET_BYTES = 256 * 2**20

# The kernel of every call but a plain causal pass: "chunked" (the dense query chunks of `dense_attention`,
# on any device) or "flex" (PyTorch's FlexAttention, `flex_attention_call`: one fused kernel over a block
# mask, no scores kept for backward, the key blocks a query cannot see skipped; its backward runs on CUDA
# only). Set from `train.attention` where train/model.py builds `DraftWithLoss`; a module setting, as
# SCORE_BUDGET_BYTES.
KERNEL = "chunked"


def attention(
    q_BNTD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    query_positions_BT: Tensor | None = None,
    extra_k_BGTJD: Tensor | None = None,
    extra_v_BGTJD: Tensor | None = None,
    extra_visible_BTJ: Tensor | None = None,
    query_starts_BT: Tensor | None = None,
) -> Tensor:
    """Grouped-query attention: query t sees the keys at positions <= its own, plus its own J extra keys
    (those of them `extra_visible_BTJ` allows, when given: [B, T, J], or [T, J] for every row). With
    `query_starts_BT` (packed rows), only the keys at positions >= its document's start, too.

    Query positions default to the last T of the S key positions (a plain causal pass when T == S; new
    tokens after a cache otherwise); `query_positions_BT` places them elsewhere (P-EAGLE's anchors).
    Both score blocks share one softmax. No key-padding mask: batches are right-padded, so a pad key sits
    after every real position and is visible only to pad queries, which get no loss.

    A plain causal pass takes PyTorch's fused kernel (no [T, S] scores at all); any other call goes in query
    chunks of at most SCORE_BUDGET_BYTES of scores, each checkpointed when it needs a gradient, so memory is
    O(T*D + budget), not O(T*S) per call (docs/design.md#training-time-test).
    """
    b, n, t, _ = q_BNTD.shape
    s = k_BGSD.shape[2]
    if extra_visible_BTJ is not None and extra_visible_BTJ.dim() == 2:  # [T, J]: the same for every row
        extra_visible_BTJ = extra_visible_BTJ[None]
    if query_positions_BT is None and extra_k_BGTJD is None and t == s and query_starts_BT is None:
        return causal_attention(q_BNTD, k_BGSD, v_BGSD)
    if query_positions_BT is None:
        query_positions_BT = torch.arange(s - t, s, device=q_BNTD.device).expand(b, t)
    if KERNEL == "flex":
        return flex_attention_call(
            q_BNTD, k_BGSD, v_BGSD, query_positions_BT, extra_k_BGTJD, extra_v_BGTJD, extra_visible_BTJ,
            query_starts_BT,
        )  # fmt: skip
    j = 0 if extra_k_BGTJD is None else extra_k_BGTJD.shape[3]
    chunk = max(1, SCORE_BUDGET_BYTES // (4 * b * n * (s + j)))
    if chunk >= t:
        return dense_attention(*visible_keys(
            q_BNTD, k_BGSD, v_BGSD, query_positions_BT, extra_k_BGTJD, extra_v_BGTJD, extra_visible_BTJ,
            query_starts_BT,
        ))  # fmt: skip
    keep_graph = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q_BNTD, k_BGSD, v_BGSD, extra_k_BGTJD, extra_v_BGTJD)
    )
    outs = []
    for start in range(0, t, chunk):
        rows = slice(start, start + chunk)
        inputs = visible_keys(
            q_BNTD[:, :, rows],
            k_BGSD,
            v_BGSD,
            query_positions_BT[:, rows],
            None if extra_k_BGTJD is None else extra_k_BGTJD[:, :, rows],
            None if extra_v_BGTJD is None else extra_v_BGTJD[:, :, rows],
            None if extra_visible_BTJ is None else extra_visible_BTJ[:, rows],
            None if query_starts_BT is None else query_starts_BT[:, rows],
        )
        if keep_graph:
            outs.append(checkpoint(dense_attention, *inputs, use_reentrant=False))
        else:
            outs.append(dense_attention(*inputs))
    return torch.cat(outs, dim=2)


def visible_keys(q, k, v, positions, extra_k, extra_v, extra_visible, starts) -> tuple:
    """`dense_attention`'s inputs cut to the keys some query sees: from the earliest query's first visible
    key (its document's or window's start) to the latest query's position. Positions and starts are then
    counted from that cut. A causal pass computes about half its scores this way, and a packed row only
    its documents' blocks."""
    first = 0 if starts is None else int(starts.min())
    last = int(positions.max()) + 1
    kept = (k[:, :, first:last], v[:, :, first:last], positions - first)
    return (q, *kept, extra_k, extra_v, extra_visible, None if starts is None else starts - first)


def dense_attention(
    q_BNTD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    query_positions_BT: Tensor,
    extra_k_BGTJD: Tensor | None,
    extra_v_BGTJD: Tensor | None,
    extra_visible_BTJ: Tensor | None,
    query_starts_BT: Tensor | None = None,
) -> Tensor:
    """`attention` over all T queries at once: [T, S] scores (and [T, J] for the extra keys), one softmax."""
    b, n, t, d = q_BNTD.shape
    g, s = k_BGSD.shape[1], k_BGSD.shape[2]
    # Query head n reads key/value head n // R (HF's repeat_kv order): a view, no copies of the keys.
    q_BGRTD = q_BNTD.view(b, g, n // g, t, d) * d**-0.5
    scores_BGRTS = torch.einsum("bgrtd,bgsd->bgrts", q_BGRTD, k_BGSD)
    key_S = torch.arange(s, device=q_BNTD.device)
    hidden_BTS = key_S > query_positions_BT[..., None]  # the future
    if query_starts_BT is not None:  # and another document's keys, in a packed row
        hidden_BTS = hidden_BTS | (key_S < query_starts_BT[..., None])
    scores_BGRTS = scores_BGRTS.masked_fill(hidden_BTS[:, None, None], float("-inf"))
    if extra_k_BGTJD is None:
        probs_BGRTS = torch.softmax(scores_BGRTS.float(), dim=-1).to(q_BNTD.dtype)
        return torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTS, v_BGSD).reshape(b, n, t, d)
    scores_BGRTJ = torch.einsum("bgrtd,bgtjd->bgrtj", q_BGRTD, extra_k_BGTJD)
    if extra_visible_BTJ is not None:
        scores_BGRTJ = scores_BGRTJ.masked_fill(~extra_visible_BTJ[:, None, None], float("-inf"))
    probs = torch.softmax(torch.cat([scores_BGRTS, scores_BGRTJ], dim=-1).float(), dim=-1).to(q_BNTD.dtype)
    probs_BGRTS, probs_BGRTJ = probs.split([s, extra_k_BGTJD.shape[3]], dim=-1)
    out_BGRTD = torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTS, v_BGSD)
    out_BGRTD = out_BGRTD + torch.einsum("bgrtj,bgtjd->bgrtd", probs_BGRTJ, extra_v_BGTJD)
    return out_BGRTD.reshape(b, n, t, d)


def flex_attention_call(
    q_BNTD: Tensor,
    k_BGSD: Tensor,
    v_BGSD: Tensor,
    query_positions_BT: Tensor,
    extra_k_BGTJD: Tensor | None,
    extra_v_BGTJD: Tensor | None,
    extra_visible_BTJ: Tensor | None,
    query_starts_BT: Tensor | None,
) -> Tensor:
    """`attention` through FlexAttention: the J extra keys laid after the sequence's (extra key i of query t
    at S + i*T + t) and one mask saying what each query sees - what `dense_attention` computes."""
    b, n, t, d = q_BNTD.shape
    g, s = k_BGSD.shape[1], k_BGSD.shape[2]
    keys_BGKD, values_BGKD, j = k_BGSD, v_BGSD, 0
    if extra_k_BGTJD is not None:
        j = extra_k_BGTJD.shape[3]
        keys_BGKD = torch.cat([k_BGSD, extra_k_BGTJD.transpose(2, 3).reshape(b, g, j * t, d)], dim=2)
        values_BGKD = torch.cat([v_BGSD, extra_v_BGTJD.transpose(2, 3).reshape(b, g, j * t, d)], dim=2)
    if extra_visible_BTJ is not None:
        extra_visible_BTJ = extra_visible_BTJ.expand(b, t, j)

    def sees(b_, q_, kv_):
        seen = kv_ <= query_positions_BT[b_, q_]  # the sequence up to the query's position (< S)
        if query_starts_BT is not None:
            seen = seen & (kv_ >= query_starts_BT[b_, q_])
        if j:
            extra = (kv_ - s).clamp(min=0)
            own = (kv_ >= s) & (extra % t == q_)
            if extra_visible_BTJ is not None:
                own = own & extra_visible_BTJ[b_, q_, (extra // t).clamp(max=j - 1)]
            seen = seen | own
        return seen

    return flex_attend(q_BNTD, keys_BGKD, values_BGKD, sees)


def flex_attend(q_BNTD: Tensor, keys_BGKD: Tensor, values_BGKD: Tensor, sees) -> Tensor:
    """FlexAttention of the queries over these keys, `sees(b, q, kv)` the mask (compiled on CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, _, t, _ = q_BNTD.shape
    mask = create_block_mask(
        lambda b_, h_, q_, kv_: sees(b_, q_, kv_), b, None, t, keys_BGKD.shape[2], device=q_BNTD.device,
        _compile=q_BNTD.is_cuda,
    )  # fmt: skip
    kernel = compiled_flex_attention() if q_BNTD.is_cuda else flex_attention
    dtype = q_BNTD.dtype  # one dtype for the three (autocast leaves the keys of a cat in fp32 at times)
    return kernel(q_BNTD, keys_BGKD.to(dtype), values_BGKD.to(dtype), block_mask=mask, enable_gqa=True)


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled (Triton): its eager form materialises the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class LayerKV:
    """One decoder layer's keys/values: the sequence [B, G, S, D], and with `steps` the keys of the later
    drafting steps, one [B, G, M_j, D] per step (M_j anchors, nested: step j's are the first M_j of step
    j-1's). `starts_BS` (packed rows): where each sequence position's document starts."""

    def __init__(self, steps: bool, starts_BS: Tensor | None = None):
        self.steps, self.starts_BS = steps, starts_BS
        self.k_BGSD: Tensor | None = None
        self.v_BGSD: Tensor | None = None
        self.step_k: list[Tensor] = []
        self.step_v: list[Tensor] = []

    def append(self, k_BGTD: Tensor, v_BGTD: Tensor) -> tuple[Tensor, Tensor]:
        """Add keys/values after the sequence's; all of them [B, G, S, D]."""
        if self.k_BGSD is None:
            self.k_BGSD, self.v_BGSD = k_BGTD, v_BGTD
        else:
            self.k_BGSD = torch.cat([self.k_BGSD, k_BGTD], dim=2)
            self.v_BGSD = torch.cat([self.v_BGSD, v_BGTD], dim=2)
        return self.k_BGSD, self.v_BGSD

    def query_starts(self, t: int, anchors_BM: Tensor | None) -> Tensor | None:
        """The document starts of this call's queries: the last t sequence positions', or the anchors'."""
        if self.starts_BS is None:
            return None
        if anchors_BM is not None:
            return self.starts_BS.gather(1, anchors_BM)
        return self.starts_BS[:, self.starts_BS.shape[1] - t :]

    def attend(
        self,
        q_BNTD: Tensor,
        k_BGTD: Tensor,
        v_BGTD: Tensor,
        anchors_BM: Tensor | None,
        window: int | None = None,
    ) -> Tensor:
        """Add this call's keys (to the sequence, or as the next step) and attend over what is kept; with a
        sliding `window`, each query sees only the keys of its last `window` positions (its own included).
        On the sequence's call, `anchors_BM` places the queries (those of some rows only, at the last layer:
        `DecoderLayer.forward`); on a step's, it names the anchors."""
        if self.k_BGSD is None or not self.steps:
            k_BGSD, v_BGSD = self.append(k_BGTD, v_BGTD)
            t, s = q_BNTD.shape[2], k_BGSD.shape[2]
            starts_BT = self.query_starts(t, anchors_BM)
            if window is not None:
                rows_BT = torch.arange(s - t, s, device=q_BNTD.device).expand(q_BNTD.shape[0], t)
                rows_BT = rows_BT if anchors_BM is None else anchors_BM
                starts_BT = later(starts_BT, window_starts(rows_BT, window))
            return attention(q_BNTD, k_BGSD, v_BGSD, anchors_BM, query_starts_BT=starts_BT)
        # A drafting step: its query at anchor t sees the sequence up to t and the steps so far at t.
        self.step_k.append(k_BGTD)
        self.step_v.append(v_BGTD)
        m = q_BNTD.shape[2]
        starts_BT = self.query_starts(m, anchors_BM)
        if window is not None:  # step j's query stands j positions past its anchor, as it is served
            s = self.k_BGSD.shape[2]
            rows_BT = (
                anchors_BM
                if anchors_BM is not None
                else torch.arange(s - m, s, device=q_BNTD.device).expand(q_BNTD.shape[0], m)
            )
            starts_BT = later(starts_BT, window_starts(rows_BT, window, len(self.step_k)))
        return attention(
            q_BNTD,
            self.k_BGSD,
            self.v_BGSD,
            anchors_BM,
            torch.stack([k[:, :, :m] for k in self.step_k], dim=3),
            torch.stack([v[:, :, :m] for v in self.step_v], dim=3),
            query_starts_BT=starts_BT,
        )

    def crop(self, length: int) -> None:
        self.k_BGSD, self.v_BGSD = self.k_BGSD[:, :, :length], self.v_BGSD[:, :, :length]


class KVCache:
    """The keys/values of a head's decoder layers across forward calls.

    steps=False (decoding): each call's T new positions follow the S cached ones and attend causally to
    all of them. steps=True (training-time test, parallel depths): the first call's positions are the
    sequence; each later call is one more drafting step at the anchors (every position, or `anchors_BM`),
    whose query sees the sequence up to its anchor and the earlier steps' keys at the same anchor.

    `starts_BS` packs several documents in a row: sequence position s belongs to the document starting at
    position starts[s], and every query sees only its own document's keys (one call over the whole
    sequence: a packed row's first call). Positions are then each document's own (`document_positions`).
    """

    def __init__(self, num_layers: int, steps: bool = False, starts_BS: Tensor | None = None):
        self.layers = [LayerKV(steps, starts_BS) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Cached sequence positions."""
        k_BGSD = self.layers[0].k_BGSD
        return 0 if k_BGSD is None else k_BGSD.shape[2]

    def crop(self, length: int) -> None:
        """Forget the sequence positions from `length` on (a draft chain's keys, rejected drafts)."""
        for layer in self.layers:
            layer.crop(length)


def block_attention(
    q_BNQD: Tensor,
    k_BGQD: Tensor,
    v_BGQD: Tensor,
    context_k_BGSD: Tensor,
    context_v_BGSD: Tensor,
    starts_BM: Tensor,
    causal: bool,
    lengths_BM: Tensor | None = None,
    context_starts_BM: Tensor | None = None,
) -> Tensor:
    """DFlash's attention: Q = M*J queries in M blocks of J consecutive positions, block m starting at
    `starts_BM[m]`; each query sees the context keys at positions < its block's start and the J keys of its
    own block (all of them, or those up to its own with `causal`; with `lengths_BM`, only the first
    lengths[m]: block m is then the shorter block vLLM serves at k = lengths[m] - 1), in one softmax. With
    `context_starts_BM` (packed rows) only the context keys at positions >= that start, its document's.

    The same `attention` as every other head: the block's keys enter as each query's extra keys, so memory
    is O(Q*S + Q*J), never a dense (Q x (S + Q)) mask over all blocks (docs/dflash.md).
    """
    if KERNEL == "flex":  # its own mask over the block keys as they are: none of the per-query layouts below
        return flex_block_attention(
            q_BNQD, k_BGQD, v_BGQD, context_k_BGSD, context_v_BGSD, starts_BM, causal, lengths_BM,
            context_starts_BM,
        )  # fmt: skip
    b, g, q, d = k_BGQD.shape
    m = starts_BM.shape[1]
    j = q // m
    query_positions_BQ = (starts_BM - 1).repeat_interleave(j, dim=1)  # context up to the block's start
    block_k_BGQJD = k_BGQD.view(b, g, m, 1, j, d).expand(b, g, m, j, j, d).reshape(b, g, q, j, d)
    block_v_BGQJD = v_BGQD.view(b, g, m, 1, j, d).expand(b, g, m, j, j, d).reshape(b, g, q, j, d)
    visible_BQJ = None
    if causal or lengths_BM is not None:
        key_J = torch.arange(j, device=q_BNQD.device)
        visible_BMJJ = torch.ones(b, m, j, j, dtype=torch.bool, device=q_BNQD.device)
        if causal:
            visible_BMJJ &= key_J[None, :] <= key_J[:, None]
        if lengths_BM is not None:
            visible_BMJJ &= (key_J < lengths_BM[..., None])[:, :, None, :]
        visible_BQJ = visible_BMJJ.view(b, q, j)
    query_starts_BQ = None if context_starts_BM is None else context_starts_BM.repeat_interleave(j, dim=1)
    return attention(
        q_BNQD, context_k_BGSD, context_v_BGSD, query_positions_BQ, block_k_BGQJD, block_v_BGQJD, visible_BQJ,
        query_starts_BQ,
    )  # fmt: skip


def flex_block_attention(
    q_BNQD: Tensor,
    k_BGQD: Tensor,
    v_BGQD: Tensor,
    context_k_BGSD: Tensor,
    context_v_BGSD: Tensor,
    starts_BM: Tensor,
    causal: bool,
    lengths_BM: Tensor | None,
    context_starts_BM: Tensor | None,
) -> Tensor:
    """`block_attention` through FlexAttention: the blocks' keys once each after the context's (block m's
    key i at S + m*J + i), and one mask."""
    s, q = context_k_BGSD.shape[2], k_BGQD.shape[2]
    j = q // starts_BM.shape[1]
    keys_BGKD = torch.cat([context_k_BGSD, k_BGQD], dim=2)
    values_BGKD = torch.cat([context_v_BGSD, v_BGQD], dim=2)

    def sees(b_, q_, kv_):
        block = q_ // j
        seen = kv_ < starts_BM[b_, block]  # the context before the block's start (< S)
        if context_starts_BM is not None:
            seen = seen & (kv_ >= context_starts_BM[b_, block])
        key = (kv_ - s).clamp(min=0)
        own = (kv_ >= s) & (key // j == block)
        if causal:
            own = own & (key % j <= q_ % j)
        if lengths_BM is not None:
            own = own & (key % j < lengths_BM[b_, block])
        return seen | own

    return flex_attend(q_BNQD, keys_BGKD, values_BGKD, sees)


def window_starts(rows_BT: Tensor, window: int, steps: int = 0) -> Tensor:
    """The first key row each query sees under a sliding window of `window` tokens, vLLM's: the query's own
    position and the `window - 1` before it. A drafting step `steps` after its anchor row stands that many
    positions past it (its earlier steps' keys, between the two, are all inside: window > steps)."""
    return (rows_BT + steps - window + 1).clamp(min=0)


def later(starts_BT: Tensor | None, other_BT: Tensor) -> Tensor:
    """The later of two first-visible-key bounds (a packed row's document start, a window's)."""
    return other_BT if starts_BT is None else torch.maximum(starts_BT, other_BT)


def document_positions(starts_BS: Tensor) -> Tensor:
    """[B, S] each position's place in its own document (RoPE positions) from the documents' starts."""
    return torch.arange(starts_BS.shape[1], device=starts_BS.device) - starts_BS


def causal_attention(q_BNTD: Tensor, k_BGTD: Tensor, v_BGTD: Tensor) -> Tensor:
    """`attention` of a plain causal pass (no cache, T == S) through PyTorch's fused kernel, which never
    holds the [T, T] scores: EAGLE-1's loss and a prefill over long sequences."""
    repeats = q_BNTD.shape[1] // k_BGTD.shape[1]  # query head n reads key/value head n // R, as above
    k_BNTD = k_BGTD.repeat_interleave(repeats, dim=1)
    v_BNTD = v_BGTD.repeat_interleave(repeats, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q_BNTD, k_BNTD, v_BNTD, is_causal=True)


def attend(
    q_BNTD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    kv: LayerKV | None,
    anchors_BM: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """A decoder layer's attention: plain causal over these positions, or through its cache; with a sliding
    `window` (head.sliding_window), over each query's last `window` positions only. Without a cache,
    `anchors_BM` are the rows of the queries (keys at every row)."""
    if kv is None and window is None and anchors_BM is None:
        return causal_attention(q_BNTD, k_BGTD, v_BGTD)
    if kv is None:
        b, _, t, _ = q_BNTD.shape
        rows_BT = torch.arange(t, device=q_BNTD.device).expand(b, t) if anchors_BM is None else anchors_BM
        starts_BT = None if window is None else window_starts(rows_BT, window)
        return attention(q_BNTD, k_BGTD, v_BGTD, anchors_BM, query_starts_BT=starts_BT)
    return kv.attend(q_BNTD, k_BGTD, v_BGTD, anchors_BM, window)
