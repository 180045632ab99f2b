"""heads/tree.py, SGLang's EAGLE-2 tree drafted by our head and verified greedily: a tree of topk 1 is the
chain decoder exactly (the decoder export verification holds vLLM to), more verified nodes never accept
fewer tokens on a round, and the tree is built as SGLang builds it. CPU, smoke target and head."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from artifacts.prompts import held_out_prompts, stop_token_ids
from heads.reference_decoder import load_head, speculative_generate
from heads.tree import Node, accepted_length, draft_tree, greedy_run, select, tree_counts
from target.model import load_tokenizer
from tests.helpers import smoke_config

MAX_NEW = 24


@pytest.fixture(scope="module")
def decoding(regen_head):
    """(target in fp32, head, 3 held-out prompts, stop ids): the session's smoke head trained on the target's
    own answers (vLLM accepts ~1.7 tokens per round of 3 from it)."""
    cfg = smoke_config(regen_head, experiment="smoke_regen")
    target_dir = regen_head / "smoke_target"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = load_head(regen_head / "draft_head", target)
    tokenizer = load_tokenizer(cfg.target)
    prompts = held_out_prompts(regen_head / "cache", tokenizer, 3)
    return target, head, prompts, stop_token_ids(tokenizer, target_dir)


@pytest.mark.parametrize("k", [1, 3])
def test_a_tree_of_topk_one_is_the_chain_decoder(decoding, k):
    target, head, prompts, stops = decoding
    accepted = 0
    for prompt in prompts:
        output, chain = speculative_generate(target, head, prompt, k, MAX_NEW, stops)
        run = greedy_run(target, head, prompt, MAX_NEW + k, stops)
        assert run.ids[len(prompt) : len(prompt) + len(output)] == output  # greedy verification commits it
        tree = tree_counts(head, run, num_steps=k, topk=1, num_draft_tokens=k + 1, max_new_tokens=MAX_NEW)
        assert (tree.num_drafts, tree.accepted_per_position) == (
            chain.num_drafts,
            chain.accepted_per_position,
        )
        accepted += chain.num_accepted_tokens
    assert accepted > 0  # a head that drafts well enough for the comparison to mean something


def test_more_verified_nodes_never_accept_fewer_tokens_on_a_round(decoding):
    """At every round of a (3, 2, 4) run: the same drafted tree with N = 2 .. all nodes verified."""
    target, head, prompts, stops = decoding
    steps, topk, most = 3, 2, 2 + 2 * 4
    rounds = []

    def each_round(position, out_B1H, state, tree_accepted):
        nodes = draft_tree(state, out_B1H, steps, topk)
        assert len(nodes) == topk + (steps - 1) * topk * topk
        greedy = run.ids[position + 1 : position + 1 + steps]
        accepted = [accepted_length(nodes, select(nodes, n), greedy) for n in range(2, most + 1)]
        assert accepted == sorted(accepted), accepted
        assert accepted[4 - 2] == tree_accepted  # N = 4: what tree_counts counted on this round
        rounds.append(accepted)

    for prompt in prompts:
        run = greedy_run(target, head, prompt, MAX_NEW + steps, stops)
        tree_counts(head, run, steps, topk, 4, MAX_NEW, on_round=each_round)
    assert len(rounds) > 10 and any(r[-1] > r[0] for r in rounds)  # a wider tree accepts more somewhere


def test_the_tree_is_built_and_verified_as_sglang_does():
    """By hand: the best N - 1 scores, a child reached only through its parent, the greedy walk."""
    nodes = [
        Node(10, 0.6, -1),
        Node(11, 0.3, -1),
        Node(20, 0.6 * 0.5, 0),
        Node(21, 0.6 * 0.4, 0),
        Node(22, 0.3 * 0.9, 1),
        Node(23, 0.3 * 0.05, 1),
    ]
    assert select(nodes, 4) == [0, 1, 2]  # 0.6, 0.3, 0.3 (ties: the first drafted)
    assert select(nodes, 5) == [0, 1, 2, 4]
    assert accepted_length(nodes, select(nodes, 5), [11, 22, 7]) == 2  # root -> 11 -> 22, then a miss
    assert accepted_length(nodes, select(nodes, 4), [11, 22, 7]) == 1  # 22 not verified at N = 4
    assert accepted_length(nodes, select(nodes, 7), [12]) == 0
    assert accepted_length(nodes, select(nodes, 7), [10, 23]) == 1  # 23 is 11's child, not 10's
