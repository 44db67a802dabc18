"""Each eval set's report: τ of the chain and the tree over every prompt and turn, the baselines, and
the timings of plain vs chain vs tree decoding per batch size (``evaluate_set``); the later turns of
a multi-turn set (``Conversations``).

    session = Session.create(verifier, drafter, settings, eos_ids, stops)   # eagle3.decoding.session
    reports = evaluate(session, {"humaneval": prompts}, conversations)      # {set: report}

Why apart from the stage: the stage (``eagle3.evaluate``) loads, checks and writes; what it
measures is decoding's, and a benchmark measures the same way without running the stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch
from tqdm import tqdm

from eagle3.decoding.acceptance import acceptance_stats, tau_by_position
from eagle3.decoding.baselines import baselines
from eagle3.decoding.config import TreeShape
from eagle3.decoding.session import Session
from eagle3.decoding.settings import Settings
from eagle3.decoding.speculative import Pause, StopStrings, speculative_decode
from eagle3.decoding.timing import (UNSTABLE_SPREAD, Run, batched, chain_sweep, decode_all, decode_graphs, disagreeing,
                                    graph_rows, step_costs, timed_prompts, timings, warm_up)
from eagle3.decoding.tree import EagleProposer
from eagle3.lm.chat import prompt_ids

log = logging.getLogger(__name__)


class Conversations:
    """The later user turns of a multi-turn eval set (its records' ``followups``), each asked after the
    verifier's own answer to the turn before.

        turn2 = conversations.next_turn(answers)   # prompts [n] of the records with a followup left

    Why the drafted answer: greedy speculative decoding emits the verifier's greedy answer (the
    chain's outputs equal plain decoding's, ``lossless``), so the next turn follows what the verifier
    itself answered, as MT-bench's second turns do, with no decode of its own.
    """

    ANSWER_MARGIN = 16  # tokens an answer's text may take beyond the decoded ones when rendered again

    def __init__(self, tokenizer, records: Sequence[dict], device: str, stops: StopStrings | None = None):
        self.tokenizer, self.device, self.stops = tokenizer, device, stops
        self.chats = [list(r["messages"]) for r in records]
        self.followups = [list(r.get("followups", [])) for r in records]
        self.asked = list(range(len(records)))  # the records of the turn decoded last
        self.done = 0  # followups asked so far

    @property
    def turns(self) -> int:
        return 1 + max(map(len, self.followups), default=0)

    def rows(self, turn: int) -> int:
        """Prompts of turn ``turn`` (1: every record)."""
        return sum(len(f) >= turn - 1 for f in self.followups)

    def longest_prompt(self, max_new_tokens: int) -> int:
        """At most the tokens of any turn's prompt: the whole conversation rendered with empty answers,
        plus each answer's ``max_new_tokens`` (and ANSWER_MARGIN)."""
        longest = 0
        for chat, followups in zip(self.chats, self.followups):
            turns = [m for f in followups for m in ({"role": "assistant", "content": ""}, {"role": "user", "content": f})]
            longest = max(longest, len(prompt_ids(self.tokenizer, chat + turns)) + len(followups) * (max_new_tokens + self.ANSWER_MARGIN))
        return longest

    def answer_text(self, tokens: list[int]) -> str:
        """An answer as the next turn's history holds it: its text, without special tokens or a closing stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for stop in self.stops.strings if self.stops else ():
            text = text.split(stop)[0]
        return text

    def next_turn(self, answers: Sequence[list[int]]) -> list[torch.Tensor]:
        """Prompts [n] of the next turn, from the answers to the last one (in its order): each conversation
        that has another followup, with its answer and that followup appended, under the chat template."""
        asked = []
        for record, answer in zip(self.asked, answers, strict=True):
            self.chats[record].append({"role": "assistant", "content": self.answer_text(answer)})
            if len(self.followups[record]) > self.done:
                self.chats[record].append({"role": "user", "content": self.followups[record][self.done]})
                asked.append(record)
        self.asked, self.done = asked, self.done + 1
        return [torch.tensor(prompt_ids(self.tokenizer, self.chats[r]), device=self.device) for r in asked]



def lossless(run: Run, plain: Run) -> float:
    """The share of a speculative run's outputs equal to the plain greedy run's (same prompts, same budget)."""
    share = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / len(plain.outputs)
    if share < 1:
        log.warning("%.0f%% of outputs differ from plain greedy decoding (numerical ties, or a bug)", 100 * (1 - share))
    return share


FIRST_PHASE = 64  # answer tokens of τ's first decode phase (``phase_ends``)


def phase_ends(max_new_tokens: int) -> list[int]:
    """The answer lengths where τ's decode regroups the answers not yet ended: doubling from FIRST_PHASE up to
    ``max_new_tokens``. Example: 256 -> [64, 128, 256]; 100 -> [64, 100]; 64 -> [64] (one phase)."""
    ends = [FIRST_PHASE]
    while ends[-1] < max_new_tokens:
        ends.append(ends[-1] * 2)
    return [end for end in ends if end < max_new_tokens] + [max_new_tokens]


def decode_tau(session: Session, prompts: Sequence[torch.Tensor], batch_size: int) -> dict[str, Run]:
    """τ's decode of every prompt at ``batch_size``, once per drafting method (``decode_phased``): the chain first,
    then the others with their first phase's prompts ordered by the chain's verifier forwards, most first."""
    methods = session.settings.drafting_methods()
    first, *others = methods
    runs = {first: decode_phased(session, prompts, batch_size, first, methods[first])}
    forwards = [len(accepted) for accepted in runs[first].accepted]
    runs.update({name: decode_phased(session, prompts, batch_size, name, methods[name], forwards) for name in others})
    return runs


def decode_phased(session: Session, prompts: Sequence[torch.Tensor], batch_size: int, name: str, shape: TreeShape,
                  forwards: Sequence[int] | None = None) -> Run:
    """One drafting method over every prompt to the end of each answer, in phases (``phase_ends``): a phase decodes
    the answers not yet ended, in batches, each until it has the phase's tokens (``speculative_decode``'s
    ``Pause``: never within a round), and the next phase goes on from each answer's last token. A phase's
    prompts are ordered by verifier forwards so far, most first (the first phase's by ``forwards``, if given).

    Why: a batch decodes until its longest answer ends, with graphs its finished rows riding along, so a
    batch of answers of 5 and of 256 tokens costs the 256's forwards for every row. Regrouped at 64 and 128
    tokens, the answers still going fill fewer, fuller batches, of rows that end together. Each answer's
    forwards are those of one decode, as if never paused (τ by position included), but for the rounding of
    another batch: each phase's prefill recomputes the features of the answer so far.
    """
    graphs, max_new = session.graphs, session.settings.max_new_tokens
    run = Run(outputs=[[] for _ in prompts], accepted=[[] for _ in prompts])
    rows = graph_rows(len(prompts), batch_size) if graphs is not None else None  # every phase's, as captured
    going = list(range(len(prompts)))
    for phase, end in enumerate(phase_ends(max_new)):
        if phase or forwards is not None:
            counts = [len(a) for a in run.accepted] if phase else forwards
            going.sort(key=lambda i: -counts[i])  # stable: ties keep prompt order
        inputs = [torch.cat([prompts[i], prompts[i].new_tensor(run.outputs[i][:-1])]) if phase else prompts[i] for i in going]
        left = []
        columns = [going, inputs, [run.outputs[i] for i in going]]
        for count, (ids, batch, answers) in tqdm(batched(columns, batch_size, rows), desc=f"{name} to {end} tokens", unit="batch",
                                                 total=-(-len(going) // batch_size), leave=False):
            decoded = speculative_decode(session.target, EagleProposer(session.drafter, shape, graphs), batch, max_new,
                                         pause=Pause(end, answers if phase else None))
            for i, d in zip(ids[:count], decoded):
                run.outputs[i], run.accepted[i] = d.tokens, run.accepted[i] + d.accepted
                if d.paused:
                    left.append(i)
        going = left
        if not going:
            break
    return run


def timed_with_tau(prompts: Sequence[torch.Tensor], settings: Settings) -> bool:
    """Whether the largest batch size's timing is the τ decode itself: it times every prompt, every token."""
    largest = max(settings.batch_sizes)
    return (largest in settings.timed_sizes and len(timed_prompts(prompts, settings, largest)) == len(prompts)
            and settings.timed_tokens == settings.max_new_tokens)


def evaluate_set(session: Session, prompts: Sequence[torch.Tensor], conversations: Conversations | None = None) -> dict:
    """τ of the chain and the tree (and the baselines) over every prompt and every turn, and the timings of
    plain vs chain vs tree decoding: {"plain": the set's counts, "chain", "tree"?, "baseline"?, "ngram"?,
    "turns"?: {n: τ per method}, "batch": {batch size: ``timings``}, "unstable": [...], "chain_k"?: ``chain_sweep``}.

    τ is decoded once, at the largest batch size, over every prompt (``max_new_tokens`` each; ``decode_tau``); a
    multi-turn set's later turns (``conversations``) follow, each after the chain's answers to the
    one before, and its τ pools every turn's forwards. Every batch size is timed ``repeats`` times
    on its ``timed_prompts`` (``timed_tokens`` each), plain decoding beside the drafting methods;
    ``lossless`` compares their outputs at the largest size. Where that timing covers every prompt
    and token (the demo), it is the τ decode itself: one decode in all.
    """
    start, settings = time.perf_counter(), session.settings
    largest, edges = max(settings.batch_sizes), settings.position_buckets

    def decode(batch: Sequence[torch.Tensor], size: int, methods: Mapping, repeats: int = 1, tokens: int | None = None) -> dict[str, Run]:
        return decode_all(session, batch, size, methods, repeats, tokens)

    timed = {}  # batch size -> the runs of its timing
    if timed_with_tau(prompts, settings):
        tau_runs = timed[largest] = decode(prompts, largest, settings.methods(), settings.repeats)
    else:
        tau_runs = decode_tau(session, prompts, largest)
    turns = [(prompts, tau_runs)]
    while conversations is not None and (later := conversations.next_turn(turns[-1][1]["chain"].outputs)):
        turns.append((later, decode_tau(session, later, largest)))
    tau_seconds = time.perf_counter() - start
    for size in settings.timed_sizes:
        if size not in timed:
            timed[size] = decode(timed_prompts(prompts, settings, size), size, settings.methods(), settings.repeats,
                                 settings.timed_tokens)
    every_prompt = [p for batch, _ in turns for p in batch]
    answers = [a for _, runs in turns for a in runs["chain"].outputs]  # the verifier's greedy answers
    headline_timed = timed_prompts(prompts, settings, settings.batch_sizes[0])
    report = {"plain": {"tokens": sum(map(len, answers)), "prompts": len(prompts), "timed_prompts": len(headline_timed) if timed else 0,
                        "outside_draft_vocab": outside_draft_vocab(session.drafter, answers)}}
    for name, shape in settings.drafting_methods().items():
        accepted = [a for _, runs in turns for a in runs[name].accepted]
        report[name] = {**acceptance_stats([j for a in accepted for j in a], shape.num_steps),
                        "tau_by_position": tau_by_position(accepted, edges)}
        if timed:  # plain decoding beside it, and the graphs of the timed batches
            report[name].update(lossless=lossless(timed[largest][name], timed[largest]["plain"]),
                                **step_costs(session, headline_timed, settings.batch_sizes[0], shape))
    if settings.baseline:
        report.update(baselines(every_prompt, answers, settings.draft_tokens, edges))
    if len(turns) > 1:  # published multi-turn τ pools the turns (as above); each turn's own beside it
        token = report.get("baseline", {}).get("token")
        report["turns"] = {n: turn_report(batch, runs, settings, token) for n, (batch, runs) in enumerate(turns, 1)}
    report["batch"] = {size: timings(timed[size]) for size in settings.timed_sizes}
    if settings.chain_sweep:  # per set: the K that pays differs with what is decoded (code, math, chat)
        report["chain_k"] = chain_sweep(session, headline_timed)
    report["unstable"] = [f"batch {size}: {what}" for size, timing in report["batch"].items() for what in disagreeing(timing)]
    report["unstable"] += [f"chain K sweep: {what}" for what in disagreeing(report.get("chain_k", {}).get("timing", {}))]
    if report["unstable"]:
        log.warning("repeated timings disagree by more than %d%% (%s): a varying load; these speedups do not repeat",
                    100 * UNSTABLE_SPREAD, ", ".join(report["unstable"]))
    report["plain"].update(seconds=time.perf_counter() - start, tau_seconds=tau_seconds)
    return report


def outside_draft_vocab(drafter, answers: Sequence[list[int]]) -> float:
    """The share of the answers' tokens the drafter cannot propose: outside its draft vocabulary (``t2d``).

    Why: each such token ends a chain however well the drafter predicts, so the share bounds τ on a set from
    above; copied names, numbers and rare words are where a draft vocabulary sized to the training answers
    falls short (docs/evaluation.md).
    """
    tokens = torch.tensor([t for answer in answers for t in answer], dtype=torch.long)
    if not len(tokens):
        return 0.0
    return float((~drafter.t2d.cpu()[tokens]).float().mean())


def turn_report(prompts: Sequence[torch.Tensor], runs: Mapping[str, Run], settings: Settings, token: int | None) -> dict:
    """One turn of a multi-turn set: its prompts and τ (and forwards) per drafting method, τ per baseline."""
    report: dict = {"prompts": len(prompts)}
    for name, shape in settings.drafting_methods().items():
        stats = acceptance_stats(runs[name].pooled, shape.num_steps)
        report[name] = {"tau": stats["tau"], "forwards": stats["forwards"]}
    if settings.baseline:
        found = baselines(prompts, runs["chain"].outputs, settings.draft_tokens, token=token)
        report.update({name: {"tau": found[name]["tau"]} for name in ("baseline", "ngram")})
    return report


def evaluate(session: Session, eval_sets: Mapping[str, Sequence[torch.Tensor]],
             conversations: Mapping[str, Conversations] | None = None) -> dict[str, dict]:
    """The stage's work on loaded models: each set's report (``evaluate_set``), from prompts [n] each;
    ``conversations``: the later turns of the multi-turn sets, by set.

    The session decodes eagerly; on a GPU (``decode_graphs``) its graphs are made here, for the
    longest prompt of any set and turn. One warm-up on the first set comes first; the sets need none
    of their own.
    """
    conversations, settings = conversations or {}, session.settings
    largest = max(settings.batch_sizes)
    longest = max([len(p) for prompts in eval_sets.values() for p in prompts] +
                  [c.longest_prompt(settings.max_new_tokens) for c in conversations.values()])
    session = session.with_graphs(decode_graphs(settings, longest))
    counts = {graph_rows(len(timed_prompts(prompts, settings, size)), size) for prompts in eval_sets.values()
              for size in settings.timed_sizes} | {graph_rows(len(prompts), largest) for prompts in eval_sets.values()}
    counts |= {graph_rows(c.rows(turn), largest) for c in conversations.values() for turn in range(2, c.turns + 1)}
    first = next(iter(eval_sets.values()))
    warm_up(session, first, sorted(counts), None if settings.timed_sizes else settings.drafting_methods())  # none timed: no plain
    if session.graphs is not None and settings.chain_sweep:  # the sweep's chains: every set's timed rows at the first batch size
        size = settings.batch_sizes[0]
        rows = sorted({graph_rows(len(timed_prompts(prompts, settings, size)), size) for prompts in eval_sets.values()})
        warm_up(session, first, rows, settings.chain_methods())
    reports = {}
    for name, prompts in eval_sets.items():
        reports[name] = report = evaluate_set(session, prompts, conversations.get(name))
        speedup = report["batch"].get(settings.batch_sizes[0], {}).get("chain", {}).get("speedup")
        log.info("%s: chain tau %.3f, speedup %s at batch %d; tree tau %s; baselines tau %s (most frequent), %s (ngram); "
                 "%d prompts%s in %.1f s (the tau decode %.1f s); %.1f%% of the answers' tokens outside the draft vocabulary",
                 name, report["chain"]["tau"],
                 "-" if speedup is None else f"{speedup:.2f}x",
                 settings.batch_sizes[0],
                 report.get("tree", {}).get("tau", "-"), report.get("baseline", {}).get("tau", "-"),
                 report.get("ngram", {}).get("tau", "-"), len(prompts),
                 f" ({len(report['turns'])} turns)" if "turns" in report else "", report["plain"]["seconds"],
                 report["plain"]["tau_seconds"], 100 * report["plain"]["outside_draft_vocab"])
    return reports
