"""The EAGLE-3 drafter: the model (``model``; its RoPE in ``rope``, its KV cache and attention in
``attention``, the GPU fusion of its elementwise ops in ``fused``), its training-time-test loss
(``loss``), the folder SGLang and vLLM load (``export``), speculative decoding with it
(``speculative``) and data-parallel training (``parallel``). docs/design.md says what each computes.
"""
