"""A reference speculative decoder in plain PyTorch: the HF target, our draft head, a chain of k greedy
drafts and greedy verification - what vLLM 0.32 runs for EAGLE and EAGLE-3 (one chain, no trees), written
to be read rather than to be fast (batch of one, explicit key/value lists).

Two uses: `export/main.py export.verify=true` compares its acceptance with vLLM's counters on the same
prompts (a flag or convention that differs between training and serving shows up as a gap), and eval's
quick offline estimate when vLLM is not wanted.

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head = load_head(run_dir / "draft_head", target)
    output_ids, counts = speculative_generate(target, head, prompt_ids, num_draft_tokens=3, max_new_tokens=64)
    counts.mean_acceptance_length, counts.per_position

One request, in vLLM's order so that the counts equal its counters:
1. prefill: the target reads the prompt; its greedy token is the first output token (no draft yet);
2. draft: the head reads every position the target has verified and the head has not seen - at position t
   the target's features of t beside the token at t+1 - and keeps their keys/values (its cache holds
   target-fed positions only); from the last one it proposes a chain of k tokens, step i reading draft
   token i at RoPE position t+i with the previous step's pre-norm output as its hidden state;
3. verify: the target reads [its pending token, d_1..d_k]; the longest prefix of drafts equal to its
   greedy tokens is accepted, then its bonus token; (k, accepted) is counted before any stop or max-tokens
   truncation, as vLLM's scheduler counts;
4. repeat until `max_new_tokens` or a stop token.
Parallel drafting (P-EAGLE, a head with a mask token): step 2 proposes the whole chain in one pass - draft 1
from the last verified position, drafts 2..k from k-1 mask slots at positions t+1..t+k-1 that read the
mask token beside `fc(mask_hidden)` and attend to the cache and to each other, causally.

Shape legend: B batch (1), T positions, S key positions, A aux layers, H hidden, N query heads,
G key/value heads, D head dim, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from artifacts.vocab import load_vocab_map
from heads.acceptance import AcceptanceCounts
from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.eagle3 import EXCLUDED_FROM_EXPORT, Eagle3Config, Eagle3Draft
from target.model import DTYPES, capture_aux_states


@dataclass
class DraftHead:
    kind: str  # eagle3 (P-EAGLE heads included: an EAGLE-3 architecture) | eagle1
    draft: Eagle3Draft | Eagle1Draft
    aux_layer_ids: list[int]  # EAGLE-3: the target layers feeding `fc`; EAGLE-1: none (final state)
    draft_to_target: Tensor | None  # EAGLE-3: [Vd] target id of each draft token
    lm_head_VH: Tensor | None  # EAGLE-1: the target's lm_head, which decodes the predicted features

    @property
    def parallel(self) -> bool:
        """True for a P-EAGLE head: one pass drafts the whole chain."""
        return self.kind == "eagle3" and self.draft.config.parallel_drafting


def inference_device() -> str:
    """Where the reference decoder runs: the first GPU when there is one (an 8B target in fp32 needs it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_head(head_dir: Path, target, weight_dtype: str = "float32") -> DraftHead:
    """A trained head (`draft_head/` from train) on the target's embedding, in fp32 for inference.

    `weight_dtype` rounds the weights through that dtype first, as an export in it would store them: the
    reference then computes with exactly the values vLLM loads from a bf16 export.
    """
    head_dir = Path(head_dir)
    head_config = json.loads((head_dir / "draft_config.json").read_text())
    kind = {"peagle": "eagle3"}.get(head_config["kind"], head_config["kind"])
    if kind == "eagle3":
        draft = Eagle3Draft(Eagle3Config.from_dict(head_config["config"]))
    elif kind == "eagle1":
        draft = Eagle1Draft(Eagle1Config.from_dict(head_config["config"]))
    else:
        raise ValueError(f"{head_dir}/draft_config.json: unknown head kind {kind!r}")
    weights = load_file(str(head_dir / "model.safetensors"))
    weights = {k: v.to(DTYPES[weight_dtype]).float() for k, v in weights.items()}
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in EXCLUDED_FROM_EXPORT]
    if missing or unexpected:
        raise ValueError(f"{head_dir}/model.safetensors: missing {missing}, unexpected {unexpected}")
    draft.load_target_embedding(target.get_input_embeddings().weight.detach().float())
    draft.float().eval().requires_grad_(False).to(
        target.device
    )  # the target's device (GPU when there is one)
    if kind == "eagle3":
        vocab = load_vocab_map(head_dir / "vocab.safetensors")
        return DraftHead(kind, draft, list(draft.config.aux_layer_ids), vocab.draft_to_target, None)
    return DraftHead(kind, draft, [], None, target.get_output_embeddings().weight.detach().float())


