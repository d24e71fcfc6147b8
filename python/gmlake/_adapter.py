# SPDX-License-Identifier: MIT
"""Building and loading the C++ adapter (csrc/adapter.cpp).

The adapter is compiled once per torch, Python and source version with
torch.utils.cpp_extension (ninja and a C++ compiler needed) into a cache
folder, and imported from there afterwards without a compiler:

  GMLAKE_CACHE_DIR, else TORCH_EXTENSIONS_DIR/gmlake, else
  $XDG_CACHE_HOME/gmlake (~/.cache/gmlake),

each build in a folder named after a digest of the adapter's source,
libgmlake's headers, and the torch, CUDA and Python versions. While it
compiles, a line on stderr says so. It needs libgmlake's public headers:
GMLAKE_INCLUDE_DIR, the package's own copy (gmlake/include), the source
tree's include/, make install's includedir, or pkg-config's.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time

from . import _version

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "adapter.cpp")
HEADERS = ("gmlake.h", "gmlake-stats.h", "gmlake-torch.h",
           "gmlake-snapshot.h")
INCLUDE_ENV = "GMLAKE_INCLUDE_DIR"
CACHE_ENV = "GMLAKE_CACHE_DIR"


class AdapterUnavailable(RuntimeError):
    """The adapter cannot be built or loaded here; the message says why."""


def _has_headers(folder):
    return bool(folder) and all(os.path.isfile(os.path.join(folder, h))
                                for h in HEADERS)


def _pkg_config_includes():
    try:
        out = subprocess.run(["pkg-config", "--cflags-only-I", "gmlake"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [w[2:] for w in out.stdout.split() if w.startswith("-I")]


def include_dir():
    """The folder of libgmlake's public headers, or AdapterUnavailable."""
    tried = []
    env = os.environ.get(INCLUDE_ENV)
    cands = [(INCLUDE_ENV, env)] if env else []
    here = os.path.dirname(os.path.abspath(__file__))
    cands.append(("the package's copy", os.path.join(here, "include")))
    tree = _version.source_tree()
    if tree:
        cands.append(("the source tree", os.path.join(tree, "include")))
    try:
        from . import _installed
        cands.append(("make install's includedir",
                      getattr(_installed, "INCLUDEDIR", None)))
    except ImportError:
        pass
    cands += [("pkg-config", d) for d in _pkg_config_includes()]
    for what, folder in cands:
        if _has_headers(folder):
            return os.path.abspath(folder)
        tried.append("%s: %s" % (what, folder))
    raise AdapterUnavailable("libgmlake's headers (%s) not found; looked "
                             "in %s; set %s" % (", ".join(HEADERS),
                                                "; ".join(tried) or "nothing",
                                                INCLUDE_ENV))


def cache_root():
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "gmlake")
    base = os.environ.get("XDG_CACHE_HOME") or \
        os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gmlake")


def digest(incdir, torch_version, cuda_version):
    """What a build depends on, as a short hex string."""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    for name in HEADERS:
        with open(os.path.join(incdir, name), "rb") as f:
            h.update(f.read())
    h.update(("%s|%s|%s|%s" % (torch_version, cuda_version,
                               sysconfig.get_config_var("SOABI"),
                               sys.version)).encode())
    return h.hexdigest()[:16]


def _import(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_tools(cpp_extension):
    if not cpp_extension.is_ninja_available():
        raise AdapterUnavailable("ninja is not installed (pip install "
                                 "ninja), so torch.utils.cpp_extension "
                                 "cannot build the adapter")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        raise AdapterUnavailable("no C++ compiler (%s) on PATH" % cxx)
    if cpp_extension.CUDA_HOME is None:
        raise AdapterUnavailable("the CUDA toolkit's headers were not found "
                                 "(set CUDA_HOME)")


def load(torch, verbose=False):
    """The adapter's Python module for this torch: imported from the cache,
    or built into it first. AdapterUnavailable when that cannot be done."""
    incdir = include_dir()
    if not os.path.isfile(SOURCE):
        raise AdapterUnavailable("%s is missing from the package" % SOURCE)
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if not cuda:
        raise AdapterUnavailable("torch %s was built without CUDA" %
                                 torch.__version__)
    name = "gmlake_adapter_" + digest(incdir, torch.__version__, cuda)
    build = os.path.join(cache_root(), name)
    so = os.path.join(build, name + ".so")
    if os.path.isfile(so):
        try:
            return _import(name, so)
        except ImportError as e:
            raise AdapterUnavailable("the cached adapter %s does not load: "
                                     "%s (remove that folder to rebuild "
                                     "it)" % (so, e)) from e
    try:
        from torch.utils import cpp_extension
    except ImportError as e:
        raise AdapterUnavailable("torch.utils.cpp_extension is missing: %s"
                                 % e) from e
    _check_tools(cpp_extension)
    os.makedirs(build, exist_ok=True)
    sys.stderr.write("gmlake: building the PyTorch adapter for torch %s "
                     "(once; about a minute) in %s ...\n" %
                     (torch.__version__, build))
    sys.stderr.flush()
    t0 = time.monotonic()
    cuda_home = cpp_extension.CUDA_HOME
    libdirs = [os.path.join(os.path.dirname(os.path.abspath(torch.__file__)),
                            "lib")]
    libdirs += [d for d in (os.path.join(cuda_home, "lib64"),
                            os.path.join(cuda_home, "lib"))
                if os.path.isdir(d)][:1]
    ldflags = ["-L" + d for d in libdirs] + ["-lc10_cuda", "-ltorch_cuda"]
    if len(libdirs) > 1:
        ldflags.append("-lcudart")
    # with_cuda stays off: it would ask torch for the GPUs' architectures
    # (for nvcc, which a .cpp does not need), and that initializes CUDA,
    # after which PyTorch's allocator can no longer be replaced. The CUDA
    # headers and libraries come in by hand instead.
    try:
        mod = cpp_extension.load(
            name=name, sources=[SOURCE],
            extra_include_paths=[incdir, os.path.join(cuda_home, "include")],
            extra_cflags=["-O2"], extra_ldflags=ldflags,
            build_directory=build, with_cuda=False, verbose=verbose)
    except Exception as e:
        raise AdapterUnavailable("building the adapter in %s failed: %s" %
                                 (build, e)) from e
    if torch.cuda.is_initialized():
        raise AdapterUnavailable("building the adapter initialized CUDA, so "
                                 "PyTorch's allocator can no longer be "
                                 "replaced in this process; it is built now "
                                 "(%s) and the next process will use it" %
                                 build)
    sys.stderr.write("gmlake: adapter built in %.0f s\n" %
                     (time.monotonic() - t0))
    return mod
