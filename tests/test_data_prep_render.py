"""Assistant-only loss masks on real chat templates (Llama-3, ChatML/SmolLM2, Llama-2 with a system prompt)."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data_prep.render import render_all, render_prompt, render_samples

# The templates as their model repositories ship them (whitespace kept).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?\nAnswer in a sentence."},
    {"role": "assistant", "content": "The capital of Italy is Rome, on the Tiber."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome — anything else?"},
]


def make_tokenizer(template, special_tokens, bos, eos):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([m["content"] for m in CONVERSATION] * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, chat_template=template)


TEMPLATES = {
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "{}<|eot_id|>",
    ),
    "chatml_smollm2": (SMOLLM2_TEMPLATE, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "{}<|im_end|>"),
    "llama2_system": (LLAMA2_TEMPLATE, ["<s>", "</s>"], "<s>", "</s>", " {} </s>"),
}


def render_one(tokenizer, conv_id, messages):
    (sample,) = render_samples(tokenizer, conv_id, messages)
    return sample


def masked_pieces(tokenizer, sample):
    """The decoded text of each maximal run of loss-masked tokens."""
    pieces, run = [], []
    for token, masked in zip(sample.input_ids, sample.loss_mask):
        if masked:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    if run:
        pieces.append(tokenizer.decode(run))
    return pieces


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_covers_exactly_the_answers_and_their_end_of_turn(name):
    template, specials, bos, eos, answer_format = TEMPLATES[name]
    tokenizer = make_tokenizer(template, specials, bos, eos)
    sample = render_one(tokenizer, "c0", CONVERSATION)

    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_pieces(tokenizer, sample) == [answer_format.format(a) for a in answers]
    # The ids are exactly what the template gives when vLLM tokenizes the chat.
    assert sample.input_ids == list(tokenizer.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])
    # Nothing of the user turns, the system prompt or the generation prompts is trained on.
    masked_text = "".join(masked_pieces(tokenizer, sample))
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"].split("\n")[0] not in masked_text


def test_chatml_default_system_prompt_is_not_trained_on():
    template, specials, bos, eos, _ = TEMPLATES["chatml_smollm2"]
    tokenizer = make_tokenizer(template, specials, bos, eos)
    sample = render_one(tokenizer, "c0", CONVERSATION[1:3])  # no system message: the template adds one
    assert masked_pieces(tokenizer, sample) == ["Paris.<|im_end|>"]
    assert "SmolLM" in tokenizer.decode(sample.input_ids)


def test_history_rewriting_template_gives_a_sample_per_turn():
    # A template that renders past answers differently from the last one (like templates that strip
    # reasoning from history): each answer is trained as the request that generated it renders it.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[past] {% endif %}{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = make_tokenizer(template, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>")
    samples = render_samples(tokenizer, "c0", CONVERSATION[1:5])
    assert [s.id for s in samples] == ["c0/turn1", "c0/turn2"]
    assert [masked_pieces(tokenizer, s) for s in samples] == [
        ["Paris.<|im_end|>"],
        ["The capital of Italy is Rome, on the Tiber.<|im_end|>"],
    ]
    assert "[past] Paris." in tokenizer.decode(samples[1].input_ids)  # the history as the server renders it


def test_max_length_policy_truncates_or_drops_and_counts():
    template, specials, bos, eos, _ = TEMPLATES["chatml_smollm2"]
    tokenizer = make_tokenizer(template, specials, bos, eos)

    class Conv:
        def __init__(self, id, messages):
            self.id, self.messages = id, messages

    convs = [Conv("long", CONVERSATION), Conv("short", CONVERSATION[1:3])]
    full_len = len(render_one(tokenizer, "long", CONVERSATION).input_ids)
    short_len = len(render_one(tokenizer, "short", CONVERSATION[1:3]).input_ids)
    assert short_len < full_len

    samples, skipped, num_truncated = render_all(tokenizer, convs, max_length=short_len, overlong="truncate")
    assert [s.id for s in samples] == ["long", "short"] and num_truncated == 1
    assert len(samples[0].input_ids) == len(samples[0].loss_mask) == short_len

    samples, skipped, num_truncated = render_all(tokenizer, convs, max_length=short_len, overlong="drop")
    assert [s.id for s in samples] == ["short"] and skipped["too_long"] == 1 and num_truncated == 0

    # Truncated before the first answer: nothing left to learn, skipped and counted.
    samples, skipped, _ = render_all(tokenizer, convs, max_length=5, overlong="truncate")
    assert samples == [] and skipped["no_loss_tokens"] == 2


def test_template_that_raises_is_skipped_and_counted():
    template, specials, bos, eos, _ = TEMPLATES["llama2_system"]
    tokenizer = make_tokenizer(template, specials, bos, eos)

    class Conv:
        id = "bad"
        messages = [CONVERSATION[1], CONVERSATION[1], CONVERSATION[2]]  # two user turns: the template raises

    samples, skipped, _ = render_all(tokenizer, [Conv()], max_length=100, overlong="truncate")
    assert samples == [] and skipped["template_error"] == 1


# Qwen3's way: an assistant turn before the last user message is rendered without its reasoning.
THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}{{ content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_drops_past_reasoning_trains_each_answer_with_its_reasoning():
    tokenizer = make_tokenizer(THINKING_TEMPLATE, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>")
    messages = [
        CONVERSATION[1],
        {"role": "assistant", "content": "<think>\nFrance: Paris.\n</think>\n\nParis."},
        CONVERSATION[3],
        {"role": "assistant", "content": "<think>\nItaly.\n</think>\n\nRome."},
    ]
    first, second = render_samples(tokenizer, "c0", messages)
    assert masked_pieces(tokenizer, first) == ["<think>\nFrance: Paris.\n</think>\n\nParis.<|im_end|>"]
    assert masked_pieces(tokenizer, second) == ["<think>\nItaly.\n</think>\n\nRome.<|im_end|>"]
    assert "France: Paris" not in tokenizer.decode(second.input_ids)  # history as the template shows it
    # Regeneration's prompt for the second turn: the first answer is history the template rewrote, not a
    # token the target generated in this request, so nothing in it is masked.
    prompt = render_prompt(tokenizer, "c0", messages[:3])
    assert sum(prompt.loss_mask) == 0 and prompt.input_ids == second.input_ids[: len(prompt.input_ids)]
