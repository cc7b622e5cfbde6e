"""The schema's defaults (dflash/config/schema.py) as keyword arguments, for tests that call a library function the
way a run with default settings calls it: those functions take these settings without defaults of their own.
Each helper returns the defaults updated with the keywords it is given."""

from typing import Any

from dflash.config.schema import DataSettings, EvalSettings, OfflineCapture, SyntheticSettings, TrainSettings


def _values(settings: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in names}


def answer_options(**given: Any) -> dict[str, Any]:
    """build_dataset's and regenerate's engine settings: group data's."""
    return {**_values(DataSettings(), ("engine", "refill", "decode_attention")), **given}


def synthetic_options(**given: Any) -> dict[str, Any]:
    """synthesize_prompts' settings: group data.synthetic's, and data's batch_size, engine and decode_attention."""
    synthetic = _values(SyntheticSettings(), ("temperature", "top_p", "max_new_tokens", "min_chars",
                                              "max_oversample", "keep_system"))
    return {**synthetic, **_values(DataSettings(), ("batch_size", "engine", "decode_attention")), **given}


def capture_options(**given: Any) -> dict[str, Any]:
    """capture_dataset's settings: group capture=offline's."""
    return {**_values(OfflineCapture(), ("batch_tokens", "shard_tokens", "dtype", "check_every", "pack")), **given}


def eval_options(**given: Any) -> dict[str, Any]:
    """evaluate's settings: group eval's."""
    names = ("batch_size", "mode", "measure_target", "live_engine", "draft_sampling")
    return {**_values(EvalSettings(), names), **given}


EVAL_BATCH = EvalSettings().batch_size  # prompts generated and replayed together (eval.batch_size)
HELDOUT_BATCH = TrainSettings().heldout_batch_size  # held-out samples replayed together (train.heldout_batch_size)
LIVE_ENGINE = EvalSettings().live_engine  # the live decode's target engine (eval.live_engine)
DRAFT_SAMPLING = EvalSettings().draft_sampling  # how the drafter proposes at T > 0 (eval.draft_sampling)
