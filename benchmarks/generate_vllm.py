"""The ``generate`` stage's ``openai`` backend against ``vllm serve`` of a run's verifier, on one prompt shard: its
answers beside the ``local`` backend's records of the same shard in the run, its throughput beside theirs, its failed
requests and retries counted. What a team does that regenerates its training answers through the engine serving
its verifier.

    PYTHONPATH=src:/root/vllm-site:/root/site python benchmarks/generate_vllm.py /root/run \\
        --out benchmarks/results/generate_vllm_openai.json --commit <sha> [--shard 000032-001000]

RUN is a finished ``dvc repro`` (benchmarks/offline/pipeline_run.sh): ``models/verifier``, the shard's prompts
(``data/prompts/shards/<shard>.jsonl``) and the local backend's answers (``data/generated/<shard>``), its stats
(``metrics/generate/<shard>.json``), the timed log of ``dvc repro`` (``logs/dvc.log``) and ``params.yaml``. In
``--work`` (default RUN/generate_vllm, emptied first):

1. the server: ``--server``, by default ``vllm serve`` of the verifier on ``--port`` (vLLM's kit:
   benchmarks/offline/vllm_kit.sh), with ``--drafter-k K`` drafting with the run's drafter as docs/serving.md
   serves it, its output in ``server.log``, waited for until ``/health`` answers;
2. ``params.yaml``: the run's, its ``backend`` the ``openai`` group (conf/backend/openai.yaml) at that server;
   dvc.yaml's ``generate`` command on the shard into ``generated/<shard>``, timed, its output in ``generate.log``
   with the openai client's retries logged (its DEBUG lines: one per retry, with the reason);
3. the answers compared by prompt (and sample) with the local backend's, as the verifier's tokens: ``equal_share``, the
   share of answers equal token for token, and ``prefix_share``, the mean share of a local answer's tokens before
   the first that differs (greedy in bf16: answers part where two tokens tie, which batch shapes decide);
4. throughput, completion tokens over wall seconds: the openai run's is the stage's process with the server up;
   the local backend's is DVC's ``generate@<shard>`` window in ``logs/dvc.log``, loading the verifier included.

The server is stopped at the end, also after a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from omegaconf import OmegaConf

from common import ROOT, child_env, commit
from eagle3.common import UserError, read_json, read_jsonl, write_json
from eagle3.runner import stage_main
from pipeline_report import read_log, stage_times
from serve_vllm import gpu_facts

VLLM_SERVE = "{python} -m vllm.entrypoints.cli.main serve {verifier} --port {port} --seed 0"
RETRY_LINE = re.compile(r"DEBUG eagle3\.backends\.openai: \S+: (.*); retry \d+$")


# --- the stage against the server ------------------------------------------------------------------------------------


def openai_params(run_params: Path, url: str):
    """The run's params with the ``openai`` backend group at ``url`` (its other keys the group's defaults)."""
    params = OmegaConf.load(run_params)
    backend = OmegaConf.load(ROOT / "conf" / "backend" / "openai.yaml")
    backend.base_urls = [url]
    params.backend = backend
    return params


def start_server(command: list[str], log: Path) -> subprocess.Popen:
    """The server in a session of its own (so that stopping it stops its workers too), its output in ``log``."""
    with log.open("w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float) -> float:
    """Seconds until ``GET <server>/health`` answers 200; a UserError when the server exits or the time runs out."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if server.poll() is not None:
            raise UserError(f"the server exited ({server.returncode}) before it was ready; its output: {log}")
        try:
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as response:
                if response.status == 200:
                    return round(time.perf_counter() - started, 1)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise UserError(f"the server did not answer /health within {timeout:g} s; its output: {log}")


