"""TargetAdapter: one frozen Hugging Face target model behind a small, version-stable surface.

The drafter needs four things from its target: the frozen input embedding, the frozen output head, the hidden
states of a few decoder layers (the "taps") and, for live decoding, logits. Everything that depends on how a
transformers release lays out a family (where the decoder layers live, what a layer returns) stays in the
family's adapter subclass; the rest of the project only sees this class.

Layer-id convention (method.md §2): tap id L is the OUTPUT of decoder layer L (0-based), which equals
`output_hidden_states[L + 1]` of the HF model for L < N-1.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dflash.host_copy import host_to_device
from dflash.models.targets.engine_attention import EngineCache
from dflash.models.targets.layout import TargetLayout, layout_problem
from dflash.models.targets.logit_transform import logit_transform_of
from dflash.models.targets.packed_attention import OffsetsNotPassed, packed_attention

# Names of end-of-turn tokens used by common chat templates; the ones present in a tokenizer stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
# What TargetAdapter.forward returns besides the features.
FORWARD_OUTPUTS = ("features", "final", "logits")


def beside(mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask on the inputs' device (from the host without a wait for the GPU)."""
    if mask is None or mask.device == input_ids.device:
        return mask
    return host_to_device(mask, input_ids.device)


class _StopForward(Exception):
    """Raised from the deepest tap's hook so the forward stops once every requested feature is captured."""


