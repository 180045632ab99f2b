"""EAGLE-2's dynamic draft tree as SGLang 0.5.23 builds it (`--speculative-num-steps` S,
`--speculative-eagle-topk` K, `--speculative-num-draft-tokens` N), drafted by our head and scored against
the target's greedy continuation: the tokens a greedy tree verifier accepts per round. vLLM serves chains
only (heads/reference_decoder.py); this is the estimate for SGLang, where no server runs (docs/sglang.md).

SGLang's algorithm, read in its code (paths under sglang/srt/):
- depth 1: the head's K most probable tokens at the last verified position, scored by their probability
  (speculative/spec_utils.py:417-487 `select_top_k_tokens`, step 0; plain softmax of the draft logits);
- depth d+1: each of the K beams of depth d is read by the head (the path to it in its cache, its pre-norm
  output carried as in a chain) and proposes its K most probable children, scored by the path's cumulative
  probability (parent score x child probability); the best K of the K^2 become the next beams; S depths;
- the N - 1 best-scored nodes of all drafted become the tree (with the root, the N tokens verified:
  speculative/eagle_utils.py:100-129 `organize_draft_results`); a child never outscores its parent, so they
  form a tree;
- greedy verification walks from the root, taking the child equal to the target's greedy token, while it
  can, then adds the target's bonus token (kernels/ops/speculative/spec_tree.py `verify_tree_greedy`).
K = 1, N = S + 1 is the chain of S drafts vLLM serves at k = S.

Greedy verification commits the target's greedy continuation whatever the drafts, so one greedy decode per
prompt serves every tree setting (`GreedyRun`): each round starts where the last one's accepted tokens and
bonus token ended, and the head reads the target's features of the positions verified by then.

    run = greedy_run(target, head, prompt_ids, max_new_tokens + S, ...)
    counts = tree_counts(head, run, num_steps=5, topk=4, num_draft_tokens=8, max_new_tokens=128)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from heads.acceptance import AcceptanceCounts
from heads.reference_decoder import DraftHead, DraftState, target_forward


@dataclass(frozen=True)
class Node:
    token: int  # a target token id
    score: float  # the path's cumulative draft probability
    parent: int  # index of the parent node in the tree's list, -1: the root (the pending token)


@dataclass
class GreedyRun:
    """A prompt and the target's greedy continuation, with the target's features of every position."""

    ids: list[int]  # prompt + continuation
    prompt_length: int
    features: Tensor  # the head's features of each position [1, T, ...] (target_forward)
    stop_token_ids: tuple[int, ...] = ()


@torch.inference_mode()
def greedy_run(
    target, head: DraftHead, prompt_ids: list[int], num_tokens: int, stop_token_ids=()
) -> GreedyRun:
    """The target's greedy continuation of `prompt_ids` (`num_tokens` tokens, not stopped at a stop token:
    a round's drafts are verified past it, as vLLM and SGLang count them) and its features."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    ids = list(prompt_ids)
    _, logits_TV, _ = target_forward(target, head, ids, cache, start=0, last_logits=True)
    for _ in range(num_tokens):
        ids.append(int(logits_TV[-1].argmax()))
        _, logits_TV, _ = target_forward(target, head, ids[-1:], cache, start=len(ids) - 1)
    features, _, _ = target_forward(target, head, ids, DynamicCache(config=target.config), start=0)
    return GreedyRun(ids, len(prompt_ids), features, tuple(stop_token_ids))


