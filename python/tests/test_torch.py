# SPDX-License-Identifier: MIT
"""Tests of gmlake.torch's parts that need no torch and no GPU.

The key mapping from libgmlake's figures to torch.cuda.memory_stats()'s,
the version check, python -m gmlake.run with a fake script and a fake
torch, the private-pool bookkeeping and snapshots through the C API on
the emulated device (ctypes), the snapshot-to-trace converter, and the
adapter's build logic (fallback to ctypes without a compiler).

Environment (tests/python_test.sh sets it): GMLAKE_LIBRARY,
GMLAKE_BACKEND=emu, top_builddir (for tools/gmlake-replay).
"""

import ctypes
import gzip
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
import types
import unittest
import warnings
from contextlib import redirect_stderr
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
ROOT = os.path.dirname(PYDIR)
sys.path.insert(0, PYDIR)

import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import (_adapter, _fields, _lib, _snapshot, _stats,  # noqa: E402
                    _version, run, snapshot_to_trace)

TORCH_HEADER = os.path.join(ROOT, "include", "gmlake-torch.h")
SNAP_HEADER = os.path.join(ROOT, "include", "gmlake-snapshot.h")
LIBRARY = os.environ.get("GMLAKE_LIBRARY")
HAVE_LIB = bool(LIBRARY) and os.path.exists(LIBRARY)
ON_EMU = os.environ.get("GMLAKE_BACKEND") == "emu"
MiB = 1 << 20

# The memory_stats() keys trainers read (torchtitan, Lightning's
# DeviceStatsMonitor, HF's memory tracker, torch.cuda.memory_summary()).
TORCH_KEYS = [
    "%s.%s.%s" % (s, p, k)
    for s in ("allocation", "segment", "active", "inactive_split",
              "allocated_bytes", "reserved_bytes", "active_bytes",
              "inactive_split_bytes", "requested_bytes")
    for p in ("all", "large_pool", "small_pool")
    for k in ("current", "peak", "allocated", "freed")
] + ["num_alloc_retries", "num_ooms", "num_sync_all_streams",
     "num_device_alloc", "num_device_free", "max_split_size"]


def xmacro(text, name):
    m = re.search(r"#define %s\(X\)(.*?)(?<!\\)\n" % name, text, re.S)
    if not m:
        raise AssertionError("%s not found in the header" % name)
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return tuple(re.findall(r"\bX\((\w+)\)", body))


class TestTorchFields(unittest.TestCase):
    """_fields.TORCH_* and the ctypes structs against the headers."""

    @classmethod
    def setUpClass(cls):
        with open(TORCH_HEADER) as f:
            cls.text = f.read()

    def test_stats(self):
        self.assertEqual(xmacro(self.text, "GMLAKE_TORCH_FOREACH_STAT"),
                         _fields.TORCH_STATS)

    def test_counts(self):
        self.assertEqual(xmacro(self.text, "GMLAKE_TORCH_FOREACH_COUNT"),
                         _fields.TORCH_COUNTS)

    def test_version_and_reserved(self):
        m = re.search(r"#define GMLAKE_TORCH_STATS_VERSION (\d+)", self.text)
        self.assertEqual(int(m.group(1)), _fields.TORCH_STATS_VERSION)
        m = re.search(r"struct gmlake_torch_stats \{.*?uint64_t "
                      r"reserved\[(\d+)\];", self.text, re.S)
        self.assertEqual(int(m.group(1)), _fields.TORCH_RESERVED_WORDS)

    def test_actions(self):
        body = self.text[self.text.index("enum gmlake_torch_action"):]
        body = body[:body.index("};")]
        names = re.findall(r"GMLAKE_TORCH_(\w+) = (\d+)", body)
        self.assertEqual([n.lower() for n, _ in names],
                         list(_fields.TORCH_ACTIONS))
        self.assertEqual([int(v) for _, v in names],
                         list(range(len(_fields.TORCH_ACTIONS))))

    def test_sizes(self):
        # Fields of 8 bytes, in the headers' order (LP64).
        self.assertEqual(ctypes.sizeof(_stats.TorchStats),
                         8 + 32 * len(_fields.TORCH_STATS) +
                         8 * len(_fields.TORCH_COUNTS) +
                         8 * _fields.TORCH_RESERVED_WORDS)
        self.assertEqual(ctypes.sizeof(_snapshot.SnapRange), 40)
        self.assertEqual(ctypes.sizeof(_snapshot.SnapPiece), 40)
        self.assertEqual(ctypes.sizeof(_snapshot.Snapshot), 48)
        self.assertEqual(ctypes.sizeof(_snapshot.TorchEvent), 64)
        with open(SNAP_HEADER) as f:
            snap = f.read()
        m = re.search(r"#define GMLAKE_SNAPSHOT_VERSION (\d+)", snap)
        self.assertEqual(int(m.group(1)), _snapshot.SNAPSHOT_VERSION)

    def test_key_mapping(self):
        st = _stats.TorchStats()
        for i, name in enumerate(_fields.TORCH_STATS):
            s = getattr(st, name)
            s.current, s.peak = 10 * i + 1, 10 * i + 5
            s.allocated, s.freed = 10 * i + 7, 10 * i + 6
        st.num_ooms, st.num_device_alloc = 3, 17
        d = _stats.torch_dict(st)
        for key in TORCH_KEYS:
            self.assertIn(key, d)
        self.assertEqual(d["allocated_bytes.all.current"],
                         st.allocated_bytes.current)
        self.assertEqual(d["reserved_bytes.all.peak"], st.reserved_bytes.peak)
        self.assertEqual(d["requested_bytes.all.freed"],
                         st.requested_bytes.freed)
        self.assertEqual(d["allocated_bytes.large_pool.current"], 0)
        self.assertEqual(d["num_ooms"], 3)
        self.assertEqual(d["num_device_alloc"], 17)


