"""bench/proposer_profile.py: py-spy's collapsed stacks split into where a speculative round's time goes, in
the process that runs the model."""

from bench.proposer_profile import split

CLIENT = 'process 1:"python -m bench.proposer_profile"'
ENGINE = f'{CLIENT};<module> (x.py:1);process 7:"VLLM::EngineCore"'
WORKER = f'{ENGINE};_main (spawn.py:2);process 9:"VLLM::Worker";worker_busy_loop (multiproc_executor.py:3)'
RUNNER = f"{WORKER};GPUModelRunner.execute_model (gpu_model_runner.py:4)"


def test_the_model_process_samples_are_split_by_stage(tmp_path):
    raw = tmp_path / "probabilistic.txt"
    raw.write_text(
        "\n".join(
            [
                f"{CLIENT};LLM.generate (llm.py:9) 50",  # the client: not counted
                f"{ENGINE};EngineCore.step (core.py:5);FutureWrapper.result (executor.py:6) 80",  # waits on the worker
                f"{RUNNER};GPUModelRunner._model_forward (gpu_model_runner.py:7) 60",
                f"{WORKER};GPUModelRunner.sample_tokens (gpu_model_runner.py:8);"
                "GPUModelRunner.propose_draft_token_ids (gpu_model_runner.py:9);SpecDecodeBaseProposer.propose (p.py:1);"
                "compute_probs_and_sample_next_token (llm_base_proposer.py:7) 15",
                f"{WORKER};GPUModelRunner.sample_tokens (gpu_model_runner.py:8);"
                "GPUModelRunner.propose_draft_token_ids (gpu_model_runner.py:9);Eagle3LlamaForCausalLM.forward (e.py:8) 20",
                f"{RUNNER};GPUModelRunner._sample (gpu_model_runner.py:9);RejectionSampler.forward (rs.py:10) 5",
                f"{RUNNER};GPUModelRunner._prepare_inputs (gpu_model_runner.py:11) 4",
                f"{RUNNER};LlamaForCausalLM.compute_logits (llama.py:12);LogitsProcessor.forward (lp.py:1) 12",
                f"{WORKER};MessageQueue.dequeue (shm.py:1);MessageQueue.acquire_read (shm.py:2) 99",  # waiting
            ]
        )
    )
    assert split(raw) == {
        "target forward": 60,
        "target lm_head (full vocabulary)": 12,
        "draft logits and sampling": 15,
        "proposer (head forward, its inputs)": 20,
        "rejection sampler": 5,
        "model runner, rest": 4,
    }
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert split(empty) == {}
