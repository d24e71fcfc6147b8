# SPDX-License-Identifier: MIT
"""Tests of the gmlake Python package; no torch needed (a fake one is used).

Environment (tests/python_test.sh sets it): GMLAKE_LIBRARY, the libgmlake
under test; GMLAKE_BACKEND=emu; GMLAKE_STATS_LAYOUT, the stats_layout
program. Parts whose input is missing are skipped.
"""

import ctypes
import os
import re
import subprocess
import sys
import types
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import _fields, _lib, _stats  # noqa: E402

HEADER = os.path.join(HERE, "..", "..", "include", "gmlake-stats.h")
LIBRARY = os.environ.get("GMLAKE_LIBRARY")
HAVE_LIB = bool(LIBRARY) and os.path.exists(LIBRARY)
MiB = 1 << 20


def xmacro(text, name):
    """The X(...) entries of '#define NAME(X)' in a header."""
    m = re.search(r"#define %s\(X\)(.*?)(?<!\\)\n" % name, text, re.S)
    if not m:
        raise AssertionError("%s not found in the header" % name)
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return tuple(re.findall(r"\bX\((\w+)\)", body))


class TestFields(unittest.TestCase):
    """python/gmlake/_fields.py against include/gmlake-stats.h."""

    @classmethod
    def setUpClass(cls):
        with open(HEADER) as f:
            cls.text = f.read()

    def test_gauges(self):
        self.assertEqual(xmacro(self.text, "GMLAKE_FOREACH_GAUGE"),
                         _fields.GAUGES)

    def test_counters(self):
        self.assertEqual(xmacro(self.text, "GMLAKE_FOREACH_COUNTER"),
                         _fields.COUNTERS)

    def test_calls(self):
        self.assertEqual(xmacro(self.text, "GMLAKE_FOREACH_CALL"),
                         _fields.CALLS)

    def test_version(self):
        m = re.search(r"#define GMLAKE_STATS_VERSION (\d+)", self.text)
        self.assertEqual(int(m.group(1)), _fields.STATS_VERSION)

    def test_reserved(self):
        m = re.search(r"uint64_t reserved\[(\d+)\];", self.text)
        self.assertEqual(int(m.group(1)), _fields.RESERVED_WORDS)

    def test_parser_sees_drift(self):
        drifted = self.text.replace("X(chunks)", "X(chunks)\t\t\\\n\tX(x)")
        self.assertNotEqual(xmacro(drifted, "GMLAKE_FOREACH_GAUGE"),
                            _fields.GAUGES)


class TestLayout(unittest.TestCase):
    """The ctypes struct against the C compiler's (tests/stats_layout)."""

    def test_layout(self):
        prog = os.environ.get("GMLAKE_STATS_LAYOUT")
        if not prog or not os.path.exists(prog):
            self.skipTest("GMLAKE_STATS_LAYOUT not built")
        out = subprocess.run([prog], capture_output=True, text=True,
                             check=True).stdout.split("\n")
        c = {}
        for line in out:
            parts = line.split()
            if len(parts) == 3:
                c[parts[0]] = (int(parts[1]), int(parts[2]))
            elif len(parts) == 2:
                c[parts[0]] = int(parts[1])
        self.assertEqual(c["stats_version"], _fields.STATS_VERSION)
        self.assertEqual(c["sizeof"], ctypes.sizeof(gmlake.Stats))
        names = [f[0] for f in gmlake.Stats._fields_]
        self.assertEqual(sorted(names), sorted(
            k for k in c if k not in ("stats_version", "sizeof")))
        for name in names:
            field = getattr(gmlake.Stats, name)
            self.assertEqual((field.offset, field.size), c[name], name)