def draft_tree(state: DraftState, out_B1H: Tensor, num_steps: int, topk: int) -> list[Node]:
    """Every node SGLang drafts from the last cached position (`out_B1H`, its pre-norm output): K at
    depth 1, K^2 children of the K beams at each further depth. The state's cache is left as it was."""
    head, length = state.head, state.length

    def children(out_B1H: Tensor, parent: int, score: float) -> list[Node]:
        probs = torch.softmax(head.draft.logits(out_B1H)[0, -1].float(), dim=-1)
        p, index = probs.topk(topk)
        if head.draft_to_target is not None:
            index = head.draft_to_target[index]
        return [Node(int(t), score * float(q), parent) for t, q in zip(index, p)]

    nodes = children(out_B1H, -1, 1.0)
    # a beam: (its node's index, the cache and pre-norm output of its parent, which it is read after)
    beams = [(i, state.cache, out_B1H) for i in range(len(nodes))]
    for depth in range(1, num_steps):
        candidates = []
        for index, parent_cache, parent_out in beams:
            cache = copy.deepcopy(parent_cache)
            # the node's token at position (last cached) + depth, fed its parent's output, as a chain step
            out = state.step([nodes[index].token], head.draft.carry(parent_out), length - 1 + depth, cache)
            for child in children(out, index, nodes[index].score):
                candidates.append((child, cache, out))
        first = len(nodes)
        nodes += [child for child, _, _ in candidates]
        best = sorted(range(len(candidates)), key=lambda i: -candidates[i][0].score)[:topk]
        beams = [(first + i, candidates[i][1], candidates[i][2]) for i in sorted(best)]
    return nodes


def select(nodes: list[Node], num_draft_tokens: int) -> list[int]:
    """The N - 1 best-scored nodes (SGLang's torch.topk over all scores), in the order drafted."""
    order = sorted(range(len(nodes)), key=lambda i: -nodes[i].score)
    return sorted(order[: num_draft_tokens - 1])


def chain_accepted(state: DraftState, out_B1H: Tensor, num_steps: int, greedy: list[int]) -> int:
    """What the chain of `num_steps` drafts accepts from the same position (the tree of topk 1)."""
    chain = draft_tree(state, out_B1H, num_steps, 1)
    return accepted_length(chain, list(range(len(chain))), greedy)


def accepted_length(nodes: list[Node], verified: list[int], greedy: list[int]) -> int:
    """Greedy verification: from the root, the child equal to the next greedy token, while there is one."""
    current, accepted = -1, 0
    while accepted < len(greedy):
        step = next(
            (i for i in verified if nodes[i].parent == current and nodes[i].token == greedy[accepted]), None
        )
        if step is None:
            break
        current, accepted = step, accepted + 1
    return accepted


def tree_counts(
    head: DraftHead,
    run: GreedyRun,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
    max_new_tokens: int,
    on_round=None,
) -> AcceptanceCounts:
    """Accepted tokens per round of the tree (S, K, N) along the greedy run, counted as vLLM counts a chain
    of S drafts: one draft of S positions per round, depth i accepted or not (`on_round(position, out_B1H,
    state, accepted)`: each round, for comparisons with other settings at the same positions)."""
    if head.draft.parallel or head.draft.drafting != "chain":
        raise ValueError(
            "EAGLE-2 trees are drafted by chain heads (EAGLE-3, EAGLE-1), not parallel or block ones"
        )
    if not 1 <= num_draft_tokens - 1 <= topk + (num_steps - 1) * topk * topk:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens}: between 2 and 1 + the {topk + (num_steps - 1) * topk**2} "
            f"nodes drafted at num_steps={num_steps}, topk={topk}"
        )
    ids, counts, state = run.ids, AcceptanceCounts(), DraftState(head)
    pending = run.prompt_length  # the position of the target's token not yet read: the round's root

    def done(position: int) -> bool:
        output = ids[run.prompt_length : position + 1]
        return len(output) >= max_new_tokens or any(t in run.stop_token_ids for t in output)

    with torch.inference_mode():
        while not done(pending):
            if pending + num_steps >= len(ids):
                raise ValueError(f"the greedy run ends at {len(ids)}: run it for max_new_tokens + num_steps")
            # The head reads the positions verified since its last round: features of t beside token t+1.
            new = slice(state.length, pending)
            out_B1H = state.extend(ids[new.start + 1 : pending + 1], run.features[:, new])
            nodes = draft_tree(state, out_B1H, num_steps, topk)
            verified = select(nodes, num_draft_tokens)
            accepted = accepted_length(nodes, verified, ids[pending + 1 : pending + 1 + num_steps])
            if on_round is not None:
                on_round(pending, out_B1H, state, accepted)
            counts.observe(num_steps, accepted)
            pending += accepted + 1
    return counts
