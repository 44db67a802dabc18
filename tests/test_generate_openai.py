"""Stage ``generate`` through OpenAI-compatible servers: a real ``transformers serve``, a scripted
fault-injecting server, and an SGLang stand-in for the ``sglang`` backend's lifecycle."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.generate import generate, generation, prompt, shard_file, stage_params
from support.openai_standin import SLOW_SECONDS, StandinServer

from eagle3.backends.openai import OpenAIBackend
from eagle3.backends.sglang import launch_command
from eagle3.common import UserError, read_json
from eagle3.lm.loading import load_tokenizer
from eagle3.lm.spec import VerifierSpec

STANDIN = Path(__file__).parent / "support" / "openai_standin.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def openai_params(tmp_path: Path, *urls: str, **backend):
    """The ``openai`` backend at ``urls`` with test-sized timeouts and backoff."""
    params = stage_params(tmp_path, "backend=openai", "generate.max_new_tokens=8")
    test_sized = dict(concurrency=4, timeout=SLOW_SECONDS / 2, max_retries=2, backoff=0.01, backoff_max=0.05)
    params.backend.update(base_urls=list(urls), **{**test_sized, **backend})
    return params


@pytest.fixture
def standin():
    server = StandinServer(0).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def transformers_serve(smollm2_dir):
    """A real ``transformers serve`` of SmolLM2 on 127.0.0.1."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("transformers")), "serve", str(smollm2_dir),
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the local backend runs in these tests (layout.threads=1)
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: healthy(f"http://127.0.0.1:{port}/health"), 90, "transformers serve")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


@pytest.mark.slow
def test_openai_backend_against_transformers_serve_matches_local(tmp_path, smollm2_dir, transformers_serve):
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = shard_file(tmp_path, tokenizer)
    served = generate(tmp_path, smollm2_dir, prompts, openai_params(tmp_path, transformers_serve, timeout=60), "served")
    local = generate(tmp_path, smollm2_dir, prompts,
                     stage_params(tmp_path, "generate.max_new_tokens=8", "backend.batch_size=1"), "local")
    assert served.stats["answers"] == 3 and served.stats["errors"] == 0
    for s, l in zip(served.records, local.records):
        assert s["prompt_tokens"] == l["prompt_tokens"] == prompt(tokenizer, s["messages"][0]["content"])["prompt_tokens"]
        assert (s["finish_reason"], s["completion_tokens"]) == ("length", 8)
        assert s["messages"][-1]["content"] == l["messages"][-1]["content"]  # greedy: the same tokens
        assert s["generation"]["backend"] == "openai" and s["id"] != l["id"]


def test_faults_are_retried_boundedly_and_accounted(tmp_path, tiny_verifier_dir, standin):
    scripts = {
        "ok": "answer", "500,ok": "answer", "429,429,ok": "answer", "timeout,ok": "answer",
        "malformed,ok": "answer", "empty,ok": "answer", "think": "answer", "reasoning": "answer",
        "500": "HTTP 500", "timeout": "no answer within", "malformed": "malformed response",
        "empty": "empty answer", "400": "HTTP 400",
    }
    tokenizer = load_tokenizer(tiny_verifier_dir)
    texts = [f"script: {s} | q{i}" for i, s in enumerate(scripts)] + ["word " * 60]
    prompts = shard_file(tmp_path, tokenizer, texts)
    params = openai_params(tmp_path, standin.url)
    params.model.max_position_embeddings = 70
    shard = generate(tmp_path, tiny_verifier_dir, prompts, params)

    assert (shard.stats["answers"], shard.stats["errors"], shard.stats["skipped"]) == (8, 5, 1)
    assert shard.stats["answers"] + shard.stats["errors"] + shard.stats["skipped"] == shard.stats["prompts"] == 14
    expected = [scripts[s] for s in scripts if scripts[s] != "answer"]
    assert [e["reason"].startswith(x) for e, x in zip(shard.errors, expected)] == [True] * 5
    assert [e["attempts"] for e in shard.errors] == [3, 3, 3, 3, 1]  # bounded: 1 + max_retries, 400 is final
    assert standin.attempts["q2"] == 3 and standin.attempts["q8"] == 3 and standin.attempts["q12"] == 1
    answers = {r["messages"][-2]["content"].split("| ")[1]: r["messages"][-1] for r in shard.records}
    assert answers["q6"] == {"role": "assistant", "content": "answer to q6", "reasoning_content": "thinking about q6"}
    assert answers["q7"]["reasoning_content"] == "thinking about q7"
    assert answers["q0"]["reasoning_content"] is None
    assert read_json(tmp_path / "out" / "stats.json")["errors"] == 5

    params.backend.concurrency = 2  # transport: the journal still applies
    again = generate(tmp_path, tiny_verifier_dir, prompts, params, "again")
    assert again.records == shard.records and len(again.errors) == 5  # only the failed requests were sent again
    assert read_json(tmp_path / "again" / "meta.json") == read_json(tmp_path / "out" / "meta.json")
    assert standin.attempts["q0"] == 1 and standin.attempts["q12"] == 2


