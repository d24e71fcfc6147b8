# SPDX-License-Identifier: MIT
"""Run a Python script with libgmlake as PyTorch's CUDA allocator.

    python -m gmlake.run [--backend auto|adapter|ctypes] [--library PATH]
                         train.py ARGS...
    python -m gmlake.run [options] -m package.module ARGS...

like torchrun or python itself: gmlake.torch.enable() first, then the
script runs as __main__ with sys.argv = [script, ARGS...] and the
script's folder first on sys.path. Nothing in the script changes.
"""

import os
import runpy
import sys

USAGE = ("python -m gmlake.run [--backend auto|adapter|ctypes] "
         "[--library PATH] (SCRIPT | -m MODULE) [ARGS...]")


class UsageError(Exception):
    pass


def parse(argv):
    """(options, target, args): our options come before the script."""
    opts = {"backend": None, "library": None, "module": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            raise UsageError(None)
        name, eq, val = a.partition("=")
        if name in ("--backend", "--library"):
            if not eq:
                i += 1
                if i == len(argv):
                    raise UsageError("%s needs a value" % name)
                val = argv[i]
            opts[name[2:]] = val
            i += 1
            continue
        if a == "-m":
            if i + 1 == len(argv):
                raise UsageError("-m needs a module")
            opts["module"] = argv[i + 1]
            return opts, None, argv[i + 2:]
        if a == "--":
            i += 1
            break
        if a.startswith("-"):
            raise UsageError("unknown option %s" % a)
        break
    if i == len(argv):
        raise UsageError("a script or -m MODULE is needed")
    if opts["backend"] not in (None, "auto", "adapter", "ctypes"):
        raise UsageError("--backend must be auto, adapter or ctypes")
    return opts, argv[i], argv[i + 1:]


def main(argv=None):
    try:
        opts, script, args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        if e.args[0]:
            sys.stderr.write("python -m gmlake.run: %s\n" % e.args[0])
        sys.stderr.write("usage: %s\n" % USAGE)
        return 0 if e.args[0] is None else 2
    if script is not None and not os.path.isfile(script):
        sys.stderr.write("python -m gmlake.run: %s: no such file\n" %
                         script)
        return 2
    import gmlake.torch
    gmlake.torch.enable(library=opts["library"], backend=opts["backend"])
    if opts["module"]:
        sys.argv = [opts["module"]] + args
        runpy.run_module(opts["module"], run_name="__main__",
                         alter_sys=True)
        return 0
    sys.argv = [script] + args
    # As python SCRIPT does: the script's folder first on the path.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
