"""The EAGLE-3 drafter: the model (``model``; its RoPE in ``rope``, its KV cache and attention in
``attention``, the GPU fusion of its elementwise ops in ``fused``), its training-time-test loss
(``loss``), the folder SGLang and vLLM load (``export``), data-parallel training (``parallel``), and
speculative decoding with it: the loop (``speculative``), the verifier's batch and its masks
(``batch``), chain and tree drafting (``tree``), CUDA-graph steps (``graphed``) and the CPU's few-row
matmuls (``skinny``). docs/design.md says what each computes.
"""
