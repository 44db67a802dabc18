"""Benchmark of the ``generate`` stage: generated tokens/s of the ways to answer one set of prompts.

    python benchmarks/generate_throughput.py --verifier models/verifier \\
        --prompts data/prompts/shards/000032-001000.jsonl --device cuda --count 256 --batch-size 128
    python benchmarks/generate_throughput.py --random-shape smollm2-135m --device cuda --count 256   # no data at all
    python benchmarks/generate_throughput.py --verifier models/verifier --prompts data/prompts/shards/000000-000032.jsonl \\
        --count 16 --batch-size 16 --max-new-tokens 64 --threads 1                                   # the CPU
    python benchmarks/generate_throughput.py --verifier models/verifier --prompts data/prompts/shards/000000-000032.jsonl \\
        --modes openai --base-url http://127.0.0.1:8000/v1 --concurrency 4

Modes, all on the same prompts (the first ``--count`` of the shard under the chat template, or
with ``--random-shape`` random token prompts of shard-like lengths and a random-weights model of
that shape, written to a temporary folder: it never stops early, so every mode does the same work):

- ``before``: the ``local`` backend as it was: cuDNN SDPA on, ``batch_size`` rows per batch;
- ``after``: the ``local`` backend now: cuDNN SDPA off on CUDA, ``--batch-tokens``, ``--pad-multiple``;
- ``generate``: plain transformers ``generate`` on the same sorted, left-padded batches;
- ``generate_batch``: transformers' continuous batching (paged attention) over all prompts;
- ``openai``: the stage's core (``generate_shard``) against an OpenAI-compatible server.

Each mode runs in its own fresh process (a cold start is per process: whatever runs first in a
process would pay it for the others). ``first`` is the first pass of that process, which is what
a ``dvc repro`` of a shard experiences; ``warm`` is the median of ``--runs`` further passes, once
every shape has been seen. Prints one JSON line per mode, then a table. Model loading is excluded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # random-weights verifiers, by the name of the model whose shape they have
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
}
MODES = ["before", "after", "generate", "generate_batch"]


def random_verifier(shape: str, folder: Path, device: str) -> Path:
    """A verifier folder with random weights of ``shape`` and a word-level tokenizer over its ids
    (decoding is all the backend asks of it; the prompts are token ids already)."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from eagle3.common import write_json

    config = AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    vocab = {f"<{i}>": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<0>")),
                                        eos_token=f"<{config.eos_token_id}>", pad_token=f"<{config.pad_token_id}>")
    tokenizer.save_pretrained(folder)
    write_json(folder / "meta.json", {"name": f"random-{shape}", "weights_path": "."})
    return folder


