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
# The agent smoke target (`target.build=smoke_agent`): the same tiny Llama with a thinking-and-tools template
# of this project's own, built on Qwen3's structure: tool schemas in the system turn, answers after the last
# user turn rendered with their reasoning in <think></think> (earlier ones without), tool calls as JSON in
# <tool_call></tool_call> (vLLM's `hermes` tool parser reads them), tool results grouped in a user turn,
# and `enable_thinking=false` opening the answer with an empty <think> block.
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
AGENT_DATA = Path(__file__).parent / "smoke_data" / "agent_conversations.jsonl"
AGENT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools or messages[0].role == 'system' -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content }}{%- if tools -%}{{ '\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- if tools -%}{{ 'You may call these tools, each call a JSON object in <tool_call></tool_call>:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}{{ '\\n</tools>' }}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- set content = content.strip('\\n') -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user -%}{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ content }}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- if content or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson)"
    " + '\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)
VOCAB_SIZE = 1024
LOGIT_SCALE = 20.0


def smoke_texts(agent: bool = False) -> list[str]:
    """Every message of the shipped smoke conversations (and, for the agent target, of the agentic ones,
    their tool calls and schemas as JSON): the tokenizer's training text."""
    texts = []
    for line in SMOKE_DATA.read_text(encoding="utf-8").splitlines():
        texts += [turn["value"] for turn in json.loads(line)["conversations"]]
    if agent:
        for line in AGENT_DATA.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            texts += [json.dumps(tool) for tool in record.get("tools", [])]
            texts += [json.dumps(message, ensure_ascii=False) for message in record["messages"]]
    return texts


def build_tokenizer(agent: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the smoke conversations, GPT-2 style, with ChatML special tokens (and, for
    the agent target, its thinking and tool tokens and template)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS + (AGENT_TOKENS if agent else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(smoke_texts(agent), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=AGENT_TEMPLATE if agent else CHATML_TEMPLATE,
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


def moe_config(vocab_size: int, eos_token_id: int, pad_token_id: int):
    """The MoE smoke target's: the smoke target's shape in Qwen3-MoE's architecture, 8 experts of
    intermediate 128 per layer with 2 routed per token (and Qwen3's q/k norms)."""
    from transformers import Qwen3MoeConfig

    llama = smoke_config(vocab_size, eos_token_id, pad_token_id).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
            "pad_token_id", "bos_token_id")  # fmt: skip
    return Qwen3MoeConfig(**{k: llama[k] for k in keep}, intermediate_size=512, moe_intermediate_size=128,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0,
                          dtype="float32")  # fmt: skip


def build_smoke_target(out_dir: str | Path, seed: int = 0, agent: bool = False, moe: bool = False) -> Path:
    """Write the smoke target to `out_dir` (once: an existing complete build is reused); `agent`: the
    agent smoke target (its thinking-and-tools template and tokens); `moe`: with it, the MoE smoke target
    (Qwen3-MoE's architecture)."""
    out_dir = Path(out_dir)
    if (out_dir / DONE_MARKER).exists():
        return out_dir
    tokenizer = build_tokenizer(agent or moe)
    torch.manual_seed(seed)
    if moe:
        from transformers import Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(
            moe_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        )
    else:
        config = smoke_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        model = LlamaForCausalLM(config)
    model.eval()
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
