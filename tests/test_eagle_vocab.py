"""The draft vocabulary map: top-k by frequency, d2t as offsets, t2d as a mask, no d2t without pruning."""

import torch

from artifacts.vocab import build_vocab_map, count_tokens, load_vocab_map, save_vocab_map


def test_counts_only_loss_masked_tokens():
    counts = count_tokens([[1, 2, 2, 3], [3, 3]], [[0, 1, 1, 0], [1, 0]], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 1, 0]


def test_top_k_sorted_by_id_with_offsets_and_mask(tmp_path):
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    vocab = build_vocab_map(counts, draft_vocab_size=3)
    # 9, 9, 7 are the top three: ids 2, 3, 5, kept in id order.
    assert vocab.draft_to_target.tolist() == [2, 3, 5]
    assert vocab.d2t.tolist() == [2, 2, 3] and vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [False, False, True, True, False, True]
    save_vocab_map(vocab, tmp_path / "vocab.safetensors")
    loaded = load_vocab_map(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)


def test_ties_keep_the_lower_id():
    vocab = build_vocab_map(torch.tensor([1, 1, 1, 1]), draft_vocab_size=2)
    assert vocab.draft_to_target.tolist() == [0, 1]


def test_no_pruning_means_no_d2t(tmp_path):
    vocab = build_vocab_map(torch.tensor([3, 0, 1]), draft_vocab_size=32000)
    assert vocab.d2t is None and vocab.t2d.all() and vocab.draft_vocab_size == 3
    save_vocab_map(vocab, tmp_path / "vocab.safetensors")
    assert load_vocab_map(tmp_path / "vocab.safetensors").d2t is None


def test_slots_the_answers_leave_go_to_prompt_tokens():
    answers = torch.tensor([5, 0, 3, 0, 0, 0])  # two answer tokens for four slots
    prompts = torch.tensor([9, 0, 0, 4, 7, 4])  # the free slots: token 4 (7), then 3 over 5 (tie: lower id)
    vocab = build_vocab_map(answers, 4, prompts)
    assert vocab.draft_to_target.tolist() == [0, 2, 3, 4]
    assert build_vocab_map(answers, 4).draft_to_target.tolist() == [0, 1, 2, 3]  # without: lowest ids
    # Answer counts always come first, whatever the prompts say.
    assert build_vocab_map(answers, 2, prompts).draft_to_target.tolist() == [0, 2]
