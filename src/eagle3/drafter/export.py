"""The drafter on disk: SGLang/vLLM's EAGLE-3 format, loading it back, and checking it.

    eagle3 check-drafter models/drafter --verifier models/verifier [--rewrite-config]

Why: a checkpoint with ``layers.0.*`` instead of ``midlayer.*``, no ``lm_head`` or ``d2t``, layer
ids one engine reads in another convention (or not at all, silently falling back to its default
taps) or a too small context loads without error and serves at acceptance length ~1.
``write_drafter`` writes exactly the keys the engines expect, through one rename table;
``check_drafter`` re-reads a folder and names every such fault, resolving the tapped layers the
way each engine's own lookup does (``vllm_taps``, ``sglang_taps``).

Folder: ``config.json`` (served as is by both engines: the taps at the top level for vLLM and in
``eagle_config`` for SGLang), ``model.safetensors`` (bf16 weights, int64 ``d2t``, bool ``t2d``),
``meta.json`` (the verifier's identity and build, taps in our convention, training summary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3.common import UserError, read_json, write_json
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.lm.identity import build_difference, note_other_build
from eagle3.lm.loading import language_model, text_config_dict, verifier_build, verifier_fingerprint
from eagle3.lm.spec import tap_problem, verifier_mismatch

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_DTYPE = torch.bfloat16

# Module state-dict name -> exported name. The module already uses the engines' names, so the map
# is the identity; it is still the one place that ties the two together (edit here, not elsewhere).
EXPORT_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.hidden_norm.weight": "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight": "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}

# The verifier's special token ids the drafter's config.json repeats (Gemma's are 2 and 1, not Llama's 1 and 2).
TOKEN_IDS = ("bos_token_id", "eos_token_id")
OUR_CONVENTION = "residual stream entering decoder layer k (HF output_hidden_states[k])"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """Both engines' taps when a drafter config names none: (2, L//2, L-3), in our convention."""
    return (2, num_layers // 2, num_layers - 3)


def sglang_layer_ids(ids) -> list[int]:
    """Our tap ids in SGLang's ``eagle_config`` convention, "output of layer k": [2, 15, 27] -> [1, 14, 26].

    SGLang captures id + 1 (see ``sglang_taps``), so id k - 1 names the stream entering layer k.
    """
    shifted = [int(i) - 1 for i in ids]
    if min(shifted) < 0:
        raise ValueError(f"layer ids {list(ids)} cannot be written for SGLang (it would capture the input of layer 0, "
                         "which its Llama forward does not hold as a residual stream)")
    return shifted


def vllm_taps(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The taps vLLM captures for this drafter config.json, in our convention (its own: input of layer k).

    Mirrors vLLM ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``:
    ``get_eagle3_aux_layers_from_config`` reads the draft hf_config's top-level
    ``eagle_aux_hidden_state_layer_ids``, then (DFlash/DSpark drafts, not ours) ``target_layer_ids``
    + 1, then ``eagle_config["layer_ids"]``; with none, ``set_eagle3_aux_hidden_state_layers`` only
    logs a warning and uses the model's ``get_eagle3_default_aux_hidden_state_layers`` = (2, L//2, L-3)
    (``vllm/model_executor/models/llama.py``, whose forward appends ``hidden_states + residual``
    before layer ``idx`` runs: the stream entering layer idx, our id). The nested
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` is never read.
    """
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [i + 1 for i in ((config.get("dflash_config") or {}).get("target_layer_ids") or [])]
    if not ids:
        ids = [i + 1 for i in (config.get("target_layer_ids") or [])]
    if not ids:
        ids = (config.get("eagle_config") or {}).get("layer_ids")
    return tuple(ids) if ids else default_taps(num_layers)


def sglang_taps(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The taps SGLang captures for this drafter config.json, in our convention.

    Mirrors SGLang ``python/sglang/srt/model_executor/model_runner.py`` ``ModelRunner.__init__`` (EAGLE-3:
    ``eagle_config["eagle_aux_hidden_state_layer_ids"]``, any error, e.g. no ``eagle_config``, -> None;
    the top-level key is never read) and ``python/sglang/srt/models/llama.py``
    ``LlamaForCausalLM.set_eagle3_layers_to_capture``: None -> layers_to_capture [2, L//2, L-3], else
    [id + 1 for each id]; ``LlamaModel.forward`` appends ``hidden_states + residual`` before layer i
    runs, so layers_to_capture are our ids.
    """
    try:
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):
        ids = None
    return default_taps(num_layers) if ids is None else tuple(int(i) + 1 for i in ids)


ENGINE_TAPS = {"vllm": vllm_taps, "sglang": sglang_taps}


def expected_tensors(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Exported name -> (shape, dtype) for a drafter of shape ``cfg``."""
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "fc.weight": (H, 3 * H),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    expected = {name: (shape, WEIGHT_DTYPE) for name, shape in shapes.items()}
    expected["d2t"] = ((Vd,), torch.int64)
    expected["t2d"] = ((cfg.vocab_size,), torch.bool)
    return expected


def engine_config(cfg: DraftConfig, token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF-style config.json both engines read: the taps once per engine, each in its convention.

    vLLM reads only the top-level ``eagle_aux_hidden_state_layer_ids`` (our ids), SGLang only the
    nested ``eagle_config.eagle_aux_hidden_state_layer_ids`` (our ids - 1); see ``vllm_taps`` and
    ``sglang_taps``. Example, taps (2, 15, 27): top level [2, 15, 27], eagle_config [1, 14, 26].
    ``token_ids``: the verifier's ``TOKEN_IDS``; a config without them reads as Llama's 1 and 2.
    """
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,  # width of one tapped state; fc reads 3x this
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        # The drafter's RoPE twice: as older engines read it, and as transformers 5 does.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **{key: value for key, value in (token_ids or {}).items() if key in TOKEN_IDS and value is not None},
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),  # vLLM
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(cfg.aux_layers),  # SGLang
            "use_aux_hidden_state": True,
        },
    }


def config_from_export(config: dict[str, Any], aux_layers) -> DraftConfig:
    """The ``DraftConfig`` of an exported config.json (``aux_layers`` in our convention)."""
    names = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "draft_vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
    missing = [n for n in names if n not in config]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    return DraftConfig.create({n: config[n] for n in names}, {"aux_layers": aux_layers})


def write_drafter(drafter: Eagle3Drafter, out: Path, verifier: dict[str, Any], training: dict[str, Any]) -> None:
    """Write the export into ``out`` (an existing, empty folder: the stage's atomic temp dir).

    ``verifier``: ``verifier_facts``: {fingerprint, build, num_layers, vocab_size, hidden_size,
    max_position_embeddings, bos_token_id, eos_token_id}.
    """
    cfg = drafter.config
    state = drafter.state_dict()
    tensors = {EXPORT_NAMES[name]: state[name].detach().cpu().contiguous() for name in EXPORT_NAMES}
    for name, (_, dtype) in expected_tensors(cfg).items():
        tensors[name] = tensors[name].to(dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    write_json(out / "config.json", engine_config(cfg, verifier))
    write_json(out / "meta.json", {
        "verifier": verifier,
        "aux_layers": list(cfg.aux_layers),
        "aux_layers_convention": OUR_CONVENTION,
        "draft_config": cfg.to_dict(),
        "training": training,
    })


def load_drafter(folder: str | Path, embed_tokens: torch.Tensor) -> Eagle3Drafter:
    """The exported drafter as an ``Eagle3Drafter`` (fp32 parameters) using the verifier's embedding."""
    folder = Path(folder)
    meta = read_json(folder / "meta.json")
    cfg = config_from_export(read_json(folder / "config.json"), meta["aux_layers"])
    drafter = Eagle3Drafter(cfg, embed_tokens)
    tensors = read_tensors(folder / "model.safetensors")
    module_names = {exported: name for name, exported in EXPORT_NAMES.items()}
    state = {module_names.get(name, name): tensor for name, tensor in tensors.items()}
    drafter.load_state_dict(state, strict=True)
    return drafter


# ---------------------------------------------------------------------------------------------
# check-drafter: each check returns a list of one-line problems (empty: fine).


def check_config(config: dict[str, Any]) -> list[str]:
    problems = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures is {config.get('architectures')}, engines need [{ARCHITECTURE!r}]")
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {config.get('num_hidden_layers')}, an EAGLE-3 drafter has 1")
    if config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings is true: lm_head is over the draft vocab and must not be tied")
    return [f"config.json: {p}" for p in problems]


def check_tensors(tensors: dict[str, torch.Tensor], cfg: DraftConfig) -> list[str]:
    expected = expected_tensors(cfg)
    problems = []
    if any(name.startswith("layers.0.") for name in tensors):
        problems.append("has layers.0.* instead of midlayer.*: SGLang skips unknown names silently and the draft layer stays random; rename them")
    if any("embed_tokens" in name for name in tensors):
        problems.append("has embed_tokens: the drafter must use the verifier's embedding, never an exported (random) one; drop it")
    for name in sorted(set(expected) - set(tensors)):
        problems.append(f"missing {name}")
    for name in sorted(set(tensors) - set(expected)):
        if not name.startswith("layers.0.") and "embed_tokens" not in name:
            problems.append(f"unexpected tensor {name}")
    for name, (shape, dtype) in expected.items():
        if name in tensors and (tuple(tensors[name].shape), tensors[name].dtype) != (shape, dtype):
            problems.append(f"{name} is {tuple(tensors[name].shape)} {tensors[name].dtype}, expected {shape} {dtype}")
    return [f"model.safetensors: {p}" for p in problems]


def check_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """No NaN or Inf weight: an engine serves such a drafter without error, and it never drafts a useful token."""
    problems = []
    for name, tensor in sorted(tensors.items()):
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                problems.append(f"{name} has {bad} NaN/Inf values of {tensor.numel()}: training diverged or the file "
                                "is damaged; retrain (`dvc repro -f train`)")
    return [f"model.safetensors: {p}" for p in problems]


def check_vocab(tensors: dict[str, torch.Tensor], cfg: DraftConfig) -> list[str]:
    """d2t maps every draft token into the verifier vocab, once, in id order; t2d marks exactly those."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None or d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
        return []  # already reported by check_tensors
    target = torch.arange(len(d2t)) + d2t.long()
    problems = []
    if int(target.min()) < 0 or int(target.max()) >= cfg.vocab_size:
        problems.append(f"d2t maps draft tokens outside the verifier vocab [0, {cfg.vocab_size}) (target ids {int(target.min())}..{int(target.max())})")
    elif not bool((target[1:] > target[:-1]).all()):
        problems.append("d2t target ids are not strictly increasing (duplicates or out of order)")
    elif not bool(t2d.bool()[target].all()):
        problems.append("t2d is not set at the target ids of d2t")
    if int(t2d.bool().sum()) != cfg.draft_vocab_size:
        problems.append(f"t2d marks {int(t2d.bool().sum())} tokens, draft_vocab_size is {cfg.draft_vocab_size}")
    return [f"model.safetensors: {p}" for p in problems]


def check_layer_ids(config: dict[str, Any], meta: dict[str, Any], num_layers: int) -> list[str]:
    """meta.json's taps are 3 ascending layers of the verifier, and each engine resolves config.json to them.

    ``num_layers`` (0: unknown) is the verifier's, for the engines' default taps when the config names none.
    """
    ids = meta.get("aux_layers") or []
    problem = tap_problem(ids, num_layers)
    if problem:
        return [f"meta.json: {problem} (the verifier's layers)"]
    problems = []
    for engine, resolve in ENGINE_TAPS.items():
        got = resolve(config, num_layers)
        if list(got) != ids:
            problems.append(f"config.json: {engine} would tap layers {list(got)}, the drafter was trained on {ids} "
                            f"(eagle3 check-drafter --rewrite-config rewrites config.json from meta.json)")
    return problems


def check_against_verifier(config: dict[str, Any], meta: dict[str, Any], verifier: dict[str, Any]) -> list[str]:
    """Sizes, context and fingerprint against the verifier (its folder, else what meta.json recorded)."""
    problems = []
    for key in ("hidden_size", "vocab_size"):
        if config.get(key) != verifier.get(key):
            problems.append(f"config.json: {key} {config.get(key)} != the verifier's {verifier.get(key)}")
    for key in TOKEN_IDS:  # exports (and meta.json records) of older versions have none: nothing to compare
        if verifier.get(key) is not None and config.get(key) != verifier[key]:
            problems.append(f"config.json: {key} {config.get(key)} != the verifier's {verifier[key]} "
                            "(eagle3 check-drafter --rewrite-config --verifier models/verifier rewrites it)")
    if int(config.get("max_position_embeddings") or 0) < int(verifier.get("max_position_embeddings") or 0):
        problems.append(f"config.json: max_position_embeddings {config.get('max_position_embeddings')} < the verifier's "
                        f"{verifier['max_position_embeddings']}: drafting would stop or misbehave on long contexts")
    return problems + verifier_problems(meta.get("verifier") or {}, verifier)


def verifier_problems(recorded: dict[str, Any], verifier: dict[str, Any]) -> list[str]:
    """The drafter's verifier (meta.json) against ``verifier``: the same identity, and a build whose weights are
    the recorded build's within rounding; another build is accepted with one log line naming both."""
    if not verifier.get("fingerprint"):
        return []
    if "build" not in recorded:
        return [f"meta.json: trained for verifier {recorded.get('fingerprint')} by an eagle3 from before verifier "
                "identities, which this one cannot compare; retrain it (`dvc repro train`)"]
    mismatch = verifier_mismatch("meta.json", "trained for", recorded.get("fingerprint"), verifier["fingerprint"], "this verifier is")
    if mismatch:
        return [mismatch]
    trained, here = recorded["build"], verifier["build"]
    if trained["id"] == here["id"]:
        return []
    if trained.get("tensors") is None or here.get("tensors") is None:
        note_other_build("meta.json", "trained with", trained, here, " (weights referenced, not compared)")
        return []
    difference = build_difference(trained["tensors"], here["tensors"])
    if difference:
        return [f"meta.json: trained with build {trained['id']} of this verifier, whose weights this machine's build "
                f"{here['id']} does not match within rounding ({difference}); re-import the verifier or retrain"]
    note_other_build("meta.json", "trained with", trained, here, ", weights within one rounding step tensor by tensor")
    return []


def verifier_facts(folder: str | Path) -> dict[str, Any]:
    """What the export must agree with, read from a verifier folder (config.json + meta.json)."""
    folder = Path(folder)
    config = text_config_dict(folder, language_model(folder))  # a multimodal wrapper keeps the LM's config inside
    facts = {key: config.get(key) for key in ("hidden_size", "vocab_size", "max_position_embeddings")}
    facts["num_layers"] = config.get("num_hidden_layers")
    top = read_json(folder / "config.json")  # a wrapper may keep the token ids beside its text_config
    facts.update({key: config.get(key, top.get(key)) for key in TOKEN_IDS})
    meta = folder / "meta.json"
    facts["fingerprint"] = verifier_fingerprint(folder) if meta.is_file() else None
    facts["build"] = verifier_build(folder) if meta.is_file() else None
    return facts


def check_drafter(folder: str | Path, verifier_folder: str | Path | None = None) -> list[str]:
    """Every problem of an exported drafter folder, one line each; empty when it is fit to serve."""
    folder = Path(folder)
    for name in ("config.json", "model.safetensors", "meta.json"):
        if not (folder / name).is_file():
            return [f"{folder / name}: not found"]
    config, meta = read_json(folder / "config.json"), read_json(folder / "meta.json")
    problems = check_config(config)
    verifier = verifier_facts(verifier_folder) if verifier_folder else dict(meta.get("verifier") or {})
    problems += check_against_verifier(config, meta, verifier)
    problems += check_layer_ids(config, meta, int(verifier.get("num_layers") or 0))
    try:
        cfg = config_from_export(config, meta.get("aux_layers") or ())
    except ValueError as err:
        return problems + [f"config.json: {err}"]
    try:
        tensors = read_tensors(folder / "model.safetensors")
    except UserError as err:
        return problems + [str(err)]
    return problems + check_tensors(tensors, cfg) + check_finite(tensors) + check_vocab(tensors, cfg)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or corrupt one is a UserError naming it."""
    try:
        return load_file(path)
    except SafetensorError as err:
        raise UserError(f"{path}: not a readable safetensors file ({err}); export it again (`dvc repro -f train`)") from None
