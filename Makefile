# The front door: `make test` and `make run` set themselves up on first use.
# TF picks the stack: 2.21 (default, in .venv) or 2.15 (in .venv-tf2.15), e.g.
# `make test TF=2.15`; SUBSET runs a named subset of the suite (tests/runner.py), and
# KERAS=3 its Keras 3 run.
TF ?= 2.21
VENV := $(if $(filter 2.21,$(TF)),.venv,.venv-tf$(TF))
PY := $(VENV)/bin/python

.PHONY: setup test run serve-demo bench bench-setup clean

setup:
	@TF=$(TF) VENV=$(VENV) bash scripts/setup.sh

# KERAS=3 runs the modules written for both Kerases with Keras 3 as tf.keras
KERAS ?= 2
test: setup
	@$(PY) -m tests.runner --keras $(KERAS) $(if $(SUBSET),--subset $(SUBSET))

# The main job: a small DLRM on a 2x2 mesh (4 ranks sharing this machine's cores).
# Tables with row-wise AdaGrad, dense layers with Adam: the pair that trained best here
# (docs/training-app.md).
RUN_FLAGS ?= --model=dlrm --dataset=synthetic --model_parallel=2 \
	--embedding_optimizer=rowwise_adagrad --embedding_learning_rate=0.05 \
	--dense_optimizer=adam --dense_learning_rate=0.003 --steps=400
run: setup
	@OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/horovodrun -np 4 -H localhost:4 --gloo \
		$(PY) -m tfhybrid.train $(RUN_FLAGS)

# Serving (docs/serving.md): a local Redis Cluster, the DLRM trained on 2x2 and exported
# with its tables in the cluster, a batch served by tfhybrid.serving.Predictor
serve-demo: setup
	@$(PY) scripts/serve_demo.py

# Every benchmark (benchmarks/catalog.py): quick checks into a scratch folder by default;
# BENCH=full reruns the full runs whose files under benchmarks/results the docs quote
# (hours; the emulated cluster's runs need root). The runs need FBGEMM's venv
# (bench-setup) and the TF 2.15 stack (tf_stacks compares the two).
BENCH ?= quick
bench: setup bench-setup
	@$(MAKE) --no-print-directory setup TF=2.15
	@$(PY) benchmarks/catalog.py $(if $(filter full,$(BENCH)),--full) $(if $(ONLY),--only $(ONLY))

# Optional: FBGEMM's CPU TBE, the kernel anchor of benchmarks/optimizer_apply.py, in a venv of
# its own so the TF venv never imports torch. fbgemm-gpu-cpu 1.8.0 is built against torch 2.13
# (the compatibility table in its fbgemm_gpu/__init__.py; its metadata names no torch), and
# torch 2.13.0 is the CPU wheel on this machine's disk: installed first, by exact version, so
# nothing pulls a multi-GB CUDA build of a newer torch.
BENCH_VENV := .venv-bench
BENCH_TORCH := torch==2.13.0
BENCH_FBGEMM := fbgemm-gpu-cpu==1.8.0
bench-setup: $(BENCH_VENV)/.bench-setup $(TFRA_VENV)/.tfra-setup
$(BENCH_VENV)/.bench-setup: Makefile
	python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q $(BENCH_TORCH)
	$(BENCH_VENV)/bin/pip install -q $(BENCH_FBGEMM) numpy $(BENCH_TORCH)
	$(BENCH_VENV)/bin/python -c "import torch, fbgemm_gpu; print('bench-setup: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)"
	touch $@

# TFRA 0.7.2, the last release that loads on TF 2.15.1 (benchmarks/dynamic_tables.py's
# baseline), in a venv of its own over the TF 2.15 stack's packages (a .pth file), so the
# stack's own venv stays as its tests expect; its pkg_resources import needs setuptools < 70
TFRA_VENV := .venv-tfra
TFRA := tensorflow-recommenders-addons==0.7.2
$(TFRA_VENV)/.tfra-setup: Makefile
	@$(MAKE) --no-print-directory setup TF=2.15
	python3 -m venv $(TFRA_VENV)
	.venv-tf2.15/bin/python -c "import site; print(site.getsitepackages()[0])" \
		> "$$($(TFRA_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/tf2.15.pth"
	$(TFRA_VENV)/bin/pip install -q --no-deps $(TFRA) "setuptools<70"
	$(TFRA_VENV)/bin/python -c "import tensorflow as tf; from tensorflow_recommenders_addons import dynamic_embedding; print('tfra on TF', tf.__version__)"
	touch $@

clean:
	rm -rf .venv .venv-tf* $(BENCH_VENV) $(TFRA_VENV) .test-reports tfhybrid/custom_ops/_tfhybrid_ops*.so
