"""Builds torchdist_ext._C against the installed torch (the only wheel build).

Install: pip install --no-build-isolation -e .
TDX_DEBUG=1 builds with -O0 -g. The CUDA part (csrc/cuda: the NCCL engine and the .cu kernels) is built only when
torch has CUDA, nvcc is found and NCCL's header and library are found (the nvidia-nccl pip package
that torch's CUDA build installs, or the system's); otherwise the build is CPU-only and says why.
TDX_CUDA=0 forces a CPU-only build; TDX_CUDA=1 makes a missing CUDA requirement an error.
TDX_CUDA_ARCH sets the GPU architectures (default "9.0" for H100/H200, e.g. "8.0;9.0").
"""
import glob
import os
import shutil
import sys

# torch finds CUDA through `which nvcc`; an nvcc in /usr/local/bin would make that /usr/local
# (no CUDA headers there), so point CUDA_HOME at a toolkit that has them.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and shutil.which("nvcc"):
    for _home in (os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc")))), "/usr/local/cuda"):
        if os.path.isfile(os.path.join(_home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = _home
            break

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
debug = os.environ.get("TDX_DEBUG", "0") == "1"
want_cuda = os.environ.get("TDX_CUDA", "auto")


def find_nccl():
    """(include dir, library dir, library file name) of NCCL, or None."""
    candidates = []
    try:
        import nvidia.nccl  # the nvidia-nccl-cu* package that torch's CUDA wheels depend on

        for base in nvidia.nccl.__path__:
            candidates.append((os.path.join(base, "include"), os.path.join(base, "lib")))
    except ImportError:
        pass
    home = os.environ.get("NCCL_HOME")
    if home:
        candidates.append((os.path.join(home, "include"), os.path.join(home, "lib")))
    candidates += [("/usr/include", "/usr/lib/x86_64-linux-gnu"), ("/usr/local/cuda/include", "/usr/local/cuda/lib64")]
    for inc, lib in candidates:
        if not os.path.isfile(os.path.join(inc, "nccl.h")):
            continue
        for name in ("libnccl.so", "libnccl.so.2"):
            if os.path.isfile(os.path.join(lib, name)):
                return inc, lib, name
    return None


def cuda_plan():
    """(use CUDA, reason, nccl) for this build."""
    if want_cuda == "0":
        return False, "TDX_CUDA=0", None
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} has no CUDA", None
    if cpp_extension.CUDA_HOME is None or not (
        shutil.which("nvcc") or os.path.isfile(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    ):
        return False, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)", None
    nccl = find_nccl()
    if nccl is None:
        return False, "NCCL (nccl.h and libnccl.so) was not found; pip install nvidia-nccl-cu13 or set NCCL_HOME", None
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL from {nccl[0]}", nccl


def pip_cuda_includes():
    """Header folders of the nvidia-* pip packages (cusparse.h, cublas_v2.h, ... that torch's CUDA
    headers include), for toolkits installed without those libraries' headers."""
    try:
        import nvidia

        return sorted(
            inc for base in nvidia.__path__ for inc in glob.glob(os.path.join(base, "*", "include")) if os.path.isdir(inc)
        )
    except ImportError:
        return []


use_cuda, why, nccl = cuda_plan()
if want_cuda == "1" and not use_cuda:
    sys.exit(f"TDX_CUDA=1 but the CUDA part cannot be built: {why}")
print(f"torchdist_ext: {'CUDA + CPU' if use_cuda else 'CPU-only'} build ({why})", flush=True)

# csrc/cuda/ (the NCCL engine, the kernels' .cu) is compiled only with CUDA; it registers itself
# with the rest of tdx at load time, so no other file tests a build macro.
CUDA_DIR = os.path.join("csrc", "cuda") + os.sep
sources = sorted(
    p
    for p in glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True)
    if not p.endswith("_test.cc") and not p.startswith(CUDA_DIR)
)
cuda_sources = (
    sorted(glob.glob(os.path.join(CUDA_DIR, "*.cc")) + glob.glob(os.path.join(CUDA_DIR, "*.cu"))) if use_cuda else []
)

# -g0 drops the debug information Python's own CFLAGS ask for: a faster build and a smaller module.
cxx_flags = ["-O0", "-g"] if debug else ["-O3", "-g0"]
cxx_flags += ["-Wall", "-Wno-unused-function", "-fvisibility=hidden"]
kwargs = dict(
    name="torchdist_ext._C",
    sources=sources + cuda_sources,
    include_dirs=[os.path.join(ROOT, "csrc")],
    # Headers count as inputs: a changed header rebuilds (ninja then recompiles what includes it).
    depends=sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)),
    extra_compile_args={"cxx": cxx_flags},
)
if use_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", os.environ.get("TDX_CUDA_ARCH", "9.0"))
    inc, lib, libname = nccl
    kwargs["include_dirs"].append(inc)
    toolkit_inc = os.path.join(cpp_extension.CUDA_HOME, "include")
    if not os.path.isfile(os.path.join(toolkit_inc, "cusparse.h")):
        kwargs["include_dirs"] += [d for d in pip_cuda_includes() if d != inc]
    kwargs["library_dirs"] = [lib]
    kwargs["libraries"] = ["nccl"] if libname == "libnccl.so" else []
    kwargs["extra_link_args"] = ([] if libname == "libnccl.so" else [f"-l:{libname}"]) + [f"-Wl,-rpath,{lib}"]
    # --fmad=false: no fused multiply-adds, so the kernels round exactly like the CPU loops.
    kwargs["extra_compile_args"]["nvcc"] = (["-O0", "-g"] if debug else ["-O3"]) + ["--fmad=false"]
    ext = cpp_extension.CUDAExtension(**kwargs)
else:
    ext = cpp_extension.CppExtension(**kwargs)


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """One object folder (build/temp) for every build of this checkout, pip's editable install and
    `setup.py build_ext --inplace` alike, so ninja recompiles only what changed since any of them."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