def target_forward(target, head: DraftHead, ids: list[int], cache, start: int) -> tuple[Tensor, Tensor]:
    """The target reads `ids` at positions start.. (its cache holds the ones before): the head's features
    of those positions (EAGLE-3 aux [1, T, A, H], EAGLE-1 final post-norm [1, T, H]) and logits [T, V]."""
    input_ids_BT = torch.tensor([ids], device=target.device)
    positions_BT = torch.arange(start, start + len(ids), device=target.device)[None]
    with capture_aux_states(target, head.aux_layer_ids) as captured:
        final_BTH = target.model(
            input_ids=input_ids_BT, position_ids=positions_BT, past_key_values=cache, use_cache=True
        ).last_hidden_state
    logits_TV = target.lm_head(final_BTH)[0].float()
    if head.kind == "eagle3":
        return torch.stack([captured[i] for i in head.aux_layer_ids], dim=2).float(), logits_TV
    return final_BTH.float(), logits_TV


def attend(q_BNTD: Tensor, k_BGSD: Tensor, v_BGSD: Tensor) -> Tensor:
    """The T queries are the last T of the S key positions: each sees the keys up to its own."""
    t, s = q_BNTD.shape[2], k_BGSD.shape[2]
    mask_TS = torch.ones(t, s, dtype=torch.bool, device=q_BNTD.device).tril(s - t)
    repeats = q_BNTD.shape[1] // k_BGSD.shape[1]
    k_BNSD = k_BGSD.repeat_interleave(repeats, dim=1)
    v_BNSD = v_BGSD.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q_BNTD, k_BNSD, v_BNSD, attn_mask=mask_TS)


class DraftState:
    """The head's keys/values (one (k, v) pair per decoder layer) of positions 0..length-1, computed from
    the target's features only."""

    def __init__(self, head: DraftHead):
        self.head = head
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.length = 0

    def layers(
        self, ids: list[int], hidden_BTH: Tensor, start: int, past: list[tuple[Tensor, Tensor]] | None
    ):
        """The decoder layers on T new positions after the `past` keys/values (per layer; None: empty), the
        T new ones attending causally among themselves: (last layer's pre-norm out, keys/values per layer)."""
        draft = self.head.draft
        device = hidden_BTH.device
        embeds_BTH = draft.embed(torch.tensor([ids], device=device))
        cos_BTD, sin_BTD = draft.rope(torch.arange(start, start + len(ids), device=device)[None])
        out_BTH, kv = hidden_BTH, []
        for index, layer in enumerate(draft.layers):
            if index > 0:
                q_BNTD, k_BGTD, v_BGTD, residual_BTH = layer.project(out_BTH, cos_BTD, sin_BTD)
            elif self.head.kind == "eagle3":
                q_BNTD, k_BGTD, v_BGTD, residual_BTH = layer.project(embeds_BTH, hidden_BTH, cos_BTD, sin_BTD)
            else:  # EAGLE-1: fc over cat(embedding, feature); attention reads it un-normed, residual is it
                residual_BTH = draft.fc(torch.cat([embeds_BTH, hidden_BTH], dim=-1))
                q_BNTD, k_BGTD, v_BGTD = layer.self_attn.project(residual_BTH, cos_BTD, sin_BTD)
            if past is not None:
                k_BGTD = torch.cat([past[index][0], k_BGTD], dim=2)
                v_BGTD = torch.cat([past[index][1], v_BGTD], dim=2)
            out_BTH = layer.finish(attend(q_BNTD, k_BGTD, v_BGTD), residual_BTH)
            kv.append((k_BGTD, v_BGTD))
        return out_BTH, kv

    def extend(self, next_ids: list[int], features: Tensor) -> Tensor:
        """Read the next verified positions (features of t beside the token at t+1); their keys/values
        join the cache. Returns the pre-norm output [1, 1, H] at the last of them."""
        if self.head.kind == "eagle3":
            hidden_BTH = self.head.draft.combine_aux(features)
        else:
            hidden_BTH = features
        out_BTH, self.kv = self.layers(next_ids, hidden_BTH, self.length, self.kv)
        self.length += len(next_ids)
        return out_BTH[:, -1:]

    def token(self, out_B1H: Tensor) -> int:
        """The greedy draft token (a target id) from a pre-norm output."""
        if self.head.kind == "eagle3":
            index = int(self.head.draft.logits(out_B1H)[0, -1].argmax())
            return int(self.head.draft_to_target[index])
        return int((out_B1H[0, -1] @ self.head.lm_head_VH.T).argmax())

    def propose(self, out_B1H: Tensor, num_draft_tokens: int) -> list[int]:
        """A chain of greedy drafts from the last cached position; the chain's keys are not kept."""
        drafts = [self.token(out_B1H)]
        if self.head.parallel:
            return drafts + self.propose_parallel(num_draft_tokens - 1)
        past = self.kv
        for i in range(1, num_draft_tokens):
            # Step i reads draft token i at position (last cached) + i, fed its previous output (`carry`).
            out_B1H, past = self.layers(
                [drafts[-1]], self.head.draft.carry(out_B1H), self.length - 1 + i, past
            )
            drafts.append(self.token(out_B1H))
        return drafts

    def propose_parallel(self, num_mask_slots: int) -> list[int]:
        """Drafts 2..k in one pass: mask slots at positions t+1..t+k-1 (t: the last cached position)."""
        if num_mask_slots == 0:
            return []
        draft = self.head.draft
        hidden_BTH = draft.mask_state().expand(1, num_mask_slots, -1)
        out_BTH, _ = self.layers(
            [draft.config.mask_token_id] * num_mask_slots, hidden_BTH, self.length, self.kv
        )
        return [self.token(out_BTH[:, i : i + 1]) for i in range(num_mask_slots)]


