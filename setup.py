"""Builds torchdist_ext._C against the installed torch (the only wheel build).

Install: pip install --no-build-isolation -e .
TDX_DEBUG=1 builds with -O0 -g. CUDA sources (csrc/**/*.cu) are added only when torch has CUDA
and nvcc is present.
"""
import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
debug = os.environ.get("TDX_DEBUG", "0") == "1"

sources = sorted(
    p for p in glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True) if not p.endswith("_test.cc")
)
cuda_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
use_cuda = bool(cuda_sources) and cpp_extension.CUDA_HOME is not None and __import__("torch").version.cuda

cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
cxx_flags += ["-Wall", "-Wno-unused-function", "-fvisibility=hidden"]
Extension = cpp_extension.CUDAExtension if use_cuda else cpp_extension.CppExtension
ext = Extension(
    name="torchdist_ext._C",
    sources=sources + (cuda_sources if use_cuda else []),
    include_dirs=[os.path.join(ROOT, "csrc")],
    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]} if use_cuda else {"cxx": cxx_flags},
    define_macros=[("TDX_WITH_CUDA", "1")] if use_cuda else [],
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
