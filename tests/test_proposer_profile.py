"""bench/proposer_profile.py: py-spy's collapsed stacks split into where a speculative round's time goes, in
the process that runs the model."""

from bench.proposer_profile import split


def test_the_model_process_samples_are_split_by_stage(tmp_path):
    raw = tmp_path / "probabilistic.txt"
    engine = 'process 7:"VLLM::EngineCore";run_engine_core (core.py:1);step (core.py:2);execute_model (gpu_model_runner.py:3)'
    raw.write_text(
        "\n".join(
            [
                'process 1:"python -m bench.proposer_profile";generate (llm.py:9) 50',  # the client: not counted
                f"{engine};_model_forward (gpu_model_runner.py:4) 60",
                f"{engine};propose (llm_base_proposer.py:5);_sample_draft_tokens (llm_base_proposer.py:6);"
                "compute_probs_and_sample_next_token (llm_base_proposer.py:7) 15",
                f"{engine};propose (llm_base_proposer.py:5);model_forward (llama_eagle3.py:8) 20",
                f"{engine};_sample (gpu_model_runner.py:9);rejection_sample (rejection_sampler.py:10) 5",
                'process 7:"VLLM::EngineCore";wait (threading.py:1) (idle) 99',  # idle: not counted
            ]
        )
    )
    assert split(raw) == {
        "target forward": 60,
        "draft logits and sampling": 15,
        "proposer forward": 20,
        "rejection sampler": 5,
    }
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert split(empty) == {}