def finish(output: list[int], max_new_tokens: int, stop_token_ids) -> tuple[list[int], bool]:
    """Cut the output at the first stop token (kept) or at max_new_tokens; True when it has ended."""
    for i, token in enumerate(output[:max_new_tokens]):
        if token in stop_token_ids:
            return output[: i + 1], True
    return output[:max_new_tokens], len(output) >= max_new_tokens


@torch.inference_mode()
def speculative_generate(
    target,
    head: DraftHead,
    prompt_ids: list[int],
    num_draft_tokens: int,
    max_new_tokens: int,
    stop_token_ids=(),
) -> tuple[list[int], AcceptanceCounts]:
    """Greedy speculative decoding of one prompt: (output token ids, acceptance counts)."""
    from transformers import DynamicCache

    if not prompt_ids:
        raise ValueError("empty prompt: the target needs at least one token")
    counts = AcceptanceCounts()
    cache = DynamicCache(config=target.config)
    ids = list(prompt_ids)  # what the target has read; its cache holds exactly these positions
    features, logits_TV = target_forward(target, head, ids, cache, start=0)
    pending = int(logits_TV[-1].argmax())  # the target's next token, not yet read by it
    output, done = finish([pending], max_new_tokens, stop_token_ids)
    state = DraftState(head)
    while not done:
        out_B1H = state.extend((ids + [pending])[state.length + 1 :], features)
        drafts = state.propose(out_B1H, num_draft_tokens)
        features, logits_TV = target_forward(target, head, [pending, *drafts], cache, start=len(ids))
        greedy = logits_TV.argmax(-1).tolist()  # greedy[i]: the target's token after position len(ids)+i
        accepted = 0
        while accepted < num_draft_tokens and drafts[accepted] == greedy[accepted]:
            accepted += 1
        counts.observe(num_draft_tokens, accepted)
        ids += [pending, *drafts[:accepted]]
        features = features[:, : accepted + 1]  # the positions just verified, next for the head to read
        rejected = cache.get_seq_length() - len(ids)
        if rejected:
            cache.crop(-rejected)  # a negative length counts the positions to drop
        pending = greedy[accepted]  # the bonus token
        output, done = finish(output + drafts[:accepted] + [pending], max_new_tokens, stop_token_ids)
    return output, counts