class FakeLib:
    """Just the version functions of a libgmlake."""

    def __init__(self, major, minor):
        self.gmlake_version_major = lambda: major
        self.gmlake_version_minor = lambda: minor
        for f in (self.gmlake_version_major, self.gmlake_version_minor):
            f.restype = None


class TestVersion(unittest.TestCase):

    def test_package_version(self):
        with open(os.path.join(ROOT, "VERSION")) as f:
            self.assertEqual(gmlake.__version__, f.read().strip())
        self.assertIn("2.11", gmlake.SUPPORTED_TORCH)

    def test_match(self):
        self.assertEqual(_lib.check_version(FakeLib(3, 4), "x", "3.4.1"),
                         (3, 4))

    def test_mismatch(self):
        for major, minor in ((0, 9), (1, 1)):
            with self.assertRaises(gmlake.LibraryVersionError) as cm:
                _lib.check_version(FakeLib(major, minor), "/x/libgmlake.so",
                                   "1.2.0")
            msg = str(cm.exception)
            self.assertIn("/x/libgmlake.so is libgmlake %d.%d" %
                          (major, minor), msg)
            self.assertIn("package is 1.2.0", msg)
            self.assertIsInstance(cm.exception, gmlake.LibraryNotFoundError)

    @unittest.skipUnless(HAVE_LIB, "GMLAKE_LIBRARY not set")
    def test_loaded_library(self):
        _, lib = gmlake.load()
        want = tuple(int(x) for x in gmlake.__version__.split(".")[:2])
        self.assertEqual((lib.gmlake_version_major(),
                          lib.gmlake_version_minor()), want)


def fake_torch_dir(tmp, initialized=False, cpp_extension=False):
    """A package 'torch' on disk: enough for gmlake.torch.enable()."""
    pkg = os.path.join(tmp, "torch")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(textwrap.dedent('''
            import types
            __version__ = "2.11.0+fake"
            version = types.SimpleNamespace(cuda="13.0")
            log = []

            class _Raw:
                def __getattr__(self, name):
                    if not name.startswith("set_"):
                        raise AttributeError(name)
                    return lambda ptr: log.append((name, ptr))

            class CUDAPluggableAllocator:
                def __init__(self, path, alloc, free):
                    log.append(("pluggable", path, alloc, free))
                    self.raw = _Raw()
                def allocator(self):
                    return self.raw

            def change_current_allocator(a):
                log.append(("change",))

            cuda = types.SimpleNamespace(
                is_initialized=lambda: %r, device_count=lambda: 1,
                memory=types.SimpleNamespace(
                    CUDAPluggableAllocator=CUDAPluggableAllocator,
                    change_current_allocator=change_current_allocator))
            ''' % initialized))
    return tmp


