"""The inference engines, below the stages that use them: KV caches for the drafter and the target (dynamic and
static), the batched regeneration decoder, the verification rules of speculative decoding, and CUDA graphs."""
