"""Loads the OpenBLAS shared library of the PyPI package scipy-openblas32 before the C++
extension, so the extension finds it whatever the install layout (wheel, editable, --target)."""

import ctypes
import os


def preload_openblas() -> None:
    try:
        import scipy_openblas32
    except ImportError as e:  # a dependency of the package; a broken install otherwise
        raise ImportError("dflash needs the 'scipy-openblas32' package: pip install scipy-openblas32") from e
    path = os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so")
    if os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def preload_cublaslt() -> None:
    """Loads libcublasLt from the PyPI package nvidia-cublas when it is installed, so the CUDA
    backend (which dlopens it by soname) finds it without LD_LIBRARY_PATH. Absent: nothing."""
    try:
        import nvidia.cu13 as cu13
    except ImportError:
        return
    for root in cu13.__path__:
        path = os.path.join(root, "lib", "libcublasLt.so.13")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
