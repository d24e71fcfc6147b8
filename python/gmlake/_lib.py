# SPDX-License-Identifier: MIT
"""Finding and loading libgmlake.so with ctypes.

Where it looks, in order:
  1. GMLAKE_LIBRARY: the library file, or a folder holding it (when set,
     nothing else is tried);
  2. the libdir this package was installed with (make install);
  3. pkg-config's libdir of gmlake (pkg-config --variable=libdir gmlake);
  4. ctypes.util.find_library("gmlake") (ldconfig's cache, LD_LIBRARY_PATH).
"""

import ctypes
import ctypes.util
import os
import subprocess
import threading

from . import _fields

ENV = "GMLAKE_LIBRARY"
NAMES = ("libgmlake.so.0", "libgmlake.so")


class LibraryNotFoundError(OSError):
    """libgmlake could not be found or loaded; the message lists where."""


def _in_dir(folder):
    for name in NAMES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _installed_libdir():
    try:
        from . import _installed  # written by make install
    except ImportError:
        return None
    return getattr(_installed, "LIBDIR", None)


def _pkg_config_libdir():
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "gmlake"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "pkg-config not usable (%s)" % e
    if out.returncode != 0:
        return None, "pkg-config knows no gmlake"
    return out.stdout.strip() or None, "pkg-config gave an empty libdir"


def find_library(path=None):
    """The path of libgmlake.so to load, or LibraryNotFoundError.

    path: a file or folder given by the caller; it overrides the search.
    """
    tried = []
    given = path or os.environ.get(ENV)
    if given:
        what = "argument" if path else ENV
        if os.path.isdir(given):
            found = _in_dir(given)
            if found:
                return os.path.abspath(found)
            tried.append("%s=%s: a folder without %s" %
                         (what, given, " or ".join(NAMES)))
        elif os.path.isfile(given):
            return os.path.abspath(given)
        else:
            tried.append("%s=%s: no such file or folder" % (what, given))
        raise LibraryNotFoundError(_message(tried))
    tried.append("%s: not set" % ENV)

    libdir = _installed_libdir()
    if libdir:
        found = _in_dir(libdir)
        if found:
            return found
        tried.append("installed libdir %s: no %s" % (libdir, NAMES[0]))
    else:
        tried.append("installed libdir: this copy of the package was not "
                     "installed by make install")

    libdir, why = _pkg_config_libdir()
    if libdir:
        found = _in_dir(libdir)
        if found:
            return found
        tried.append("pkg-config libdir %s: no %s" % (libdir, NAMES[0]))
    else:
        tried.append(why)

    name = ctypes.util.find_library("gmlake")
    if name:
        return name
    tried.append('ctypes.util.find_library("gmlake"): not found')
    raise LibraryNotFoundError(_message(tried))


def _message(tried):
    return ("libgmlake not found; looked in:\n  - " + "\n  - ".join(tried) +
            "\nBuild libgmlake and set %s to the library (a build tree's "
            "lib/.libs/libgmlake.so) or install it (make install)." % ENV)


class LibraryVersionError(LibraryNotFoundError):
    """The libgmlake found is not the version this package was made for."""


def _version_tuple(text):
    parts = str(text).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_version(lib, found, want=None):
    """Raise LibraryVersionError unless lib's major.minor matches the
    package's (want: "MAJOR.MINOR[.PATCH]", default gmlake.__version__)."""
    from . import _version
    want = want or _version.VERSION
    need = _version_tuple(want)
    try:
        lib.gmlake_version_major.restype = ctypes.c_int
        lib.gmlake_version_minor.restype = ctypes.c_int
        have = (lib.gmlake_version_major(), lib.gmlake_version_minor())
    except AttributeError as e:
        raise LibraryNotFoundError("%s is not libgmlake (%s)" %
                                   (found, e)) from e
    if need is None or have == need:
        return have
    raise LibraryVersionError(
        "%s is libgmlake %d.%d, but this gmlake Python package is %s: "
        "build and install both from the same source (or set %s to the "
        "matching library)" % (found, have[0], have[1], want, ENV))


