"""GPU check of ``evaluate``'s decoding: CUDA-graph vs eager outputs, and tokens/s and speedup per batch size.

    # one H200, a random SmolLM2-shaped verifier and drafter (about 2 minutes, at most --deadline seconds)
    PYTHONPATH=src python benchmarks/evaluate_throughput.py --shape smollm2 --device cuda --dtype bfloat16 --json bench.json
    # a real verifier (and drafter, eval set) instead of random ones
    PYTHONPATH=src python benchmarks/evaluate_throughput.py --verifier models/verifier --drafter models/drafter \\
        --prompts data/prompts/eval/heldout.jsonl --device cuda --dtype bfloat16 --json bench.json
    python benchmarks/evaluate_throughput.py --device cpu --tiny       # a tiny shape in seconds (tested)

Parts, each in turn; one that fails prints its whole traceback and the next one runs:

1. ``check``: --check-rows prompts decoded by every method eagerly (the growing caches, as on the
   CPU), in ``eagle3.decoding.graphed``'s static caches eagerly, and in those caches with
   CUDA-graph-captured steps (on the CPU: eager too): the share of the graphs' outputs and
   acceptance counts equal to each of the other two.
2. ``graph``: per batch size B (--batch-sizes) the first B prompts decoded as one batch by plain
   greedy, a chain of --draft-tokens and SGLang's tree, with ``evaluate``'s own loop
   (``eagle3.decoding.timing``: ``warm_up``, then ``decode_all`` with --repeats alternating timings) and statistics
   (``timings``: median and spread; ``step_costs``).
3. ``oracle`` (random verifier only): ``OracleDrafter``, the verifier's own greedy continuation,
   as 1 (its chains and trees accepted whole through the graphs) and as 2 at --oracle-batch-sizes
   (the speedup ceiling of these step costs).
4. ``chain_k``: chains of K = 2..7 (--chain-sweep) with graphs at batch 1: τ, speedup, the best K.
5. ``eager``: as 2, eagerly (--eager-batch-sizes, --eager-repeats): what the graphs save.

A part is skipped once --budget seconds have passed, and one still running at --deadline is
interrupted (its error recorded), so the whole run ends within about --deadline seconds. The JSON
(--json) is rewritten after every part, so what ran survives a later failure. The table printed last has one row per mode, batch
size and method: tokens/s and speedup (median ± spread over repeats), τ, and the proposal's and
the verify forward's cost in 1-token verifier forwards (graphs only).

``--shape smollm2`` is SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocabulary 49152,
tied embedding) with random weights; its random drafter accepts almost nothing (τ ≈ 1: the
most verifier forwards, the slowest case), and random weights never emit EOS, so every prompt
decodes --max-new-tokens tokens. Random prompts of --prompt-tokens tokens at most (half to all of
it, so batches are padded as real ones are).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, LlamaForCausalLM

from eagle3.common import read_jsonl
from eagle3.drafter.export import load_drafter
from eagle3.decoding.graphed import DecodeGraphs
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.decoding.speculative import Target, greedy_decode, prefill, speculative_decode
from eagle3.decoding.tree import EagleProposer
from eagle3.decoding.config import TreeShape
from eagle3.decoding.session import Session, for_decoding
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import WHOLE_COPY, eos_token_ids, input_embedding, load_tokenizer, load_verifier, prepare_torch
from eagle3.decoding.acceptance import acceptance_stats
from eagle3.decoding.settings import Settings
from eagle3.decoding.timing import decode_all, step_costs, timings, warm_up
from shapes import VERIFIER_SHAPES

# Random verifiers (Llama architecture), by the CLI's names: SmolLM2-135M's shape, and a tiny one for the CPU test.
SHAPES = {"smollm2": VERIFIER_SHAPES["smollm2-135m"], "tiny": VERIFIER_SHAPES["tiny"]}


def random_verifier(shape: str, device: str, dtype: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(AutoConfig.for_model(**SHAPES[shape]))
    return model.to(getattr(torch, dtype)).eval()


def random_drafter(config, embed: torch.Tensor, taps: list[int]) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DraftConfig.from_verifier(config, min(32000, embed.shape[0]), taps)
    drafter = Eagle3Drafter(cfg, embed)
    drafter.set_draft_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # the first Vd tokens
    return drafter


class OracleDrafter(nn.Module):
    """A stand-in drafter proposing the verifier's own greedy continuation: every draft is accepted.

    Row b's table holds its prompt and greedy output; at RoPE position p it proposes table[b, p + 2]
    (the alignment: (g_p, x_{p+1}) predicts x_{p+2}), the position carried in channels 0 and 1 of
    h2 as p // 64 and p % 64 (small integers: exact in bf16).
    Rows must stay in place, so every row runs to the same length (no EOS: a random verifier).
    Why: with it the graphs' verify forwards accept whole chains and trees, which a random drafter
    never exercises, and its speedup is the ceiling the step costs allow.
    """

    def __init__(self, table: torch.Tensor, vocab_size: int, taps: tuple[int, ...]):
        super().__init__()
        self.table, self.vocab_size = table, vocab_size  # [B, L]
        self.config = types.SimpleNamespace(aux_layers=taps)
        self.fc = nn.Identity()
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long, device=table.device))  # draft vocab = target's

    def step(self, input_ids, hidden, position_ids, cache, rows=None):
        h2 = hidden.clone()
        h2[..., 0], h2[..., 1] = (position_ids // 64).to(h2.dtype), (position_ids % 64).to(h2.dtype)
        return h2

    def logits(self, h2):
        position = 64 * h2[..., 0].float().round().long() + h2[..., 1].float().round().long()
        index = (position + 2).clamp(0, self.table.shape[1] - 1)  # [B, T]
        tokens = self.table.gather(1, index)[..., None]  # scatter, not one_hot: no host check inside a graph capture
        return h2.new_zeros(*tokens.shape[:-1], self.vocab_size).scatter_(-1, tokens, 10.0)


def oracle_drafter(verifier, drafter, prompts, settings: Settings) -> OracleDrafter:
    """The ``OracleDrafter`` of these prompts (their greedy continuation, past max_new_tokens by a chain)."""
    extra = settings.max_new_tokens + max(settings.draft_tokens, *settings.chain_sweep, settings.tree.num_steps) + 2
    rows = [torch.cat([p, torch.tensor(g, device=p.device)]) for p, g in zip(prompts, greedy_decode(verifier, prompts, extra, set()))]
    table = torch.stack([F.pad(r, (0, max(map(len, rows)) - len(r))) for r in rows])
    return OracleDrafter(table, input_embedding(verifier).shape[0], tuple(drafter.config.aux_layers))


def load_prompts(args, tokenizer, vocab_size: int, count: int) -> list[torch.Tensor]:
    if args.prompts:
        records = list(read_jsonl(args.prompts))[:count]
        prompts = [torch.tensor(prompt_ids(tokenizer, r["messages"]), device=args.device) for r in records]
        return [prompts[i % len(prompts)] for i in range(count)]  # a small set repeats to fill the largest batch
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (count,), generator=g)
    return [torch.randint(0, vocab_size, (int(n),), generator=g).to(args.device) for n in lengths]


def models(args):
    """(verifier, drafter, eos ids, tokenizer or None)."""
    if args.verifier:
        verifier = load_verifier(args.verifier, args.device, args.dtype)
        tokenizer = load_tokenizer(args.verifier)
        eos = eos_token_ids(verifier, tokenizer)
    else:
        verifier, tokenizer, eos = random_verifier(args.shape, args.device, args.dtype), None, set()
    embed = input_embedding(verifier)
    layers = verifier.config.get_text_config().num_hidden_layers
    if args.drafter:
        drafter = load_drafter(args.drafter, embed)
    else:
        drafter = random_drafter(verifier.config.get_text_config(), embed, args.taps or [1, layers // 2, layers - 1])
    return verifier, drafter.to(args.device, embed.dtype).eval(), eos, tokenizer


def agreement(verifier, drafter, prompts, settings: Settings, eos: set[int], graphs: DecodeGraphs) -> dict:
    """Per method, the share of outputs and of acceptance lists of ``graphs``' decoding equal to eager decoding's
    (the growing caches) and, to tell the layout's numerics from the capture, to the static layout run eagerly."""
    layer_ids = drafter.config.aux_layers
    prefilled = prefill(verifier, prompts, layer_ids)
    static_eager = DecodeGraphs(graphs.prompt_tokens, graphs.max_new_tokens, capture=False)
    report = {}
    for name, shape in settings.methods().items():
        def decode(with_graphs: DecodeGraphs | None):
            proposer = shape and EagleProposer(drafter, shape, with_graphs)
            target = Target(verifier=verifier, layer_ids=layer_ids, eos_ids=eos, graphs=with_graphs)
            return speculative_decode(target, proposer, prompts, settings.max_new_tokens, prefilled)

        eager, layout, graphed = decode(None), decode(static_eager), decode(graphs)
        report[name] = {"tau_eager": tau(eager), "tau_graph": tau(graphed)}
        for label, other in (("eager", eager), ("static_eager", layout)):
            report[name][f"same_tokens_as_{label}"] = sum(a.tokens == b.tokens for a, b in zip(other, graphed)) / len(prompts)
            report[name][f"same_accepted_as_{label}"] = sum(a.accepted == b.accepted for a, b in zip(other, graphed)) / len(prompts)
    return report


