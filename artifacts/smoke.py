"""The smoke target: a tiny random Llama with a real BPE tokenizer and a ChatML template, built locally.

It is the project's debug model (`experiment=smoke`): every stage runs on it in seconds, on CPU, with no
download. The build is deterministic (same seed, same files), so caches and heads made from it in
different runs or processes agree.

    python -m artifacts.smoke /tmp/smoke_target
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from artifacts import atomic

SMOKE_DATA = Path(__file__).parent / "smoke_data" / "conversations.jsonl"
DONE_MARKER = ".smoke_target_complete"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024
LOGIT_SCALE = 20.0


def smoke_texts() -> list[str]:
    """Every message of the shipped smoke conversations: the tokenizer's training text."""
    texts = []
    for line in SMOKE_DATA.read_text(encoding="utf-8").splitlines():
        texts += [turn["value"] for turn in json.loads(line)["conversations"]]
    return texts


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the smoke conversations, GPT-2 style, with ChatML special tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(smoke_texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def smoke_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> LlamaConfig:
    # head_dim 64 because vLLM's CPU attention supports only a few head sizes; 6 layers so that the
    # EAGLE-3 taps (low, middle, high) are distinct layers.
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def build_smoke_target(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the smoke target to `out_dir` (once: an existing complete build is reused)."""
    out_dir = Path(out_dir)
    if (out_dir / DONE_MARKER).exists():
        return out_dir
    tokenizer = build_tokenizer()
    config = smoke_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # A random init gives near-uniform next-token distributions (entropy 6.9 of 6.9 nats), which no draft
    # can learn from; sharper logits (entropy ~0.9, top token ~0.7 on average, greedy text unchanged) make
    # the smoke target confident like a real LM, so a smoke head measurably learns and drafts.
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    # Built beside the destination and renamed: a killed build never looks complete; every rank of a job
    # builds the same bytes, so the first one published is kept.
    with atomic.publish_dir(out_dir, once=True) as tmp_dir:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / DONE_MARKER).write_text("ok\n")
    if not (out_dir / DONE_MARKER).exists():
        raise ValueError(
            f"{out_dir} exists and is not a smoke target (no {DONE_MARKER}): remove it, or pick another"
        )
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m artifacts.smoke OUT_DIR")
    print(build_smoke_target(sys.argv[1]))