class TestDiscovery(unittest.TestCase):

    def test_env_file(self):
        if not HAVE_LIB:
            self.skipTest("GMLAKE_LIBRARY not set")
        self.assertEqual(gmlake.find_library(),
                         os.path.abspath(LIBRARY))

    def test_env_folder(self):
        if not HAVE_LIB:
            self.skipTest("GMLAKE_LIBRARY not set")
        folder = os.path.dirname(os.path.abspath(LIBRARY))
        with mock.patch.dict(os.environ, {"GMLAKE_LIBRARY": folder}):
            found = gmlake.find_library()
        self.assertEqual(os.path.dirname(found), folder)
        self.assertIn(os.path.basename(found), _lib.NAMES)

    def test_env_wrong(self):
        with mock.patch.dict(os.environ,
                             {"GMLAKE_LIBRARY": "/nonexistent/libgmlake.so"}):
            with self.assertRaises(gmlake.LibraryNotFoundError) as cm:
                gmlake.find_library()
        self.assertIn("GMLAKE_LIBRARY=/nonexistent/libgmlake.so",
                      str(cm.exception))
        self.assertIn("no such file", str(cm.exception))

    def test_nothing_found_lists_places(self):
        env = dict(os.environ)
        env.pop("GMLAKE_LIBRARY", None)
        with mock.patch.dict(os.environ, env, clear=True), \
                mock.patch.object(_lib, "_installed_libdir",
                                  return_value="/nowhere/lib"), \
                mock.patch.object(_lib, "_pkg_config_libdir",
                                  return_value=(None,
                                                "pkg-config knows no gmlake")), \
                mock.patch("ctypes.util.find_library", return_value=None):
            with self.assertRaises(gmlake.LibraryNotFoundError) as cm:
                gmlake.find_library()
        msg = str(cm.exception)
        for part in ("GMLAKE_LIBRARY: not set", "/nowhere/lib",
                     "pkg-config knows no gmlake",
                     'find_library("gmlake")', "make install"):
            self.assertIn(part, msg)

    def test_not_a_library(self):
        with mock.patch.dict(os.environ, {"GMLAKE_LIBRARY": HEADER}):
            with self.assertRaises(gmlake.LibraryNotFoundError) as cm:
                gmlake.load()
        self.assertIn("not loadable", str(cm.exception))


@unittest.skipUnless(HAVE_LIB, "GMLAKE_LIBRARY not set")
class TestEmu(unittest.TestCase):
    """Stats through the torch entry points on the emulated device."""

    DEVICE = 2

    @classmethod
    def setUpClass(cls):
        if os.environ.get("GMLAKE_BACKEND") != "emu":
            raise unittest.SkipTest("needs GMLAKE_BACKEND=emu")
        os.environ.setdefault("GMLAKE_EMU_CAPACITY", "512M")
        cls.path, cls.lib = gmlake.load()

    def test_stats_change(self):
        lib, dev = self.lib, self.DEVICE
        p = lib.gmlake_torch_alloc(8 * MiB, dev, None)
        self.assertTrue(p, _lib.last_error(lib))
        before = gmlake.stats(dev)
        q = lib.gmlake_torch_alloc(4 * MiB, dev, None)
        self.assertTrue(q)
        after = gmlake.stats(dev)
        self.assertEqual(after["allocs"], before["allocs"] + 1)
        self.assertGreaterEqual(after["allocated_bytes.current"],
                                before["allocated_bytes.current"] + 4 * MiB)
        self.assertGreaterEqual(after["reserved_bytes.current"], 12 * MiB)
        self.assertGreaterEqual(after["calls.mem_create"], 1)
        lib.gmlake_torch_free(q, 4 * MiB, dev, None)
        lib.gmlake_torch_free(p, 8 * MiB, dev, None)
        st = gmlake.stats(dev)
        self.assertEqual(st["allocated_bytes.current"], 0)
        self.assertGreaterEqual(st["allocated_bytes.peak"], 12 * MiB)
        gmlake.reset_peak_stats(dev)
        self.assertEqual(gmlake.stats(dev)["allocated_bytes.peak"], 0)
        lib.gmlake_torch_empty_cache()
        self.assertEqual(gmlake.stats(dev)["reserved_bytes.current"], 0)

    def test_summary(self):
        p = self.lib.gmlake_torch_alloc(3 * MiB, self.DEVICE, None)
        text = gmlake.memory_summary(self.DEVICE)
        self.lib.gmlake_torch_free(p, 3 * MiB, self.DEVICE, None)
        self.assertIn("libgmlake memory summary, device 2", text)
        self.assertIn("Allocated memory", text)
        # Allocated: the bytes handed out (3 MiB); reserved: two chunks.
        self.assertRegex(text, r"Allocated, on the device +\| +3\.00 MiB")
        self.assertRegex(text, r"Reserved memory \(chunks\) +\| +4\.00 MiB")
        self.assertIn("Reserved memory", text)
        self.assertIn("Fragmentation at peaks", text)
        # One definition: 1 - requested.peak / reserved.peak (3 MiB asked
        # of a 4 MiB reservation at least: 25% or more, never negative).
        st = gmlake.stats(self.DEVICE)
        want = 100 * (1 - st["requested_bytes.peak"] /
                      st["reserved_bytes.peak"])
        self.assertIn("%.1f %%" % want, text)

    def test_no_context(self):
        with self.assertRaises(RuntimeError) as cm:
            gmlake.stats(97)
        self.assertIn("nothing was allocated", str(cm.exception))

    def test_oom_error(self):
        n0, _ = gmlake.torch.last_error(self.path)
        p = self.lib.gmlake_torch_alloc(1 << 40, self.DEVICE, None)
        self.assertIsNone(p)
        n, msg = gmlake.torch.last_error(self.path)
        self.assertEqual(n, n0 + 1)
        self.assertIn("device 2: out of memory allocating 1.00 TiB", msg)
        self.assertIn("reserved", msg)
        exc = gmlake.torch.error_for(RuntimeError("The tensor has a "
                                                  "non-zero number of "
                                                  "elements, but its data "
                                                  "is not allocated yet"),
                                     n0, self.path)
        self.assertIsInstance(exc, gmlake.torch.OutOfMemoryError)
        self.assertIn("1.00 TiB", str(exc))
        self.assertIsNone(gmlake.torch.error_for(RuntimeError("x"), n,
                                                 self.path))

    def test_translate_errors(self):
        def work():
            self.lib.gmlake_torch_alloc(1 << 41, self.DEVICE, None)
            raise RuntimeError("The tensor has a non-zero number of "
                               "elements, but its data is not allocated "
                               "yet")
        with self.assertRaises(gmlake.torch.OutOfMemoryError) as cm:
            with gmlake.torch.translate_errors(self.path):
                work()
        self.assertIn("2.00 TiB", str(cm.exception))
        with self.assertRaises(ValueError):
            with gmlake.torch.translate_errors(self.path):
                raise ValueError("unrelated")