def ensure_pad_token(tokenizer: Any) -> Any:
    """`tokenizer`, given its end-of-sequence token as pad token where it has none: some tokenizer releases (SmolLM2
    under transformers 5.17) have none, and batches need one."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def without_bpe_cleanup(tokenizer: Any) -> Any:
    """`tokenizer`, its decode's clean-up of spaces turned off where its model is BPE, for which that clean-up strips
    real spaces before punctuation: transformers 5.7 and later skip it there anyway (unless a tokenizer sets
    clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output, which is left as it asks), warning at
    the first decode where the tokenizer's config asks for it (SmolLM2's does, on some releases); earlier releases
    applied it. So the text is the same on every release, and no warning comes that no user can act on."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if backend is not None and type(backend.model).__name__ == "BPE" and not forced:
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """Map "auto" / "bfloat16" / "float32" (or a torch dtype) to a torch dtype; float16 is refused.

    "auto" is bfloat16 on CUDA and float32 elsewhere. float16 overflows in the feature fusion (method.md §4),
    so it is never accepted.
    """
    names = {
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    }
    if isinstance(dtype, str):
        if dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'bfloat16' or 'float32'")
        resolved = names[dtype]
    else:
        resolved = dtype
    if resolved == torch.float16:
        raise ValueError("float16 is not supported for targets (hidden states overflow); use bfloat16 or float32")
    if resolved not in (torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported target dtype {resolved}; use bfloat16 or float32")
    return resolved


class TargetAdapter:
    """A frozen HF *ForCausalLM plus its tokenizer, with hook-based capture of decoder-layer outputs."""

    # forward() without logits leaves the padding mask out (see `_run_decoder`): None = on CUDA inputs only.
    drop_padding_mask: bool | None = None

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        model.eval()
        model.requires_grad_(False)
        without_bpe_cleanup(ensure_pad_token(tokenizer))
        self.model = model
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config()
        self.model_type: str = model.config.model_type
        self.num_layers: int = int(text_config.num_hidden_layers)
        self.hidden_size: int = int(text_config.hidden_size)
        self.vocab_size: int = int(self.embed_tokens().weight.shape[0])
        self.config = text_config
        if getattr(text_config, "attn_logit_softcapping", None) and model.config._attn_implementation != "eager":
            # Only HF's eager attention applies Gemma 2's attention soft cap (SDPA drops it, and transformers 5.17
            # picks SDPA for it): without the cap, capture and live decoding would run another model than the
            # static engines, which apply it.
            model.set_attn_implementation("eager")
        # What the model does to hidden @ lm_head^T: the drafter's logits, sharing the head, get the same.
        self.logit_transform = logit_transform_of(text_config)
        layers = self.decoder_layers()
        if len(layers) < self.num_layers:
            raise ValueError(
                f"{type(self).__name__} found {len(layers)} decoder layers in {type(model).__name__}, "
                f"expected {self.num_layers}"
            )

    # Family-specific layout -------------------------------------------------------------------------------

    def text_model(self) -> nn.Module:
        """The decoder stack (embed_tokens, layers, norm) whose forward returns hidden states, not logits."""
        raise NotImplementedError(f"{type(self).__name__} must define text_model()")

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, in order; tap id L hooks `decoder_layers()[L]`."""
        return self.text_model().layers

    def final_norm(self) -> nn.Module:
        """The text model's last norm: its output is the LM head's input."""
        return self.text_model().norm

    def static_layout_problem(self) -> str | None:
        """Why the static engines (dflash/inference/) cannot run this target's layers, or None when they can."""
        return layout_problem(self)

    def static_layout(self) -> TargetLayout:
        """The target's modules and shapes for the static engines (which run each decoder layer's own forward with
        their attention, engine_attention.py): the dense Llama layout here; a family whose modules sit elsewhere
        overrides this and static_layout_problem()."""
        return TargetLayout.of(self)

    @property
    def engine_layout(self) -> TargetLayout:
        """static_layout() of the model as it is now: what the static engines and forward() over an EngineCache run.
        Made once, and made again after the model moved to another device or dtype (the layout records both, and
        the engines size and type their caches by them)."""
        layout = getattr(self, "_engine_layout", None)
        if layout is None or (layout.device, layout.dtype) != (torch.device(self.device), self.dtype):
            layout = self._engine_layout = self.static_layout()
        return layout

    @classmethod
    def layout_of(cls, model: nn.Module) -> TargetAdapter:
        """An adapter over `model` that only answers `text_model()` and `decoder_layers()`: no tokenizer, no
        checks, so it works on a meta-device model before loading (dflash.models.targets.placement uses it)."""
        shell = cls.__new__(cls)
        shell.model = model
        return shell

    # Properties -------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The embedding's device: where inputs go and where every feature, final state and logit is returned.

        For a target placed layer-wise over several GPUs (load_target with a device list) this is the first one.
        """
        return self.embed_tokens().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens().weight.dtype

    def embed_tokens(self) -> nn.Embedding:
        """The frozen input embedding module."""
        return self.model.get_input_embeddings()

    def lm_head_weight(self) -> torch.Tensor:
        """The frozen output head weight [V, H] (the embedding weight for tied models)."""
        return self.model.get_output_embeddings().weight

    # Features ---------------------------------------------------------------------------------------------

    def check_layer_ids(self, layer_ids: list[int]) -> list[int]:
        """Validate tap ids: non-empty, unique integers in [0, num_layers - 1]."""
        ids = [int(i) for i in layer_ids]
        if not ids:
            raise ValueError("layer_ids is empty: give at least one target layer id")
        for i in ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"target layer id {i} is out of range for {self.model_type} with {self.num_layers} layers "
                    f"(valid: 0..{self.num_layers - 1})"
                )
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids has duplicates: {ids}")
        return ids

    @staticmethod
    def check_right_padding(attention_mask: torch.Tensor | None) -> None:
        """Raise ValueError unless every row of the mask is ones then zeros (positions are taken as 0..T-1)."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attention_mask is not right-padded: capture assumes real tokens first, padding last")

    def _run_decoder(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **packing: Any) -> None:
        """Run the decoder stack (no LM head) on a right-padded batch whose mask was checked.

        On CUDA (or when `drop_padding_mask` is True) the mask is left out: under a causal mask a real token only
        sees earlier positions, and with right padding those are all real, so the padding mask changes nothing on
        real tokens: not in attention, not in the GDN recurrence or conv (both causal), not in MoE routing (per
        token). Leaving it out spares building the [b, 1, T, T] mask, lets SDPA take its causal flash kernel
        instead of the masked one, and skips the GDN layers' zeroing of padded states. Only the padded positions'
        states change. On the CPU the mask is kept by default, so CPU results stay as they were.
        `packing` holds a packed row's position ids and offsets (capture_packed), passed on to every layer.
        """
        drop = self.drop_padding_mask if self.drop_padding_mask is not None else input_ids.is_cuda
        with torch.no_grad():
            self.text_model()(input_ids=input_ids, attention_mask=None if drop else beside(attention_mask, input_ids),
                              use_cache=False, **packing)

    def kernels(self) -> contextlib.AbstractContextManager[None]:
        """The kernel choices this adapter's forwards without a cache run under: none here (a GDN hybrid's causal
        conv1d choice, hybrid.py)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def taps(self, layer_ids: list[int], stop_at: int | None = None) -> Iterator[dict[int, torch.Tensor]]:
        """Inside the block, each decoder layer in `layer_ids` puts its output into the dict the block gets, by id,
        whenever it runs. With `stop_at` (one of the ids) the forward ends right after that layer: its hook raises,
        the block ends there without an error, and the layers after it never run."""
        layers = self.decoder_layers()
        store: dict[int, torch.Tensor] = {}
        handles = []
        for layer_id in set(layer_ids):
            def hook(module: nn.Module, args: Any, output: Any, layer_id: int = layer_id) -> None:
                # Decoder layers return a tensor in recent releases and a tuple in older ones.
                store[layer_id] = output[0] if isinstance(output, (tuple, list)) else output
                if layer_id == stop_at:
                    raise _StopForward
            handles.append(layers[layer_id].register_forward_hook(hook))
        try:
            yield store
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int],
                output: str = "features", *, cache: Any = None, position_ids: torch.Tensor | None = None,
                last_logits_only: bool = False, **packing: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The one forward of the target, behind capture(), capture_packed(), capture_with_final(),
        forward_with_features() and, with a cache, the live decoder's CachedTarget (dflash/inference/target_cache.py).
        Returns the features [b, T, K*H] of the taps in `layer_ids` order (None for empty `layer_ids`, which only a
        forward with a cache takes) and by `output`
        - "features": None; the decoder stack runs up to the deepest tap only, never the LM head;
        - "final": the final normed hidden state [b, T, H] (the LM head's input, HF's `output_hidden_states[-1]`,
          caught by a hook on the final norm); the whole decoder stack, still without the LM head;
        - "logits": logits [b, T, V] of the whole model, run with the padding mask ([b, 1, V] of the last position
          with `last_logits_only`, where the model takes logits_to_keep).
        Without a cache, `attention_mask` is right padding (checked) and padded positions hold unspecified states
        without logits (see `_run_decoder`); real positions equal an unpadded forward's. A mask on the host beside
        inputs on the GPU is checked on the host (a check of a GPU mask waits for the GPU), and copied over only where
        the forward reads it.
        `position_ids` and `packing`: a packed row's positions and offsets (capture_packed), passed on to every
        layer.
        With `cache` (a transformers Cache, extended in place; output "logits" only) the tokens are appended at
        `position_ids` after the cached positions; `attention_mask` spans the cached and the new positions and is
        the caller's, not checked (a decode step reads nothing back from the device); a GDN hybrid's causal conv
        runs under the caller's choice ("auto" unless a gdn_kernels.conv_choice is open), not under kernels(),
        which holds the conv that set_gdn_conv picks for capture. With an EngineCache (a static engine's KV cache,
        engine_attention.py; output "logits" only) the static layout's layers run over it (`_engine_forward`).
        Everything is returned on the adapter's device."""
        if output not in FORWARD_OUTPUTS:
            raise ValueError(f"output must be one of {FORWARD_OUTPUTS}, got {output!r}")
        if cache is not None and output != "logits":
            raise ValueError(f"a forward with a cache returns logits (output='logits'), got output={output!r}")
        ids = self.check_layer_ids(layer_ids) if layer_ids or cache is None else []
        if isinstance(cache, EngineCache):
            return self._engine_forward(input_ids, ids, cache)
        if cache is None:
            self.check_right_padding(attention_mask)
        if position_ids is not None:
            packing["position_ids"] = position_ids
        final: list[torch.Tensor] = []
        logits = None
        norm_hook = self.final_norm().register_forward_hook(
            lambda _module, _args, out: final.append(out)) if output == "final" else None
        kernels = self.kernels() if cache is None else contextlib.nullcontext()
        try:
            with kernels, self.taps(ids, stop_at=max(ids) if output == "features" else None) as store:
                if output == "logits":
                    logits = self._logits(input_ids, attention_mask, cache, last_logits_only, **packing)
                else:
                    self._run_decoder(input_ids, attention_mask, **packing)
        finally:
            if norm_hook is not None:
                norm_hook.remove()
        features = self._concat(ids, store) if ids else None
        if output == "logits":
            return features, logits.to(self.device)
        if output == "final":
            if len(final) != 1:
                raise RuntimeError(f"the final norm of {self.model_type} ran {len(final)} times in one forward, "
                                   f"not once")
            return features, final[0].to(self.device)
        return features, None

    def _engine_forward(self, input_ids: torch.Tensor, ids: list[int],
                        cache: EngineCache) -> tuple[torch.Tensor | None, torch.Tensor]:
        """forward() over a static engine's KV cache: `engine_layout`'s run (the embedding and each decoder layer's own
        forward with the cache's RoPE and attend function) and the logits of the cache's `rows` of the last layer's
        output; the features [b, t, K*H] of the taps in `ids` (None without taps). The engine enters
        engine_attention(engine_layout.layers) around the call; the attention mask and last_logits_only are the
        engine's (its attend function and `rows`), so forward() reads neither."""
        layout = self.engine_layout
        hidden, taps = layout.run(input_ids, cache.rope, cache.attend, ids)
        logits = layout.logits(hidden[cache.rows])
        return torch.cat([taps[i] for i in ids], dim=-1) if ids else None, logits

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any,
                last_logits_only: bool, **inputs: Any) -> torch.Tensor:
        """The whole model's logits; with `cache` the model reads and extends it (use_cache)."""
        parameters = self._model_parameters
        if cache is not None:
            # transformers 5.24 renamed the argument to `cache` (`past_key_values`, the only name in 5.17, is
            # deprecated there).
            inputs["cache" if "cache" in parameters else "past_key_values"] = cache
        if last_logits_only and "logits_to_keep" in parameters:
            inputs["logits_to_keep"] = 1  # a prompt's [T, vocab] logits are GBs for long prompts
        with torch.no_grad():
            return self.model(input_ids=input_ids, attention_mask=beside(attention_mask, input_ids),
                              use_cache=cache is not None, **inputs).logits

    @functools.cached_property
    def _model_parameters(self) -> frozenset[str]:
        """The argument names of the HF model's forward."""
        return frozenset(inspect.signature(self.model.forward).parameters)

    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int]
    ) -> torch.Tensor:
        """Features [b, T, K*H] of the taps in `layer_ids` order (right padding), without computing logits:
        forward(output="features"), which stops right after the deepest tap."""
        return self.forward(input_ids, attention_mask, layer_ids)[0]

    def capture_packed(self, input_ids: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
        """capture() of sequences laid end to end in one row, without padding: `input_ids` [T] holds sequences of
        `lengths` (sum T) back to back; returns their features [T, K*H] in the same order.

        Every sequence starts at position 0 and sees only itself: its attention runs packed_attention_forward
        (FlashAttention's variable-length kernel on CUDA) and the GDN layers of a hybrid restart their conv and
        recurrent states at each sequence (fla's kernels read the offsets; the torch references run per sequence).
        Features equal those of each sequence captured alone, up to the kernels' rounding. A target whose attention
        the packed kernels cannot repeat (packing_problem) is captured as one right-padded batch instead.
        """
        ids = self.check_layer_ids(layer_ids)
        if input_ids.dim() != 1:
            raise ValueError(f"capture_packed takes a 1-D row of token ids, got shape {tuple(input_ids.shape)}")
        if not lengths or min(lengths) < 1 or sum(lengths) != input_ids.numel():
            raise ValueError(f"packed lengths must be positive and sum to the row's {input_ids.numel()} tokens, "
                             f"got {len(lengths)} lengths summing to {sum(lengths)}")
        if self.packing_problem() is not None:
            return self._capture_padded(input_ids, lengths, ids)
        sizes = torch.tensor(lengths, dtype=torch.int64)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = sizes.cumsum(0)
        positions = torch.arange(input_ids.numel()) - offsets[:-1].repeat_interleave(sizes)
        device = input_ids.device
        offsets = host_to_device(offsets, device)
        try:
            with packed_attention(self.model, max(lengths)):
                features, _ = self.forward(input_ids[None], None, ids,
                                           position_ids=host_to_device(positions, device)[None],
                                           cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)
        except OffsetsNotPassed:
            self.unpacked_reason = "its decoder layers do not pass the packing offsets on to their attention"
            return self._capture_padded(input_ids, lengths, ids)
        return features[0]

    # Set when a packed forward found that the layers drop the offsets (capture_packed): padded from then on.
    unpacked_reason: str | None = None

    def packing_problem(self) -> str | None:
        """Why packed capture would not equal a plain forward on this target (attention sinks, soft-capped
        attention logits, chunked attention: packed_attention_forward has none of them; query scales taken from
        the row's positions; layers that drop the offsets), or None."""
        if self.unpacked_reason is not None:
            return self.unpacked_reason
        softcap = getattr(self.config, "attn_logit_softcapping", None)
        if softcap:
            return f"its attention soft-caps its logits (attn_logit_softcapping={softcap})"
        if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in self.decoder_layers().modules()):
            return "its attention has sinks"
        if "chunked_attention" in (getattr(self.config, "layer_types", None) or []):
            chunk = getattr(self.config, "attention_chunk_size", None)
            return f"its attention is chunked (attention_chunk_size={chunk})"
        if getattr(self.config, "attn_temperature_tuning", False):
            # Llama 4's NoPE layers scale each query by its index in the row, not in its own sequence.
            return "its NoPE layers scale their queries by the token's place in the row (attn_temperature_tuning)"
        return None

    def _capture_padded(self, input_ids: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
        """capture_packed's result [T, K*H] from one right-padded batch of the sequences."""
        rows = list(torch.split(input_ids, lengths))
        batch = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        sizes = torch.tensor(lengths, device=batch.device)
        mask = torch.arange(batch.shape[1], device=batch.device)[None] < sizes[:, None]
        features = self.capture(batch, mask.long(), layer_ids)
        return features[mask.to(features.device)]

    def capture_with_final(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`capture()`'s features [b, T, K*H] plus the final normed hidden state [b, T, H] (the LM head's input):
        forward(output="final"), the whole decoder stack without the LM head."""
        return self.forward(input_ids, attention_mask, layer_ids, output="final")

    def forward_with_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One full forward: logits [b, T, V] and the same features as `capture()` (forward(output="logits"))."""
        features, logits = self.forward(input_ids, attention_mask, layer_ids, output="logits")
        return logits, features

    def _concat(self, ids: list[int], store: dict[int, torch.Tensor]) -> torch.Tensor:
        missing = [i for i in ids if i not in store]
        if missing:
            raise RuntimeError(f"decoder layers {missing} of {self.model_type} did not run; no features captured")
        # A layer-wise placed target computes taps on several devices; features are returned on the first.
        return torch.cat([store[i].to(self.device) for i in ids], dim=-1)

    # Chat -------------------------------------------------------------------------------------------------

    def stop_token_ids(self) -> list[int]:
        """Ids that end a generation: the configured eos ids plus any known end-of-turn token in the vocab."""
        found: list[int] = []

        def add(value: Any) -> None:
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v is not None and int(v) not in found:
                    found.append(int(v))

        generation_config = getattr(self.model, "generation_config", None)
        add(getattr(generation_config, "eos_token_id", None))
        add(getattr(self.config, "eos_token_id", None))
        add(self.tokenizer.eos_token_id)
        vocab = self.tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in vocab:
                add(vocab[token])
        return found

    def stop_strings(self) -> list[str]:
        """Texts that end an answer where no stop token does (the plain format's next turn, chat_template.py)."""
        from dflash.models.targets.chat_template import answer_stop_strings

        return answer_stop_strings(self.tokenizer)

    def chat_ids(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` through the chat template, with the generation prompt added."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of this {self.model_type} target has no chat template")
        ids = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, **template_kwargs
        )
        # transformers 5.x may return a BatchEncoding instead of a plain list.
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_type={self.model_type!r}, num_layers={self.num_layers}, "
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, dtype={self.dtype}, device={self.device})"
        )
