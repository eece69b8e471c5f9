"""dflash: a speculative-decoding LLM inference runtime with a C++ core.

Public API: Session, SamplingParams, RequestOutput, RequestMetrics, StreamOutput, DFlashError;
cmake_dir() for C++ programs built against the library in this package.
"""

import os as _os

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


def cmake_dir() -> str:
    """The folder of dflash's CMake package inside this installed package (the C++ library
    libdflash and its headers): pass it as dflash_DIR to find_package(dflash CONFIG), as
    `python -m dflash --cmake-dir` prints it. FileNotFoundError if this install has none."""
    path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "lib", "cmake", "dflash")
    if not _os.path.isfile(_os.path.join(path, "dflashConfig.cmake")):
        raise FileNotFoundError(f"this install of dflash has no CMake package ({path} is missing); "
                                "install the package from its wheel or with `pip install .`")
    return path