class FakeAllocator:
    """torch.cuda.memory.CUDAPluggableAllocator's interface, recorded."""

    def __init__(self, torch, path, alloc, free):
        self.args = (path, alloc, free)
        self.hooks = {}
        torch.log.append(("CUDAPluggableAllocator", path, alloc, free))
        test = self

        class Raw:
            def __getattr__(self, name):
                if not name.startswith("set_"):
                    raise AttributeError(name)
                return lambda ptr: test.hooks.__setitem__(name, ptr)
        self.raw = Raw()

    def allocator(self):
        return self.raw


def fake_torch(initialized=False, swap_error=None):
    torch = types.ModuleType("torch")
    torch.log = []
    cuda = types.SimpleNamespace()
    cuda.is_initialized = lambda: initialized
    cuda.device_count = lambda: 2

    def change(alloc):
        if swap_error:
            raise RuntimeError(swap_error)
        torch.log.append(("change_current_allocator", alloc))
    cuda.memory = types.SimpleNamespace(
        CUDAPluggableAllocator=lambda *a: FakeAllocator(torch, *a),
        change_current_allocator=change)
    torch.cuda = cuda
    return torch


@unittest.skipUnless(HAVE_LIB, "GMLAKE_LIBRARY not set")
class TestEnable(unittest.TestCase):

    def setUp(self):
        _lib.set_enabled(None, None)
        gmlake.torch._allocator = None
        self.hook = sys.excepthook
        self.env = mock.patch.dict(os.environ,
                                   {"GMLAKE_TORCH_BACKEND": "ctypes"})
        self.env.start()

    def tearDown(self):
        self.env.stop()
        _lib.set_enabled(None, None)
        gmlake.torch._allocator = None
        sys.excepthook = self.hook

    def test_enable(self):
        torch = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            path = gmlake.torch.enable()
            self.assertEqual(gmlake.torch.enable(), path)  # no-op
        _, lib = gmlake.load()
        self.assertEqual(torch.log[0], ("CUDAPluggableAllocator", path,
                                        "gmlake_torch_alloc",
                                        "gmlake_torch_free"))
        self.assertEqual(torch.log[1][0], "change_current_allocator")
        self.assertEqual(len(torch.log), 2)
        alloc = torch.log[1][1]
        for setter, symbol in gmlake.torch.HOOKS:
            addr = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
            self.assertEqual(alloc.hooks[setter], addr, setter)
        # The names given to PyTorch are exported functions of that file.
        for name in alloc.args[1:]:
            self.assertTrue(getattr(ctypes.CDLL(path), name))

    def test_too_late(self):
        with mock.patch.dict(sys.modules,
                             {"torch": fake_torch(initialized=True)}):
            with self.assertRaises(RuntimeError) as cm:
                gmlake.torch.enable()
        msg = str(cm.exception)
        self.assertIn("too late", msg)
        self.assertIn("before any CUDA tensor", msg)
        self.assertIsNone(gmlake.torch.enabled())

    def test_swap_refused(self):
        torch = fake_torch(swap_error="Can't swap an already initialized "
                           "allocator")
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(RuntimeError) as cm:
                gmlake.torch.enable()
        self.assertIn("too late", str(cm.exception))
        self.assertIn("Can't swap", str(cm.exception))
        self.assertIsNone(gmlake.torch.enabled())


if __name__ == "__main__":
    unittest.main()
