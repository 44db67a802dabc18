"""Speculative decoding and the evaluate stage: lossless, oracle τ = K+1, wrong τ = 1, consistent metrics.

The tiny random verifier gets an untied random lm_head so its greedy text is not one repeated
token (with tied random weights it copies its last input). Drafter stand-ins implement the same
interface as ``Eagle3Drafter`` and read the RoPE positions they are given, so a position
off-by-one in the decoding loop shows up as a lost oracle token.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from transformers import MistralConfig, MistralForCausalLM

from conftest import project_params, run
from eagle3.common import UserError
from eagle3.evaluate import acceptance_stats, check_pair, main, most_frequent_token
from eagle3.export import verifier_facts, write_drafter
from eagle3.verifier import prompt_ids
from eagle3.model import DraftConfig, Eagle3Drafter, KVCache
from eagle3.speculative import (
    ConstantDrafter,
    accept,
    draft_k,
    greedy_decode,
    prefill,
    rollback,
    speculative_decode,
    truncate,
    verify,
)
from eagle3.verifier import load_tokenizer, load_verifier, read_meta
from tiny_drafter import draft_d2t

K = 4
MAX_NEW = 24
TINY_TAPS = (1, 2, 3)
QUESTIONS = ["Hello there, how are you?", "Write a short poem about the sea.", "def fibonacci(n):"]


class TableDrafter(nn.Module):
    """Proposes table[p + 2] at RoPE position p (the alignment: position p predicts x_{p+2}).

    With the verifier's own greedy sequence as the table it is an oracle; with a shifted one it is
    always wrong.
    """

    def __init__(self, table: torch.Tensor, vocab_size: int):
        super().__init__()
        self.fc = nn.Identity()
        self.table, self.vocab_size = table, vocab_size
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))  # draft vocab = target vocab

    def step(self, input_ids, hidden, position_ids, cache, rows=None):
        self.positions = position_ids  # [T], read by the logits call that follows
        return hidden

    def logits(self, h2):
        positions = self.positions[-h2.shape[1]:]  # the rows h2 holds: the last ones stepped
        index = (positions + 2).clamp(max=len(self.table) - 1)  # [T]
        return F.one_hot(self.table[index], self.vocab_size).float()[None]  # [1, T, V]


def encode(tokenizer, question: str) -> torch.Tensor:
    return torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": question}])])  # [1, n]


def greedy_table(verifier, prompt_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Prompt + ``length`` greedy tokens, ignoring EOS: every token an oracle may be asked for."""
    return torch.cat([prompt_ids[0], torch.tensor(greedy_decode(verifier, prompt_ids, length, eos_ids=set()))])


def random_drafter(verifier, draft_vocab: int, taps, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_verifier(verifier.config, draft_vocab, taps)
    drafter = Eagle3Drafter(cfg, verifier.get_input_embeddings().weight)
    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, draft_vocab))
    return drafter.eval()


@pytest.fixture(scope="module")
def tiny(tiny_verifier_dir):
    """(verifier with an untied random head, prompts [1, n] each)."""
    torch.set_num_threads(1)
    verifier = load_verifier(tiny_verifier_dir)
    g = torch.Generator().manual_seed(0)
    verifier.lm_head.weight = nn.Parameter(torch.randn(verifier.config.vocab_size, verifier.config.hidden_size, generator=g))
    tokenizer = load_tokenizer(tiny_verifier_dir)
    return verifier, [encode(tokenizer, q) for q in QUESTIONS]


def test_accept_rule():
    drafts = torch.tensor([5, 6, 7])
    assert accept(drafts, torch.tensor([5, 6, 9, 1])) == 2
    assert accept(drafts, torch.tensor([4, 6, 7, 1])) == 0  # later matches do not count after a miss
    assert accept(drafts, torch.tensor([5, 6, 7, 1])) == 3


def test_truncate_stops_after_first_eos_and_at_max():
    assert truncate([4, 2, 5, 2], 10, {2}) == [4, 2]
    assert truncate([4, 5, 6], 2, {2}) == [4, 5]


def test_acceptance_stats_match_docstring_and_tau():
    stats = acceptance_stats([0, 2, 1, 2], k=2)
    assert stats["tau"] == pytest.approx(2.25) and stats["forwards"] == 4
    assert stats["acceptance"] == pytest.approx([0.75, 0.5])
    assert stats["conditional"] == pytest.approx([0.75, 2 / 3])
    assert stats["tau_distribution"] == pytest.approx([0.25, 0.25, 0.5])
    assert most_frequent_token([[3, 5, 5], [3, 9]]) == 3  # tie between 3 and 5: the lower id


