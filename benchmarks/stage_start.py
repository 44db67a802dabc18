"""What a per-shard stage process pays before and at its first work: imports, device start, verifier load,
the first extract forward and the first slot-decoded batch (CUDA graph capture), each against its second run.

    python benchmarks/stage_start.py OUT.json                                   # cuda, bf16, SmolLM2-135M-shaped random weights
    python benchmarks/stage_start.py OUT.json --verifier models/verifier --repeats 3
    python benchmarks/stage_start.py OUT.json --smoke                           # CPU, a tiny verifier, seconds (tests/)

Each measurement is a fresh interpreter (as ``dvc repro`` starts one per shard and stage), run once per
load ``--methods`` in turn, ``--repeats`` times: ``transformers`` is the load before the stages read
safetensors straight onto the device (``from_pretrained`` on the host, then ``.to(device)``), ``eagle3``
is ``eagle3.lm.loading.load_verifier``. Without ``--verifier``, random weights of SmolLM2-135M's shape
are saved in the verifier stage's dtype (bf16) into a temporary folder: a load's cost is the shape's.
The first forward's hidden states are hashed per method: equal hashes mean the same numbers.

OUT.json: ``{"commit", "command", "device", "versions", "verifier": {"folder", "weights_bytes"}, "runs": [...],
"median": {method: {phase: seconds}}, "same_outputs"}``; a phase ``*_1`` is the first call, ``*_2`` the second
(the difference is warm-up). ``process_s``: the child's whole wall time, interpreter start included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import child_env, commit, gpu_name, random_verifier, versions
from shapes import VERIFIER_SHAPES

START = time.perf_counter()
# (rows, prompt tokens, new tokens) of the first-work batches: a shard's extract batch and decode group
WORK = {"full": (64, 320, 64), "smoke": (2, 16, 4)}


def child(method: str, folder: Path, device: str, dtype: str, work: str) -> dict:
    """One stage-like process: every phase timed from this interpreter's start."""
    times: dict[str, float] = {"to_main": time.perf_counter() - START}

    def lap(name: str) -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times[name] = time.perf_counter() - mark[0]
        mark[0] = time.perf_counter()

    mark = [time.perf_counter()]
    import torch

    times["import_torch"], mark[0] = time.perf_counter() - mark[0], time.perf_counter()
    from transformers import AutoModelForCausalLM

    from eagle3.backends.base import Request
    from eagle3.backends.local import LocalBackend  # noqa: F401 (what generate's local backend imports)
    from eagle3.backends.slot_groups import group_requests
    from eagle3.backends.slots import Ending, decode_groups
    from eagle3.hidden_states.capture import hidden_states
    from eagle3.hidden_states.workers import run_worker  # noqa: F401 (what extract imports)
    from eagle3.lm.loading import load_verifier, torch_dtype

    times["import_stage"], mark[0] = time.perf_counter() - mark[0], time.perf_counter()
    torch.empty(1, device=device)
    if device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the local backend does
    lap("device_start")
    if method == "transformers":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype)).to(device).eval()
    else:
        model = load_verifier(folder, device, dtype)
    lap("load")
    rows, prompt, new = WORK[work]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=generator).tolist()
    batch = [Request(f"r{row}", f"p{row}", [], row_ids[: prompt - row % 8], 0) for row, row_ids in enumerate(ids)]
    digest = hashlib.sha256()
    for run in (1, 2):
        with torch.inference_mode():
            samples = [SimpleNamespace(input_ids=r.prompt_ids) for r in batch]
            _, _, final = hidden_states(model, samples, (1, 2, 3), 0)
            if run == 1:  # each row's real tokens
                for row, sample in enumerate(samples):
                    digest.update(final[row, : len(sample.input_ids)].float().cpu().numpy().tobytes())
        lap(f"forward_{run}")
    for run in (1, 2):
        with torch.inference_mode():
            decode_groups(model, group_requests(batch, new, rows, None), Ending(new, [0], 0), lambda request, tokens: None)
        lap(f"decode_{run}")
    times["total"] = time.perf_counter() - START
    return {"method": method, **{k: round(v, 4) for k, v in times.items()}, "forward_sha256": digest.hexdigest()}


def run_child(method: str, folder: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", method, str(folder), args.device, args.dtype, args.work]
    start = time.perf_counter()
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"stage_start child {method} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "process_s": round(time.perf_counter() - start, 4)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        method, folder, device, dtype, work = sys.argv[2:7]
        print(json.dumps(child(method, Path(folder), device, dtype, work)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="where the JSON goes")
    parser.add_argument("--verifier", type=Path, help="a verifier folder (default: random SmolLM2-135M-shaped weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="the compute dtype (layout.dtype)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["transformers", "eagle3"], choices=["transformers", "eagle3"])
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, a tiny random verifier, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.dtype, args.repeats = "cpu", "float32", 1
    args.work = "smoke" if args.smoke else "full"
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.verifier
        if folder is None:
            folder = Path(scratch) / "verifier"
            shape = "tiny" if args.smoke else "smollm2-135m"
            random_verifier(VERIFIER_SHAPES[shape], folder, name=f"random-{shape}")
        runs = [run_child(method, folder, args) for _ in range(args.repeats) for method in args.methods]
        weights = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    phases = [k for k in runs[0] if k not in ("method", "forward_sha256")]
    result = {
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": gpu_name(args.device) or "cpu",
        "versions": versions(),
        "verifier": {"folder": str(args.verifier) if args.verifier else "random smollm2-135m shape" if not args.smoke else "random tiny",
                     "weights_bytes": weights, "dtype": args.dtype},
        "runs": runs,
        "median": {m: {p: round(statistics.median(r[p] for r in runs if r["method"] == m), 4) for p in phases} for m in args.methods},
        "same_outputs": len({r["forward_sha256"] for r in runs}) == 1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2), f"same outputs: {result['same_outputs']}", sep="\n")


if __name__ == "__main__":
    main()