def random_prompts(count: int, vocab_size: int) -> list[list[int]]:
    """Token prompts whose lengths spread like a chat shard's (median about 90, 20 to 512)."""
    import random

    rng = random.Random(0)
    lengths = [min(512, max(20, int(rng.lognormvariate(4.5, 0.7)))) for _ in range(count)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def shard_prompts(verifier: Path, shard: Path, count: int) -> list[list[int]]:
    from eagle3.generate import read_prompts
    from eagle3.verifiers.chat import prompt_ids
    from eagle3.verifiers.loading import load_tokenizer

    tokenizer = load_tokenizer(verifier)
    return [prompt_ids(tokenizer, p["messages"]) for p in read_prompts(shard)[:count]]


def median_passes(one_pass, runs: int) -> dict:
    """Tokens/s of the first pass and the median of ``runs`` more (each pass: seconds, tokens)."""
    first_s, tokens = one_pass()
    warm = [one_pass() for _ in range(runs)]
    return {"tokens": tokens, "first_tok_s": round(tokens / first_s, 1),
            "warm_tok_s": round(statistics.median(t / s for s, t in warm), 1) if warm else None}


def backend_pass(spec: dict, prompts: list[list[int]], old: bool):
    """One pass of the ``local`` backend; ``old``: the behaviour before cuDNN SDPA was switched off
    and batches were token-budgeted."""
    import torch
    from omegaconf import OmegaConf

    from eagle3.backends import Generation, Request
    from eagle3.backends.local import LocalBackend

    cfg = OmegaConf.create({"device": spec["device"], "dtype": spec["dtype"], "threads": spec["threads"],
                            "batch_size": spec["batch_size"], "batch_tokens": None if old else spec["batch_tokens"],
                            "pad_multiple": 1 if old else spec["pad_multiple"]})
    gen = Generation("bench", spec["max_new_tokens"], temperature=0.0, top_p=1.0, seed=0, think_tags=None,
                     context=1 << 30, stop=(), trust_remote_code=False)  # context: the prompts are token ids, never skipped
    backend = LocalBackend(cfg, Path(spec["verifier"]), gen)
    if old and spec["device"].startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(True)
    requests = [Request(str(i), str(i), [], ids, 0) for i, ids in enumerate(prompts)]

    def one_pass():
        counted = []
        start = time.perf_counter()
        backend.run(requests, set(), lambda request, answer: counted.append(answer.completion_tokens))
        synchronize(spec["device"])
        return time.perf_counter() - start, sum(counted)

    return one_pass


def greedy_model(spec: dict):
    """(the verifier, its stop ids, a greedy GenerationConfig) for the plain transformers modes."""
    from transformers import GenerationConfig

    from eagle3.verifiers.loading import load_verifier

    model = load_verifier(spec["verifier"], spec["device"], spec["dtype"])
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    config = GenerationConfig(max_new_tokens=spec["max_new_tokens"], do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return model, eos, config


def generate_pass(spec: dict, prompts: list[list[int]]):
    """One pass of plain ``generate`` on the backend's batches (sorted by length, left padded)."""
    import torch

    from eagle3.backends import Request
    from eagle3.backends.local import left_pad, plan_batches

    model, eos, config = greedy_model(spec)
    batches = plan_batches([Request(str(i), str(i), [], ids, 0) for i, ids in enumerate(prompts)], spec["batch_size"])

    @torch.inference_mode()
    def one_pass():
        tokens = 0
        start = time.perf_counter()
        for batch in batches:
            input_ids, mask = left_pad([r.prompt_ids for r in batch], eos[0])
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                                 generation_config=config)
            tokens += sum(count_until_stop(row, eos) for row in out[:, input_ids.shape[1]:].tolist())
        synchronize(spec["device"])
        return time.perf_counter() - start, tokens

    return one_pass


def generate_batch_pass(spec: dict, prompts: list[list[int]]):
    """One pass of transformers' continuous batching over all prompts at once."""
    model, eos, config = greedy_model(spec)

    def one_pass():
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        synchronize(spec["device"])
        seconds = time.perf_counter() - start
        return seconds, sum(count_until_stop(o.generated_tokens, eos) for o in outputs.values())

    return one_pass


def openai_pass(spec: dict):
    """One pass of the stage's core against a server: prompts as chats, so it needs a shard."""
    from omegaconf import OmegaConf

    from eagle3.backends import Generation, make_backend
    from eagle3.config import compose_params
    from eagle3.generate import Journal, generate_shard, generation_params, read_prompts
    from eagle3.verifiers.loading import load_tokenizer
    from eagle3.verifiers.spec import VerifierSpec

    scratch = Path(tempfile.mkdtemp())
    compose_params(["backend=openai", f"backend.base_urls=[{spec['base_url']}]", f"backend.concurrency={spec['concurrency']}",
                    f"generate.max_new_tokens={spec['max_new_tokens']}"], output=scratch / "params.yaml")
    params = OmegaConf.load(scratch / "params.yaml")
    tokenizer = load_tokenizer(spec["verifier"])
    prompts = read_prompts(Path(spec["prompts"]))[: spec["count"]]
    model = VerifierSpec.from_params(params.model)
    generation = Generation.from_params(params.generate, model)
    record_params = generation_params(generation, "openai")

    def one_pass():
        journal = Journal(Path(tempfile.mkdtemp(dir=scratch)) / "journal.jsonl")  # empty: every pass answers all
        backend = make_backend(params.backend, Path(spec["verifier"]), generation, model)
        start = time.perf_counter()
        shard = generate_shard("bench", prompts, backend, tokenizer, generation, record_params, "bench", journal)
        return time.perf_counter() - start, shard.stats["completion_tokens"]

    return one_pass


def count_until_stop(tokens: list[int], eos: list[int]) -> int:
    """Generated tokens up to and including the first stop token, as the backend counts them."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def worker(spec_path: Path, mode: str) -> None:
    """One mode in this (fresh) process: print its JSON line."""
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    prompts = spec["prompt_ids"]
    one_pass = {
        "before": lambda: backend_pass(spec, prompts, old=True),
        "after": lambda: backend_pass(spec, prompts, old=False),
        "generate": lambda: generate_pass(spec, prompts),
        "generate_batch": lambda: generate_batch_pass(spec, prompts),
        "openai": lambda: openai_pass(spec),
    }[mode]()
    print(json.dumps({"mode": mode, **median_passes(one_pass, spec["runs"])}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, help="verifier folder (models/verifier); not with --random-shape")
    parser.add_argument("--prompts", type=Path, help="a prompt shard (data/prompts/shards/X.jsonl)")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="random weights of this shape, random token prompts")
    parser.add_argument("--modes", nargs="+", choices=[*MODES, "openai"], default=MODES)
    parser.add_argument("--count", type=int, default=256, help="prompts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batch-tokens", type=int, help="`after`: backend.batch_tokens (default: none)")
    parser.add_argument("--pad-multiple", type=int, default=1, help="`after`: backend.pad_multiple")
    parser.add_argument("--runs", type=int, default=2, help="warm passes after the first (median)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai")
    parser.add_argument("--concurrency", type=int, default=4, help="openai")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.spec, args.worker)
        return
    if bool(args.random_shape) == bool(args.verifier and args.prompts):
        parser.error("give either --verifier and --prompts, or --random-shape")
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_shape:
            verifier = random_verifier(args.random_shape, Path(tmp) / "verifier", args.device)
            prompt_ids = random_prompts(args.count, SHAPES[args.random_shape]["vocab_size"])
        else:
            verifier, prompt_ids = args.verifier, shard_prompts(args.verifier, args.prompts, args.count)
        spec = {"verifier": str(verifier), "prompts": str(args.prompts), "prompt_ids": prompt_ids, "count": args.count,
                "device": args.device, "dtype": args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"),
                "threads": args.threads, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                "batch_tokens": args.batch_tokens, "pad_multiple": args.pad_multiple, "runs": args.runs,
                "base_url": args.base_url, "concurrency": args.concurrency}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        rows = [run_mode(mode, Path(tmp) / "spec.json") for mode in args.modes]
    settings = {k: spec[k] for k in ("device", "dtype", "count", "max_new_tokens", "batch_size", "batch_tokens", "pad_multiple")}
    print(json.dumps({"shape": args.random_shape or str(args.verifier), "prompt_tokens": sum(map(len, prompt_ids)), **settings}))
    print(f"{'mode':<16}{'tokens':>10}{'first tok/s':>14}{'warm tok/s':>13}")
    for row in rows:
        print(f"{row['mode']:<16}{row.get('tokens', '-'):>10}{row.get('first_tok_s', '-'):>14}{row.get('warm_tok_s') or '-':>13}"
              + (f"  {row['error']}" if "error" in row else ""))


def run_mode(mode: str, spec: Path) -> dict:
    """One mode in a fresh interpreter; a mode that fails is reported, the others still run."""
    result = subprocess.run([sys.executable, __file__, "--worker", mode, "--spec", str(spec)], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"mode"')]
    if result.returncode or not lines:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        row = {"mode": mode, "error": f"failed (exit {result.returncode}): {last}"}
    else:
        row = json.loads(lines[-1])
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
