"""Stage ``extract``: answer masks on the real SmolLM2 template, taps equal to HF's hidden states,
post-norm final states, FP8 error bound, validation, disk preflight, data-parallel workers."""

from __future__ import annotations

import errno
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eagle3.common import UserError, read_jsonl, write_json
from eagle3.extract import extract, stage_arguments
from eagle3.hidden_states.capture import Settings, check_sample, extract_samples, stored_samples
from eagle3.hidden_states.samples import Sample, prepare
from eagle3.hidden_states.storage import PartWriter, decode_states, dequantize_fp8, encode_states, quantize_fp8
from eagle3.lm.chat import ChatFormat, render
from eagle3.lm.loading import load_tokenizer, load_verifier, verifier_fingerprint
from eagle3.lm.spec import VerifierSpec

from support.data import conversation, stored_sample, tiny_params, write_generated
from support.repo import project_params


def smollm2_format(tokenizer) -> ChatFormat:
    return VerifierSpec.from_params(project_params().model).chat.for_tokenizer(tokenizer)


def masked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    spans = [i for i, m in enumerate(mask) if m]
    assert spans == list(range(spans[0], spans[-1] + 1)), "the answer mask must be one contiguous span"
    return tokenizer.decode([ids[i] for i in spans])


# --- loss mask on the real SmolLM2 template ---------------------------------------------------------


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}], "2+2 is 4.<|im_end|>"),
        (
            [
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "An earlier answer, not the verifier's."},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Maintenant, bonjour !\n\n```python\nprint(1)\n```"},
            ],
            "Maintenant, bonjour !\n\n```python\nprint(1)\n```<|im_end|>",
        ),
        (
            [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because.", "reasoning_content": "Think first."}],
            "<think>\nThink first.\n</think>\nBecause.<|im_end|>",
        ),
    ],
)
def test_mask_covers_exactly_the_answer_on_smollm2(smollm2_dir, messages, expected):
    tokenizer = load_tokenizer(smollm2_dir)
    ids, mask = render(tokenizer, messages, smollm2_format(tokenizer))
    assert tokenizer.decode(ids).endswith("<|im_end|>\n")
    assert masked_text(tokenizer, ids, mask) == expected
    assert 0 < sum(mask) < len(mask)
    assert mask[-1] == 0  # the newline after <|im_end|> is template scaffolding


