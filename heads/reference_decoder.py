"""A reference speculative decoder in plain PyTorch: the HF target, our draft head, a chain of k greedy
drafts and greedy verification (or, at a temperature, vLLM's rejection sampling of them) - what vLLM 0.32
runs for EAGLE and EAGLE-3 (one chain, no trees), written to be read rather than to be fast (batch of one,
a key/value cache kept per layer; train/rollouts.py `roll_out_batch` verifies several `Request`s in one
target forward).

Two uses: `export/main.py export.verify=true` compares its acceptance with vLLM's counters on the same
prompts (a flag or convention that differs between training and serving shows up as a gap), and eval's
quick offline estimate when vLLM is not wanted.

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head = load_head(run_dir / "draft_head", target)
    output_ids, counts = speculative_generate(target, head, prompt_ids, num_draft_tokens=3, max_new_tokens=64)
    counts.mean_acceptance_length, counts.per_position

The head is driven through its own `forward` with a `heads.attention.KVCache`, one call per draft step
(gpt-fast's loop): a head kind brings its forward, `target_hidden`, `carry` and `logits`, nothing else.

One request, in vLLM's order so that the counts equal its counters:
1. prefill: the target reads the prompt; its greedy token is the first output token (no draft yet);
2. draft: the head reads every position the target has verified and the head has not seen - at position t
   the target's features of t beside the token at t+1 - and keeps their keys/values (its cache holds
   target-fed positions only); from the last one it proposes a chain of k tokens, step i reading draft
   token i at RoPE position t+i with the previous step's pre-norm output as its hidden state;
3. verify: the target reads [its pending token, d_1..d_k]; the longest prefix of drafts equal to its
   greedy tokens is accepted, then its bonus token; (k, accepted) is counted before any stop or max-tokens
   truncation, as vLLM's scheduler counts. At temperature T > 0 (`Request.accepts`, `sample`), draft i is
   accepted when the target's probability of it at T is at least a uniform draw, the first rejected one is
   replaced by a draw from the target's distribution without it, the bonus token is a draw: the output is
   distributed as the target's own sampling;
4. repeat until `max_new_tokens` or a stop token.
Parallel drafting (P-EAGLE, a head with a mask token): step 2 proposes the whole chain in one pass - draft 1
from the last verified position, drafts 2..k from k-1 mask slots at positions t+1..t+k-1 that read the
mask token beside `fc(mask_hidden)` and attend to the cache and to each other, causally.
Block drafting (DFlash): step 2 adds the target's context of every newly verified position to the head's
cache, then one forward over the block [pending token, k mask tokens] at the positions after them, which
sees the whole context and the block, drafts all k (the mask slot at position q drafts the token at q).

Shape legend: B batch (1), T positions, S key positions, A aux layers, H hidden, N query heads,
G key/value heads, D head dim, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from artifacts.vocab import load_vocab_map
from heads.acceptance import AcceptanceCounts
from heads.attention import KVCache
from heads.head_file import load_draft
from heads.layers import DraftModel
from target.model import DTYPES, capture_aux_states


@dataclass
class DraftHead:
    """A head ready to draft for a target: its model (on the target's embedding, and for EAGLE-1 its
    lm_head) and the map from its output vocabulary to target token ids (None: the same ids)."""

    draft: DraftModel
    draft_to_target: Tensor | None = None  # [Vd] target id of each draft token


def inference_device() -> str:
    """Where the reference decoder runs: the first GPU when there is one (an 8B target in fp32 needs it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def on_target(draft: DraftModel, target, draft_to_target: Tensor | None) -> DraftHead:
    """`draft` in fp32 for inference on `target`'s device, with the target's embedding (and lm_head)."""
    draft.load_target_embedding(target.get_input_embeddings().weight.detach().float())
    if hasattr(draft, "load_target_lm_head"):
        draft.load_target_lm_head(target.get_output_embeddings().weight.detach().float())
    # On the target's device (a GPU when there is one).
    draft.float().eval().requires_grad_(False).to(target.device)
    return DraftHead(draft, None if draft_to_target is None else draft_to_target.to(target.device))


def load_head(head_dir: Path, target, weight_dtype: str = "float32") -> DraftHead:
    """A trained head (`draft_head/` from train) on the target, in fp32 for inference.

    `weight_dtype` rounds the weights through that dtype first, as an export in it would store them: the
    reference then computes with exactly the values vLLM loads from a bf16 export.
    """
    _, draft = load_draft(head_dir, DTYPES[weight_dtype])
    vocab = load_vocab_map(Path(head_dir) / "vocab.safetensors") if draft.features == "aux" else None
    return on_target(draft, target, vocab.draft_to_target if vocab else None)


def target_forward(
    target, head: DraftHead, ids: list[int], cache, start: int, last_logits: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """The target reads `ids` at positions start.. (its cache holds the ones before): the head's features
    of those positions (EAGLE-3 aux [1, T, A, H], EAGLE-1 final post-norm [1, T, H]), logits [T, V] (only
    the last position's, [1, V], with `last_logits`: a prefill's) and the final post-norm states [T, H] they
    come from (the teacher of an on-policy rollout)."""
    input_ids_BT = torch.tensor([ids], device=target.device)
    positions_BT = torch.arange(start, start + len(ids), device=target.device)[None]
    features, logits_BTV, final_BTH = target_states(
        target, head, input_ids_BT, positions_BT, cache, last_logits=last_logits
    )
    return features, logits_BTV[0], final_BTH[0]


def target_states(
    target, head: DraftHead, input_ids_BT: Tensor, positions_BT: Tensor, cache, slot_mask_BS=None,
    last_logits: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`target_forward` of a batch: rows at their own positions, `slot_mask_BS` (1 where a row's cached or
    new key is real; None: all are) over the cache's slots and the new ones. Features [B, T, (A,) H], logits
    [B, T, V] ([B, 1, V] with `last_logits`) and final post-norm states [B, T, H], fp32."""
    layer_ids = head.draft.target_layer_ids
    with capture_aux_states(target, layer_ids) as captured:
        final_BTH = target.model(
            input_ids=input_ids_BT, attention_mask=slot_mask_BS, position_ids=positions_BT,
            past_key_values=cache, use_cache=True,
        ).last_hidden_state  # fmt: skip
    logits_BTV = target.lm_head(final_BTH[:, -1:] if last_logits else final_BTH).float()
    if head.draft.features == "aux":
        return torch.stack([captured[i] for i in layer_ids], dim=2).float(), logits_BTV, final_BTH.float()
    return final_BTH.float(), logits_BTV, final_BTH.float()


class DraftState:
    """The head's key/value cache of positions 0..length-1, computed from the target's features only."""

    @staticmethod
    def of(head: DraftHead) -> DraftState:
        """The state that drafts for `head`: a block drafter's (DFlash) or a chain / parallel one's."""
        return BlockDraftState(head) if head.draft.drafting == "block" else DraftState(head)

    def __init__(self, head: DraftHead):
        self.head = head
        self.cache = KVCache(len(head.draft.layers))

    @property
    def length(self) -> int:
        return self.cache.length

    def step(self, ids: list[int], hidden_BTH: Tensor, start: int, cache: KVCache | None = None) -> Tensor:
        """One forward of the head on T positions from `start` after the cached ones (in `cache`, by default
        the state's own): pre-norm out [1, T, H]."""
        device = hidden_BTH.device
        positions_BT = torch.arange(start, start + len(ids), device=device)[None]
        ids_BT = torch.tensor([ids], device=device)
        return self.head.draft(ids_BT, hidden_BTH, positions_BT, self.cache if cache is None else cache)

    def extend(self, next_ids: list[int], features: Tensor) -> Tensor:
        """Read the next verified positions (features of t beside the token at t+1); their keys/values
        join the cache. Returns the pre-norm output [1, 1, H] at the last of them."""
        out_BTH = self.step(next_ids, self.head.draft.target_hidden(features), self.length)
        return out_BTH[:, -1:]

    def token(self, out_B1H: Tensor) -> int:
        """The greedy draft token (a target id) from a pre-norm output."""
        index = int(self.head.draft.logits(out_B1H)[0, -1].argmax())
        return index if self.head.draft_to_target is None else int(self.head.draft_to_target[index])

    def propose(self, out_B1H: Tensor, num_draft_tokens: int) -> list[int]:
        """A chain of greedy drafts from the last cached position; the chain's keys are not kept."""
        drafts, length = [self.token(out_B1H)], self.length
        if self.head.draft.parallel:
            drafts += self.propose_parallel(num_draft_tokens - 1)
        else:
            for i in range(1, num_draft_tokens):
                # Step i reads draft token i at position (last cached) + i, fed its previous output (`carry`).
                out_B1H = self.step([drafts[-1]], self.head.draft.carry(out_B1H), length - 1 + i)
                drafts.append(self.token(out_B1H))
        self.cache.crop(length)
        return drafts

    def round(self, ids: list[int], pending: int, features: Tensor, num_draft_tokens: int) -> list[int]:
        """One round's drafts: read the positions the target verified since the last round (`features`, their
        target states; each beside the token after it), then propose a chain from the last of them."""
        out_B1H = self.extend((ids + [pending])[self.length + 1 :], features)
        return self.propose(out_B1H, num_draft_tokens)

    def propose_parallel(self, num_mask_slots: int) -> list[int]:
        """Drafts 2..k in one pass: mask slots at positions t+1..t+k-1 (t: the last cached position)."""
        if num_mask_slots == 0:
            return []
        draft = self.head.draft
        hidden_BTH = draft.mask_state().expand(1, num_mask_slots, -1)
        out_BTH = self.step([draft.config.mask_token_id] * num_mask_slots, hidden_BTH, self.length)
        return [self.token(out_BTH[:, i : i + 1]) for i in range(num_mask_slots)]


class BlockDraftState(DraftState):
    """A block drafter's (DFlash's) cache: the keys/values of the target's context at positions 0..length-1,
    which is every position the target has verified (its features of position t, not shifted)."""

    def round(self, ids: list[int], pending: int, features: Tensor, num_draft_tokens: int) -> list[int]:
        """The context of the newly verified positions joins the cache; one forward over the block
        [pending, mask x k] at the positions after them drafts the k tokens (vLLM's DFlash round)."""
        draft, device = self.head.draft, features.device
        block_ids_B1J = torch.tensor(
            [[[pending] + [draft.config.mask_token_id] * num_draft_tokens]], device=device
        )
        start_B1 = torch.tensor([[len(ids)]], device=device)
        out_B1JH = draft(block_ids_B1J, start_B1, draft.target_hidden(features), self.cache)
        return [self.token(out_B1JH[:, 0, i : i + 1]) for i in range(1, num_draft_tokens + 1)]


def finish(output: list[int], max_new_tokens: int, stop_token_ids) -> tuple[list[int], bool]:
    """Cut the output at the first stop token (kept) or at max_new_tokens; True when it has ended."""
    for i, token in enumerate(output[:max_new_tokens]):
        if token in stop_token_ids:
            return output[: i + 1], True
    return output[:max_new_tokens], len(output) >= max_new_tokens


@dataclass
class Rounds:
    """What the verifications of one request exposed (`speculative_generate(..., rounds=Rounds())`), for
    on-policy training (train/rollouts.py): the sequence the target read, its features at every one of those
    positions as the head read them, and per round where it began, its drafts, how many were accepted and
    the target's final states at the drafted positions - computed by the verification forward, which read
    the drafts before them."""

    ids: list[int] = field(default_factory=list)  # the sequence the target read, prompt first
    features: list[Tensor] = field(default_factory=list)  # [1, T_i, ...] per target forward, verified rows
    anchors: list[int] = field(default_factory=list)  # the last position the head read before drafting
    drafts: list[list[int]] = field(default_factory=list)  # k target ids per round
    accepted: list[int] = field(default_factory=list)
    final: list[Tensor] = field(default_factory=list)  # [k, H]: row i predicts draft i's position


class Request:
    """One request's decoding: what the target has read (its cache holds exactly these positions), its
    pending token (its next, not yet read by it), the head's state, the output and the counts. A loop
    drives it: `start` with the prefill's features and logits, then until `done`, `draft` the round's
    tokens for the target to read and `verify` with what it computed on them."""

    def __init__(
        self, head: DraftHead, prompt_ids: list[int], num_draft_tokens: int, max_new_tokens: int,
        stop_token_ids=(), rounds: Rounds | None = None, temperature: float = 0.0, seed: int = 0,
    ):  # fmt: skip
        if not prompt_ids:
            raise ValueError("empty prompt: the target needs at least one token")
        self.ids = list(prompt_ids)
        self.k, self.max_new, self.stops = num_draft_tokens, max_new_tokens, stop_token_ids
        self.state, self.rounds, self.counts = DraftState.of(head), rounds, AcceptanceCounts()
        self.drafts: list[int] = []
        self.temperature, self.seed, self.generator = temperature, seed, None

    def start(self, features: Tensor, logits_TV: Tensor) -> None:
        """After the prefill: the target's token is the first output token (no draft yet)."""
        self.features, self.pending = features, self.sample(logits_TV[-1])
        if self.rounds is not None:
            self.rounds.features.append(features)
        self.end([self.pending])

    def draft(self) -> list[int]:
        """The round's drafts; returns what the target reads next: [pending, d_1..d_k]."""
        self.drafts = self.state.round(self.ids, self.pending, self.features, self.k)
        return [self.pending, *self.drafts]

    def verify(self, features: Tensor, logits_TV: Tensor, final_TH: Tensor) -> int:
        """The target read [pending, drafts] (logits_TV[i]: its distribution after position len(ids)+i): the
        longest prefix of drafts it accepts (`accepts`), then its own token at the first rejection, or its
        bonus token after all k. Returns how many of the positions it read it keeps (accepted + 1)."""
        drafts, k = self.drafts, self.k
        accepted = 0
        while accepted < k and self.accepts(logits_TV[accepted], drafts[accepted]):
            accepted += 1
        self.counts.observe(k, accepted)
        self.features = features[:, : accepted + 1]  # the positions just verified, next for the head to read
        if self.rounds is not None:
            self.rounds.anchors.append(len(self.ids) - 1)
            self.rounds.drafts.append(list(drafts))
            self.rounds.accepted.append(accepted)
            self.rounds.final.append(final_TH[:k])
            self.rounds.features.append(self.features)
        self.ids += [self.pending, *drafts[:accepted]]
        self.pending = self.sample(logits_TV[accepted], drafts[accepted] if accepted < k else None)
        self.end(self.output + drafts[:accepted] + [self.pending])
        return accepted + 1

    def accepts(self, logits_V: Tensor, draft: int) -> bool:
        """Greedy (temperature 0): the draft is the target's argmax. Sampled: vLLM's rejection sampling of
        a draft without probabilities (its argmax drafts): accepted when the target's probability of it at
        the temperature is at least a uniform draw."""
        if self.temperature == 0:
            return draft == int(logits_V.argmax())
        probability = torch.softmax(logits_V / self.temperature, dim=-1)[draft]
        return bool(
            probability
            >= torch.rand((), generator=self.generator_on(logits_V.device), device=logits_V.device)
        )

    def sample(self, logits_V: Tensor, rejected: int | None = None) -> int:
        """The target's own token: its argmax at temperature 0, else a draw from its distribution at the
        temperature - without the draft it `rejected`, when there is one (vLLM's recovered token: the
        residual of the target's distribution and a one-hot draft), which keeps the output the target's."""
        if self.temperature == 0:
            return int(logits_V.argmax())
        probs_V = torch.softmax(logits_V / self.temperature, dim=-1)
        if rejected is not None:
            probs_V[rejected] = 0
        return int(torch.multinomial(probs_V, 1, generator=self.generator_on(logits_V.device)))

    def generator_on(self, device) -> torch.Generator:
        """The request's own random stream (seeded: a request decodes the same alone or in a batch)."""
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def end(self, output: list[int]) -> None:
        self.output, self.done = finish(output, self.max_new, self.stops)
        if self.done and self.rounds is not None:
            self.rounds.ids = list(self.ids)


@torch.inference_mode()
def speculative_generate(
    target,
    head: DraftHead,
    prompt_ids: list[int],
    num_draft_tokens: int,
    max_new_tokens: int,
    stop_token_ids=(),
    rounds: Rounds | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], AcceptanceCounts]:
    """Speculative decoding of one prompt, greedy or (temperature > 0) sampled as vLLM verifies, seeded:
    (output token ids, acceptance counts); `rounds` filled with what each verification exposed when
    given."""
    from transformers import DynamicCache

    request = Request(
        head, prompt_ids, num_draft_tokens, max_new_tokens, stop_token_ids, rounds, temperature, seed
    )
    cache = DynamicCache(config=target.config)
    request.start(*target_forward(target, head, request.ids, cache, start=0, last_logits=True)[:2])
    while not request.done:
        start = len(request.ids)
        request.verify(*target_forward(target, head, request.draft(), cache, start))
        rejected = cache.get_seq_length() - len(request.ids)
        if rejected:
            cache.crop(
                -rejected
            )  # the rejected drafts' positions leave the target's cache (a count: negative)
    return request.output, request.counts


def reference_acceptance(
    target_dir: Path,
    head_dir: Path | None,
    prompts: list[list[int]],
    num_draft_tokens: int,
    max_new_tokens: int,
    stop_ids: list[int],
    dtype: str = "float32",
    weight_dtype: str = "float32",
    draft: tuple[DraftModel, Tensor | None] | None = None,
) -> tuple[list[list[int]], AcceptanceCounts]:
    """Outputs and summed counts of the reference decoder (the HF target plus our head) on `prompts`: what
    export verification holds vLLM to, and what the recipe grid (bench/grid.py) ranks heads by. `draft`
    (a draft model and its draft-to-target ids) drafts instead of the head in `head_dir`: a head trained
    elsewhere, read from its export as vLLM reads it (export/read_vllm.py `read_export`)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    target = (
        AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype]).eval().to(inference_device())
    )
    head = on_target(draft[0], target, draft[1]) if draft else load_head(head_dir, target, weight_dtype)
    outputs, total = [], AcceptanceCounts()
    for prompt in tqdm(prompts, desc="reference decoder", unit="prompt"):
        output, counts = speculative_generate(
            target, head, prompt, num_draft_tokens, max_new_tokens, stop_ids
        )
        outputs.append(output)
        total = total + counts
    return outputs, total
