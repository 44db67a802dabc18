"""The configured chat template is the verifier's everywhere; stop strings end answers and close the loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from support.models import BASE_END_OF_TURN, BASE_TEMPLATE, TINY_LLAMA, verifier_model
from support.repo import run
from eagle3.backends.base import Request, cut_at_stop
from eagle3.backends.local import LocalBackend
from eagle3.backends.openai import parse_answer
from eagle3.backends.sglang import launch_command
from eagle3.common import UserError, read_json, read_jsonl
from eagle3.lm.chat import ChatFormat, render
from eagle3.verifier import import_verifier
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import load_tokenizer
from eagle3.lm.spec import VerifierSpec
from support.generate import generate, shard_file, stage_params
from support.pipeline import FAST, SMALL, add_dataset, overrides


def random_model(tokenizer: Path, chat_template: str | None = None, seed: int = 0, end_of_turn: str = "<|im_end|>", **config):
    return verifier_model(name="tiny-base", copy_weights=True, chat_template=chat_template, end_of_turn=end_of_turn,
                          source={"kind": "random", "tokenizer": str(tokenizer), "config": {**TINY_LLAMA, **config}, "seed": seed,
                                  "dtype": "float32"})


@pytest.fixture(scope="module")
def base_verifier(tmp_path_factory, base_tokenizer_dir) -> Path:
    """A tiny random base model whose tokenizer has no template, with the base template configured."""
    out = tmp_path_factory.mktemp("base") / "verifier"
    import_verifier(random_model(base_tokenizer_dir, BASE_TEMPLATE, end_of_turn=BASE_END_OF_TURN), out)
    return out


def test_the_configured_template_is_written_into_the_verifier_folder(base_verifier, base_tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(base_verifier)
    assert tokenizer.chat_template == BASE_TEMPLATE and (base_verifier / "chat_template.jinja").is_file()
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.decode(prompt_ids(tokenizer, messages)) == "<|im_start|>User: Hi\nAssistant: "  # BOS rendered
    other = import_verifier(random_model(base_tokenizer_dir, BASE_TEMPLATE.replace("Assistant", "A"), end_of_turn=BASE_END_OF_TURN),
                            tmp_path / "other")
    assert other["identity"]["tokenizer"] != read_json(base_verifier / "chat_identity.json")["tokenizer"]  # content-addressed


def test_no_template_and_none_configured_is_one_clear_error(base_tokenizer_dir, tmp_path):
    with pytest.raises(UserError, match=r"^model.chat_template: the verifier's tokenizer has no chat template"):
        import_verifier(random_model(base_tokenizer_dir), tmp_path / "verifier")
    assert not (tmp_path / "verifier").exists()


def test_a_stop_string_the_template_does_not_write_is_refused_by_the_verifier_stage(base_tokenizer_dir, tmp_path):
    """A base model's template closes answers with one marker, model.stop names another: extract
    would reject every answer that stopped on it (14 of 32 once), so the verifier stage refuses."""
    model = random_model(base_tokenizer_dir, BASE_TEMPLATE, end_of_turn=BASE_END_OF_TURN)
    model.stop = ["<end_of_turn>"]
    with pytest.raises(UserError) as caught:
        import_verifier(model, tmp_path / "verifier")
    assert str(caught.value).startswith(
        "model.stop: '<end_of_turn>' is not what the chat template (model.chat_template, or the tokenizer's own) writes "
        f"after an answer ({BASE_END_OF_TURN + chr(10)!r}), so extract would reject every answer that ends with it; "), caught.value
    assert not (tmp_path / "verifier").exists()
    model.stop, model.end_of_turn = [BASE_END_OF_TURN], "<|im_end|>"  # SmolLM2's marker, which this template never writes
    with pytest.raises(UserError, match=r"^model.end_of_turn: '<\|im_end\|>' is not what the chat template"):
        import_verifier(model, tmp_path / "verifier")


def test_local_generation_ends_at_a_stop_string(tmp_path, tiny_verifier_dir):
    verifier = tmp_path / "verifier"  # larger random weights than the fixture's: varied text, not one repeated token
    import_verifier(random_model(tiny_verifier_dir, initializer_range=0.2, seed=1), verifier)
    prompts = shard_file(tmp_path, load_tokenizer(verifier))
    free = generate(tmp_path, verifier, prompts, stage_params(tmp_path, "generate.max_new_tokens=12"), "free")
    text = free.records[0]["messages"][-1]["content"]
    stop = text[len(text) // 2 :][:3]  # a piece of what the verifier writes anyway
    params = stage_params(tmp_path, "generate.max_new_tokens=12")
    params.model.stop = [stop]
    stopped = generate(tmp_path, verifier, prompts, params, "stopped").records[0]
    assert 0 < text.find(stop) < len(text) // 2 + 1
    assert stopped["messages"][-1]["content"] == text[: text.find(stop)]
    assert (stopped["stop"], stopped["finish_reason"]) == (stop, "stop")
    assert stopped["completion_tokens"] < 12 and stopped["generation"]["stop"] == [stop]
    assert "stop" not in free.records[0] and "stop" not in free.records[0]["generation"]  # unchanged without stop strings


def test_the_stop_token_of_a_padded_row_is_not_counted(tiny_verifier_dir):
    backend = LocalBackend.__new__(LocalBackend)  # only the tokenizer-side fields matter here
    backend.tokenizer, backend.eos_ids, backend.stop_strings = load_tokenizer(tiny_verifier_dir), {2}, ["\nUser:"]
    backend.generation = OmegaConf.create({"think_tags": None})
    ids = backend.tokenizer("4.\nUser: and more", add_special_tokens=False).input_ids
    answer = backend.to_answer(Request("r", "p", [], [1], 0), ids + [2, 2])  # finished by the string, then padding
    assert (answer.content, answer.stop, answer.finish_reason) == ("4.", "\nUser:", "stop")
    assert backend.tokenizer.decode(ids[: answer.completion_tokens]) == "4.\nUser:"


def test_server_answers_are_cut_and_the_matched_stop_is_kept():
    usage = {"prompt_tokens": 5, "completion_tokens": 7}
    ignored = {"choices": [{"message": {"content": "4.\nUser: and"}, "finish_reason": "length"}], "usage": usage}
    answer = parse_answer(ignored, None, ["\nUser:"])  # a server that ignored `stop`
    assert (answer.content, answer.stop, answer.finish_reason) == ("4.", "\nUser:", "stop")
    named = {"choices": [{"message": {"content": "4."}, "finish_reason": "stop", "matched_stop": "\nUser:"}], "usage": usage}
    assert parse_answer(named, None, ["\nUser:"]).stop == "\nUser:"
    eos = {"choices": [{"message": {"content": "4."}, "finish_reason": "stop", "stop_reason": None}], "usage": usage}
    assert parse_answer(eos, None, ["\nUser:"]).stop is None
    assert cut_at_stop("a;b.c", [".", ";"]) == ("a", ";")


def test_the_stop_string_is_the_end_of_turn_of_the_loss_mask(base_verifier):
    tokenizer = load_tokenizer(base_verifier)
    fmt = ChatFormat(None, "template", "\n")  # a configured end_of_turn the stop string overrides
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask = render(tokenizer, messages, fmt, stop=BASE_END_OF_TURN)
    learned = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert learned.strip() == "Hello there" + BASE_END_OF_TURN
    cut_ids, cut_mask = render(tokenizer, messages, fmt, finished=False, stop=BASE_END_OF_TURN)
    assert tokenizer.decode([i for i, m in zip(cut_ids, cut_mask) if m]).strip() == "Hello there"


def test_sglang_is_given_the_configured_template(tmp_path):
    params = stage_params(tmp_path, "backend=sglang", "layout=gpu1")
    spec = VerifierSpec.from_params(params.model)
    command = launch_command(params.backend, Path("/weights"), spec, Path("models/verifier/chat_template.jinja"))
    assert command[command.index("--chat-template") + 1] == "models/verifier/chat_template.jinja"
    assert "--chat-template" not in launch_command(params.backend, Path("/weights"), spec)


BASE_MODEL = {  # conf/model/tiny-base.yaml: all a base model needs (its tokenizer has no chat template)
    "name": "tiny-base", "copy_weights": True, "trust_remote_code": False, "num_layers": 4,
    "max_position_embeddings": 2048, "aux_layers": [1, 2, 3], "final_state": "post-norm",
    "chat_template": BASE_TEMPLATE, "reasoning_parser": None, "reasoning_format": "<think>\n{reasoning}\n</think>\n",
    "end_of_turn": BASE_END_OF_TURN, "stop": [BASE_END_OF_TURN], "draft_head": {},
}


@pytest.mark.slow
def test_a_base_model_runs_the_demo_pipeline_with_only_a_model_file(make_project, base_tokenizer_dir):
    repo = make_project(*FAST[1:])
    source = {"kind": "random", "tokenizer": str(base_tokenizer_dir), "config": TINY_LLAMA, "seed": 0, "dtype": "float32"}
    (repo / "conf" / "model" / "tiny-base.yaml").write_text(yaml.safe_dump({**BASE_MODEL, "source": source}))
    add_dataset(repo, SMALL)
    run(["eagle3", "params", *overrides(*FAST, "model=tiny-base", "dataset=small")], repo)
    run(["dvc", "repro"], repo)
    assert "up to date" in run(["dvc", "status"], repo).stdout
    tokenizer = load_tokenizer(repo / "models" / "verifier")
    assert tokenizer.chat_template == BASE_TEMPLATE
    records = list(read_jsonl(repo / "data" / "generated" / "000000-000008" / "records.jsonl"))
    rendered = tokenizer.apply_chat_template(records[0]["messages"], tokenize=False)
    assert rendered.startswith("<|im_start|>") and rendered.endswith(BASE_END_OF_TURN + "\n")  # BOS, end of turn
    metrics = json.loads((repo / "dvclive" / "evaluate" / "metrics.json").read_text())
    assert all(metrics[name]["lossless"] == 1 for name in ("heldout", "humaneval"))
