"""Whether a run with capture=online keeps its first epoch's features for the later epochs (capture.cache).

Trainer rank 0 decides when a run starts and records the decision in <run_dir>/capture_logs/cache.json with the
fingerprint of the checkpoints it trains: a restart of the same run keeps it (the epochs already passed will not
be captured again).
"""

from __future__ import annotations

import logging
import os
import uuid

from dflash.extract.capture import bytes_per_token
from dflash.extract.feature_cache import FeatureCache, cache_room, cached_epochs
from dflash.extract.store import store_dtype
from dflash.run_files import make_owned_dir, read_json, read_json_or_none, remove_owned_dir, write_json

logger = logging.getLogger(__name__)


def cache_mode(value) -> str:
    """capture.cache as "auto", "true" or "false" (YAML reads true and false as booleans)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value).lower()


def choose_feature_cache(capture, *, run_dir: str, info: dict, hidden_size: int, epochs: int,
                         checkpoint_key: str | None, resume_step: int) -> dict:
    """{"cache": on, "dir": its folder, "checkpoint": checkpoint_key} and, for a cache this run prepared, "token"
    (also in the folder: every trainer rank checks that it sees it, FeatureCache), written to
    capture_logs/cache.json.

    capture: the online capture settings (cache, cache_dir, cache_budget_bytes, dtype); info: the capture stage's
    online.json (taps) with "data", this run's data folder; epochs: of training (one epoch has no later epoch to
    read a cache: off).
    """
    log_dir = os.path.join(run_dir, "capture_logs")
    cache_dir = os.path.abspath(str(capture.cache_dir or os.path.join(run_dir, "feature_cache")))
    token = None
    if resume_step:
        use, cache_dir, token = _resumed(log_dir, checkpoint_key, cache_dir, run_dir)
    elif epochs < 2:
        use = False
        logger.info("[online] feature cache off: training runs one epoch, which nothing would read back")
    else:
        use = _fresh(capture, run_dir, info, hidden_size, cache_dir)
        if use:
            token = uuid.uuid4().hex
            FeatureCache(cache_dir).write_token(token)
    record = {"cache": use, "dir": cache_dir, "checkpoint": checkpoint_key, **({"token": token} if token else {})}
    os.makedirs(log_dir, exist_ok=True)
    write_json(os.path.join(log_dir, "cache.json"), record)
    return record


def _resumed(log_dir: str, key: str | None, cache_dir: str, run_dir: str) -> tuple[bool, str, str | None]:
    """(cache on, its folder, its token: None where the decision recorded none) of a resumed run: the epochs
    already passed decided it. With the cache off then, later epochs have nothing cached for the samples read
    before the restart; with it on, the capture made the first epoch only. A decision recorded for other
    checkpoints (settings changed, then changed back: the old checkpoints are restored while cache.json and the
    cache are another run's) is not used: cache off, every epoch captured, which is right whatever the cache
    holds."""
    previous = read_json_or_none(os.path.join(log_dir, "cache.json"))
    if previous is None or key is None or previous.get("checkpoint") != key:
        if previous is not None and previous["cache"]:  # another run's features: no resume will read them
            remove_owned_dir(previous["dir"], run_dir)
        logger.info("[online] feature cache off: no cache decision was recorded for the checkpoints resumed here")
        return False, cache_dir, None
    use = bool(previous["cache"])
    logger.info(f"[online] feature cache {'on' if use else 'off'}, as when this run started")
    return use, previous["dir"] if use else cache_dir, previous.get("token") if use else None


def _fresh(capture, run_dir: str, info: dict, hidden_size: int, cache_dir: str) -> bool:
    """A run's start: keep the first epoch when the disk holds it, in an emptied folder (what it holds from an
    earlier run is not this run's)."""
    remove_owned_dir(cache_dir, run_dir)
    make_owned_dir(cache_dir)
    taps = len(info["target_layer_ids"])
    tokens = int(read_json(os.path.join(info["data"], "stats.json"))["num_tokens"])
    needed = tokens * bytes_per_token(taps * hidden_size, taps, store_dtype(str(capture.dtype)))
    budget = capture.cache_budget_bytes
    room = cache_room(cache_dir)
    use = cached_epochs(cache_mode(capture.cache), needed, None if budget is None else int(budget), room)
    logger.info(f"[online] feature cache {'on' if use else 'off'}: one epoch is {needed / 2**30:.2f} GiB"
                + (f" -> {cache_dir}; the first epoch only is captured" if use else ""))
    return use
