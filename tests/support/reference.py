"""Slow, literal reference implementations the tests compare the fast code against.

Loops over batch rows, positions and steps; every key a query may see is listed explicitly;
no masks, no shifts, no caches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def explicit_attention(q, keys, values):
    """Softmax attention of one query [nh, hd] over an explicit list of (k, v) pairs [nkv, hd]."""
    nh, hd = q.shape
    k = torch.stack(keys, 1).repeat_interleave(nh // keys[0].shape[0], 0)  # [nh, N, hd]
    v = torch.stack(values, 1).repeat_interleave(nh // values[0].shape[0], 0)
    probs = ((k @ q[:, :, None]).squeeze(-1) / math.sqrt(hd)).softmax(-1)  # [nh, N]
    return (probs[:, :, None] * v).sum(1)  # [nh, hd]


def rope_one(x, position, inv_freq):
    """RoPE of one vector per head [heads, hd] at an integer position (half-split layout)."""
    angles = position * inv_freq
    cos, sin = torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat([-second, first], -1) * sin


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_ttt_loss(drafter, head_weight, d2t, input_ids, loss_mask, aux, final, steps, decay):
    """Σ_k decay^k · mean soft CE of step k, computed position by position.

    Step k, row t: token x[t+k+1], hidden = fc(aux[t]) (k=0) or row t's h2 of step k-1, position
    t+k; keys: step 0 at rows <= t, steps 1..k at row t. Target: the verifier distribution at
    s = t+k+1 (of x[s+1]), used where x[s+1] is under the loss mask and the argmax is a draft token.
    Returns (loss, acc per step over all targets, valid targets per step).
    """
    cfg, layer = drafter.config, drafter.midlayer
    attn, eps = layer.self_attn, cfg.rms_norm_eps
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    draft_ids = [i + int(d2t[i]) for i in range(len(d2t))]
    B, T = input_ids.shape
    sums, counts, targets, hits = [0.0] * steps, [0] * steps, [0] * steps, [0] * steps
    for b in range(B):
        hidden = {t: drafter.fc(aux[b, t]) for t in range(T)}
        keys, values = {}, {}
        for k in range(steps):
            new_hidden = {}
            for t in range(T - k - 1):
                e = drafter.embed_tokens[input_ids[b, t + k + 1]]
                x = torch.cat([rms(e, layer.input_layernorm.weight, eps), rms(hidden[t], layer.hidden_norm.weight, eps)])
                q = rope_one(attn.q_proj(x).view(nh, hd), t + k, drafter.rotary.inv_freq)
                keys[k, t] = rope_one(attn.k_proj(x).view(nkv, hd), t + k, drafter.rotary.inv_freq)
                values[k, t] = attn.v_proj(x).view(nkv, hd)
                seen = [(0, s) for s in range(t + 1)] + [(j, t) for j in range(1, k + 1)]
                out = explicit_attention(q, [keys[i] for i in seen], [values[i] for i in seen])
                h1 = hidden[t] + attn.o_proj(out.reshape(nh * hd))
                h2 = h1 + layer.mlp(rms(h1, layer.post_attention_layernorm.weight, eps))
                new_hidden[t] = h2
                logits = drafter.lm_head(rms(h2, drafter.norm.weight, eps))
                s = t + k + 1
                if s + 1 >= T or not loss_mask[b, s + 1]:
                    continue
                z = head_weight @ final[b, s]
                best = int(z.argmax())
                targets[k] += 1  # a target outside the draft vocabulary: no loss, an accuracy miss
                if best not in draft_ids:
                    continue
                p = z[draft_ids].softmax(-1)
                sums[k] = sums[k] - (p * F.log_softmax(logits, -1)).sum()
                counts[k] += 1
                hits[k] += int(int(logits.argmax()) == draft_ids.index(best))
            hidden = new_hidden
    loss = sum(decay**k * sums[k] / max(counts[k], 1) for k in range(steps))
    return loss, [hits[k] / max(targets[k], 1) for k in range(steps)], counts