class TestRun(unittest.TestCase):
    """python -m gmlake.run SCRIPT ARGS: enable, then the script as
    __main__ with its own argv."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.out = os.path.join(self.tmp, "out.txt")
        self.script = os.path.join(self.tmp, "train.py")
        with open(self.script, "w") as f:
            f.write(textwrap.dedent('''
                import sys, gmlake.torch
                with open(%r, "w") as f:
                    f.write(repr((__name__, sys.argv,
                                  gmlake.torch.backend(),
                                  sys.path[0])))
                ''' % self.out))

    def result(self):
        with open(self.out) as f:
            return eval(f.read())

    def test_parse(self):
        opts, script, args = run.parse(["--backend=ctypes", "t.py", "--lr",
                                        "3", "--backend", "x"])
        self.assertEqual(opts["backend"], "ctypes")
        self.assertEqual((script, args), ("t.py", ["--lr", "3", "--backend",
                                                   "x"]))
        opts, script, args = run.parse(["-m", "pkg.mod", "a"])
        self.assertEqual((opts["module"], script, args), ("pkg.mod", None,
                                                          ["a"]))
        for bad in ([], ["--library"], ["--what", "t.py"],
                    ["--backend", "cuda", "t.py"]):
            with self.assertRaises(run.UsageError):
                run.parse(bad)

    def test_in_process(self):
        calls = []

        def enable(library=None, backend=None):
            calls.append((library, backend))
            _lib.set_enabled("/fake/libgmlake.so", "adapter")
        saved = list(sys.argv), list(sys.path)
        try:
            with mock.patch.object(gmlake.torch, "enable", enable):
                rc = run.main(["--library", "/fake", self.script, "a", "-b"])
        finally:
            sys.argv[:], sys.path[:] = saved
            _lib.set_enabled(None, None)
        self.assertEqual(rc, 0)
        self.assertEqual(calls, [("/fake", None)])
        name, argv, backend, path0 = self.result()
        self.assertEqual((name, argv, backend),
                         ("__main__", [self.script, "a", "-b"], "adapter"))
        self.assertEqual(path0, self.tmp)

    def test_missing_script(self):
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(run.main([os.path.join(self.tmp, "no.py")]), 2)
        self.assertIn("no such file", err.getvalue())

    @unittest.skipUnless(HAVE_LIB, "GMLAKE_LIBRARY not set")
    def test_subprocess_fake_torch(self):
        """The real command line, with a fake torch: the ctypes backend."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([fake_torch_dir(self.tmp),
                                             PYDIR])
        env["GMLAKE_TORCH_BACKEND"] = "ctypes"
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        p = subprocess.run([sys.executable, "-m", "gmlake.run", self.script,
                            "x", "--y=1"], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        name, argv, backend, _ = self.result()
        self.assertEqual((name, argv, backend),
                         ("__main__", [self.script, "x", "--y=1"], "ctypes"))

    @unittest.skipUnless(HAVE_LIB, "GMLAKE_LIBRARY not set")
    def test_subprocess_auto_falls_back(self):
        """No torch.utils.cpp_extension: a warning, then ctypes."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([fake_torch_dir(self.tmp),
                                             PYDIR])
        env.pop("GMLAKE_TORCH_BACKEND", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["GMLAKE_CACHE_DIR"] = os.path.join(self.tmp, "cache")
        p = subprocess.run([sys.executable, "-m", "gmlake.run", self.script],
                           env=env, capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("adapter is not available", p.stderr)
        self.assertIn("cpp_extension", p.stderr)
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", p.stderr)
        self.assertEqual(self.result()[2], "ctypes")


class TestAdapterBuild(unittest.TestCase):
    """gmlake._adapter: headers, cache folder, digest, refusal reasons."""

    def test_include_dir(self):
        inc = _adapter.include_dir()
        for h in _adapter.HEADERS:
            self.assertTrue(os.path.isfile(os.path.join(inc, h)))
        with mock.patch.dict(os.environ, {_adapter.INCLUDE_ENV: "/nowhere"}):
            self.assertEqual(_adapter.include_dir(), inc)  # falls through

    def test_cache_root(self):
        with mock.patch.dict(os.environ, {_adapter.CACHE_ENV: "/c"}):
            self.assertEqual(_adapter.cache_root(), "/c")
        env = {"TORCH_EXTENSIONS_DIR": "/t"}
        with mock.patch.dict(os.environ, env):
            os.environ.pop(_adapter.CACHE_ENV, None)
            self.assertEqual(_adapter.cache_root(), "/t/gmlake")

    def test_digest(self):
        inc = _adapter.include_dir()
        a = _adapter.digest(inc, "2.11.0", "13.0")
        self.assertEqual(a, _adapter.digest(inc, "2.11.0", "13.0"))
        self.assertNotEqual(a, _adapter.digest(inc, "2.11.1", "13.0"))
        self.assertNotEqual(a, _adapter.digest(inc, "2.11.0", "12.8"))

    def test_source_ships(self):
        self.assertTrue(os.path.isfile(_adapter.SOURCE))
        with open(_adapter.SOURCE) as f:
            src = f.read()
        # Every C function it takes by name is exported by the library.
        names = re.findall(r"^\s*X\((gmlake_\w+)\)", src, re.M)
        self.assertGreater(len(names), 20)
        with open(os.path.join(ROOT, "lib", "libgmlake.map")) as f:
            exported = set(re.findall(r"^\s*(gmlake_\w+);", f.read(), re.M))
        self.assertEqual(sorted(set(names) - exported), [])

    def test_no_cuda_torch(self):
        torch = types.SimpleNamespace(__version__="2.11.0+cpu",
                                      version=types.SimpleNamespace(
                                          cuda=None))
        with self.assertRaises(_adapter.AdapterUnavailable) as cm:
            _adapter.load(torch)
        self.assertIn("without CUDA", str(cm.exception))

    def test_no_ninja(self):
        ext = types.SimpleNamespace(is_ninja_available=lambda: False,
                                    CUDA_HOME="/usr/local/cuda")
        with self.assertRaises(_adapter.AdapterUnavailable) as cm:
            _adapter._check_tools(ext)
        self.assertIn("ninja", str(cm.exception))

    def test_cached_build_is_imported(self):
        torch = types.SimpleNamespace(__version__="2.11.0",
                                      version=types.SimpleNamespace(
                                          cuda="13.0"))
        with tempfile.TemporaryDirectory() as tmp:
            name = "gmlake_adapter_" + _adapter.digest(
                _adapter.include_dir(), "2.11.0", "13.0")
            os.makedirs(os.path.join(tmp, name))
            so = os.path.join(tmp, name, name + ".so")
            open(so, "w").close()
            with mock.patch.dict(os.environ, {_adapter.CACHE_ENV: tmp}), \
                    mock.patch.object(_adapter, "_import",
                                      return_value="module") as imp:
                self.assertEqual(_adapter.load(torch), "module")
            imp.assert_called_once_with(name, so)


@unittest.skipUnless(HAVE_LIB and ON_EMU, "needs GMLAKE_LIBRARY and "
                     "GMLAKE_BACKEND=emu")
class TestEmuTorch(unittest.TestCase):
    """The C entry points through ctypes on the emulated device."""

    DEVICE = 5

    @classmethod
    def setUpClass(cls):
        cls.path, cls.lib = gmlake.load()
        lib = cls.lib
        for name in ("gmlake_memcpy_htod", "gmlake_memcpy_dtoh"):
            f = getattr(lib, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_size_t, ctypes.c_void_p]

    def alloc(self, size):
        p = self.lib.gmlake_torch_alloc(size, self.DEVICE, None)
        self.assertTrue(p, _lib.last_error(self.lib))
        return p

    def free(self, p, size=0):
        self.lib.gmlake_torch_free(p, size, self.DEVICE, None)

    def ctx(self):
        ctx = ctypes.c_void_p()
        self.assertEqual(self.lib.gmlake_torch_ctx_get(self.DEVICE,
                                                       ctypes.byref(ctx)), 0)
        return ctx

    def fill(self, p, size, byte):
        buf = (ctypes.c_uint8 * size)()
        ctypes.memset(buf, byte, size)
        self.assertEqual(self.lib.gmlake_memcpy_htod(self.ctx(), p, buf,
                                                     size, None), 0)

    def read(self, p, size):
        buf = (ctypes.c_uint8 * size)()
        self.assertEqual(self.lib.gmlake_memcpy_dtoh(self.ctx(), buf, p,
                                                     size, None), 0)
        return bytes(buf)

    def test_long_lived(self):
        """gmlake.torch.long_lived(): inside, a large block that grows is
        one handle (one map); it nests; outside, chunks again; off
        without on is refused."""
        MiB = 1 << 20
        maps = _fields.CALLS.index("mem_map")

        def mapped(size):
            before = _stats.raw_stats(self.DEVICE, self.path).calls[maps]
            p = self.alloc(size)
            self.fill(p, size, 7)
            n = _stats.raw_stats(self.DEVICE, self.path).calls[maps] - before
            self.assertEqual(self.read(p, size)[-3:], b"\x07" * 3)
            self.free(p)
            return n
        self.lib.gmlake_torch_empty_cache()
        keep = self.alloc(2 * MiB)      # a segment to grow
        got = []
        try:
            with gmlake.torch.long_lived(self.DEVICE, self.path):
                with gmlake.torch.long_lived(self.DEVICE, self.path):
                    got.append(mapped(32 * MiB))
                got.append(mapped(32 * MiB))
            got.append(mapped(32 * MiB))
        finally:
            self.free(keep)
        self.assertEqual(got[:2], [1, 1])
        self.assertGreater(got[2], 1)
        self.assertLess(self.lib.gmlake_torch_long_lived(self.DEVICE, 0), 0)
        self.assertIn("off without", _lib.last_error(self.lib))
        # Without libgmlake as PyTorch's allocator it does nothing.
        with mock.patch.object(_lib, "enabled_library", return_value=None):
            with gmlake.torch.long_lived(self.DEVICE):
                pass

    def test_grow_slack(self):
        """gmlake.torch.grow_slack() sets and reads the context's growth
        budget and refuses one out of range; offload_activations' memory
        first lowers it to 5 once, but not under GMLAKE_GROW_SLACK or
        below a lower budget."""
        from gmlake import activations
        gs = gmlake.torch.grow_slack
        was = gs(None, self.DEVICE, self.path)
        try:
            self.assertEqual(gs(7, self.DEVICE, self.path), was)
            self.assertEqual(gs(None, self.DEVICE, self.path), 7)
            with self.assertRaisesRegex(ValueError, "per mille"):
                gs(1001, self.DEVICE, self.path)
            self.assertEqual(gs(None, self.DEVICE, self.path), 7)

            fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
                current_device=lambda: self.DEVICE))

            def memory_first(budget, env=None):
                """The budget after _memory_first from budget, on a device
                not seen yet, GMLAKE_GROW_SLACK only as env says."""
                gs(budget, self.DEVICE, self.path)
                activations._budget_lowered.discard(self.DEVICE)
                environ = {k: v for k, v in os.environ.items()
                           if k != "GMLAKE_GROW_SLACK"}
                environ.update(env or {})
                with mock.patch.dict(sys.modules, {"torch": fake}), \
                        mock.patch.object(_lib, "enabled_library",
                                          return_value=self.path), \
                        mock.patch.dict(os.environ, environ, clear=True):
                    activations._memory_first()
                return gs(None, self.DEVICE, self.path)
            self.assertEqual(memory_first(20),
                             activations.OFFLOAD_GROW_SLACK)
            # Once a device: a budget set since stays.
            gs(30, self.DEVICE, self.path)
            with mock.patch.dict(sys.modules, {"torch": fake}), \
                    mock.patch.object(_lib, "enabled_library",
                                      return_value=self.path):
                activations._memory_first()
            self.assertEqual(gs(None, self.DEVICE, self.path), 30)
            self.assertEqual(memory_first(20, {"GMLAKE_GROW_SLACK": "20"}),
                             20)
            self.assertEqual(memory_first(2), 2)
            # Without libgmlake as PyTorch's allocator: nothing to set.
            with mock.patch.object(_lib, "enabled_library",
                                   return_value=None):
                self.assertIsNone(gs(5, self.DEVICE))
                activations._memory_first()
        finally:
            activations._budget_lowered.discard(self.DEVICE)
            gs(was, self.DEVICE, self.path)

    def test_torch_stats_match_gmlake(self):
        before = gmlake.torch.memory_stats(self.DEVICE, self.path)
        a, b = self.alloc(6 * MiB), self.alloc(2000)
        d = gmlake.torch.memory_stats(self.DEVICE, self.path)
        g = gmlake.stats(self.DEVICE)
        for key in TORCH_KEYS:
            self.assertIn(key, d)
        self.assertEqual(d["allocated_bytes.all.current"],
                         g["allocated_bytes.current"])
        self.assertEqual(d["reserved_bytes.all.current"],
                         g["reserved_bytes.current"])
        self.assertEqual(d["requested_bytes.all.current"] -
                         before["requested_bytes.all.current"],
                         6 * MiB + 2000)
        self.assertEqual(d["allocation.all.current"],
                         g["active_blocks.current"])
        self.assertEqual(d["num_device_alloc"], g["calls.mem_create"])
        self.free(b, 2000)
        self.assertEqual(self.lib.gmlake_torch_stats_reset_peaks(
            self.DEVICE), 0)
        d = gmlake.torch.memory_stats(self.DEVICE, self.path)
        self.assertEqual(d["allocated_bytes.all.peak"],
                         d["allocated_bytes.all.current"])
        self.assertEqual(self.lib.gmlake_torch_stats_reset_accumulated(
            self.DEVICE), 0)
        d = gmlake.torch.memory_stats(self.DEVICE, self.path)
        self.assertEqual(d["allocation.all.allocated"], 0)
        self.free(a, 6 * MiB)
        d = gmlake.torch.memory_stats(self.DEVICE, self.path)
        self.assertEqual(d["allocation.all.freed"], 1)
        self.assertEqual(d["allocated_bytes.all.current"],
                         before["allocated_bytes.all.current"])

    def test_graph_pool_corruption(self):
        """Freed inside a capture, allocated outside afterwards, the
        graph's block "replayed" (written again): nothing outside
        changes, and the pool's next capture gets its block back."""
        lib, dev, size = self.lib, self.DEVICE, 4 * MiB
        pool = (11, 0)
        self.assertEqual(lib.gmlake_torch_pool_begin(dev, *pool), 0)
        inside = lib.gmlake_torch_pool_alloc(size, dev, None, *pool)
        self.assertTrue(inside)
        self.fill(inside, size, 0x11)
        self.free(inside, size)                 # freed during capture
        self.assertEqual(lib.gmlake_torch_pool_end(dev, *pool), 0)
        outside = [self.alloc(size) for _ in range(3)]
        for i, p in enumerate(outside):
            self.assertFalse(p <= inside < p + size or
                             inside <= p < inside + size)
            self.fill(p, size, 0x40 + i)
        self.fill(inside, size, 0x22)           # the replay writes it
        for i, p in enumerate(outside):
            self.assertEqual(self.read(p, size), bytes([0x40 + i]) * size)
        # Checks as torch.compile's graph trees make them.
        live = (ctypes.c_void_p * 1)()
        self.assertEqual(lib.gmlake_torch_pool_check_live(dev, *pool, live,
                                                          0), 1)
        self.assertEqual(lib.gmlake_torch_pool_begin(dev, *pool), 0)
        again = lib.gmlake_torch_pool_alloc(size, dev, None, *pool)
        self.assertEqual(again, inside)
        live[0] = again
        self.assertEqual(lib.gmlake_torch_pool_check_live(dev, *pool, live,
                                                          1), 1)
        self.free(again, size)
        self.assertEqual(lib.gmlake_torch_pool_end(dev, *pool), 0)
        self.assertEqual(lib.gmlake_torch_pool_release(dev, *pool), 1)
        self.assertEqual(lib.gmlake_torch_pool_release(dev, *pool), 0)
        self.assertEqual(lib.gmlake_torch_pool_use_count(dev, *pool), 0)
        for p in outside:
            self.free(p, size)
        self.assertEqual(gmlake.stats(dev)["active_blocks.current"], 0)

    def test_history_stop_drops_the_trace(self):
        # As PyTorch's _record_memory_history(enabled=None): a recording
        # started after a stop holds only its own events, whatever the
        # first one recorded (a process tracing one workload after another).
        self.lib.gmlake_torch_empty_cache()
        _snapshot.record_memory_history(True, 1000, clear=True,
                                        library=self.path)
        first = self.alloc(3 * MiB)
        _snapshot.record_memory_history(False, library=self.path)
        try:
            _snapshot.record_memory_history(True, 1000, library=self.path)
            second = self.alloc(5 * MiB)
            trace = gmlake.memory_snapshot()["device_traces"][self.DEVICE]
        finally:
            _snapshot.record_memory_history(False, library=self.path)
        self.assertEqual([e["addr"] for e in trace if e["action"] == "alloc"],
                         [second])
        stopped = gmlake.memory_snapshot()["device_traces"][self.DEVICE]
        self.assertEqual(stopped, [])
        self.free(first, 3 * MiB)
        self.free(second, 5 * MiB)

    def test_snapshot_and_history(self):
        # Memory other tests left cached would serve these allocations.
        self.lib.gmlake_torch_empty_cache()
        _snapshot.record_memory_history(True, 1000, clear=True,
                                        library=self.path)
        try:
            blocks = [self.alloc(s) for s in (5 * MiB, 700, 3 * MiB, 9000)]
            self.free(blocks[2], 3 * MiB)
            snap = gmlake.memory_snapshot()
        finally:
            _snapshot.record_memory_history(False, library=self.path)
        segs = [s for s in snap["segments"] if s["device"] == self.DEVICE]
        self.assertTrue(segs)
        requested = 0
        for seg in segs:
            addr = seg["address"]
            for b in seg["blocks"]:
                self.assertEqual(b["address"], addr)
                addr += b["size"]
                self.assertIn(b["state"], ("active_allocated", "inactive",
                                           "active_pending_free"))
                if b["state"] == "active_allocated":
                    requested += b["requested_size"]
            self.assertEqual(addr, seg["address"] + seg["total_size"])
        self.assertEqual(requested, 5 * MiB + 700 + 9000)
        trace = snap["device_traces"][self.DEVICE]
        actions = [e["action"] for e in trace]
        self.assertEqual(actions.count("alloc"), 4)
        self.assertEqual(actions.count("free_completed"), 1)
        # New memory comes as a segment or as a segment's growth.
        self.assertTrue({"segment_alloc", "segment_map"} & set(actions),
                        actions)
        allocs = [e for e in trace if e["action"] == "alloc"]
        self.assertEqual([e["addr"] for e in allocs], blocks)
        self.assertEqual(allocs[1]["size"], 700)

        # The converter writes what gmlake-replay reads.
        with tempfile.TemporaryDirectory() as tmp:
            pick = os.path.join(tmp, "s.pickle")
            with open(pick, "wb") as f:
                pickle.dump(snap, f)
            out = os.path.join(tmp, "s.trace.gz")
            err = io.StringIO()
            with redirect_stderr(err):
                rc = snapshot_to_trace.main([pick, out, "--device",
                                             str(self.DEVICE), "--workload",
                                             "emu", "--steps", "1"])
            self.assertEqual(rc, 0, err.getvalue())
            with gzip.open(out, "rt") as f:
                lines = f.read().splitlines()
            self.assertTrue(lines[0].startswith("# pytorch snapshot "
                                                "workload=emu steps=1 "))
            events = [ln.split() for ln in lines if not ln.startswith("#")]
            self.assertEqual([e[0] for e in events if e[0] == "alloc"],
                             ["alloc"] * 4)
            self.assertTrue(all(len(e) == 4 and e[1].isdigit()
                                for e in events))
            replay = os.path.join(os.environ.get("top_builddir", ROOT),
                                  "tools", "gmlake-replay")
            if os.access(replay, os.X_OK):
                p = subprocess.run([replay, out], capture_output=True,
                                   text=True, timeout=120)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for b in (blocks[0], blocks[1], blocks[3]):
            self.free(b)

    def test_cache_info(self):
        p = self.alloc(8 * MiB)
        self.free(p, 8 * MiB)
        largest = ctypes.c_size_t()
        self.assertEqual(self.lib.gmlake_torch_cache_info(
            self.DEVICE, ctypes.byref(largest)), 0)
        self.assertGreaterEqual(largest.value, 8 * MiB)
        self.lib.gmlake_torch_empty_cache()


class TestConverter(unittest.TestCase):
    """snapshot_to_trace on a hand-made trace."""

    def test_convert(self):
        trace = [
            {"action": "free_completed", "addr": 99, "size": 8, "stream": 0},
            {"action": "segment_alloc", "addr": 4096, "size": 8192,
             "stream": 7},
            {"action": "alloc", "addr": 4096, "size": 100, "stream": 7},
            {"action": "alloc", "addr": 4608, "size": 200, "stream": 7},
            {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
            {"action": "free_requested", "addr": 4096, "size": 100,
             "stream": 7},
            {"action": "free_completed", "addr": 4096, "size": 100,
             "stream": 7},
            {"action": "oom", "addr": 5, "size": 1 << 40, "stream": 0},
            {"action": "segment_free", "addr": 4096, "size": 8192,
             "stream": 7},
        ]
        ev, peak_alloc, peak_reserved = snapshot_to_trace.convert(trace)
        self.assertEqual([e[0] for e in ev],
                         ["segment_alloc", "alloc", "alloc",
                          "free_requested", "free_completed",
                          "segment_free"])
        self.assertEqual((peak_alloc, peak_reserved), (300, 8192))
        ev, _, _ = snapshot_to_trace.convert(trace, keep_unmatched=True)
        self.assertEqual(ev[0], ("free_completed", 99, 8, 0))

    def test_not_a_snapshot(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "x.pickle")
            with open(bad, "wb") as f:
                pickle.dump([1, 2], f)
            err = io.StringIO()
            with redirect_stderr(err):
                rc = snapshot_to_trace.main([bad, os.path.join(tmp, "o")])
        self.assertEqual(rc, 1)
        self.assertIn("_record_memory_history", err.getvalue())


class TestEnableWarns(unittest.TestCase):

    def test_alloc_conf(self):
        with mock.patch.dict(os.environ,
                             {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:"
                              "128"}):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                gmlake.torch._warn_alloc_conf()
        self.assertEqual(len(w), 1)
        self.assertIn("does not apply under libgmlake", str(w[0].message))

    def test_supported(self):
        ok = types.SimpleNamespace(__version__="2.11.0+cu130")
        old = types.SimpleNamespace(__version__="2.10.1")
        self.assertTrue(gmlake.torch._torch_supported(ok))
        self.assertFalse(gmlake.torch._torch_supported(old))

    def test_bad_backend(self):
        torch = types.ModuleType("torch")
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(ValueError):
                gmlake.torch.enable(backend="cuda")

    def test_optimizer_state_mode(self):
        mode = gmlake.torch._optimizer_state_mode
        env = gmlake.torch.SETTLE_ENV
        for value, want in ((None, "place"), ("place", "place"),
                            (True, "copy"), (False, None)):
            with mock.patch.dict(os.environ, {}, clear=False):
                os.environ.pop(env, None)
                self.assertEqual(mode(value), want)
        for text, want in (("", "place"), ("place", "place"), ("1", "copy"),
                           ("0", None), (" 1 ", "copy")):
            with mock.patch.dict(os.environ, {env: text}):
                self.assertEqual(mode(None), want)
                self.assertEqual(mode(False), None)     # the argument wins
        with mock.patch.dict(os.environ, {env: "yes"}):
            with self.assertRaisesRegex(ValueError, env + ".*'yes'"):
                mode(None)
        for bad in (1, "copy", "on"):
            with self.assertRaisesRegex(ValueError, "optimizer_state"):
                mode(bad)

    def test_bad_optimizer_state_env(self):
        torch = types.ModuleType("torch")
        with mock.patch.dict(sys.modules, {"torch": torch}), \
                mock.patch.dict(os.environ,
                                {gmlake.torch.SETTLE_ENV: "true"}):
            with self.assertRaisesRegex(ValueError, "SETTLE_OPTIMIZER"):
                gmlake.torch.enable()


if __name__ == "__main__":
    unittest.main()
