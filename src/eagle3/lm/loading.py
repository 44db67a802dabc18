"""The verifier as every stage loads it: the folder ``models/verifier`` that the verifier stage wrote.

    meta = read_meta("models/verifier")                      # source, weights_path, this machine's build
    verifier_fingerprint("models/verifier")                  # its identity's id, which later stages record and check
    verifier_build("models/verifier")                        # this machine's bytes of it (eagle3.lm.identity)
    model = load_verifier("models/verifier", "cuda", "bfloat16")
    tokenizer = load_tokenizer("models/verifier")
    config = text_config("models/verifier")                  # the language model's config, no weights

Multimodal checkpoints (Kimi-K2.5: a vision wrapper around a DeepSeek-V3 text model) nest the
language model: its config under ``text_config``, its weights under ``language_model.``. The
params' ``model.language_model`` says where (``spec.LanguageModel``); the verifier stage records it
in ``meta.json``, and every stage finds the text model's config, weights and embedding/norm/lm_head
through it. Only the text model is ever loaded (the vision tower's weights are skipped).
``Placement`` lays one copy over several processes (tensor/expert parallel) for extract and evaluate.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, read_json, to_plain
from eagle3.lm.identity import IDENTITY_FILE
from eagle3.lm.spec import VERIFIER_TENSORS, LanguageModel
from eagle3.schema import PLACEMENT, refuse

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"  # the text model's embedding, relative to LanguageModel.prefix
DTYPES = {"float32", "bfloat16", "float16"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class Placement:
    """How one copy of the verifier is laid over devices for extract and evaluate (params ``layout.verifier``).

    tp 1: a whole copy per process (data parallel, ``layout.extract_workers`` copies). tp > 1: one
    copy sharded over tp processes that the stage runs under torchrun, with transformers' tensor
    parallel plan (``DistributedConfig``); ep = tp also splits a MoE's experts over them.
    """

    tp: int  # processes (GPUs) holding one copy together
    ep: int  # 1, or tp: experts split over the tp processes (MoE)

    @classmethod
    def from_params(cls, layout: DictConfig) -> Placement:
        """``layout.verifier`` (the layout's, or conf/config.yaml's model.placement): both keys, no fallback."""
        section = to_plain(layout.verifier)
        if not PLACEMENT.test(section):  # the params stage refused it already; a stage run alone (`dvc repro -s`) did not
            raise refuse("layout.verifier", section, PLACEMENT.allowed)
        return cls(section["tp"], section["ep"])

    @property
    def sharded(self) -> bool:
        return self.tp > 1

    def check(self, config, device: str) -> None:
        """Refuse what cannot be sharded this way: more GPUs than the node has, a model without a
        TP (or EP) plan in transformers, heads or experts that tp (ep) does not divide."""
        if not self.sharded:
            return
        if device == "cuda":
            import torch

            if self.tp > torch.cuda.device_count():
                raise UserError(f"params.yaml: layout.verifier.tp {self.tp} needs {self.tp} GPUs; this node has {torch.cuda.device_count()}")
        if not getattr(config, "base_model_tp_plan", None):
            raise UserError(f"params.yaml: layout.verifier.tp {self.tp}: transformers has no tensor-parallel plan for "
                            f"{config.model_type!r} models; use tp 1 (a whole copy per GPU)")
        if self.ep > 1 and not getattr(config, "base_model_ep_plan", None):
            raise UserError(f"params.yaml: layout.verifier.ep {self.ep}: transformers has no expert-parallel plan for "
                            f"{config.model_type!r} models; use ep 1")
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, key, None)
            if value and value % self.tp:
                raise UserError(f"params.yaml: layout.verifier.tp {self.tp} does not divide the verifier's {key} ({value})")
        experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None)
        if self.ep > 1 and experts and experts % self.ep:
            raise UserError(f"params.yaml: layout.verifier.ep {self.ep} does not divide the verifier's {experts} experts")

    def distributed_config(self):
        """transformers' ``DistributedConfig`` for this placement (5.17 and 5.24 spell EP differently)."""
        from transformers.distributed import DistributedConfig

        if self.ep == 1:
            return DistributedConfig(tp_size=self.tp)
        if "ep_size" in DistributedConfig.__dataclass_fields__:  # >= 5.21: the TP plan, with the EP plan over the experts
            return DistributedConfig(tp_size=self.tp, ep_size=self.ep)
        return DistributedConfig(tp_size=self.tp, enable_expert_parallel=True)  # older: the EP plan alone

    def launch(self, module: str, argv: list[str]) -> bool:
        """Run ``python -m module argv`` as tp torchrun processes on this node and wait; False when
        not sharded or when this process already is one of them (then the caller goes on itself)."""
        if not self.sharded or "WORLD_SIZE" in os.environ:
            return False
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(self.tp),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", module, *argv]
        log.info("sharded verifier: %s", " ".join(command[1:]))
        returncode = subprocess.run(command).returncode
        if returncode:
            raise SystemExit(returncode)
        return True