def test_server_dying_mid_shard_stops_the_run_and_a_rerun_resumes(tmp_path, tiny_verifier_dir, standin):
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer, ["q0", "q1", "script: die,ok | q2", "q3", "q4"])
    params = openai_params(tmp_path, standin.url, concurrency=1)
    with pytest.raises(UserError, match=rf"{standin.url}: unreachable after 3 attempts"):
        generate(tmp_path, tiny_verifier_dir, prompts, params)
    assert not (tmp_path / "out").exists()

    revived = StandinServer(standin.server_address[1]).start()
    revived.attempts = standin.attempts  # q2's next attempt is its second: "ok"
    try:
        shard = generate(tmp_path, tiny_verifier_dir, prompts, params)
    finally:
        revived.stop()
    assert shard.stats["answers"] == 5 and shard.stats["errors"] == 0
    assert [revived.attempts[q] for q in ("q0", "q1", "q2", "q3", "q4")] == [1, 1, 2, 1, 1]  # q0, q1 came from the journal


def test_unreachable_endpoint_names_the_url(tmp_path, tiny_verifier_dir):
    prompts = shard_file(tmp_path, load_tokenizer(tiny_verifier_dir))
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(UserError, match=rf"{url}: unreachable after 3 attempts \(connection failed"):
        generate(tmp_path, tiny_verifier_dir, prompts, openai_params(tmp_path, url))
    assert not (tmp_path / "out").exists()


def test_api_key_comes_from_the_named_variable(tmp_path, monkeypatch):
    params = openai_params(tmp_path, "http://127.0.0.1:1/v1", api_key_env="EAGLE3_TEST_KEY")
    monkeypatch.delenv("EAGLE3_TEST_KEY", raising=False)
    with pytest.raises(UserError, match="EAGLE3_TEST_KEY is not set"):
        OpenAIBackend(params.backend, generation(params))
    monkeypatch.setenv("EAGLE3_TEST_KEY", "sk-test")
    assert OpenAIBackend(params.backend, generation(params)).key == "sk-test"


def test_requests_go_round_robin_over_base_urls(tmp_path, tiny_verifier_dir, standin):
    other = StandinServer(0).start()
    try:
        prompts = shard_file(tmp_path, load_tokenizer(tiny_verifier_dir), [f"q{i}" for i in range(6)])
        shard = generate(tmp_path, tiny_verifier_dir, prompts, openai_params(tmp_path, standin.url, other.url))
    finally:
        other.stop()
    assert shard.stats["answers"] == 6
    assert sum(standin.attempts.values()) == sum(other.attempts.values()) == 3


def test_each_answer_sends_its_own_temperature_and_seed(tmp_path, tiny_verifier_dir, standin):
    prompts = shard_file(tmp_path, load_tokenizer(tiny_verifier_dir), ["q0", "q1"])
    params = openai_params(tmp_path, standin.url)
    params.generate.update(samples=4, sample_temperatures=[0.7, 1.0])
    shard = generate(tmp_path, tiny_verifier_dir, prompts, params)
    sent = {(body["messages"][-1]["content"], body["seed"]): body["temperature"] for body in standin.bodies}
    assert len(standin.bodies) == len(sent) == shard.stats["answers"] == 8
    cycle = [0.0, 0.7, 1.0, 0.7]  # answer 0 at generate.temperature, then the cycle
    assert [sent[r["messages"][0]["content"], r["generation"]["seed"]] for r in shard.records] == cycle * 2
    assert [r["generation"]["temperature"] for r in shard.records] == cycle * 2