def test_greedy_decode_equals_hf_generate(tiny):
    verifier, prompts = tiny
    ids = prompts[0]
    expected = verifier.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)[0, ids.shape[1]:].tolist()
    assert greedy_decode(verifier, ids, MAX_NEW, {2}) == expected
    assert len(set(expected)) > 5  # varied text, not one repeated token


def test_random_drafter_is_lossless(tiny):
    verifier, prompts = tiny
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    for ids in prompts:
        spec = speculative_decode(verifier, drafter, ids, TINY_TAPS, K, MAX_NEW, {2})
        assert spec.tokens == greedy_decode(verifier, ids, MAX_NEW, {2})
        assert len(spec.accepted) >= (MAX_NEW - 1) // (K + 1)


def test_oracle_accepts_everything(tiny):
    verifier, prompts = tiny
    for ids in prompts:
        oracle = TableDrafter(greedy_table(verifier, ids, MAX_NEW + K + 2), verifier.config.vocab_size)
        spec = speculative_decode(verifier, oracle, ids, TINY_TAPS, K, MAX_NEW, {2})
        assert spec.tokens == greedy_decode(verifier, ids, MAX_NEW, {2})
        stats = acceptance_stats(spec.accepted, K)
        assert stats["tau"] == K + 1 and stats["acceptance"] == [1.0] * K


def test_all_accepted_round_keeps_the_whole_cache(tiny):
    """j = K: nothing to roll back (crop(0) empties the cache in some transformers 5.x releases)."""
    verifier, prompts = tiny
    ids = prompts[0]
    n = ids.shape[1]
    table = greedy_table(verifier, ids, 2 * K + 4)
    cache, first, _ = prefill(verifier, ids, TINY_TAPS)
    drafts = table[n + 1 : n + 1 + K]  # the oracle's K drafts after x_n
    greedy, _ = verify(verifier, cache, first, drafts, TINY_TAPS)
    assert accept(drafts, greedy) == K
    rollback(cache, K - K)
    assert cache.get_seq_length() == n + K + 1
    bonus = greedy[K:]  # the next round verifies on top of the kept cache: still exactly greedy
    again, _ = verify(verifier, cache, bonus, table[n + K + 2 : n + 2 * K + 2], TINY_TAPS)
    assert torch.equal(again, table[n + K + 2 : n + 2 * K + 3])
    rollback(cache, 2)
    assert cache.get_seq_length() == n + 2 * K


@pytest.fixture(scope="module")
def sliding_verifier():
    """A tiny random Mistral-style verifier whose every layer attends to a 16-token window."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, tie_word_embeddings=False)
    return MistralForCausalLM(config).eval()


def test_sliding_window_verifier_rolls_back_past_its_window(sliding_verifier):
    """Prompt (40) longer than the window (16): partly right drafts force rollbacks inside sliding layers."""
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    expected = sliding_verifier.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert greedy_decode(sliding_verifier, ids, MAX_NEW, set()) == expected
    table = greedy_table(sliding_verifier, ids, MAX_NEW + K + 2)
    table[::3] = (table[::3] + 1) % 512
    spec = speculative_decode(sliding_verifier, TableDrafter(table, 512), ids, TINY_TAPS, K, MAX_NEW, set())
    assert spec.tokens == expected and 0 < max(spec.accepted) and min(spec.accepted) < K


def test_always_wrong_drafter_accepts_nothing(tiny):
    verifier, prompts = tiny
    ids = prompts[1]
    table = greedy_table(verifier, ids, MAX_NEW + K + 2)
    wrong = TableDrafter((table + 1) % verifier.config.vocab_size, verifier.config.vocab_size)
    spec = speculative_decode(verifier, wrong, ids, TINY_TAPS, K, MAX_NEW, {2})
    assert spec.tokens == greedy_decode(verifier, ids, MAX_NEW, {2})
    stats = acceptance_stats(spec.accepted, K)
    assert stats["tau"] == 1 and stats["acceptance"] == [0.0] * K and len(spec.accepted) == MAX_NEW - 1


def test_partly_right_drafter_is_lossless_and_rates_add_up_to_tau(tiny):
    """Every third oracle token corrupted: accept lengths vary, exercising both caches' rollback."""
    verifier, prompts = tiny
    accepted = []
    for ids in prompts:
        table = greedy_table(verifier, ids, MAX_NEW + K + 2)
        noisy = table.clone()
        noisy[::3] = (noisy[::3] + 1) % verifier.config.vocab_size
        spec = speculative_decode(verifier, TableDrafter(noisy, verifier.config.vocab_size), ids, TINY_TAPS, K, MAX_NEW, {2})
        assert spec.tokens == greedy_decode(verifier, ids, MAX_NEW, {2})
        accepted += spec.accepted
    assert len(set(accepted)) > 2  # neither all-or-nothing
    stats = acceptance_stats(accepted, K)
    assert stats["tau"] == pytest.approx(1 + sum(stats["acceptance"]))
    assert stats["tau"] == pytest.approx(1 + sum(accepted) / len(accepted))
    assert sum(stats["tau_distribution"]) == pytest.approx(1)


