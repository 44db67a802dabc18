"""The drafter's shapes, names, RoPE, and its attention pattern in training and in decoding."""

from __future__ import annotations

import runpy
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor
from transformers import AutoConfig, DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eagle3.drafter import attention, model, rope
from eagle3.training import loss
from eagle3.drafter.attention import KVCache, cached_attention, document_block_mask, masked_attention, rows_attention
from eagle3.drafter.model import DraftConfig
from eagle3.drafter.rope import rope_frequencies
from support.reference import explicit_attention
from support.repo import ROOT
from support.tiny_drafter import DEBUG, make_drafter, one_thread  # noqa: F401 (autouse fixture)

CONF = Path(__file__).parent.parent / "conf"
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

STATE_KEYS = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def test_names_shapes_and_vocab():
    drafter = make_drafter()
    cfg = drafter.config
    assert set(drafter.state_dict()) == STATE_KEYS  # the frozen embedding is never saved
    assert drafter.fc.weight.shape == (cfg.hidden_size, 3 * cfg.hidden_size)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (cfg.num_attention_heads * cfg.head_dim, 2 * cfg.hidden_size)
    assert drafter.midlayer.self_attn.k_proj.weight.shape == (cfg.num_key_value_heads * cfg.head_dim, 2 * cfg.hidden_size)
    assert drafter.lm_head.weight.shape == (cfg.draft_vocab_size, cfg.hidden_size)
    assert int(drafter.t2d.sum()) == cfg.draft_vocab_size
    assert drafter.t2d[torch.arange(cfg.draft_vocab_size) + drafter.d2t].all()
    B, T = 2, 5
    hidden = drafter.fc(torch.randn(B, T, 3 * cfg.hidden_size))
    logits, h2 = drafter(torch.randint(0, cfg.vocab_size, (B, T)), hidden, torch.arange(T), KVCache())
    assert logits.shape == (B, T, cfg.draft_vocab_size) and h2.shape == (B, T, cfg.hidden_size)
    assert not any(p.requires_grad for p in drafter.buffers())


@pytest.mark.parametrize("scaling", [None, LLAMA3_ROPE])
def test_rope_matches_transformers(scaling):
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500000.0,
                         rope_scaling=dict(scaling) if scaling else None, max_position_embeddings=131072)
    if scaling:
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    else:
        expected = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    got = rope_frequencies(128, 500000.0, scaling)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    cfg = DraftConfig.from_verifier(config, 1000, [2, 16, 29])
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == (dict(LLAMA3_ROPE) if scaling else None)


def test_from_verifier_and_overrides(tiny_verifier_dir, smollm2_dir):
    tiny = DraftConfig.from_verifier(AutoConfig.from_pretrained(tiny_verifier_dir), 4096, [1, 2, 3])
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim) == (64, 4, 2, 16)
    assert (tiny.vocab_size, tiny.draft_vocab_size, tiny.rope_theta, tiny.rope_scaling) == (49152, 4096, 100000.0, None)
    smol = DraftConfig.from_verifier(AutoConfig.from_pretrained(smollm2_dir), 32000, [2, 15, 27], {"intermediate_size": 768})
    shapes = runpy.run_path(str(ROOT / "benchmarks" / "shapes.py"))  # the benchmarks are scripts, not a package
    assert smol == DraftConfig.create(shapes["DRAFTER_SHAPES"]["smollm2-135m"], {"intermediate_size": 768, "rms_norm_eps": smol.rms_norm_eps})
    with pytest.raises(ValueError, match="unknown drafter setting"):
        DraftConfig.create(DEBUG, {"hidden": 3})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        DraftConfig.create(DEBUG, {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})


def test_kimi_description_gives_a_servable_drafter():
    """Kimi-K2.5's YaRN (which the drafter could follow) and MLA head size are replaced by conf/model/kimi-k2.5.yaml's draft_head."""
    kimi = DeepseekV3Config(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                            num_hidden_layers=61, vocab_size=163840, max_position_embeddings=262144, rope_theta=50000.0,
                            rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    assert DraftConfig.from_verifier(kimi, 32000, [2, 30, 58]).rope_scaling["rope_type"] == "yarn"
    overrides = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "kimi-k2.5.yaml").draft_head)
    cfg = DraftConfig.from_verifier(kimi, 32000, [2, 30, 58], overrides)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.rope_scaling, cfg.rope_theta) == (128, 64, None, 50000.0)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (7168, 18432, 163840, 262144)