def test_sglang_command_from_layout_and_model(tmp_path):
    params = stage_params(tmp_path, "backend=sglang", "layout=gpu8", "model=kimi-k2.5", "train.batch_tokens=6144")  # 8 rows: one per GPU
    assert launch_command(params.backend, Path("/models/kimi"), VerifierSpec.from_params(params.model)) == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/kimi", "--host", "127.0.0.1",
        "--port", "30000", "--tp", "8", "--dp", "1", "--reasoning-parser", "kimi_k2", "--trust-remote-code",
    ]


def sglang_params(tmp_path: Path, *extra_args: str):
    params = stage_params(tmp_path, "backend=sglang", "generate.max_new_tokens=8")
    params.backend.update(launcher=[sys.executable, str(STANDIN)], port=free_port(), health_timeout=30,
                          extra_args=list(extra_args), timeout=5, max_retries=1, backoff=0.01)
    return params


def test_sglang_backend_starts_uses_and_stops_the_server(tmp_path, tiny_verifier_dir, monkeypatch):
    monkeypatch.setenv("STANDIN_ARGV", str(tmp_path / "argv.json"))
    params = sglang_params(tmp_path, "--mem-fraction-static", "0.8")
    prompts = shard_file(tmp_path, load_tokenizer(tiny_verifier_dir))
    shard = generate(tmp_path, tiny_verifier_dir, prompts, params)
    assert shard.stats["answers"] == 3
    assert shard.records[0]["messages"][-1]["content"] == f"answer to {shard.records[0]['messages'][-2]['content']}"
    launched = read_json(tmp_path / "argv.json")
    assert launched["argv"][:2] == ["--model-path", str(tiny_verifier_dir)] and launched["argv"][-2:] == ["--mem-fraction-static", "0.8"]
    assert not pid_alive(launched["pid"]) and not healthy(f"http://127.0.0.1:{params.backend.port}/health")


def test_sglang_server_is_stopped_on_errors(tmp_path, tiny_verifier_dir, monkeypatch):
    monkeypatch.setenv("STANDIN_ARGV", str(tmp_path / "argv.json"))
    prompts = shard_file(tmp_path, load_tokenizer(tiny_verifier_dir))
    with pytest.raises(UserError, match="exited with status 3 before"):
        generate(tmp_path, tiny_verifier_dir, prompts, sglang_params(tmp_path, "--exit-at-once"))

    def broken_client(*args):
        raise RuntimeError("client bug")

    monkeypatch.setattr(OpenAIBackend, "run", broken_client)
    with pytest.raises(RuntimeError, match="client bug"):
        generate(tmp_path, tiny_verifier_dir, prompts, sglang_params(tmp_path))
    assert not pid_alive(read_json(tmp_path / "argv.json")["pid"])


def test_sglang_server_dies_with_a_killed_stage(tmp_path):
    """The server gets SIGTERM when the process that started it is SIGKILLed (Linux PDEATHSIG)."""
    port = free_port()
    owner = (f"import sys, time\nfrom eagle3.backends.sglang import running_server\n"
             f"with running_server(sys.argv[1:], '127.0.0.1', {port}, 30):\n    time.sleep(60)")
    stage = subprocess.Popen([sys.executable, "-c", owner, sys.executable, str(STANDIN), "--model-path", "m", "--port", str(port)],
                             env={**os.environ, "STANDIN_ARGV": str(tmp_path / "argv.json")}, stderr=subprocess.DEVNULL)
    wait_until(lambda: healthy(f"http://127.0.0.1:{port}/health"), 30, "the server to start")
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    server_pid = read_json(tmp_path / "argv.json")["pid"]
    wait_until(lambda: not pid_alive(server_pid), 10, "the orphaned server to exit")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
