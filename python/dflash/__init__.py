"""dflash: a speculative-decoding LLM inference runtime with a C++ core.

Public API: Session, SamplingParams, RequestOutput, RequestMetrics, StreamOutput, DFlashError.
"""

from dflash.errors import DFlashError
from dflash._blas import preload_cublaslt as _preload_cublaslt  # noqa: E402
from dflash._blas import preload_openblas as _preload_openblas  # noqa: E402

_preload_openblas()
_preload_cublaslt()

from dflash import _core  # noqa: E402
from dflash.params import SamplingParams  # noqa: E402
from dflash.outputs import RequestMetrics, RequestOutput, StreamOutput  # noqa: E402
from dflash.session import Session  # noqa: E402

__all__ = ["Session", "SamplingParams", "RequestOutput", "RequestMetrics", "StreamOutput", "DFlashError"]
__version__ = "0.1.0"


def built_with_cuda() -> bool:
    """True when this build of the extension contains the CUDA backend."""
    return bool(_core.built_with_cuda())