def test_chain_attention_sees_own_row_only():
    """Step 2 of TTT at T=3: row r sees context keys 0..r and its own chain keys, nothing else."""
    torch.manual_seed(0)
    B, nkv, nh, T, hd = 1, 2, 4, 3, 8
    cache = KVCache()
    ctx = [torch.randn(B, nkv, T, hd) for _ in range(2)]
    cache.add_context(*ctx)
    chain = [[torch.randn(B, nkv, T, hd) for _ in range(2)] for _ in range(2)]  # steps 1, 2
    rows = torch.arange(T)
    for k, v in chain:
        cache.add_chain(k, v, rows)
    q = torch.randn(B, nh, T, hd)
    out = cached_attention(q, cache, rows)
    for r in range(T):
        keys = [ctx[0][0, :, s] for s in range(r + 1)] + [k[0, :, r] for k, _ in chain]
        values = [ctx[1][0, :, s] for s in range(r + 1)] + [v[0, :, r] for _, v in chain]
        torch.testing.assert_close(out[0, :, r], explicit_attention(q[0, :, r], keys, values))


def test_decoding_with_cache_equals_training_unroll():
    """Prefill + one-row chain drafting gives the logits of the batched TTT unroll at that row."""
    drafter = make_drafter().double()
    cfg = drafter.config
    T, K = 6, 3
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, T + K))
    hidden0 = drafter.fc(torch.randn(1, T, 3 * cfg.hidden_size, dtype=torch.float64))
    positions = torch.arange(T)
    # Training layout: every row chains, step k feeds token x_{t+k+1}.
    train_cache, hidden, unrolled = KVCache(), hidden0, []
    for k in range(K):
        logits, hidden = drafter(ids[:, k + 1 : k + 1 + T], hidden, positions + k, train_cache, None if k == 0 else positions)
        unrolled.append(logits[:, -1])
    # Decoding layout: prefill in two chunks, then chain from the last row only.
    cache = KVCache()
    drafter(ids[:, 1:4], hidden0[:, :3], positions[:3], cache)
    logits, h2 = drafter(ids[:, 4 : T + 1], hidden0[:, 3:], positions[3:], cache)
    decoded, last = [logits[:, -1]], torch.tensor([T - 1])
    for k in range(1, K):
        logits, h2 = drafter(ids[:, T + k : T + k + 1], h2[:, -1:], torch.tensor([T - 1 + k]), cache, last)
        decoded.append(logits[:, -1])
    for step, (a, b) in enumerate(zip(unrolled, decoded)):
        torch.testing.assert_close(a, b, msg=f"step {step}")


def test_chain_step_needs_context_and_same_rows():
    drafter = make_drafter()
    cfg = drafter.config
    hidden = torch.randn(1, 4, cfg.hidden_size)
    with pytest.raises(ValueError, match="needs a context step"):
        drafter(torch.zeros(1, 4, dtype=torch.long), hidden, torch.arange(4), KVCache(), torch.arange(4))
    cache = KVCache()
    drafter(torch.zeros(1, 4, dtype=torch.long), hidden, torch.arange(4), cache)
    drafter(torch.zeros(1, 4, dtype=torch.long), hidden, torch.arange(4) + 1, cache, torch.arange(4))
    with pytest.raises(ValueError, match="chain step over 1 rows"):
        drafter(torch.zeros(1, 1, dtype=torch.long), hidden[:, :1], torch.tensor([5]), cache, torch.tensor([3]))
    causal = KVCache(starts=torch.zeros(1, 4, dtype=torch.long))
    drafter(torch.zeros(1, 4, dtype=torch.long), hidden, torch.arange(4), causal)
    with pytest.raises(ValueError, match="cover all 4 rows"):
        drafter(torch.zeros(1, 1, dtype=torch.long), hidden[:, :1], torch.tensor([5]), causal, torch.tensor([3]))
    with pytest.raises(ValueError, match="one context step"):
        drafter(torch.zeros(1, 4, dtype=torch.long), hidden, torch.arange(4) + 4, causal)


def packed_starts(T: int) -> Tensor:
    """starts [2, T] of two packed rows: documents of 10, 20 and T-30 tokens; one document."""
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(20), torch.arange(T - 30)]), torch.arange(T)])
    return torch.arange(T) - positions