class RecordingDrafter(TableDrafter):
    """A table drafter that records what it is fed, in order; its h2 is its hidden input + 1."""

    def __init__(self, table: torch.Tensor, vocab_size: int):
        super().__init__(table, vocab_size)
        self.fed = []  # (chain step?, position, token, hidden [3H]) per row fed

    def step(self, input_ids, hidden, position_ids, cache, rows=None):
        self.fed += [(rows is not None, int(p), int(t), h) for p, t, h in zip(position_ids, input_ids[0], hidden[0])]
        return super().step(input_ids, hidden, position_ids, cache, rows) + 1


def test_drafter_is_fed_like_sglang(tiny):
    """Context row t = (g_t, x_{t+1}) at position t, each t once; chain steps get the previous step's h2.

    g_t is checked against one plain forward of the verifier over the final sequence, so features
    kept from verify forwards after partial acceptances must belong to the accepted tokens.
    """
    verifier, prompts = tiny
    ids = prompts[0]
    table = greedy_table(verifier, ids, MAX_NEW + K + 2)
    table[::3] = (table[::3] + 1) % verifier.config.vocab_size
    drafter = RecordingDrafter(table, verifier.config.vocab_size)
    spec = speculative_decode(verifier, drafter, ids, TINY_TAPS, K, MAX_NEW, {2})
    sequence = torch.cat([ids[0], torch.tensor(spec.tokens)])  # [n + generated]
    with torch.no_grad():
        hidden_states = verifier(sequence[None], output_hidden_states=True).hidden_states
    g = torch.cat([hidden_states[k][0] for k in TINY_TAPS], -1)  # [S, 3H]
    context = [(p, t, h) for chain, p, t, h in drafter.fed if not chain]
    assert [p for p, _, _ in context] == list(range(len(context)))
    assert len(context) >= len(sequence) - K - 1
    for position, token, fed in context:
        assert token == sequence[position + 1]
        torch.testing.assert_close(fed, g[position], atol=1e-4, rtol=1e-4)
    previous = {}  # position -> the hidden fed there most recently
    for chain, position, _, fed in drafter.fed:
        if chain:  # continues the row or step at position - 1: its h2 = its hidden + 1
            torch.testing.assert_close(fed, previous[position - 1] + 1)
        previous[position] = fed


def test_stops_at_eos_inside_an_accepted_chunk(tiny):
    verifier, prompts = tiny
    ids = prompts[2]
    table = greedy_table(verifier, ids, MAX_NEW + K + 2)
    eos = {int(table[ids.shape[1] + 9])}  # a token greedy decoding emits 10th (or earlier)
    expected = greedy_decode(verifier, ids, MAX_NEW, eos)
    assert len(expected) <= 10 and expected[-1] in eos
    oracle = TableDrafter(table, verifier.config.vocab_size)
    assert speculative_decode(verifier, oracle, ids, TINY_TAPS, K, MAX_NEW, eos).tokens == expected
    assert speculative_decode(verifier, ConstantDrafter(expected[-1]), ids, TINY_TAPS, K, MAX_NEW, eos).tokens == expected


def test_draft_k_after_a_rollback_equals_a_fresh_context(tiny):
    """A context step drops the previous round's chain keys: resuming equals drafting from scratch."""
    verifier, _ = tiny
    drafter = random_drafter(verifier, 512, TINY_TAPS, seed=1)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 12, 3 * verifier.config.hidden_size, generator=g)  # [1, T, 3H]
    next_ids = torch.randint(0, verifier.config.vocab_size, (12,), generator=g)
    fresh = draft_k(drafter, KVCache(), features, next_ids, 0, K)
    cache = KVCache()
    draft_k(drafter, cache, features[:, :7], next_ids[:7], 0, K)  # leaves K-1 chain keys behind
    assert torch.equal(draft_k(drafter, cache, features[:, 7:], next_ids[7:], 7, K), fresh)


