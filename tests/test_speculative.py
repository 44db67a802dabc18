"""Batched speculative decoding: lossless (chain, tree, n-gram), oracle τ = K+1, wrong τ = 1, holes masked.

The tiny random verifier gets an untied random lm_head so its greedy text is not one repeated
token (with tied random weights it copies its last input). Drafter stand-ins implement the same
interface as ``Eagle3Drafter`` and read the RoPE positions they are given (carried in channel 0 of
their h2), so a position off-by-one in the decoding loop shows up as a lost oracle token.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from eagle3.decoding.batch import drop_rejected
from eagle3.decoding.graphed import DecodeGraphs
from eagle3.decoding.skinny import SKINNY_ROWS, skinny_matmuls
from eagle3.decoding.speculative import (StopStrings, Target, accept, commit, greedy_decode, prefill, read_round, speculative_decode, truncate,
                                        verify)
from eagle3.decoding.tree import Draft, EagleProposer
from eagle3.decoding.config import TreeShape, tree_shape_problem
from eagle3.lm.loading import load_tokenizer, load_verifier
from eagle3.decoding.acceptance import acceptance_stats
from eagle3.decoding.baselines import HistoryProposer, most_frequent, ngram, replay

from support.repo import ROOT
from support.speculative import K, QUESTIONS, TINY_TAPS, TableDrafter, encode, greedy_tables, random_drafter

MAX_NEW = 24
TREE = TreeShape(num_steps=K, topk=3, num_draft_tokens=10)


def decode(verifier, proposer, prompts, max_new=MAX_NEW, eos=frozenset({2})):
    return speculative_decode(Target(verifier=verifier, layer_ids=TINY_TAPS, eos_ids=set(eos)), proposer, prompts, max_new)


@pytest.fixture(scope="module")
def tiny(tiny_verifier_dir):
    """(verifier with an untied random head, prompts [n] each, plain greedy outputs)."""
    torch.set_num_threads(1)
    verifier = load_verifier(tiny_verifier_dir)
    g = torch.Generator().manual_seed(0)
    verifier.lm_head.weight = nn.Parameter(torch.randn(verifier.config.vocab_size, verifier.config.hidden_size, generator=g))
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = [encode(tokenizer, q) for q in QUESTIONS]
    return verifier, prompts, greedy_decode(verifier, prompts, MAX_NEW, {2})


def test_accept_rule_walks_the_tree_within_budget_and_eos():
    # root -> 1 (token 5) -> 2 (token 6); root -> 3 (token 7) -> 4 (token 8)
    draft = Draft(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 0, 3]]), torch.ones(1, 4, dtype=torch.bool))
    greedy = torch.tensor([[7, 0, 0, 8, 9]])  # root wants 7, node 3 wants 8, node 4's bonus 9

    def path(budget, eos=()):
        mask = accept(draft, greedy, torch.tensor([budget]), torch.tensor(eos, dtype=torch.long))
        return mask[0].nonzero().flatten().tolist()

    assert path(10) == [0, 3, 4]
    assert path(2) == [0, 3]  # only 2 tokens still wanted
    assert path(10, [8]) == [0, 3]  # EOS is the bonus, never accepted past
    draft.valid[0, 2] = False
    assert path(10) == [0]  # an invalid node is never accepted


def test_rows_accepting_differently_in_one_batch():
    """Row 0 takes the chain 1 -> 2, row 1 only node 1, row 2 nothing: one path mask each, and the round reads back."""
    draft = Draft(torch.tensor([[5, 6], [5, 6], [5, 6]]), torch.tensor([[0, 1]] * 3), torch.ones(3, 2, dtype=torch.bool))
    greedy = torch.tensor([[5, 6, 9], [5, 4, 9], [3, 6, 9]])
    mask = accept(draft, greedy, torch.tensor([10, 10, 10]), torch.tensor([], dtype=torch.long))
    assert mask.tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    inputs = torch.cat([torch.tensor([[1]] * 3), draft.tokens], 1)
    assert read_round(inputs, mask, torch.tensor([9, 4, 3])) == ([[0, 1, 2], [0, 1], [0]], [[5, 6, 9], [5, 4], [3]])


@pytest.mark.parametrize("rows", [1, 3, SKINNY_ROWS + 4])
def test_skinny_matmuls_compute_the_same_linear_layers(rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 8, bias=False))
    x = torch.randn(rows, 1, 24)  # [B, T, K]
    expected = model(x)
    assert skinny_matmuls(model) is model
    torch.testing.assert_close(model(x), expected)
    assert model(x).is_contiguous() and model(x).shape == (rows, 1, 8)


def test_truncate_stops_after_first_eos_and_at_max():
    assert truncate([4, 2, 5, 2], 10, {2}) == [4, 2]
    assert truncate([4, 5, 6], 2, {2}) == [4, 5]


def test_tree_shape_chain_and_limits():
    assert TreeShape.chain(7) == TreeShape(7, 1, 8) and tree_shape_problem(5, 4, 16) is None
    assert "num_draft_tokens must be in 2..69" in tree_shape_problem(5, 4, 70)


def test_batched_greedy_decode_equals_hf_generate(tiny):
    """Prompts of different lengths in one batch (left padding, masked) decode as HF does each alone."""
    verifier, prompts, plain = tiny
    assert len({len(p) for p in prompts}) == len(prompts)
    for ids, tokens in zip(prompts, plain):
        expected = verifier.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=MAX_NEW,
                                     do_sample=False, eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
        assert tokens == expected
    assert len(set(plain[0])) > 5  # varied text, not one repeated token


@pytest.mark.parametrize("shape", [TreeShape.chain(K), TREE], ids=["chain", "tree"])
def test_random_drafter_is_lossless_and_batch_equals_one_by_one(tiny, shape):
    verifier, prompts, plain = tiny
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    batched = decode(verifier, EagleProposer(drafter, shape), prompts)
    assert [d.tokens for d in batched] == plain
    alone = [decode(verifier, EagleProposer(drafter, shape), [p])[0] for p in prompts]
    assert [d.accepted for d in alone] == [d.accepted for d in batched]


@pytest.mark.parametrize("shape", [TreeShape.chain(K), TREE], ids=["chain", "tree"])
def test_batching_leaves_every_acceptance_as_one_by_one(tiny, shape):
    """evaluate measures τ in one batch of every prompt: on the CPU in fp32 each row accepts exactly what it
    accepts alone, with a drafter right often enough for acceptances of every length."""
    verifier, prompts, plain = tiny
    table = greedy_tables(verifier, prompts, MAX_NEW + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    batched = decode(verifier, EagleProposer(TableDrafter(table, verifier.config.vocab_size), shape), prompts)
    alone = [decode(verifier, EagleProposer(TableDrafter(row[:len(p) + MAX_NEW + K + 2], verifier.config.vocab_size), shape), [p])[0]
             for row, p in zip(table, prompts)]
    assert [d.accepted for d in batched] == [d.accepted for d in alone] and [d.tokens for d in batched] == plain
    assert len({j for d in batched for j in d.accepted}) > 2


def test_decoding_from_a_shared_prefill_leaves_it_unchanged(tiny):
    verifier, prompts, plain = tiny
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    prefilled = prefill(verifier, prompts, TINY_TAPS)
    for proposer in (None, EagleProposer(drafter, TREE), None):
        out = speculative_decode(Target(verifier=verifier, layer_ids=TINY_TAPS, eos_ids={2}), proposer, prompts, MAX_NEW, prefilled)
        assert [d.tokens for d in out] == plain


def test_columns_no_row_accepted_leave_the_cache(tiny):
    """One round by hand: row 0 accepts its first draft, row 1 none; only block columns 0, 1 stay, and decoding goes on exactly."""
    verifier, prompts, plain = tiny
    batch, features = prefill(verifier, prompts[:2], TINY_TAPS)
    width = batch.valid.shape[1]
    wrong = [(t + 1) % verifier.config.vocab_size for t in (plain[0][2], plain[1][1])]
    draft = Draft(torch.tensor([[plain[0][1], wrong[0], 7], [wrong[1], 7, 7]]), torch.tensor([[0, 1, 2]] * 2),
                  torch.ones(2, 3, dtype=torch.bool))
    inputs = torch.cat([batch.root[:, None], draft.tokens], 1)
    greedy, _ = verify(verifier, batch, draft, TINY_TAPS)
    path = accept(draft, greedy, torch.tensor([MAX_NEW, MAX_NEW]), torch.tensor([2]))
    commit(batch, path, greedy)
    paths, emitted = read_round(inputs, path, batch.root)
    assert paths == [[0, 1], [0]] and emitted == [plain[0][1:3], plain[1][1:2]]
    drop_rejected(batch, 4, torch.tensor([0, 1]))
    assert batch.valid.shape[1] == batch.positions.shape[1] == batch.cache.get_seq_length() == width + 2
    assert batch.valid[:, width:].tolist() == [[True, True], [True, False]]
    out = speculative_decode(Target(verifier=verifier, layer_ids=TINY_TAPS, eos_ids=set()), None, prompts[:2], 8, (batch, features))
    assert [d.tokens for d in out] == [plain[0][2:10], plain[1][1:9]]


def test_oracle_accepts_everything_every_round(tiny):
    """The all-accepted round, every round: nothing is rolled back and the next round still verifies exactly."""
    verifier, prompts, plain = tiny
    max_new = 1 + 4 * (K + 1)  # prefill's token, then 4 full rounds
    oracle = TableDrafter(greedy_tables(verifier, prompts, max_new + K + 2), verifier.config.vocab_size)
    out = decode(verifier, EagleProposer(oracle, TreeShape.chain(K)), prompts, max_new, eos=())
    assert [d.tokens for d in out] == greedy_decode(verifier, prompts, max_new, set())
    assert [d.accepted for d in out] == [[K] * 4] * len(prompts)


def test_always_wrong_drafter_accepts_nothing(tiny):
    verifier, prompts, plain = tiny
    table = greedy_tables(verifier, prompts, MAX_NEW + K + 2)
    wrong = TableDrafter((table + 1) % verifier.config.vocab_size, verifier.config.vocab_size)
    out = decode(verifier, EagleProposer(wrong, TreeShape.chain(K)), prompts, eos=())
    assert [d.tokens for d in out] == greedy_decode(verifier, prompts, MAX_NEW, set())
    assert all(d.accepted == [0] * (MAX_NEW - 1) for d in out)


@pytest.mark.parametrize("shape", [TreeShape.chain(K), TREE], ids=["chain", "tree"])
def test_partly_right_drafter_is_lossless_and_rates_add_up_to_tau(tiny, shape):
    """Every third oracle token corrupted: accept lengths vary per row, leaving holes in both caches."""
    verifier, prompts, plain = tiny
    table = greedy_tables(verifier, prompts, MAX_NEW + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    out = decode(verifier, EagleProposer(TableDrafter(table, verifier.config.vocab_size), shape), prompts)
    assert [d.tokens for d in out] == plain
    accepted = [j for d in out for j in d.accepted]
    assert len(set(accepted)) > 2  # neither all-or-nothing
    stats = acceptance_stats(accepted, K)
    assert stats["tau"] == pytest.approx(1 + sum(stats["acceptance"]))
    assert stats["tau"] == pytest.approx(1 + sum(accepted) / len(accepted))
    assert sum(stats["tau_distribution"]) == pytest.approx(1)


def test_tree_beats_chain_when_the_right_token_is_second(tiny):
    """Top-1 wrong (but close) at every other position: the chain stops there, the tree takes the runner-up."""
    verifier, prompts, plain = tiny
    table = greedy_tables(verifier, prompts, MAX_NEW + K + 2)
    runner_up = torch.arange(table.shape[1]) % 2 == 0
    drafter = TableDrafter(table, verifier.config.vocab_size, runner_up)
    chain = decode(verifier, EagleProposer(drafter, TreeShape.chain(K)), prompts)
    tree = decode(verifier, EagleProposer(drafter, TreeShape(num_steps=K, topk=2, num_draft_tokens=15)), prompts)
    assert [d.tokens for d in chain] == [d.tokens for d in tree] == plain
    tau = {name: acceptance_stats([j for d in out for j in d.accepted], K)["tau"] for name, out in (("chain", chain), ("tree", tree))}
    assert tau["tree"] > tau["chain"] + 1, tau


class RecordingDrafter(TableDrafter):
    """A table drafter that records what it is fed, in order: (chain step?, position, token, hidden)."""

    def __init__(self, table: torch.Tensor, vocab_size: int):
        super().__init__(table, vocab_size)
        self.fed = []

    def step(self, input_ids, hidden, position_ids, cache, rows=None):
        self.fed += [(rows is not None, int(p), int(t), h) for p, t, h in zip(position_ids[0], input_ids[0], hidden[0])]
        return super().step(input_ids, hidden, position_ids, cache, rows)


def test_drafter_is_fed_like_sglang(tiny):
    """Context row t = (g_t, x_{t+1}) at position t, each t once; chain steps get the previous step's h2.

    g_t is checked against one plain forward of the verifier over the final sequence, so features
    kept from verify forwards after partial acceptances must belong to the accepted tokens.
    """
    verifier, prompts, plain = tiny
    ids = prompts[0]
    table = greedy_tables(verifier, [ids], MAX_NEW + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % verifier.config.vocab_size
    drafter = RecordingDrafter(table, verifier.config.vocab_size)
    out = decode(verifier, EagleProposer(drafter, TreeShape.chain(K)), [ids])[0]
    sequence = torch.cat([ids, torch.tensor(out.tokens)])  # [n + generated]
    with torch.no_grad():
        hidden_states = verifier(sequence[None], output_hidden_states=True).hidden_states
    g = torch.cat([hidden_states[k][0] for k in TINY_TAPS], -1)  # [S, 3H]
    context = [(p, t, h) for chain, p, t, h in drafter.fed if not chain]
    real = [(p, t, h) for p, t, h in context if p < len(sequence) - 1 and t == sequence[p + 1]]
    assert [p for p, _, _ in real] == list(range(len(real)))  # every row once, in order (pad rows aside)
    assert len(real) >= len(sequence) - K - 1
    for position, _, fed in real:
        torch.testing.assert_close(fed, g[position], atol=1e-4, rtol=1e-4)
    previous = {}  # position -> the hidden fed there most recently
    for chain, position, _, fed in drafter.fed:
        if chain:  # continues the row or step at position - 1: its h2 is that hidden with the position in channel 0
            torch.testing.assert_close(fed[1:], previous[position - 1][1:])
            assert int(fed[0]) == position - 1
        previous[position] = fed


def test_stops_at_eos_inside_an_accepted_chunk(tiny):
    verifier, prompts, plain = tiny
    ids = prompts[2]
    table = greedy_tables(verifier, [ids], MAX_NEW + K + 2)
    eos = {int(table[0, len(ids) + 9])}  # a token greedy decoding emits 10th (or earlier)
    expected = greedy_decode(verifier, [ids], MAX_NEW, eos)
    assert len(expected[0]) <= 10 and expected[0][-1] in eos
    oracle = TableDrafter(table, verifier.config.vocab_size)
    assert [d.tokens for d in decode(verifier, EagleProposer(oracle, TreeShape.chain(K)), [ids], eos=eos)] == expected
    constant = HistoryProposer(most_frequent(expected[0][-1]), K)
    assert [d.tokens for d in decode(verifier, constant, [ids], eos=eos)] == expected


@pytest.mark.parametrize("method", ["plain", "chain", "tree", "ngram"])
def test_finished_rows_leave_the_batch(tiny, method):
    """A prompt that stops early (its EOS) leaves the batch: the forwards after it carry the other
    rows only, and every output and acceptance count is what that prompt gets decoded alone."""
    verifier, prompts, plain = tiny
    early = next(t for i, t in enumerate(plain[1][2:10], 2)
                 if t not in plain[1][:i] and t not in plain[0] and t not in plain[2])  # stops prompt 1 alone
    eos = {early}
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    proposer = lambda: {"plain": None, "chain": EagleProposer(drafter, TreeShape.chain(K)),  # noqa: E731
                        "tree": EagleProposer(drafter, TREE), "ngram": HistoryProposer(ngram, K)}[method]
    rows = []
    hook = verifier.base_model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        batched = decode(verifier, proposer(), prompts, eos=eos)
    finally:
        hook.remove()
    alone = [decode(verifier, proposer(), [p], eos=eos)[0] for p in prompts]
    assert [d.tokens for d in batched] == [d.tokens for d in alone] == greedy_decode(verifier, prompts, MAX_NEW, eos)
    assert [d.accepted for d in batched] == [d.accepted for d in alone]
    assert batched[1].tokens[-1] == early and len(batched[1].tokens) < 10
    with_it = 1 + len(batched[1].accepted)  # the prefill and prompt 1's verify forwards
    assert rows[:with_it] == [3] * with_it and max(rows[with_it:]) == 2 and rows == sorted(rows, reverse=True)

def test_ngram_matches_the_longest_latest_suffix():
    assert ngram([5, 6, 7, 1, 5, 6], 2) == [7, 1]
    assert ngram([5, 6, 7, 9, 6, 8, 5, 6], 3) == [7, 9, 6]  # n = 2 matches [5, 6] at 0
    assert ngram([1, 2, 3, 2, 4, 2], 5) == [4, 2]  # n = 1: the latest earlier 2, then what followed
    assert ngram([1, 2, 3], 4) == [] and ngram([7], 4) == []


def test_ngram_finds_what_a_scan_of_every_position_finds(monkeypatch):
    """The byte search of ``ngram`` against the scan on random histories over few tokens (many matches), among them
    ids whose 4-byte encodings overlap one another at other offsets (0, 1, 256, 65536, 16777216: a hit inside a token
    must not count)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from baselines_replay import scanned_ngram  # the definition: every earlier position, latest first

    generator = torch.Generator().manual_seed(3)
    tokens = [0, 1, 2, 256, 257, 65536, 16777216, 49151]
    for _ in range(3000):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        history = [tokens[i] for i in torch.randint(0, len(tokens), (length,), generator=generator).tolist()]
        k, max_n = int(torch.randint(1, 8, (1,), generator=generator)), int(torch.randint(1, 5, (1,), generator=generator))
        assert ngram(history, k, max_n) == scanned_ngram(history, k, max_n), (history, k, max_n)


