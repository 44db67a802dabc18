"""The EAGLE-3 drafter: the model (``model``; its RoPE in ``rope``, its KV cache and attention in
``attention``, the GPU fusion of its elementwise ops in ``fused``), the folder SGLang and vLLM load
(``export``; the command line's tools for it in ``tools``). How it is trained is ``eagle3.training``,
how it decodes ``eagle3.decoding``. docs/design.md says what each computes.
"""
