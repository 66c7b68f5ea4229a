# The front door: `make test` and `make run` set themselves up on first use.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup test run bench clean

setup:
	@bash scripts/setup.sh

test: setup
	@$(PY) -m tests.runner

# The main job: a small DLRM on a 2x2 mesh (4 ranks sharing this machine's cores).
# Tables with row-wise AdaGrad, dense layers with Adam: the pair that trained best here
# (README, "Training app").
RUN_FLAGS ?= --model=dlrm --dataset=synthetic --model_parallel=2 \
	--embedding_optimizer=rowwise_adagrad --embedding_learning_rate=0.05 \
	--dense_optimizer=adam --dense_learning_rate=0.003 --steps=400
run: setup
	@OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 $(VENV)/bin/horovodrun -np 4 -H localhost:4 --gloo \
		$(PY) -m tfhybrid.train $(RUN_FLAGS)

clean:
	rm -rf $(VENV) .test-reports tfhybrid/custom_ops/_tfhybrid_ops.so
