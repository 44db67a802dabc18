"""The EAGLE-3 drafter: the model (``model``; its RoPE in ``rope``, its KV cache and attention in
``attention``, the GPU fusion of its elementwise ops in ``fused``), the folder SGLang and vLLM load
(``export``; the command line's tools for it in ``tools``), and speculative decoding with it: the
loop (``speculative``), the verifier's batch and its masks (``batch``), chain and tree drafting
(``tree``), CUDA-graph steps (``graphed``) and the CPU's few-row matmuls (``skinny``). How it is
trained is ``eagle3.training``. docs/design.md says what each computes.
"""