@pytest.mark.parametrize("name", ["ngram", "most_frequent"])
def test_history_baselines_are_lossless_and_replay_exactly(tiny, name):
    """Decoding for real equals replaying the proposer on the plain output (what evaluate reports)."""
    verifier, prompts, plain = tiny
    propose = ngram if name == "ngram" else most_frequent(plain[0][3])
    out = decode(verifier, HistoryProposer(propose, K), prompts)
    assert [d.tokens for d in out] == plain
    assert [d.accepted for d in out] == [[j for j, _ in replay(propose, p.tolist(), o, K)] for p, o in zip(prompts, plain)]
    assert sum(j for d in out for j in d.accepted) > 0


SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["mistral", "hybrid"])
def sliding_verifier(request):
    """Tiny random verifiers with a 16-token window: Mistral-style (every layer) and hybrid (sliding, full, ...)."""
    torch.manual_seed(0)
    if request.param == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=16, **SMALL)).eval()
    config = Qwen2Config(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                         **SMALL)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("shape", [TreeShape.chain(K), TREE], ids=["chain", "tree"])
def test_sliding_window_verifier_past_its_window(sliding_verifier, shape):
    """Prompts (40, 33) longer than the window (16): rejected drafts leave holes inside sliding layers.

    The hybrid family takes one mask per layer type; the window must matter (a full mask decodes differently).
    """
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g) for n in (40, 33)]
    expected = [sliding_verifier.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    assert greedy_decode(sliding_verifier, prompts, MAX_NEW, set()) == expected
    unwindowed = copy.deepcopy(sliding_verifier)
    unwindowed.config.sliding_window = 10_000
    assert greedy_decode(unwindowed, prompts, MAX_NEW, set()) != expected  # the window is exercised
    table = greedy_tables(sliding_verifier, prompts, MAX_NEW + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % 512
    out = decode(sliding_verifier, EagleProposer(TableDrafter(table, 512), shape), prompts, eos=())
    assert [d.tokens for d in out] == expected
    accepted = [j for d in out for j in d.accepted]
    assert 0 < max(accepted) and min(accepted) < K


@pytest.mark.parametrize("shape", [TreeShape.chain(K), TREE], ids=["chain", "tree"])
def test_static_caches_read_growing_windows_exactly(sliding_verifier, shape):
    """Grouped-query attention (4 heads, 2 kv heads) over static caches read through windows of 256, 512, ...
    columns (``ColumnCache.window``), sliding layers among them: the tokens of plain greedy decoding."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g) for n in (40, 33)]
    max_new = 160  # with a miss every third token, chains (K + 1 columns a round) pass 256 columns
    expected = greedy_decode(sliding_verifier, prompts, max_new, set())
    table = greedy_tables(sliding_verifier, prompts, max_new + K + 2)
    table[:, ::3] = (table[:, ::3] + 1) % 512  # rounds of about two accepted drafts
    graphs = DecodeGraphs(max(map(len, prompts)), max_new, capture=False)
    target = Target(verifier=sliding_verifier, layer_ids=TINY_TAPS, eos_ids=set(), graphs=graphs)
    out = speculative_decode(target, EagleProposer(TableDrafter(table, 512), shape, graphs), prompts, max_new)
    assert [d.tokens for d in out] == expected
    (cache,) = graphs.verifier_caches.values()
    assert cache.columns > 256 and len(cache.windows()) >= 2  # the windows grew past the first
    assert sorted(key[3] for key in graphs.graphs if key[0] == "verifier") == cache.windows()  # all made at the first forward


@pytest.mark.parametrize("method", ["plain", "chain", "tree"])
def test_static_caches_decode_as_the_growing_ones(tiny, method):
    """The CUDA-graph layout run eagerly (``DecodeGraphs(capture=False)``): preallocated caches,
    rows and columns that never leave, fixed-width drafter context steps; over two batches of the
    same size (buffers reused) and a prompt stopping early, every output and τ is the eager one's."""
    verifier, prompts, plain = tiny
    eos = {next(t for i, t in enumerate(plain[1][2:10], 2) if t not in plain[1][:i] and t not in plain[0])}
    drafter = random_drafter(verifier, 512, TINY_TAPS)
    shape = {"plain": None, "chain": TreeShape.chain(K), "tree": TREE}[method]
    graphs = DecodeGraphs(max(map(len, prompts)), MAX_NEW, capture=False)
    for batch in (prompts[:2], prompts[1:]):
        eager = decode(verifier, shape and EagleProposer(drafter, shape), batch, eos=eos)
        static = speculative_decode(Target(verifier=verifier, layer_ids=TINY_TAPS, eos_ids=eos, graphs=graphs),
                                    shape and EagleProposer(drafter, shape, graphs), batch, MAX_NEW)
        assert [d.tokens for d in static] == [d.tokens for d in eager] == greedy_decode(verifier, batch, MAX_NEW, eos)
        assert [d.accepted for d in static] == [d.accepted for d in eager]
    assert len(graphs.verifier_caches) == 1


@pytest.mark.parametrize("layout", ["growing", "static"])
def test_decoding_stops_after_a_stop_string_as_generation_does(tiny, tiny_verifier_dir, layout):
    """model.stop ends an answer (a base model's end of turn), not only EOS: every method keeps the
    tokens up to the one completing the string, and an oracle's round that runs past it counts the
    drafts up to there, so τ is of the served text."""
    verifier, prompts, plain = tiny
    tokenizer = load_tokenizer(tiny_verifier_dir)
    stop = tokenizer.decode(plain[0][5:7])
    stops = StopStrings(tokenizer, [stop])

    def served(tokens: list[int]) -> list[int]:
        return next((tokens[:n] for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n])), tokens)

    expected = [served(tokens) for tokens in plain]
    assert len(expected[0]) <= 7 < len(plain[0])
    graphs = DecodeGraphs(max(map(len, prompts)), MAX_NEW, capture=False) if layout == "static" else None
    oracle = TableDrafter(greedy_tables(verifier, prompts, MAX_NEW + K + 2), verifier.config.vocab_size)
    for proposer in (None, EagleProposer(oracle, TreeShape.chain(K), graphs), EagleProposer(oracle, TREE, graphs)):
        target = Target(verifier=verifier, layer_ids=TINY_TAPS, eos_ids={2}, stops=stops, graphs=graphs)
        out = speculative_decode(target, proposer, prompts, MAX_NEW)
        assert [d.tokens for d in out] == expected and out[0].stopped
        assert all(1 + sum(a + 1 for a in d.accepted) == len(d.tokens) for d in out)  # every kept token, once
    assert greedy_decode(verifier, prompts, MAX_NEW, {2}, stops) == expected
