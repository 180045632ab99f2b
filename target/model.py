"""The target model: where it lives, how to load it, and the hashes that identify it.

Every stage resolves the target through `target_dir` (a local directory, or a hub id downloaded into the
Hugging Face cache) so that the same files are loaded, hashed and recorded in the manifests.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def target_dir(cfg) -> Path:
    """The local directory holding the target: `cfg.path` itself, or its hub snapshot."""
    path = Path(cfg.path).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or cfg.path.startswith("."):
        raise ValueError(f"target.path={cfg.path!r}: no such directory (a hub id looks like 'org/name')")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(cfg.path, revision=cfg.revision))


def load_tokenizer(cfg) -> PreTrainedTokenizerBase:
    """The target's fast tokenizer, with a chat template (from the tokenizer or `target.chat_template`)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg))
    if cfg.chat_template:
        template_path = Path(cfg.chat_template).expanduser()
        is_file = len(cfg.chat_template) < 4096 and "{" not in cfg.chat_template and template_path.is_file()
        tokenizer.chat_template = template_path.read_text() if is_file else cfg.chat_template
    if not tokenizer.chat_template:
        raise ValueError(
            f"The tokenizer of target {cfg.path!r} has no chat template, so conversations cannot be rendered "
            "the way the target sees them when served. Give one with "
            "`target.chat_template=/path/to/template.jinja` (or the Jinja string itself), the same template "
            "vLLM will serve with."
        )
    if not tokenizer.is_fast:
        raise ValueError(
            f"target {cfg.path!r}: a fast tokenizer is needed (character offsets for loss masks)"
        )
    return tokenizer


def load_config(cfg):
    return AutoConfig.from_pretrained(target_dir(cfg))


@contextmanager
def whole_weights():
    """Load a model whole even inside a DeepSpeed ZeRO-3 run: accelerate registers its ZeRO-3 config with
    transformers, whose from_pretrained would then partition the weights into placeholders that only a
    DeepSpeed engine can use (the frozen target of online training runs outside the engine)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def load_model(cfg, device: torch.device | str = "cpu"):
    """The target in `cfg.dtype`, in eval mode, without gradients."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"target.dtype={cfg.dtype!r}: choose one of {sorted(DTYPES)}")
    with whole_weights():
        model = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=DTYPES[cfg.dtype])
    model.to(device).eval().requires_grad_(False)
    return model


def weights_hash(directory: Path) -> str:
    """sha256 over config.json and every weight file, in name order: a content hash of the target."""
    digest = hashlib.sha256()
    files = sorted(
        p for p in directory.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES)
    )
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ValueError(f"{directory}: no weight files (*.safetensors or *.bin)")
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the tokenizer's vocabulary/merges, its special tokens and its chat template."""
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(sorted(tokenizer.special_tokens_map.items())).encode())
    digest.update((tokenizer.chat_template or "").encode())
    return digest.hexdigest()


DFLASH_TARGET_LAYERS = 5  # DFlash's fused target layers (the 5-layer reproductions: ModelOpt, speculators)