def run_generate(run: Path, shard: str, work: Path) -> float:
    """dvc.yaml's ``generate`` command on ``shard`` with ``work``'s params, from ``work`` (its journal stays there), the
    openai client's retries logged; its wall seconds."""
    command = [sys.executable, "-c", "import logging, runpy; logging.getLogger('eagle3.backends.openai')"
               ".setLevel(logging.DEBUG); runpy.run_module('eagle3.generate', run_name='__main__')",
               str(run / "models" / "verifier"), str(run / "data" / "prompts" / "shards" / f"{shard}.jsonl"),
               str(work / "generated" / shard), "--metrics", str(work / "metrics.json"), "--params", str(work / "params.yaml")]
    started = time.perf_counter()
    with (work / "generate.log").open("w") as log:
        done = subprocess.run(command, cwd=work, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise UserError(f"generate with the openai backend failed ({done.returncode}); its output: {work / 'generate.log'}")
    return time.perf_counter() - started


def retry_reasons(log: str) -> Counter:
    """The openai client's retries by reason (its text up to the first ':' or '('), from the stage's DEBUG lines."""
    return Counter(re.split(r"[:(]", match[1], maxsplit=1)[0].strip() for match in map(RETRY_LINE.search, log.splitlines())
                   if match)


# --- the comparison ---------------------------------------------------------------------------------------------------


def answer_ids(folder: Path, tokenizer) -> dict[tuple[str, int], list[int]]:
    """Each record's answer (its last message's content) as the verifier's token ids, by prompt id and sample (a
    record's own id also hashes the verifier's build, which another import of the same weights changes)."""
    return {(record["prompt_id"], record["generation"].get("sample", 0)):
            tokenizer.encode(record["messages"][-1]["content"], add_special_tokens=False)
            for record in read_jsonl(folder / "records.jsonl")}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(served: dict, local: dict) -> dict:
    """The served answers against the local backend's (``answer_ids``), over the answers both have."""
    both = sorted(served.keys() & local.keys())
    if not both:
        raise UserError("the openai run and the run's local records share no prompt: not the same shard's prompts")
    prefixes = [common_prefix(served[i], local[i]) / max(len(local[i]), 1) for i in both]
    return {"compared": len(both), "only_local": len(local.keys() - served.keys()),
            "equal_share": round(sum(served[i] == local[i] for i in both) / len(both), 4),
            "prefix_share": round(sum(prefixes) / len(both), 4)}


def local_rate(run: Path, shard: str) -> dict:
    """The local backend's completion tokens over its stage's window in the run's ``dvc repro`` log."""
    stats = read_json(run / "metrics" / "generate" / f"{shard}.json")
    items = stage_times(read_log(run / "logs" / "dvc.log"), [], time.time()).get("generate", {}).get("items", {})
    if shard not in items:
        raise UserError(f"{run / 'logs' / 'dvc.log'}: no generate@{shard} window; the run's dvc repro did not run that stage")
    return rate(stats["completion_tokens"], items[shard]["wall_s"])


def vllm_version() -> str | None:
    try:
        return version("vllm")
    except PackageNotFoundError:  # another server (--server)
        return None


def rate(tokens: int, seconds: float) -> dict:
    return {"completion_tokens": tokens, "wall_s": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished dvc repro's folder (models/, data/, metrics/, logs/dvc.log)")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON")
    parser.add_argument("--shard", default="000032-001000", help="the prompt shard (data/prompts/shards/<shard>.jsonl)")
    parser.add_argument("--work", type=Path, help="the openai run's folder (default RUN/generate_vllm; emptied first)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--server", default=VLLM_SERVE, help="the server's command ({python}, {verifier}, {port} filled)")
    parser.add_argument("--drafter-k", type=int, help="serve with the run's drafter drafting K tokens (vLLM's flag)")
    parser.add_argument("--health-timeout", type=float, default=600.0, help="seconds the server may take to be ready")
    parser.add_argument("--commit", help="the commit measured (default: this checkout's)")
    args = parser.parse_args(argv)
    run, shard = args.run, args.shard
    local_dir = run / "data" / "generated" / shard
    for needed in ("params.yaml", "models/verifier", f"data/prompts/shards/{shard}.jsonl", f"data/generated/{shard}",
                   f"metrics/generate/{shard}.json", "logs/dvc.log"):
        if not (run / needed).exists():
            raise UserError(f"{run / needed}: not found; RUN must be a finished dvc repro (benchmarks/offline/pipeline_run.sh)")
    local = local_rate(run, shard)
    work = args.work or run / "generate_vllm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    OmegaConf.save(openai_params(run / "params.yaml", url), work / "params.yaml")
    facts = gpu_facts()  # before our server: the processes that share the GPU with it
    command = shlex.split(args.server.format(python=sys.executable, verifier=run / "models" / "verifier", port=args.port))
    if args.drafter_k:  # as docs/serving.md serves the drafter
        spec = {"method": "eagle3", "model": str(run / "models" / "drafter"), "num_speculative_tokens": args.drafter_k}
        command += ["--speculative-config", json.dumps(spec)]
    server = start_server(command, work / "server.log")
    try:
        ready = wait_healthy(url, server, work / "server.log", args.health_timeout)
        seconds = run_generate(run, shard, work)
    finally:
        stop_server(server)
    from eagle3.lm.loading import load_tokenizer

    tokenizer = load_tokenizer(run / "models" / "verifier")
    stats = read_json(work / "metrics.json")
    retries = retry_reasons((work / "generate.log").read_text(errors="replace"))
    results = {"commit": args.commit or commit(), "command": shlex.join(["python", "benchmarks/generate_vllm.py", *argv]),
               "server": shlex.join(command), "vllm": vllm_version(), "server_ready_s": ready, **facts, "shard": shard,
               "prompts": stats["prompts"], "answers": stats["answers"], "errors": stats["errors"], "retries": sum(retries.values()),
               "retry_reasons": dict(retries),
               **compare(answer_ids(work / "generated" / shard, tokenizer), answer_ids(local_dir, tokenizer)),
               "tokens_per_s": {"openai": rate(stats["completion_tokens"], seconds), "local": local}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    stage_main(main)
