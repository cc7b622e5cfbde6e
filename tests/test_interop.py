"""Interop with the reference implementation (PyPI `dflash==0.1.0`, MIT): same outputs, same greedy acceptance.

The reference package's import name is also `dflash`, so its `dflash/model.py` is read out of the wheel and imported
by file path under another module name. The wheel comes from $DFLASH_REFERENCE_WHEEL, else from `pip download` into
the pytest cache (the tests skip, saying why, when neither works).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from dflash.eval.export import export_zlab, load_drafter
from dflash.eval.live import live_decode
from dflash.eval.replay import replay
from tests.schema_options import DRAFT_SAMPLING, EVAL_BATCH, LIVE_ENGINE

REFERENCE_VERSION = "0.1.0"


@pytest.fixture(scope="session")
def reference(request, tmp_path_factory):
    """The reference `dflash/model.py` as a module named `dflash_reference_model`."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("dflash-reference") if cache is not None else tmp_path_factory.mktemp("dflash-reference")
    wheel = os.environ.get("DFLASH_REFERENCE_WHEEL")
    if wheel and not os.path.isfile(wheel):
        pytest.fail(f"DFLASH_REFERENCE_WHEEL points to a missing file: {wheel}")
    if not wheel:
        pattern = os.path.join(folder, f"dflash-{REFERENCE_VERSION}-py3-none-any.whl")
        if not glob.glob(pattern):
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", f"dflash=={REFERENCE_VERSION}", "-d",
                 str(folder)], capture_output=True, text=True, timeout=300,
            )
            if proc.returncode != 0 or not glob.glob(pattern):
                pytest.skip(f"cannot fetch dflash=={REFERENCE_VERSION} (set DFLASH_REFERENCE_WHEEL): "
                            f"{proc.stderr.strip()[-300:]}")
        wheel = glob.glob(pattern)[0]
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read("dflash/model.py")
    path = os.path.join(folder, "dflash_reference_model.py")
    with open(path + ".tmp", "wb") as f:
        f.write(source)
    os.replace(path + ".tmp", path)
    spec = importlib.util.spec_from_file_location("dflash_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_reference(reference, folder):
    """The reference drafter through its own loading path (transformers from_pretrained on our export)."""
    model, info = reference.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("layer_types", [["full_attention", "full_attention"],
                                         ["sliding_attention", "full_attention", "sliding_attention"]])
def test_reference_model_matches_ours(reference, tiny_target, make_drafter, layer_types, tmp_path):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, layer_types=layer_types, window=8, block_size=4, std=0.1)
    folder = export_zlab(drafter, str(tmp_path / "export"), dtype=torch.float32)
    ours, theirs = load_drafter(folder), load_reference(reference, folder)
    assert theirs.block_size == 4 and theirs.mask_token_id == 3 and list(theirs.target_layer_ids) == [1, 3, 5]
    generator = torch.Generator().manual_seed(0)
    context, queries = 21, 4  # context longer than the sliding window of 8
    target_hidden = torch.randn(2, context, 3 * adapter.hidden_size, generator=generator)
    noise = torch.randn(2, queries, adapter.hidden_size, generator=generator)
    positions = torch.arange(context + queries).expand(2, -1)
    with torch.no_grad():
        expected = theirs(position_ids=positions, noise_embedding=noise, target_hidden=target_hidden)
        got = ours(positions, noise, target_hidden)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The window matters: without it the sliding layers would give another result.
    if "sliding_attention" in layer_types:
        with torch.no_grad():
            unwindowed = ours(positions, noise, target_hidden, attention_mask={})
        assert not torch.allclose(unwindowed, expected, atol=1e-4)


def drafter_with_constant_guess(make_drafter, adapter, token, attention_scale):
    """A drafter whose drafts lean to `token`: MLPs off, mask id = token, attention scaled.

    With the tiny llama target (tied embeddings, greedy output one repeated token) a small attention scale gives
    full blocks and a larger one perturbs the drafts, so acceptance lengths vary from step to step.
    """
    drafter = make_drafter(adapter, layer_types=["sliding_attention", "full_attention"], window=8, block_size=4,
                           mask_token_id=token)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
            layer.mlp.down_proj.weight.zero_()
    return drafter


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # raised inside the reference loop
def test_reference_generate_matches_replay_and_live(reference, tiny_target, make_drafter, tmp_path, monkeypatch):
    from transformers import DynamicCache

    if not hasattr(DynamicCache, "activate_past_recording"):
        pytest.skip("reference dflash_generate needs DynamicCache.activate_past_recording (newer transformers)")
    # return_stats times with torch.cuda.synchronize; plain wall time is enough on CPU.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    adapter = tiny_target("llama")
    prompts = [adapter.chat_ids([{"role": "user", "content": t}]) for t in ("Hi", "What is two plus two?")]
    stop_ids = adapter.stop_token_ids()
    (replayed,) = replay(make_drafter(adapter), adapter, prompts[:1], max_new_tokens=2, batch_size=EVAL_BATCH)
    first = replayed.continuation[0]
    lengths = []
    for scale in (1.0, 1.5):
        drafter = drafter_with_constant_guess(make_drafter, adapter, first, scale)
        folder = export_zlab(drafter, str(tmp_path / f"export{scale}"), dtype=torch.float32)
        theirs = load_reference(reference, folder)
        for prompt, ours in zip(prompts, replay(drafter, adapter, prompts, max_new_tokens=18, batch_size=EVAL_BATCH)):
            stats = reference.dflash_generate(theirs, adapter.model, torch.tensor([prompt]), max_new_tokens=18,
                                              stop_token_ids=stop_ids, return_stats=True)
            assert stats.output_ids[0, len(prompt):].tolist() == ours.continuation
            assert stats.acceptance_lengths == ours.trace.committed
            # Our live decoder (KV caches, cached drafter context) takes the same steps as the reference loop.
            live = live_decode(drafter, adapter, prompt, max_new_tokens=18, stop_token_ids=stop_ids,
                               target_engine=LIVE_ENGINE, draft_sampling=DRAFT_SAMPLING)
            assert live.continuation == ours.continuation and live.trace.committed == stats.acceptance_lengths
            lengths += stats.acceptance_lengths
    assert len(set(lengths)) >= 3, f"acceptance lengths did not vary: {lengths}"
    # A prefill token that is a stop token: no verify step in either.
    stats = reference.dflash_generate(theirs, adapter.model, torch.tensor([prompts[0]]), max_new_tokens=18,
                                      stop_token_ids=[first], return_stats=True)
    (ours,) = replay(drafter, adapter, prompts[:1], max_new_tokens=18, stop_token_ids=[first], batch_size=EVAL_BATCH)
    assert stats.acceptance_lengths == ours.trace.committed == []
