"""The shapes of real verifiers and of their drafters, for benchmarks run without the verifier at hand.

``VERIFIER_SHAPES``: transformers config keys of random-weights verifiers (``common.random_verifier``), by
the model whose shape they have, and ``tiny`` for the benchmarks' CPU smoke runs. ``DRAFTER_SHAPES``: what
``DraftConfig.from_verifier`` gives for the verifier's config with a 32k draft vocabulary (tests/test_model.py
checks the SmolLM2 one against SmolLM2's own config). The pipeline never reads them: a stage takes the shape
from the verifier it was given.
"""

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

DRAFTER_SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
                         max_position_embeddings=8192, aux_layers=(2, 15, 27)),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                      max_position_embeddings=131072, aux_layers=(2, 16, 29)),
}

VERIFIER_SHAPES = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0),
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2),
}