def test_evaluate_main_writes_metrics_and_plots(tmp_path, tiny_verifier_dir, monkeypatch):
    verifier = load_verifier(tiny_verifier_dir)
    drafter_dir, prompts_dir = tmp_path / "drafter", tmp_path / "prompts"
    drafter_dir.mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), drafter_dir, verifier_facts(tiny_verifier_dir), {})
    (prompts_dir / "eval").mkdir(parents=True)
    (prompts_dir / "meta.json").write_text(json.dumps({"verifier": read_meta(tiny_verifier_dir)["fingerprint"]["id"]}))
    records = [{"id": str(i), "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    (prompts_dir / "eval" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    params = project_params()
    params.evaluate = {"name": "test", "draft_tokens": 3, "max_new_tokens": 8, "sets": ["heldout"], "max_prompts": 2,
                       "baseline": True}
    params.layout.threads = 1
    OmegaConf.save(params, tmp_path / "params.yaml")
    out = tmp_path / "dvclive" / "evaluate"
    monkeypatch.chdir(tmp_path)
    main([str(tiny_verifier_dir), str(drafter_dir), str(prompts_dir), str(out), "--params", str(tmp_path / "params.yaml")])
    metrics = json.loads((out / "metrics.json").read_text())["heldout"]
    assert metrics["prompts"] == 2 and metrics["lossless"] == 1
    assert 1 <= metrics["tau"] <= 4 and metrics["speedup"] > 0 and metrics["baseline"]["tau"] >= 1
    acceptance = json.loads((out / "plots" / "custom" / "acceptance" / "heldout.json").read_text())
    assert [row["position"] for row in acceptance] == [1, 2, 3]
    assert metrics["tau"] == pytest.approx(1 + sum(row["drafter"] for row in acceptance), abs=1e-3)
    tau = json.loads((out / "plots" / "custom" / "tau" / "heldout.json").read_text())
    assert sum(row["fraction"] for row in tau) == pytest.approx(1)


def test_drafter_of_another_verifier_is_refused(tmp_path, tiny_verifier_dir):
    verifier = load_verifier(tiny_verifier_dir)
    facts = {**verifier_facts(tiny_verifier_dir), "fingerprint": "0123456789abcdef"}
    (tmp_path / "drafter").mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), tmp_path / "drafter", facts, {})
    with pytest.raises(UserError, match="trained for verifier 0123456789abcdef"):
        check_pair(tiny_verifier_dir, tmp_path / "drafter", tmp_path / "prompts")


@pytest.mark.slow
def test_smollm2_random_and_partly_right_drafters_are_lossless(smollm2_dir):
    """The real verifier: a random exported-shape drafter and a partly right one decode exactly greedily."""
    torch.set_num_threads(1)
    verifier, tokenizer = load_verifier(smollm2_dir), load_tokenizer(smollm2_dir)
    taps = tuple(project_params().model.aux_layers)
    drafter = random_drafter(verifier, 32000, taps)
    eos = {tokenizer.eos_token_id}
    for question in QUESTIONS[:2]:
        ids = encode(tokenizer, question)
        expected = greedy_decode(verifier, ids, 16, eos)
        assert speculative_decode(verifier, drafter, ids, taps, K, 16, eos).tokens == expected
    table = greedy_table(verifier, ids, 16 + K + 2)
    table[::3] = (table[::3] + 1) % verifier.config.vocab_size
    spec = speculative_decode(verifier, TableDrafter(table, verifier.config.vocab_size), ids, taps, K, 16, eos)
    assert spec.tokens == expected and max(spec.accepted) > 0


@pytest.mark.slow
def test_dvc_repro_evaluate_lists_tau_and_speedup_and_renders_plots(make_project, tiny_verifier_dir):
    """The dvc.yaml block: deps and params resolve, metrics reach `dvc exp show`, plots render."""
    repo = make_project("evaluate.max_prompts=2", "evaluate.max_new_tokens=6", "evaluate.draft_tokens=3",
                        "evaluate.sets=[heldout]", "layout.threads=1")
    shutil.copytree(tiny_verifier_dir, repo / "models" / "verifier")
    verifier = load_verifier(tiny_verifier_dir)
    (repo / "models" / "drafter").mkdir()
    write_drafter(random_drafter(verifier, 512, TINY_TAPS), repo / "models" / "drafter", verifier_facts(tiny_verifier_dir), {})
    (repo / "data" / "prompts" / "eval").mkdir(parents=True)
    (repo / "data" / "prompts" / "meta.json").write_text(json.dumps({"verifier": read_meta(tiny_verifier_dir)["fingerprint"]["id"]}))
    records = [{"id": str(i), "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS)]
    (repo / "data" / "prompts" / "eval" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run(["dvc", "repro", "-s", "evaluate"], repo)
    shown = run(["dvc", "exp", "show", "--csv"], repo).stdout
    assert "heldout.tau" in shown and "heldout.speedup" in shown
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)["data"]
    for path in ("dvclive/evaluate/plots/custom/acceptance/heldout.json", "dvclive/evaluate/plots/custom/tau/heldout.json"):
        assert plots[path][0]["type"] == "vega" and plots[path][0]["content"]["data"]["values"]
