"""The ``layout`` params section's schema: the hardware a run is laid on (device, dtype, processes,
threads, the verifier's and a server's parallelism, the batch sizes it holds).

    check_schema(LayoutSettings, get)    # config.validate, for every view holding layout keys

Its readers are many (launch's torchrun command in dvc.yaml, extract's capture, evaluate's
settings, ``lm.loading.Placement``, the stage groups interpolating ``layout.batch``), so it stands
apart from each of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.schema import ABSENT, BOOL, NON_NEGATIVE_NUMBER, PLACEMENT, POSITIVE, Lookup, one_of, refuse, setting


@dataclass(frozen=True)
class LayoutSettings:
    """One field per key of conf/layout/*.yaml."""

    GROUP: ClassVar[str] = "layout"

    device: str = setting(one_of("cpu", "cuda"))  # torch device of every stage (worker r of several takes cuda:r)
    dtype: str = setting(one_of("float32", "bfloat16", "float16"))  # compute dtype (relations: float32 on the CPU)
    server: dict = setting()  # an inference server's {tp, dp} (backend.tp, backend.dp)
    verifier: dict = setting(PLACEMENT)  # one verifier copy's {tp, ep} (lm.loading.Placement)
    extract_workers: int = setting(POSITIVE)  # data-parallel extraction processes
    train_procs: int = setting(POSITIVE)  # torchrun processes per node
    nnodes: int = setting(POSITIVE)  # training nodes
    rdzv_endpoint: str = setting()  # torchrun rendezvous host:port
    threads: int = setting(POSITIVE)  # torch threads per process
    warm_seconds: float = setting(NON_NEGATIVE_NUMBER)  # generate, extract, train, evaluate through a warm server idle this long (docs/layout.md); 0: none
    compile_ahead: bool = setting(BOOL)  # train's compiled step built while extract runs (eagle3.training.ahead; one CUDA training process)
    batch: dict = setting()  # the batch sizes this hardware holds, read by the stage groups' keys

    @staticmethod
    def relations(get: Lookup) -> None:
        """The CPU computes in float32."""
        device, dtype = get("layout.device"), get("layout.dtype")
        if device == "cpu" and dtype not in (ABSENT, "float32"):
            raise refuse("layout.dtype", dtype, "float32 on the CPU (bf16 is several times slower there)")