def tau(decoded) -> float:
    return 1 + sum(sum(d.accepted) for d in decoded) / max(1, sum(len(d.accepted) for d in decoded))


def timed(verifier, drafter, prompts, settings: Settings, eos: set[int], batch_size: int, graphs: DecodeGraphs | None,
          methods=None) -> dict:
    """``evaluate``'s measurement of one batch of ``batch_size`` prompts: {method: timings + tau (+ costs)}."""
    methods = methods or settings.methods()
    batch = prompts[:batch_size]
    settings = dataclasses.replace(settings, batch_sizes=(batch_size,))  # the eager warm-up's batch too
    session = Session.create(verifier, drafter, settings, eos).with_graphs(graphs)
    start = time.perf_counter()
    warm_up(session, batch, [batch_size], methods)
    warmed = time.perf_counter()
    runs = decode_all(session, batch, batch_size, methods, settings.repeats)
    report = timings(runs)
    for name, shape in methods.items():
        report[name]["tau"] = acceptance_stats(runs[name].pooled, shape.num_steps)["tau"] if shape else 1.0
        if shape:
            report[name].update(step_costs(session, batch, batch_size, shape))
    report["seconds"] = {"warm_up_and_capture": warmed - start, "timed": time.perf_counter() - warmed}
    return report


