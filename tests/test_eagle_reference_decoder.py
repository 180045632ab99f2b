"""The reference speculative decoder: lossless, vLLM's counting on hand-made cases, and the same chain
arithmetic as training's TTT rollout."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from heads.acceptance import AcceptanceCounts
from heads.eagle3 import Eagle3Config, Eagle3Draft
from heads.reference_decoder import DraftHead, DraftState, speculative_generate
from train.losses import parallel_forward, ttt_rollout


def test_acceptance_counts_by_hand():
    counts = AcceptanceCounts()
    for accepted in (3, 0, 1, 2):  # k = 3
        counts.observe(3, accepted)
    assert counts.accepted_per_position == [3, 2, 1]
    assert counts.mean_acceptance_length == 1 + 6 / 4
    assert counts.draft_acceptance_rate == 6 / 12
    assert counts.per_position == [0.75, 0.5, 0.25]
    assert counts.conditional_per_position == [0.75, 2 / 3, 0.5]
    later = counts + AcceptanceCounts(2, 6, 1, [1, 0, 0])
    assert later - counts == AcceptanceCounts(2, 6, 1, [1, 0, 0])
    assert math.isnan(AcceptanceCounts().mean_acceptance_length)


def test_acceptance_counts_read_vllms_metric_objects():
    reader = pytest.importorskip("vllm.v1.metrics.reader")
    metrics = [
        reader.Counter(name="vllm:spec_decode_num_drafts", labels={}, value=10),
        reader.Counter(name="vllm:spec_decode_num_draft_tokens", labels={}, value=30),
        reader.Counter(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=12),
        reader.Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=[6, 4, 2]),
        reader.Counter(name="vllm:prompt_tokens", labels={}, value=99),
    ]
    counts = AcceptanceCounts.from_vllm_metrics(metrics)
    assert counts == AcceptanceCounts(10, 30, 12, [6, 4, 2])
    assert counts.mean_acceptance_length == pytest.approx(2.2)


@pytest.fixture(scope="module")
def target_and_head(smoke_target_dir):
    target = AutoModelForCausalLM.from_pretrained(smoke_target_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(smoke_target_dir), [1, 3, 4], 1024)
    draft = Eagle3Draft(config).eval().requires_grad_(False)
    draft.load_target_embedding(target.get_input_embeddings().weight)
    return target, DraftHead(draft, torch.arange(1024))


def greedy(target, prompt, n):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


PROMPT = [5, 77, 301, 12, 9, 640, 33]


def test_sampled_verification_keeps_the_targets_distribution(target_and_head):
    """At a temperature the output is the target's sampling (vLLM's rejection sampling of argmax drafts):
    the first token after a round is distributed as the target's distribution at T whether the draft was
    likely or not, and the second, given the first draft accepted, as the target's there; a recovered token
    drawn with the rejected draft left in would give the draft (1 - p) p too much."""
    from heads.reference_decoder import Request

    _, head = target_and_head
    t, draws = 0.7, 20_000
    logits_TV = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 1.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    probs_TV = torch.softmax(logits_TV / t, -1)
    first, second = torch.zeros(4), torch.zeros(4)
    for seed in range(draws):
        request = Request(head, [1], 2, 8, temperature=t, seed=seed)
        request.output, request.pending, request.drafts = [], 0, [1, 1]  # draft 1 is p = 0.19 likely
        request.verify(torch.zeros(1, 3, 1), logits_TV, torch.zeros(3, 1))
        first[request.output[0]] += 1
        if request.output[0] == 1:
            second[request.output[1]] += 1
    for counts, probs in ((first, probs_TV[0]), (second, probs_TV[1])):
        n = counts.sum()
        sigma = (probs * (1 - probs) / n).sqrt()
        assert ((counts / n - probs).abs() < 4 * sigma + 1e-3).all(), (counts / n, probs)
    # a seed is a stream: the same seed draws the same tokens, another seed others
    streams = [Request(head, [1], 2, 8, temperature=t, seed=seed) for seed in (3, 3, 4)]
    drawn = [[r.sample(logits_TV[2]) for _ in range(32)] for r in streams]
    assert drawn[0] == drawn[1] != drawn[2]


def test_output_is_the_targets_greedy_output(target_and_head):
    target, head = target_and_head
    output, counts = speculative_generate(target, head, PROMPT, num_draft_tokens=3, max_new_tokens=20)
    assert output == greedy(target, PROMPT, 20)
    assert counts.num_drafts >= 20 // 4 and counts.num_draft_tokens == 3 * counts.num_drafts


def test_counts_of_perfect_and_useless_drafts(target_and_head, monkeypatch):
    target, head = target_and_head
    truth = PROMPT + greedy(target, PROMPT, 20)

    def perfect(state, out, k):
        # state.length == the pending token's position; drafts continue after it.
        return truth[state.length + 1 : state.length + 1 + k]

    monkeypatch.setattr(DraftState, "propose", perfect)
    output, counts = speculative_generate(target, head, PROMPT, 3, max_new_tokens=10)
    # 1 token from the prefill, then 4 per verify step (3 accepted + bonus): 5, 9, 13 -> cut to 10.
    assert output == truth[len(PROMPT) : len(PROMPT) + 10]
    assert counts == AcceptanceCounts(3, 9, 9, [3, 3, 3]) and counts.mean_acceptance_length == 4.0

    def useless(state, out, k):
        return [(truth[state.length + 1] + 1) % 1024] * k  # the first draft is always wrong

    monkeypatch.setattr(DraftState, "propose", useless)
    output, counts = speculative_generate(target, head, PROMPT, 3, max_new_tokens=10)
    assert output == truth[len(PROMPT) : len(PROMPT) + 10]
    assert counts == AcceptanceCounts(9, 27, 0, [0, 0, 0])  # one token (the bonus) per verify step


def test_partial_acceptance_counts_each_position_exactly(target_and_head, monkeypatch):
    """Drafts equal to the target's greedy tokens at their first j of k=3 positions, j chosen per verify
    step: j accepted, j + 1 tokens out (the bonus), +1 at each position i < j - and a draft after the first
    wrong one counts for nothing, even where it is the greedy continuation again."""
    target, head = target_and_head
    truth = PROMPT + greedy(target, PROMPT, 20)
    schedule = iter([2, 0, 1, 3, 1])  # drafts matching per verify step

    def first_j_right(state, out, k):
        right, j = truth[state.length + 1 : state.length + 1 + k], next(schedule)
        return right if j == k else right[:j] + [(right[j] + 1) % 1024] + right[j + 1 :]

    monkeypatch.setattr(DraftState, "propose", first_j_right)
    output, counts = speculative_generate(target, head, PROMPT, 3, max_new_tokens=12)
    # 1 token from the prefill, then 3, 1, 2, 4, 2 per verify step: 13, cut to 12; the last step's drafts
    # are counted all the same (vLLM counts before truncating).
    assert output == truth[len(PROMPT) : len(PROMPT) + 12]
    assert next(schedule, None) is None  # five verify steps, no more
    assert counts == AcceptanceCounts(5, 15, 7, [4, 2, 1])
    assert counts.per_position == [0.8, 0.4, 0.2] and counts.conditional_per_position == [0.8, 0.5, 0.5]


def test_a_stop_token_ends_the_output(target_and_head):
    target, head = target_and_head
    full = greedy(target, PROMPT, 20)
    stop = full[6]
    output, _ = speculative_generate(target, head, PROMPT, 3, max_new_tokens=20, stop_token_ids=[stop])
    assert output == full[: full.index(stop) + 1]


@pytest.mark.parametrize(
    "flags",
    [{}, {"norm_output": True, "fc_norm": True, "norm_before_residual": True}, {"sliding_window": 5}],
    ids=["plain", "norms", "window"],
)
def test_the_chain_is_trainings_ttt_rollout(target_and_head, flags):
    """Teacher-forced, chain step i from position t equals TTT step i at t: what training optimises is what
    the decoder (and vLLM) runs - with the norm flags too (norm_output changes what the chain carries), and
    with a sliding window shorter than the context (head.sliding_window)."""
    target, head = target_and_head
    if flags:
        torch.manual_seed(0)
        config = Eagle3Config(**{**head.draft.config.to_dict(), **flags})
        draft = Eagle3Draft(config).eval().requires_grad_(False)
        draft.load_target_embedding(target.get_input_embeddings().weight)
        head = DraftHead(draft, torch.arange(1024))
    torch.manual_seed(1)
    num_steps, length = 3, 24
    ids = torch.randint(0, 1024, (1, length))
    aux_BTAH = torch.randn(1, length, 3, 256)
    ttt_outs = ttt_rollout(head.draft, ids, aux_BTAH, num_steps)
    for t in (0, 5, length - num_steps - 1):
        state = DraftState(head)
        if t > 4:  # the cache filled in two calls, as successive verify steps fill it
            state.extend(ids[0, 1:5].tolist(), aux_BTAH[:, :4])
        out = state.extend(ids[0, state.length + 1 : t + 2].tolist(), aux_BTAH[:, state.length : t + 1])
        torch.testing.assert_close(out[0, 0], ttt_outs[0][0, t], atol=1e-5, rtol=1e-5)
        for i in range(1, num_steps):
            out = state.step([int(ids[0, t + 1 + i])], head.draft.carry(out), t + i)
            torch.testing.assert_close(out[0, 0], ttt_outs[i][0, t], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def target_and_parallel_head(smoke_target_dir):
    """A two-layer P-EAGLE head on the smoke target (random weights: parity, not quality)."""
    target = AutoModelForCausalLM.from_pretrained(smoke_target_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = Eagle3Config.from_target_config(
        AutoConfig.from_pretrained(smoke_target_dir), [1, 3, 4], 1024, num_hidden_layers=2, mask_token_id=7
    )
    draft = Eagle3Draft(config).eval().requires_grad_(False)
    draft.load_target_embedding(target.get_input_embeddings().weight)
    return target, DraftHead(draft, torch.arange(1024))


def test_parallel_drafting_is_lossless(target_and_parallel_head):
    target, head = target_and_parallel_head
    assert head.draft.parallel
    for k in (1, 3):
        output, counts = speculative_generate(target, head, PROMPT, k, max_new_tokens=20)
        assert output == greedy(target, PROMPT, 20)
        assert counts.num_draft_tokens == k * counts.num_drafts > 0


@pytest.mark.parametrize("window", [None, 4])
def test_a_parallel_round_is_trainings_parallel_forward(target_and_parallel_head, window):
    """The mask slots the decoder (and vLLM) appends after position t equal training's depths at anchor t:
    same inputs, positions and attention, through both layers (and a sliding window shorter than t)."""
    _, head = target_and_parallel_head
    if window is not None:
        torch.manual_seed(0)
        draft = Eagle3Draft(Eagle3Config(**{**head.draft.config.to_dict(), "sliding_window": window}))
        draft.load_state_dict(head.draft.state_dict())
        head = DraftHead(draft.eval().requires_grad_(False), torch.arange(1024))
    torch.manual_seed(1)
    num_depths, length = 4, 20
    ids = torch.randint(0, 1024, (1, length))
    aux_BTAH = torch.randn(1, length, 3, 256)
    outs = parallel_forward(head.draft, ids, aux_BTAH, [None] * num_depths)
    for t in (0, 6, length - 2):
        state = DraftState(head)
        out = state.extend(ids[0, 1 : t + 2].tolist(), aux_BTAH[:, : t + 1])
        torch.testing.assert_close(out[0, 0], outs[0][0, t], atol=1e-5, rtol=1e-5)
        mask_BTH = head.draft.mask_state().expand(1, num_depths - 1, -1)
        slots = state.step([head.draft.config.mask_token_id] * (num_depths - 1), mask_BTH, t + 1)
        for d in range(1, num_depths):
            torch.testing.assert_close(slots[0, d - 1], outs[d][0, t], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_the_output_is_still_the_targets_greedy_output(target_and_head):
    target, head = target_and_head
    cpu_output, cpu_counts = speculative_generate(target, head, PROMPT, 3, 20)
    gpu_target = target.to("cuda")
    gpu_head = DraftHead(head.draft.to("cuda"), head.draft_to_target.to("cuda"))
    try:
        output, counts = speculative_generate(gpu_target, gpu_head, PROMPT, 3, 20)
    finally:
        target.to("cpu"), head.draft.to("cpu")
    assert output == cpu_output and counts.num_drafts > 0