def test_answer_cut_at_the_token_limit_has_no_end_of_turn_in_its_mask(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2, 3, 4"}]
    ids, mask = render(tokenizer, messages, smollm2_format(tokenizer), finished=False)
    assert masked_text(tokenizer, ids, mask) == "1, 2, 3, 4"
    assert tokenizer.decode(ids).endswith("1, 2, 3, 4<|im_end|>\n")  # the template still closes the turn


def test_template_that_drops_reasoning_is_refused(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    fmt = ChatFormat(None, "template", "<|im_end|>")
    messages = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because.", "reasoning_content": "hidden"}]
    with pytest.raises(UserError, match="drops reasoning_content"):
        render(tokenizer, messages, fmt)


def test_bad_records_and_masks_are_rejected_with_reasons(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    records = [conversation(0), {"id": "x", "messages": [{"role": "user", "content": "no answer"}]}, conversation(1)]
    samples, rejected = prepare(records, tokenizer, smollm2_format(tokenizer), max_length=10)
    assert samples == []  # 10 tokens hold only the system prompt: the mask is all zero
    assert [r["record"] for r in rejected] == [0, 1, 2]
    assert "all zero after truncation" in rejected[0]["reason"] and rejected[1]["reason"].startswith("record:")


# --- taps, final state, storage ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_verifier_dir, tiny_model_params):
    """One shard of 7 records on the tiny verifier: several batches and parts, one record truncated."""
    root = tmp_path_factory.mktemp("extract")
    records = [conversation(i) for i in range(6)] + [conversation(6, answer_sentences=30)]
    generated = write_generated(root / "generated", records)
    params = tiny_params(tiny_model_params, max_length=300)
    meta = extract(tiny_verifier_dir, generated, root / "hidden", *stage_arguments(params))
    return root / "hidden", records, meta


@pytest.fixture(scope="module")
def tiny_model(tiny_verifier_dir):
    return load_verifier(tiny_verifier_dir)


def test_taps_equal_hf_hidden_states_and_final_is_post_norm(extracted, tiny_model, tiny_model_params):
    folder, records, meta = extracted
    model, captured = tiny_model, {}
    hook = model.model.norm.register_forward_hook(lambda module, args, output: captured.update(norm_out=output))
    index = list(read_jsonl(folder / "index.jsonl"))
    assert len({e["part"] for e in index}) > 1
    layers = list(tiny_model_params.aux_layers)
    for entry in index:
        stored = stored_sample(folder, entry)
        ids = stored["input_ids"].long()[None]  # [1, T]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)  # the CausalLM, unbatched: the reference
        reference = torch.cat([out.hidden_states[k][0] for k in layers], dim=-1)  # [T, 3H]
        torch.testing.assert_close(stored["aux"].float(), reference.bfloat16().float(), rtol=1e-2, atol=1e-3)
        other = torch.cat([out.hidden_states[k - 1][0] for k in layers], dim=-1)
        assert not torch.allclose(stored["aux"].float(), other, rtol=1e-2, atol=1e-2)  # the taps are not off by one
        torch.testing.assert_close(stored["final"].float(), captured["norm_out"][0].bfloat16().float(), rtol=1e-2, atol=1e-3)
        logits = model.lm_head(stored["final"][-8:].float())  # what train does: lm_head only
        torch.testing.assert_close(logits, out.logits[0, -8:], rtol=0.05, atol=0.05)
    hook.remove()
    assert meta["final_state"] == "post-norm" and meta["aux_layers"] == layers
    assert "output_hidden_states[k]" in meta["layer_convention"]
    assert meta["params"] == {**OmegaConf.to_container(project_params().extract), "max_length": 300, "batch_tokens": 256,
                              "part_bytes": 40_000}  # the whole section, as read


def test_extract_logs_where_the_capture_loop_spent_its_time(tmp_path, tiny_model, tiny_model_params, caplog):
    """The parts a slow extract is read by: the forwards, the copies to the host, the checks, the part writers."""
    samples = [Sample(id=f"s{i}", record=i, input_ids=list(range(1, 30 + 7 * i)), loss_mask=[1] * (29 + 7 * i), truncated=False)
               for i in range(6)]
    with caplog.at_level("INFO", logger="eagle3.hidden_states.capture"):
        index, rejected, parts = extract_samples(tiny_model, samples, Settings.from_params(tiny_params(tiny_model_params)),
                                                 tmp_path, 0)
    assert len(index) == 6 and not rejected and len(parts) > 1
    [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("capture and storage: ")]
    assert re.fullmatch(r"capture and storage: [\d.]+ s; queueing forwards [\d.]+ s \(\d+%\), encoding and copying to the "
                        r"host [\d.]+ s \(\d+%\), checking samples [\d.]+ s \(\d+%\), waiting for part writers [\d.]+ s \(\d+%\)", line)


def test_extract_runs_the_verifier_with_cudnn_attention_off_on_cuda(tmp_path, tiny_model_params, monkeypatch):
    """cuDNN's SDPA pays a setup for every new shape, and extract's length-sorted batches are nearly all new: its
    worker switches it off before loading the verifier, as generate and evaluate do (on the CPU only the threads)."""
    import eagle3.hidden_states.workers as workers
    from eagle3.lm.loading import prepare_torch

    settings = replace(Settings.from_params(tiny_params(tiny_model_params)), device="cuda")
    seen = []
    monkeypatch.setattr(workers, "load_verifier", lambda *args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or 1 / 0)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with pytest.raises(ZeroDivisionError):
            workers.run_worker(0, workers.Job(tmp_path, settings, None, False, 0), [])
        assert seen == [False]
        torch.backends.cuda.enable_cudnn_sdp(True)
        prepare_torch("cpu", torch.get_num_threads())
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def test_stored_ids_masks_index_and_counts(extracted, tiny_verifier_dir):
    folder, records, meta = extracted
    tokenizer = load_tokenizer(tiny_verifier_dir)
    index = list(read_jsonl(folder / "index.jsonl"))
    assert [e["record"] for e in index] == list(range(len(records)))
    for entry, record in zip(index, records):
        ids, mask = render(tokenizer, record["messages"], smollm2_format(tokenizer))
        stored = stored_sample(folder, entry)
        assert stored["input_ids"].tolist() == ids[:300] and stored["loss_mask"].tolist() == mask[:300]
        assert entry["truncated"] == (len(ids) > 300) and entry["masked"] == sum(mask[:300])
        assert stored["aux"].dtype == torch.bfloat16 and stored["aux"].shape == (entry["length"], 3 * 64)
    counts = meta["counts"]
    assert counts == {
        "records": 7, "samples": 7, "rejected": 0, "tokens": sum(e["length"] for e in index),
        "masked_tokens": sum(e["masked"] for e in index), "truncated": 1, "rejected_by_reason": {},
    }
    assert meta["verifier"]["fingerprint"] == verifier_fingerprint(tiny_verifier_dir)
    assert (folder / "rejected.jsonl").read_text() == ""
    written = sum(f.stat().st_size for f in folder.iterdir())
    assert written <= meta["estimated_bytes"] < written + (1 << 20) + 7 * 256 + 1  # the preflight's estimate


def test_fp8_round_trip_error_is_bounded(tmp_path, tiny_verifier_dir, tiny_model, tiny_model_params, extracted):
    folder, records, _ = extracted
    generated = write_generated(tmp_path / "generated", records)
    meta = extract(tiny_verifier_dir, generated, tmp_path / "fp8", *stage_arguments(tiny_params(tiny_model_params, max_length=300, dtype="float8_e4m3fn")))
    assert meta["dtype"] == "float8_e4m3fn"
    model = tiny_model
    for entry in read_jsonl(tmp_path / "fp8" / "index.jsonl"):
        stored = stored_sample(tmp_path / "fp8", entry)
        assert stored["aux"].dtype == torch.float8_e4m3fn and stored["aux_scale"].shape == (entry["length"], 3)
        with torch.no_grad():
            states = model(stored["input_ids"].long()[None], output_hidden_states=True).hidden_states
        exact = torch.cat([states[k][0] for k in tiny_model_params.aux_layers], dim=-1)  # [T, 3H]
        decoded = dequantize_fp8(stored["aux"], stored["aux_scale"])
        scale = stored["aux_scale"].repeat_interleave(64, dim=1)  # [T, 3H]
        # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals are spaced scale·2^-9.
        bound = exact.abs() * 2**-4 + scale * 2**-10 + 1e-5
        assert ((decoded - exact).abs() <= bound).all()
        assert (decoded - exact).norm() / exact.norm() < 0.05


def test_fp8_scale_is_per_token_and_layer():
    x = torch.randn(5, 3 * 8)
    x[:, 16:] *= 1000.0  # a loud layer must not cost the quiet ones their precision
    q, scale = quantize_fp8(x, groups=3)
    assert scale.shape == (5, 3)
    relative = (dequantize_fp8(q, scale) - x).abs() / x.abs().clamp_min(1e-3)
    assert relative[:, :8].median() < 2**-4


# --- validation, preflight, workers ------------------------------------------------------------------


def test_validation_rejects_planted_nan(tmp_path, tiny_verifier_dir, tiny_model_params, smollm2_dir):
    tokenizer = load_tokenizer(tiny_verifier_dir)
    records = [conversation(i, answer_sentences=2 + i) for i in range(4)]
    samples, _ = prepare(records, tokenizer, smollm2_format(tokenizer), max_length=2048)
    model = load_verifier(tiny_verifier_dir)  # its own copy: the hook stays on it
    poisoned = {"calls": 0}

    def plant_nan(module, args, output):  # first batch, first row = the shortest record (0)
        poisoned["calls"] += 1
        if poisoned["calls"] == 1:
            output[0, 3, 5] = float("nan")

    model.model.layers[0].register_forward_hook(plant_nan)
    settings = Settings.from_params(tiny_params(tiny_model_params, batch_tokens=10_000))
    index, rejected, _ = extract_samples(model, samples, settings, tmp_path, pad_id=2)
    assert rejected == [{"id": records[0]["id"], "record": 0, "reason": "non-finite values (NaN/Inf) in aux"}]
    assert [e["record"] for e in index] == [1, 2, 3]


def magnitudes(stored: dict[str, torch.Tensor]) -> dict[str, float]:
    """The index's max_abs of one sample, by definition: the largest |value| of its decoded aux and final."""
    return {name: float(decode_states(stored, name).abs().amax()) for name in ("aux", "final")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_batch_is_stored_as_its_samples_one_by_one(dtype):
    """stored_samples encodes and measures a padded batch at once: each sample gets the tensors and magnitudes of its
    own tokens encoded alone, bit for bit; what the padding holds (here inf and a large value) counts nowhere."""
    generator = torch.Generator().manual_seed(0)
    lengths, width, hidden = [3, 5, 1], 5, 4
    batch = [Sample(f"s{i}", i, list(range(2, 2 + n)), [0] + [1] * (n - 1), False) for i, n in enumerate(lengths)]
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
    aux = torch.randn(len(batch), width, 3 * hidden, generator=generator) * 3
    final = torch.randn(len(batch), width, hidden, generator=generator)
    aux[0, 4, 1], final[2, 3, 0] = float("inf"), 1e4  # padding
    got = list(stored_samples(batch, ids, aux, final, dtype))
    assert [sample for sample, _, _ in got] == batch
    for row, (sample, stored, largest) in enumerate(got):
        n = lengths[row]
        want = {"input_ids": torch.tensor(sample.input_ids, dtype=torch.int32), "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8),
                **encode_states("aux", aux[row, :n], dtype, 3), **encode_states("final", final[row, :n], dtype, 1)}
        assert stored.keys() == want.keys()
        for name in want:
            assert stored[name].dtype == want[name].dtype and torch.equal(stored[name].view(torch.uint8), want[name].view(torch.uint8)), name
        assert largest == magnitudes(want) and all(math.isfinite(v) for v in largest.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_part_holds_the_bytes_safetensors_writes(tmp_path, dtype):
    """write_part streams each key's concatenation; the file is byte for byte safetensors.torch.save_file's of the
    concatenated tensors, and the returned sha256 is the file's."""
    from safetensors.torch import save_file

    from eagle3.common import sha256_file
    from eagle3.hidden_states.storage import write_part

    generator = torch.Generator().manual_seed(1)
    samples = []
    for tokens in (3, 17, 1, 40):
        states = {"aux": torch.randn(tokens, 12, generator=generator), "final": torch.randn(tokens, 4, generator=generator)}
        samples.append({"input_ids": torch.randint(0, 99, (tokens,), dtype=torch.int32, generator=generator),
                        "loss_mask": torch.randint(0, 2, (tokens,), dtype=torch.uint8, generator=generator),
                        **encode_states("aux", states["aux"], dtype, 3), **encode_states("final", states["final"], dtype, 1)})
    digest = write_part(tmp_path / "part.safetensors", samples)
    save_file({key: torch.cat([sample[key] for sample in samples]) for key in samples[0]}, tmp_path / "reference.safetensors")
    assert (tmp_path / "part.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert digest == sha256_file(tmp_path / "part.safetensors")


def test_parts_written_by_several_threads_are_those_of_one(tmp_path):
    """PartWriter's writer threads change when a part is written, not what: with 1 and with 3 of them (more parts
    than threads, so the oldest is waited for), the same files, index and sha256 map, in the parts' order."""
    generator = torch.Generator().manual_seed(2)
    stream = []
    for record, tokens in enumerate(torch.randint(1, 30, (40,), generator=generator).tolist()):
        ids = torch.randint(0, 99, (tokens,), dtype=torch.int32, generator=generator)
        stored = {"input_ids": ids, "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                  **encode_states("aux", torch.randn(tokens, 12, generator=generator), "bfloat16", 3),
                  **encode_states("final", torch.randn(tokens, 4, generator=generator), "bfloat16", 1)}
        stream.append((Sample(f"s{record}", record, ids.tolist(), [1] * tokens, False), stored, {"aux": 1.0, "final": 1.0}))
    written = {}
    for writers in (1, 3):
        folder = tmp_path / str(writers)
        folder.mkdir()
        with PartWriter(folder, part_bytes=1000, writers=writers) as writer:
            for sample in stream:
                writer.add(*sample)
        files = {path.name: path.read_bytes() for path in sorted(folder.iterdir())}
        written[writers] = (files, writer.index, list(writer.sha256.items()))
    assert len(written[1][0]) > 3
    assert written[1] == written[3]


def test_validation_rejects_id_mismatch():
    sample = Sample("a", 0, [5, 6, 7], [0, 1, 1], False)
    stored = {"input_ids": torch.tensor([5, 6, 8], dtype=torch.int32), "aux": torch.zeros(3, 6), "final": torch.zeros(3, 2)}
    assert check_sample(sample, stored, magnitudes(stored)) == "stored input_ids differ from the rendered conversation"
    stored["input_ids"][2] = 7
    assert check_sample(sample, stored, magnitudes(stored)) is None
    stored["final"][1, 1] = float("inf")
    assert check_sample(sample, stored, magnitudes(stored)) == "non-finite values (NaN/Inf) in final"


def test_preflight_refuses_before_loading_the_model(tmp_path, tiny_verifier_dir, tiny_model_params, monkeypatch):
    generated = write_generated(tmp_path / "generated", [conversation(i) for i in range(3)])
    monkeypatch.setenv("EAGLE3_DISK_FREE_BYTES", "1000")
    monkeypatch.setattr("eagle3.hidden_states.workers.load_verifier", lambda *a, **k: pytest.fail("model loaded before the preflight"))
    with pytest.raises(UserError, match=r"extract: needs \d+\.\d\d MB, 0\.00 MB free on "):
        extract(tiny_verifier_dir, generated, tmp_path / "out", *stage_arguments(tiny_params(tiny_model_params)))
    assert not (tmp_path / "out").exists()


def test_taps_beyond_the_verifier_are_refused_before_loading_it(tmp_path, tiny_verifier_dir, tiny_model_params, monkeypatch):
    generated = write_generated(tmp_path / "generated", [conversation(0)])
    params = tiny_params(tiny_model_params)
    params.model.aux_layers = [1, 2, 4]  # the tiny verifier has 4 layers: ids 0..3
    monkeypatch.setattr("eagle3.hidden_states.workers.load_verifier", lambda *a, **k: pytest.fail("model loaded before the check"))
    with pytest.raises(UserError) as caught:
        extract(tiny_verifier_dir, generated, tmp_path / "out", *stage_arguments(params))
    assert str(caught.value) == f"params.yaml: model.aux_layers [1, 2, 4] must be 3 ascending layer ids in [1, 4) (the layers of {tiny_verifier_dir})"
    assert not (tmp_path / "out").exists()


def test_conversations_of_another_verifier_are_refused(tmp_path, tiny_verifier_dir, tiny_model_params):
    generated = write_generated(tmp_path / "generated", [conversation(0)])
    write_json(generated / "meta.json", {"verifier": "0123456789abcdef"})
    with pytest.raises(UserError, match="generated by verifier 0123456789abcdef"):
        extract(tiny_verifier_dir, generated, tmp_path / "out", *stage_arguments(tiny_params(tiny_model_params)))


def test_two_workers_store_the_same_samples(tmp_path, tiny_verifier_dir, tiny_model_params, extracted):
    folder, records, _ = extracted
    generated = write_generated(tmp_path / "generated", records)
    params = tiny_params(tiny_model_params, max_length=300)
    params.layout.extract_workers = 2
    params.layout.threads = 1
    meta = extract(tiny_verifier_dir, generated, tmp_path / "hidden", *stage_arguments(params))
    assert meta["counts"]["samples"] == len(records)
    assert not list((tmp_path / "hidden").glob(".worker-*"))
    one, two = list(read_jsonl(folder / "index.jsonl")), list(read_jsonl(tmp_path / "hidden" / "index.jsonl"))
    assert [(e["id"], e["length"], e["masked"]) for e in one] == [(e["id"], e["length"], e["masked"]) for e in two]
    for a, b in zip(one, two):
        torch.testing.assert_close(stored_sample(folder, a)["aux"].float(), stored_sample(tmp_path / "hidden", b)["aux"].float(), rtol=1e-2, atol=1e-3)


def test_background_part_write_failure_reaches_the_extractor(tmp_path):
    """A part the writer thread cannot write fails the extraction, not silently."""
    sample = Sample("a", 0, [1, 2, 3], [0, 1, 1], False)
    tensors = {"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32)}
    with pytest.raises(Exception, match="No such file|not found|os error"):
        with PartWriter(tmp_path / "missing" / "folder", part_bytes=1) as writer:
            writer.add(sample, tensors, {"aux": 1.0, "final": 1.0})  # full at once: handed to the writer thread
            writer.add(Sample("b", 1, [4], [1], False), {"input_ids": torch.tensor([4], dtype=torch.int32)}, {"aux": 1.0, "final": 1.0})
    assert [entry["id"] for entry in writer.index] == ["a", "b"]


def test_a_full_disk_is_one_line_and_keeps_nothing(tmp_path, tiny_verifier_dir, tiny_model_params, monkeypatch):
    """A disk that fills mid-run (another process's writes): a part's write fails with ENOSPC."""
    real_open = open

    class FullDisk:  # fault injection: the file takes 1,000 bytes, then the disk is full
        def __init__(self, file):
            self.file, self.written = file, 0

        def write(self, data):
            if self.written + len(data) > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.file.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *_):
            self.file.close()

    def full_disk_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return FullDisk(file) if str(path).endswith(".safetensors") and "w" in mode else file

    monkeypatch.setattr("eagle3.hidden_states.storage.open", full_disk_open, raising=False)
    generated = write_generated(tmp_path / "generated", [conversation(i) for i in range(3)])
    with pytest.raises(UserError) as caught:
        extract(tiny_verifier_dir, generated, tmp_path / "out", *stage_arguments(tiny_params(tiny_model_params)))
    message = str(caught.value)
    assert "\n" not in message
    assert re.search(r"/part-000000\.safetensors: no space left on the device writing this part of \d+\.\d\d MB "
                     r"\(\d+\.\d\d [MG]B free now\); free space .*, then re-run extract", message), message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_shard_rejecting_more_than_a_tenth_of_its_records_is_refused(tmp_path, tiny_verifier_dir, tiny_model_params, monkeypatch):
    """Answers that stopped on a string the verifier's template never writes after an answer are
    all rejected; once that is more than 10% of the shard, extract stops in one line (before the
    forward) instead of training on the rest. Exactly 10% passes, counted in meta.json."""
    records = [conversation(i) for i in range(10)]
    for record in records[:4]:
        record["stop"] = "<end_of_turn>"  # a base model's marker; the tiny verifier's template writes <|im_end|>
    generated = write_generated(tmp_path / "generated", records)
    params = stage_arguments(tiny_params(tiny_model_params))
    with monkeypatch.context() as patch:
        patch.setattr("eagle3.hidden_states.workers.load_verifier", lambda *a, **k: pytest.fail("model loaded for a refused shard"))
        with pytest.raises(UserError) as caught:
            extract(tiny_verifier_dir, generated, tmp_path / "out", *params)
    reason = "render: no end-of-turn marker '<end_of_turn>' after the answer"
    assert str(caught.value) == (f"{generated}/records.jsonl: 4 of 10 records rejected, more than 10% ({{{reason!r}: 4}}); fix the "
                                 "cause (model.stop, model.end_of_turn and the chat template, or extract.max_length) and re-run extract")
    assert not (tmp_path / "out").exists()
    for record in records[1:4]:
        del record["stop"]
    meta = extract(tiny_verifier_dir, write_generated(tmp_path / "one", records), tmp_path / "out", *params)
    assert (meta["counts"]["rejected"], meta["counts"]["rejected_by_reason"]) == (1, {reason: 1})