# One copy on one device: what a caller without a layout loads (generate's local backend, one
# process; tests and benchmarks). extract and evaluate pass Placement.from_params(layout) instead.
WHOLE_COPY = Placement(tp=1, ep=1)


def shard_rank() -> int:
    """This process's rank among a sharded verifier's processes (0 when not sharded): rank 0 writes."""
    return int(os.environ.get("RANK", "0"))


def close_sharded() -> None:
    """Leave the process group a sharded verifier was loaded into, once every process is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def text_config_dict(folder: Path, lm: LanguageModel) -> dict[str, Any]:
    """The language model's config as a dict: ``config.json`` or its ``lm.config`` section, typed as ``lm.model_type``.

    A quantization config kept at the top level (beside the sub-config) applies to the text model too.
    """
    raw = read_json(folder / "config.json")
    if lm.config is None:
        config = dict(raw)
    elif isinstance(raw.get(lm.config), dict):
        config = dict(raw[lm.config])
        if "quantization_config" in raw:
            config.setdefault("quantization_config", raw["quantization_config"])
    else:
        raise UserError(f"{folder}/config.json: no {lm.config!r} section; model.language_model.config names the text model's sub-config")
    if lm.model_type is not None:
        config["model_type"] = lm.model_type
    return config


def checkpoint_names(folder: Path) -> set[str]:
    """Every tensor name of the safetensors checkpoint in ``folder`` (from the index, else the file headers)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(read_json(index)["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as part:
            names.update(part.keys())
    return names


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UserError(f"model.source.dtype: {name!r} is not one of {sorted(DTYPES)}")
    return getattr(torch, name)


def prepare_torch(device: str, threads: int) -> None:
    """Torch's process settings for verifier forwards: intra-op threads and, on CUDA, cuDNN's SDPA attention off. It pays
    a setup for every new (batch, length) shape, about 10 s per 256 prompts on an H200, which dominated a ``generate``
    shard; ``extract``'s length-sorted batches and ``evaluate``'s verify forwards are nearly all new shapes. The flash
    and memory-efficient SDPA kernels pay none."""
    import torch

    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def read_meta(folder: str | Path) -> dict[str, Any]:
    return read_json(Path(folder) / "meta.json")


def read_identity(folder: str | Path) -> dict[str, Any]:
    """A verifier folder's identity.json; one line to re-import a folder an older eagle3 wrote without one."""
    path = Path(folder) / IDENTITY_FILE
    if not path.is_file() and (Path(folder) / "meta.json").is_file():
        raise UserError(f"{path}: not found: {folder} was imported before verifiers had an identity; "
                        "re-run the verifier stage (`dvc repro verifier`)")
    return read_json(path)


def verifier_fingerprint(folder: str | Path) -> str:
    """The id of a verifier folder's identity (``identity.json``: source, recipe, architecture, tokenizer),
    the same on every machine, which every later stage records with its output and checks its inputs against."""
    return read_identity(folder)["id"]


def verifier_build(folder: str | Path) -> dict[str, Any]:
    """This machine's build of the verifier (``meta.json``): {id, weights, torch, transformers, tensors}."""
    read_identity(folder)  # an older folder: one line to re-import it
    return read_meta(folder)["build"]


def weights_dir(folder: str | Path) -> Path:
    """Where the verifier's weights live: the folder itself, or the referenced location."""
    folder = Path(folder)
    location = read_meta(folder)["weights_path"]
    return folder if location == "." else Path(location)


def language_model(folder: str | Path) -> LanguageModel:
    """Where the verifier folder's language model sits, as its ``meta.json`` recorded (default: a plain LM)."""
    meta = Path(folder) / "meta.json"
    return LanguageModel(**(read_json(meta).get("language_model") or {})) if meta.is_file() else LanguageModel()


def verifier_parts(folder: Path) -> tuple[SimpleNamespace, dict[str, Any]]:
    """The verifier's LM config and the three tensors training needs (embedding, lm_head, final
    norm), read from its safetensors files without loading the model. A nested language model
    (``model.language_model``) has them under its prefix."""
    from safetensors import safe_open

    lm = language_model(folder)
    config = SimpleNamespace(**text_config_dict(folder, lm))
    wanted = {lm.prefix + name: key for key, name in VERIFIER_TENSORS.items()}
    found: dict[str, Any] = {}  # key -> tensor
    for file in sorted(weights_dir(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as part:
            found.update({wanted[name]: part.get_tensor(name) for name in wanted.keys() & set(part.keys())})
    if "head" not in found and getattr(config, "tie_word_embeddings", False) and "embed" in found:
        found["head"] = found["embed"]
    missing = [lm.prefix + VERIFIER_TENSORS[k] for k in VERIFIER_TENSORS if k not in found]
    if missing:
        raise UserError(f"{folder}: verifier weights lack {missing}")
    packed = [lm.prefix + VERIFIER_TENSORS[k] for k, t in found.items() if not t.is_floating_point()]
    if packed:
        raise UserError(f"{folder}: {packed} are quantized (packed integers); the drafter needs them in floating point")
    return config, found


def text_config(folder: str | Path, trust_remote_code: bool = False):
    """The language model's transformers config (no weights loaded)."""
    from transformers import AutoConfig

    folder, lm = Path(folder), language_model(folder)
    if not lm.nested:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).get_text_config()
    config = text_config_dict(folder, lm)
    try:
        return AutoConfig.for_model(**config)
    except ValueError:
        raise UserError(
            f"{folder}/config.json: transformers has no model type {config.get('model_type')!r}; set "
            "model.language_model.model_type to the architecture the text model follows (e.g. deepseek_v3)"
        ) from None


def require_quantizer(config) -> None:
    """Refuse, before loading, quantized weights whose transformers quantizer package is missing."""
    method = (getattr(config, "quantization_config", None) or {})
    method = method.get("quant_method") if isinstance(method, dict) else getattr(method, "quant_method", None)
    packages = {"compressed-tensors": "compressed_tensors"}  # Kimi-K2.5 ships INT4 compressed-tensors
    if str(method) in packages and importlib.util.find_spec(packages[str(method)]) is None:
        raise UserError(f"the verifier's weights are {method}-quantized; run `pip install {method}` (transformers loads them through it)")


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends an answer: the generation config's EOS ids, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])


def load_verifier(folder: str | Path, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
                  placement: Placement = WHOLE_COPY):
    """The verifier's language model as an eval-mode ``AutoModelForCausalLM`` on ``device`` in ``dtype``.

    A nested language model is built from its own config and its weights are read with the prefix
    stripped (the vision tower's are left unread). A sharded ``placement`` loads this process's
    shard under torchrun (transformers places it on the process's own device). A whole copy is read
    from its safetensors straight onto ``device`` in ``dtype`` (``device_map``): no copy in host
    memory first, which a per-shard stage process would pay at every start.
    """
    from transformers import AutoModelForCausalLM

    lm = language_model(folder)
    config = text_config(folder, trust_remote_code)
    require_quantizer(config)
    extra = {"config": config, "key_mapping": lm.key_mapping()} if lm.nested else {}
    if placement.sharded:
        extra["distributed_config"] = placement.distributed_config()
    else:
        extra["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(
        weights_dir(folder), dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code, **extra
    )
    return model.eval()


def input_embedding(model):
    """The verifier's token embedding as a plain tensor: whole even when the verifier is sharded (a tied
    embedding is split with the lm_head), for a drafter that keeps its own frozen copy."""
    weight = model.get_input_embeddings().weight.detach()
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight
