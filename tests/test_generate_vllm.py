"""benchmarks/generate_vllm.py on the CPU: the real ``generate`` stage with its ``openai`` backend against a server the
script starts and stops, its answers and throughput beside a run's local records. vLLM cannot run here: the server is
the scripted OpenAI stand-in (tests/support/openai_standin.py), answering "answer to <question>"."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from support.models import tiny_model_spec
from support.repo import ROOT, project_params, with_sources

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import child_env  # noqa: E402  (the benchmarks' shared module, beside them)

SCRIPT = ROOT / "benchmarks" / "generate_vllm.py"
STANDIN = "{python} " + str(ROOT / "tests" / "support" / "openai_standin.py") + " --model-path {verifier} --port {port}"
SHARD = "000032-001000"
# (question as sent, the local backend's answer): the stand-in fails the second's first attempt with a 500
PROMPTS = [("Hello there", "answer to Hello there"), ("script: 500,ok | Name a river", "answer to Name a river"),
           ("Write a poem", "a different answer")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_run(folder: Path, verifier: Path) -> Path:
    """A finished run as generate_vllm reads it: params, the verifier, the shard's prompts and its local answers, their
    stats and the dvc repro log with the shard's generate window (10 s)."""
    params = project_params()
    params.model = tiny_model_spec()
    params.generate.max_new_tokens = 8
    params.layout.threads = 1
    (folder / "models").mkdir(parents=True)
    OmegaConf.save(params, folder / "params.yaml")
    (folder / "models" / "verifier").symlink_to(verifier)
    for sub in ("data/prompts/shards", f"data/generated/{SHARD}", "metrics/generate", "logs"):
        (folder / sub).mkdir(parents=True)
    prompts = [{"id": f"p{i}", "source": "tests", "messages": [{"role": "user", "content": q}]} for i, (q, _) in enumerate(PROMPTS)]
    (folder / "data" / "prompts" / "shards" / f"{SHARD}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    local = [{"id": f"r{p['id']}", "prompt_id": p["id"], "generation": {"temperature": 0.0, "seed": 1},
              "messages": [*p["messages"], {"role": "assistant", "content": answer, "reasoning_content": None}]}
             for p, (_, answer) in zip(prompts, PROMPTS)]
    (folder / "data" / "generated" / SHARD / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in local))
    (folder / "metrics" / "generate" / f"{SHARD}.json").write_text(json.dumps({"completion_tokens": 50, "prompts": 3}))
    (folder / "logs" / "dvc.log").write_text(f"100.0\tRunning stage 'generate@{SHARD}':\n110.0\tUpdating lock file 'dvc.lock'\n"
                                             "110.0\t=== exit 0\n")
    return folder


def test_generate_through_a_started_server_is_compared_with_the_local_answers(tmp_path, tiny_verifier_dir):
    """Started as the docstring says, from the checkout with a relative ``PYTHONPATH=src`` (here the installed project
    imports either way: the next test checks the folders the stage is given)."""
    run = tiny_run(tmp_path / "run", tiny_verifier_dir)
    out, port = tmp_path / "generate_vllm.json", free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SCRIPT.relative_to(ROOT)), str(run), "--out", str(out), "--port", str(port),
                           "--server", STANDIN, "--drafter-k", "7"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    spec = shlex.split(result["server"])[-1]  # the server's last argument: vLLM's speculative config, as the docs give it
    assert json.loads(spec) == {"method": "eagle3", "model": str(run / "models" / "drafter"), "num_speculative_tokens": 7}
    assert (result["prompts"], result["answers"], result["errors"], result["compared"]) == (3, 3, 0, 3)
    assert result["retries"] == 1 and result["retry_reasons"] == {"HTTP 500": 1}
    assert result["equal_share"] == 0.6667 and result["prefix_share"] == 0.6667  # the third differs from its first token
    assert result["tokens_per_s"]["local"] == {"completion_tokens": 50, "wall_s": 10.0, "tokens_per_s": 5.0}
    assert result["tokens_per_s"]["openai"]["completion_tokens"] == 9  # the stand-in's usage: 3 a answer
    assert result["shard"] == SHARD and result["server_ready_s"] >= 0
    with socket.socket() as probe:  # the server is gone
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_server_that_never_gets_ready_is_one_line_and_no_results(tmp_path, tiny_verifier_dir):
    run = tiny_run(tmp_path / "run", tiny_verifier_dir)
    out = tmp_path / "generate_vllm.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(run), "--out", str(out), "--port", str(free_port()),
                           "--server", STANDIN + " --exit-at-once"], cwd=tmp_path, env=with_sources(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr and not out.exists()
    assert done.stderr.strip().splitlines()[-1].startswith("error: the server exited (3) before it was ready")


def test_the_stage_gets_pythonpath_folders_it_can_find_from_its_own_folder(monkeypatch):
    """The stage runs from the work folder: a relative PYTHONPATH (the docstring's ``src``) named nothing there and the
    stage died on "No module named 'eagle3'" where the project is not installed (a GPU host's carried wheels). The
    child gets this checkout's src first and every other folder absolute."""
    monkeypatch.chdir(ROOT / "benchmarks")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["../src", "", "offline", "/root/vllm-site"]))
    assert child_env()["PYTHONPATH"] == os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks" / "offline"), "/root/vllm-site"])