@pytest.mark.parametrize("T", [37, 128, 300, 1024])  # under a block, one block, padded blocks, whole blocks
def test_document_block_mask_is_create_block_masks(T):
    """The packed rows' block mask, built from the documents' starts, holds the very tensors ``create_block_mask``
    builds from the mask_mod at every pair: documents of lengths around the 128-row block, many packings."""
    from torch.nn.attention.flex_attention import create_block_mask

    generator = torch.Generator().manual_seed(T)
    for _ in range(10):
        lengths = [torch.tensor([1, 5, 127, 128, 129, 300])[torch.randint(6, (40,), generator=generator)] for _ in range(3)]
        positions = [torch.cat([torch.arange(n) for n in row])[:T] for row in lengths]
        starts = torch.arange(T) - torch.stack([torch.cat([p, torch.arange(T - len(p))]) for p in positions])  # padding: one more document
        ours = document_block_mask(starts)
        theirs = create_block_mask(lambda b, h, q, k: (q >= k) & (k >= starts[b, q]), 3, None, T, T, device="cpu")
        assert (ours.seq_lengths, ours.BLOCK_SIZE) == (theirs.seq_lengths, theirs.BLOCK_SIZE)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            mine, reference = getattr(ours, name), getattr(theirs, name)
            assert mine.dtype == reference.dtype and torch.equal(mine, reference), name


def test_document_block_mask_traces_whole_in_a_compiled_graph():
    """Built inside the compiled training step on GPUs: one graph with the attention (fullgraph: no graph break),
    which sees what the masked path sees (aot_eager: the traced graph run without a kernel build; forward only,
    FlexAttention's backward runs on CUDA)."""
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 700, 16  # full blocks, partial ones, a padded last block
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
    starts = packed_starts(T)
    traced = torch.compile(lambda q, k, v, starts: attention.fused_causal_attention(q, k, v, document_block_mask(starts)),
                           fullgraph=True, backend="aot_eager")
    out, lse = traced(q, k, v, starts)
    expected, expected_lse = masked_attention(q, k, v, torch.arange(T), starts)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