def default_aux_layer_ids(num_hidden_layers: int, head_kind: str = "eagle3") -> list[int]:
    """The target layers a head of `head_kind` reads by default, in vLLM's aux-id convention, sorted and
    de-duplicated as vLLM does - the one place every kind's default is chosen (data_prep's cache, online
    training and the export all take the cache's ids).

    EAGLE-3 / P-EAGLE (and EAGLE-1's cache): (2, L//2, L-3). DFlash: DFLASH_TARGET_LAYERS layers evenly
    spaced over the 0-based layer outputs 1..L-3 (z-lab's `build_target_layer_ids`), + 1 for vLLM's aux ids.
    """
    if head_kind != "dflash":
        return sorted({2, num_hidden_layers // 2, num_hidden_layers - 3})
    last = max(1, num_hidden_layers - 3)
    n = DFLASH_TARGET_LAYERS
    return sorted({round(1 + i * (last - 1) / (n - 1)) + 1 for i in range(n)})


def layer_output_ids(aux_layer_ids) -> list[int]:
    """The same layers in the other convention, 0-based decoder-layer outputs (transformers'
    `output_hidden_states[i + 1]`): DFlash's `target_layer_ids` and SGLang's
    `eagle_aux_hidden_state_layer_ids` (its capture hook adds 1 back: sglang/srt/models/llama.py:939).
    vLLM's aux id i is the residual stream entering layer i, which is layer i - 1's output."""
    return [int(i) - 1 for i in aux_layer_ids]


def resolve_aux_layer_ids(ids, num_hidden_layers: int, head_kind: str = "eagle3") -> list[int]:
    """Validated aux ids: id i is the residual stream entering decoder layer i (id L: before the final norm)."""
    if ids is None:
        ids = default_aux_layer_ids(num_hidden_layers, head_kind)
    ids = [int(i) for i in ids]
    if not ids and head_kind != "eagle1":  # an EAGLE-1 head reads only the final state: [] is its cache
        raise ValueError(
            f"cache.aux_layer_ids=[]: a head.kind={head_kind} head needs at least one tapped layer; leave it "
            f"null for the default {default_aux_layer_ids(num_hidden_layers, head_kind)} ([] suits EAGLE-1 heads only)"
        )
    bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
    if bad:
        raise ValueError(
            f"cache.aux_layer_ids={ids}: ids {bad} are outside 0..{num_hidden_layers} for this target"
        )
    if ids != sorted(set(ids)):
        raise ValueError(
            f"cache.aux_layer_ids={ids}: give them ascending and without repeats; vLLM sorts and "
            "de-duplicates them, so any other order would train `fc` on a different concatenation"
        )
    return ids


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (single file or an index of shards)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise ValueError(
            f"{directory}: no model.safetensors(.index.json); the head needs the target's safetensors"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def weights_bytes(cfg) -> int:
    """Bytes the target's weights take in `target.dtype`, from the safetensors headers (nothing loaded)."""
    files = _weight_files(target_dir(cfg))
    numel = 0
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                numel += math.prod(f.get_slice(name).get_shape())
    return numel * DTYPES[cfg.dtype].itemsize


def load_embedding_and_lm_head(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and lm_head [V, H], read without loading the whole model.

    The draft shares the embedding (frozen) and the teacher comes from the lm_head; with tied
    embeddings (SmolLM2, Llama-3.2-1B) the lm_head is the embedding.
    """
    directory = target_dir(cfg)
    files = _weight_files(directory)
    embed_name = next((n for n in ("model.embed_tokens.weight", "embed_tokens.weight") if n in files), None)
    if embed_name is None:
        raise ValueError(f"{directory}: no model.embed_tokens.weight among the target's tensors")

    def read(name):
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name).to(DTYPES[cfg.dtype])

    embed = read(embed_name)
    lm_head = read("lm_head.weight") if "lm_head.weight" in files else embed
    return embed, lm_head


def load_final_norm(cfg) -> torch.Tensor:
    """The weight [H] of the target's final RMSNorm (the one before its lm_head)."""
    directory = target_dir(cfg)
    files = _weight_files(directory)
    name = next((n for n in ("model.norm.weight", "norm.weight") if n in files), None)
    if name is None:
        raise ValueError(f"{directory}: no model.norm.weight among the target's tensors")
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name).float()


@contextmanager
def capture_aux_states(model, aux_layer_ids: list[int]):
    """Record the residual stream entering decoder layer i for each aux id (id L: entering the final norm)."""
    decoder = model.model
    num_layers = len(decoder.layers)
    captured: dict[int, torch.Tensor] = {}

    def recorder(layer_id):
        def hook(module, args, kwargs):
            captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    modules = {i: (decoder.layers[i] if i < num_layers else decoder.norm) for i in aux_layer_ids}
    handles = [m.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, m in modules.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def target_hidden_states(model, input_ids_BT, attention_mask_BT, aux_layer_ids):
    """Aux states [B, T, n_aux, H] and final post-norm states [B, T, H] in one target forward.

    Only the decoder runs: the lm_head's logits are not needed. data_prep caches these; online training
    (`train.features=online`) computes them in the training step: one implementation for both.
    """
    with capture_aux_states(model, aux_layer_ids) as captured:
        final_BTH = model.model(
            input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False
        ).last_hidden_state
    if aux_layer_ids:
        aux_BTNH = torch.stack([captured[i] for i in aux_layer_ids], dim=2)
    else:
        aux_BTNH = final_BTH.new_zeros(*final_BTH.shape[:2], 0, final_BTH.shape[-1])
    return aux_BTNH, final_BTH