def _declare(lib):
    c = ctypes
    sigs = {
        "gmlake_torch_alloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "gmlake_torch_free": (None, [c.c_void_p, c.c_size_t, c.c_int,
                                     c.c_void_p]),
        "gmlake_torch_init": (None, [c.c_int]),
        "gmlake_torch_empty_cache": (None, []),
        "gmlake_torch_memory_fraction": (None, [c.c_double, c.c_int]),
        "gmlake_torch_record_stream": (None, [c.c_void_p, c.c_void_p]),
        "gmlake_torch_ctx_get": (c.c_int, [c.c_int, c.POINTER(c.c_void_p)]),
        "gmlake_torch_error": (c.c_int, [c.c_char_p, c.c_size_t]),
        "gmlake_stats_get": (c.c_int, [c.c_void_p, c.c_void_p]),
        "gmlake_stats_reset_peaks": (c.c_int, [c.c_void_p]),
        "gmlake_last_error": (c.c_char_p, []),
        "gmlake_version_major": (c.c_int, []),
        "gmlake_version_minor": (c.c_int, []),
        "gmlake_torch_stats_get": (c.c_int, [c.c_int, c.c_void_p]),
        "gmlake_torch_stats_reset_peaks": (c.c_int, [c.c_int]),
        "gmlake_torch_stats_reset_accumulated": (c.c_int, [c.c_int]),
        "gmlake_torch_cache_info": (c.c_int, [c.c_int,
                                              c.POINTER(c.c_size_t)]),
        "gmlake_torch_pool_begin": (c.c_int, [c.c_int, c.c_uint64,
                                              c.c_uint64]),
        "gmlake_torch_pool_end": (c.c_int, [c.c_int, c.c_uint64, c.c_uint64]),
        "gmlake_torch_pool_incref": (c.c_int, [c.c_int, c.c_uint64,
                                               c.c_uint64]),
        "gmlake_torch_pool_release": (c.c_int, [c.c_int, c.c_uint64,
                                                c.c_uint64]),
        "gmlake_torch_pool_use_count": (c.c_int, [c.c_int, c.c_uint64,
                                                  c.c_uint64]),
        "gmlake_torch_pool_alloc": (c.c_void_p, [c.c_size_t, c.c_int,
                                                 c.c_void_p, c.c_uint64,
                                                 c.c_uint64]),
        "gmlake_torch_pool_check_live": (c.c_int, [c.c_int, c.c_uint64,
                                                   c.c_uint64,
                                                   c.POINTER(c.c_void_p),
                                                   c.c_size_t]),
        "gmlake_torch_pool_empty": (c.c_int, [c.c_int, c.c_uint64,
                                              c.c_uint64]),
        "gmlake_torch_pool_of": (c.c_int, [c.c_int, c.c_void_p,
                                           c.POINTER(c.c_uint64)]),
        "gmlake_torch_pool_routing": (c.c_bool, [c.c_int]),
        "gmlake_torch_history_start": (c.c_int, [c.c_size_t, c.c_uint32,
                                                 c.c_void_p, c.c_bool]),
        "gmlake_torch_history_stop": (None, [c.c_bool]),
        "gmlake_torch_history_enabled": (c.c_bool, []),
        "gmlake_torch_history_read": (c.c_int, [c.c_int, c.c_void_p,
                                                c.c_size_t]),
        "gmlake_torch_history_mark": (None, [c.c_int]),
        "gmlake_torch_memory_fraction_get": (c.c_int, [
            c.c_int, c.POINTER(c.c_double)]),
        "gmlake_torch_long_lived": (c.c_int, [c.c_int, c.c_int]),
        "gmlake_torch_grow_slack": (c.c_int, [c.c_int, c.c_int]),
        "gmlake_snapshot_take": (c.c_int, [c.c_void_p,
                                           c.POINTER(c.c_void_p)]),
        "gmlake_snapshot_free": (None, [c.c_void_p]),
        "gmlake_cache_info": (c.c_int, [c.c_void_p, c.POINTER(c.c_size_t),
                                        c.POINTER(c.c_size_t)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


_lock = threading.Lock()
_loaded = {}


def load(path=None):
    """(path, ctypes.CDLL) of libgmlake, loaded once per path."""
    found = find_library(path)
    with _lock:
        if found not in _loaded:
            try:
                lib = ctypes.CDLL(found)
            except OSError as e:
                raise LibraryNotFoundError(
                    "libgmlake found at %s but not loadable: %s" %
                    (found, e)) from e
            if not os.environ.get("GMLAKE_SKIP_VERSION_CHECK"):
                check_version(lib, found)
            try:
                _declare(lib)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    "%s is not a libgmlake with the PyTorch entry points "
                    "(%s)" % (found, e)) from e
            _loaded[found] = lib
        return found, _loaded[found]


def last_error(lib):
    msg = lib.gmlake_last_error()
    return msg.decode(errors="replace") if msg else ""


def torch_error(lib):
    """(failures so far, message of the last) of the torch entry points."""
    buf = ctypes.create_string_buffer(1024)
    n = lib.gmlake_torch_error(buf, len(buf))
    return n, buf.value.decode(errors="replace")


# Which libgmlake PyTorch uses, and through what, once gmlake.torch.enable()
# ran. Kept here, below gmlake.torch, gmlake.activations and gmlake.offload,
# so that those need not import each other.
_state_lock = threading.Lock()
_state = {"library": None, "backend": None}


def enabled_library():
    """The path of the libgmlake PyTorch allocates with, or None."""
    return _state["library"]


def enabled_backend():
    """"adapter", "ctypes", or None when gmlake.torch.enable() did not run."""
    return _state["backend"]


def set_enabled(library, backend):
    with _state_lock:
        _state["library"] = library
        _state["backend"] = backend


__all__ = ["LibraryNotFoundError", "LibraryVersionError", "check_version",
           "enabled_backend", "enabled_library", "find_library", "load",
           "set_enabled", "_fields"]