def test_document_block_mask_equals_masked_attention(monkeypatch):
    """The FlexAttention mask of packed rows sees what the masked path sees (flex run eagerly here), and the
    kernel's log-sum-exp comes back without a deprecation warning (a compiled step would guard on it)."""
    from torch.nn.attention.flex_attention import flex_attention

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(attention, "flex_attention_kernel", lambda: flex_attention)
    monkeypatch.setattr(flex, "_WARNINGS_SHOWN", set())  # once-only warnings: as in a fresh process, whatever ran before
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 37, 16
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
    starts = packed_starts(T)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = attention.fused_causal_attention(q, k, v, document_block_mask(starts))
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]  # return_lse's deprecation (the UserWarning: uncompiled flex)
    expected, expected_lse = masked_attention(q, k, v, torch.arange(T), starts)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    for b, r in [(0, 12), (0, 36), (1, 36)]:  # spot checks against explicit key lists
        seen = range(int(starts[b, r]), r + 1)
        ref = explicit_attention(q[b, :, r], [k[b, :, s] for s in seen], [v[b, :, s] for s in seen])
        torch.testing.assert_close(out[b, :, r], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel (FlexAttention) runs on CUDA")
@pytest.mark.parametrize("T", [37, 300])  # not multiples of the kernel's 128-row blocks
def test_fused_ttt_attention_matches_masked_on_gpu(T):
    """Three TTT steps over packed rows through the fused kernel == the masked path (on the CPU,
    fp32): outputs and gradients."""
    torch.manual_seed(0)
    B, nkv, nh, hd = 2, 3, 9, 64  # SmolLM2's grouping: 3 query heads per KV head
    leaves = [torch.randn(B, heads, T, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for heads in [nh] * 3 + [nkv] * 6]

    def unroll(leaves: list[Tensor]) -> list[Tensor]:
        device = leaves[0].device
        cache, rows, outs = KVCache(starts=packed_starts(T).to(device)), torch.arange(T, device=device), []
        queries, keys = leaves[:3], leaves[3:]
        for step, q in enumerate(queries):
            k, v = keys[2 * step], keys[2 * step + 1]
            last = cache.add_context(k, v) if step == 0 else cache.add_chain(k, v, rows)
            outs.append(cached_attention(q, cache, last))
        return outs

    reference_leaves = [x.detach().float().cpu().requires_grad_() for x in leaves]
    fused, masked = unroll(leaves), unroll(reference_leaves)
    grads = [torch.autograd.grad(sum((o.float() * w).sum() for o, w in zip(outs, (1.0, 2.0, 3.0))), inputs)
             for outs, inputs in ((fused, leaves), (masked, reference_leaves))]
    for a, b in zip(fused, masked):
        torch.testing.assert_close(a.float().cpu(), b, atol=2e-2, rtol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float().cpu(), b, atol=5e-2, rtol=5e-2)


def fused_cases() -> list[tuple]:
    """(fused function, its float inputs, its other inputs): every function training fuses on GPUs."""
    torch.manual_seed(0)
    N, H, B, nh, R, J, Vd = 6, 16, 2, 4, 5, 3, 11
    return [
        (model.rms_norm, [torch.randn(B, R, H), torch.rand(H) + 0.5], [1e-5]),
        (rope.apply_rope, [torch.randn(B, nh, R, 8), torch.randn(B, R, 8), torch.randn(B, R, 8)], []),
        (model.swiglu, [torch.randn(B, R, H), torch.randn(B, R, H)], []),
        (attention.chain_softmax, [torch.randn(B, nh, R), torch.randn(B, nh, R, J)], [torch.float32]),
        (attention.merge_chain, [torch.randn(B, nh, R, 8), torch.randn(B, nh, R), torch.randn(B, nh, R) + 1, torch.randn(B, nh, R, 8)], []),
        (loss.soft_cross_entropy_sum, [torch.randn(N - 2, Vd), torch.randn(N, Vd).softmax(-1)],
         [torch.tensor([5, 0, 3, 3]), torch.tensor([True, True, False, True])]),
        (loss.soft_cross_entropy_sum, [torch.randn(N - 2, Vd), torch.randn(N, Vd).softmax(-1)],  # train.loss_normalisation: sequence
         [torch.tensor([5, 0, 3, 3]), torch.tensor([True, True, False, True]), torch.tensor([0.5, 0.5, 1.0, 1 / 3])]),
    ]


@pytest.mark.parametrize("case", range(len(fused_cases())))
def test_fused_functions_compile_whole_and_match_eager(case):
    """What training compiles on GPUs is one graph per function (fullgraph: no graph break), and
    that graph with its derived backward computes what the eager ops do, values and gradients."""
    fused, floats, others = fused_cases()[case]
    compiled = torch.compile(fused.eager, fullgraph=True, backend="aot_eager")  # the graph, without a kernel build
    inputs = [x.clone().requires_grad_() for x in floats]
    copies = [x.clone().requires_grad_() for x in floats]
    got, want = compiled(*inputs, *others), fused.eager(*copies, *others)
    got, want = (got,) if isinstance(got, Tensor) else got, (want,) if isinstance(want, Tensor) else want
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    grads = torch.autograd.grad(sum(g.float().sum() for g in got), inputs)
    for g, w in zip(grads, torch.autograd.grad(sum(w.float().sum() for w in want), copies)):
        torch.testing.assert_close(g, w)


def test_masked_attention_by_row_slices_equals_all_rows_at_once(monkeypatch):
    """Scores past SCORES_LIMIT go a slice of query rows at a time (a long prompt's prefill at batch 64 ran an H100 out
    of memory): the same outputs and log-sum-exps, for a causal, packed and a bool-masked query alike."""
    torch.manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 37, 16
    q, k, v = torch.randn(B, nh, T, hd), torch.randn(B, nkv, T, hd), torch.randn(B, nkv, T, hd)
    starts = packed_starts(T)
    holes = torch.rand(B, 1, 1, T, T) > 0.3
    holes |= torch.eye(T, dtype=torch.bool)  # every query sees its own key
    cases = [(torch.arange(T), None), (torch.arange(T), starts), (holes, None)]
    whole = [masked_attention(q, k, v, last, first) for last, first in cases]
    monkeypatch.setattr(attention, "SCORES_LIMIT", B * nh * T * 5)  # five rows a slice: 8 slices, the last of 2
    slices = []
    monkeypatch.setattr(attention, "rows_attention", lambda q, *rest: slices.append(q.shape[2]) or rows_attention(q, *rest))
    for (last, first), (out, lse) in zip(cases, whole):
        slices.clear()
        sliced_out, sliced_lse = masked_attention(q, k, v, last, first)
        assert slices == [5] * 7 + [2]
        torch.testing.assert_close(sliced_out, out, rtol=0, atol=0)
        torch.testing.assert_close(sliced_lse, lse, rtol=0, atol=0)
