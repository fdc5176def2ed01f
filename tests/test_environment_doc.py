"""docs/environment.md lists every environment variable the package and its build read.

A static scan (no import): every quoted TDX_* / TORCH_* / TORCHELASTIC_* name in csrc/,
torchdist_ext/ and setup.py, and every name read through os.environ / os.getenv / getenv(), must
appear in the page as `NAME`.
"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "environment.md")

_PREFIXED = re.compile(r"""["']((?:TDX|TORCH|TORCHELASTIC)_[A-Z0-9_]+)["']""")
_READ = re.compile(r"""(?:environ(?:\.get|\.setdefault)?\s*[(\[]|getenv\s*\()\s*["']([A-Z][A-Z0-9_]*)["']""")


def _sources():
    patterns = ["csrc/**/*.cc", "csrc/**/*.h", "csrc/**/*.cu", "csrc/**/*.cuh", "torchdist_ext/**/*.py", "setup.py"]
    for pattern in patterns:
        yield from glob.glob(os.path.join(ROOT, pattern), recursive=True)


def variables_read():
    """{name: first file that mentions it} over the package's and the build's sources."""
    found = {}
    for path in _sources():
        text = open(path, encoding="utf-8").read()
        for name in _PREFIXED.findall(text) + _READ.findall(text):
            found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def test_every_variable_read_is_documented():
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]*)(?:=[^`]*)?`", open(PAGE, encoding="utf-8").read()))
    missing = {name: path for name, path in sorted(variables_read().items()) if name not in documented}
    assert not missing, ("environment variables read but not in docs/environment.md (add a row: variable, read by, "
                         f"default, meaning): {missing}")


def test_the_scan_finds_what_it_should():
    found = variables_read()
    for name in ("TDX_BUFFER_BYTES", "TDX_FAILURE_NOTICE", "TORCH_FR_BUFFER_SIZE", "TDX_CUDA", "MASTER_ADDR"):
        assert name in found, name