def table(results: dict) -> list[str]:
    """The markdown table of the timed parts: one row per mode, batch size and method."""
    def pm(row: dict, key: str, digits: int) -> str:
        spread = row.get(f"{key}_spread")
        return "-" if key not in row else f"{row[key]:.{digits}f}" + ("" if spread is None else f" ±{100 * spread:.0f}%")

    lines = ["| mode | batch | method | tokens/s | speedup | tau | draft cost | verify cost |", "|---|---|---|---|---|---|---|---|"]
    for part in ("graph", "oracle", "chain_k", "eager"):
        for size, methods in results.get(part, {}).items():
            if not isinstance(methods, dict) or "error" in methods or "skipped" in methods:
                lines.append(f"| {part} | {size} | {methods if isinstance(methods, str) else next(iter(methods.values()))} |")
                continue
            for name, row in methods.items():
                if isinstance(row, dict) and "tokens_per_s" in row:
                    lines.append(f"| {part} | {size} | {name} | {pm(row, 'tokens_per_s', 1)} | {pm(row, 'speedup', 3)} | "
                                 f"{row['tau']:.3f} | {row.get('draft_cost', float('nan')):.2f} | {row.get('verify_cost', float('nan')):.2f} |")
    return lines


class Parts:
    """Runs the benchmark's parts in turn within a time budget; a failing part records its error and the rest run."""

    def __init__(self, budget: float, json_path: Path | None):
        self.start, self.budget, self.json_path = time.perf_counter(), budget, json_path
        self.results: dict = {}

    def run(self, part: str, key: str, fn) -> None:
        elapsed = time.perf_counter() - self.start
        slot = self.results.setdefault(part, {})
        if elapsed > self.budget:
            slot[key] = {"skipped": f"time budget ({elapsed:.0f} s of {self.budget:.0f} s spent)"}
            print(f"# {part} {key}: skipped, {elapsed:.0f} s spent", flush=True)
            return
        try:
            slot[key] = fn()
            print(f"# {part} {key} ({time.perf_counter() - self.start - elapsed:.1f} s): {json.dumps(slot[key])}", flush=True)
        except Exception as error:  # noqa: BLE001 - a GPU check reports every part it can
            traceback.print_exc()
            slot[key] = {"error": f"{type(error).__name__}: {error}"}
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.write()

    def write(self) -> None:
        self.results["seconds"] = round(time.perf_counter() - self.start, 1)
        if self.json_path:
            self.json_path.write_text(json.dumps(self.results, indent=1, default=str) + "\n")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, help="a verifier folder (default: a random one of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny, batches 1 and 4, 16 new tokens, CPU-sized")
    parser.add_argument("--drafter", type=Path, help="exported drafter folder (default: random, verifier-shaped)")
    parser.add_argument("--taps", type=int, nargs=3, help="random drafter's taps (default: 1, L//2, L-1)")
    parser.add_argument("--prompts", type=Path, help="eval set jsonl (default: random token prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--eager-batch-sizes", type=int, nargs="*", default=[1, 64], help="eager timings (slow at batch 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager-repeats", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=4)
    parser.add_argument("--oracle-batch-sizes", type=int, nargs="*", default=[1, 4], help="timed with the oracle drafter (random verifier)")
    parser.add_argument("--chain-sweep", type=int, nargs="*", default=[2, 3, 4, 5, 6, 7])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=7)
    parser.add_argument("--tree", type=int, nargs=3, default=[5, 4, 16], metavar=("STEPS", "TOPK", "TOKENS"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=130, help="seconds after which the remaining parts are skipped")
    parser.add_argument("--deadline", type=int, default=170, help="seconds after which the running part is interrupted")
    parser.add_argument("--json", type=Path, help="write every part's results here")
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.max_new_tokens, args.prompt_tokens, args.repeats, args.eager_repeats = "tiny", 16, 24, 2, 2
        args.batch_sizes, args.eager_batch_sizes, args.check_rows, args.chain_sweep = [1, 4], [1], 2, [2, 3]
        args.oracle_batch_sizes = [2]
    return args


def interrupt(signum, frame) -> None:
    raise TimeoutError("--deadline reached: this part was interrupted, the rest are skipped")


def main() -> None:
    args = arguments()
    signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(args.deadline)  # the table still prints: the running part records the error, the rest are past --budget
    settings = Settings(draft_tokens=args.draft_tokens, tree=TreeShape(*args.tree), batch_sizes=tuple(args.batch_sizes),
                        repeats=args.repeats, timed_prompts=None, timed_new_tokens=None, chain_sweep=tuple(args.chain_sweep),
                        cuda_graphs=True, max_new_tokens=args.max_new_tokens, position_buckets=(), sets=("bench",),
                        max_prompts=None, baseline=False, device=args.device, dtype=args.dtype, threads=args.threads, stop=(),
                        trust_remote_code=False, placement=WHOLE_COPY)
    prepare_torch(settings.device, settings.threads)  # every verify forward has a new key length
    verifier, drafter, eos, tokenizer = models(args)
    for_decoding(verifier, drafter, settings)
    sizes = sorted({*args.batch_sizes, *args.eager_batch_sizes, args.check_rows})
    prompts = load_prompts(args, tokenizer, input_embedding(verifier).shape[0], max(sizes))
    capture = args.device.startswith("cuda")
    print(f"# {args.verifier or args.shape} on {args.device} {args.dtype}, torch {torch.__version__}, "
          f"{'CUDA graphs' if capture else 'static caches, eager (no GPU)'}, {args.max_new_tokens} new tokens, "
          f"chain {args.draft_tokens}, tree {args.tree}", flush=True)
    graphs = DecodeGraphs(max(len(p) for p in prompts), args.max_new_tokens, capture)
    parts = Parts(args.budget, args.json)
    parts.results["setup"] = {"verifier": str(args.verifier or args.shape), "drafter": str(args.drafter or "random"),
                              "device": args.device, "dtype": args.dtype, "torch": torch.__version__, "cuda_graphs": capture,
                              "max_new_tokens": args.max_new_tokens, "chain": args.draft_tokens, "tree": args.tree}
    oracle: dict = {}
    parts.run("check", str(args.check_rows), lambda: agreement(verifier, drafter, prompts[: args.check_rows], settings, eos, graphs))
    for size in args.batch_sizes:
        parts.run("graph", str(size), lambda: timed(verifier, drafter, prompts, settings, eos, size, graphs))
    if args.chain_sweep:
        parts.run("chain_k", "1", lambda: with_best(timed(verifier, drafter, prompts, settings, eos, 1, graphs, settings.chain_methods())))
    if not args.verifier:  # a random verifier never ends early: the oracle's rows stay aligned
        rows = max(args.check_rows, *args.oracle_batch_sizes)

        def make_oracle() -> dict:
            oracle["drafter"] = oracle_drafter(verifier, drafter, prompts[:rows], settings)
            return {"rows": rows}

        parts.run("oracle", "setup", make_oracle)
        if "drafter" in oracle:
            parts.run("oracle", f"check {args.check_rows}",
                      lambda: agreement(verifier, oracle["drafter"], prompts[: args.check_rows], settings, eos, graphs))
            for size in args.oracle_batch_sizes:
                parts.run("oracle", str(size), lambda: timed(verifier, oracle["drafter"], prompts, settings, eos, size, graphs))
    eager = dataclasses.replace(settings, repeats=args.eager_repeats)
    for size in args.eager_batch_sizes:  # last: the slowest, and what the budget cuts first
        parts.run("eager", str(size), lambda: timed(verifier, drafter, prompts, eager, eos, size, None))
    signal.alarm(0)
    parts.write()
    print("\n" + "\n".join(table(parts.results)))
    memory = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if capture else ""
    print(f"\n# {parts.results['seconds']} s{memory}; check: {json.dumps(parts.results.get('check'))}")
    if args.chain_sweep and "k2" in parts.results.get("chain_k", {}).get("1", {}):
        print(f"# best chain K at batch 1: {parts.results['chain_k']['1']['best_k']}")
    sys.exit(0)


def with_best(report: dict) -> dict:
    """``timed``'s chain sweep with ``best_k``: the K of the highest median speedup."""
    chains = {name: row for name, row in report.items() if name.startswith("k")}
    report["best_k"] = int(max(chains, key=lambda name: chains[name]["speedup"])[1:])
    return report


if __name__ == "__main__":
    main()
