"""Triton's interpreter without its repeated patching of ``triton.language`` (the CPU suite's speed).

When the interpreter runs a kernel it replaces ``triton.language``'s functions by interpreted ones for
the duration of the launch (``_patch_lang``, undone by the scope it returns). It does the same again at
every call of a ``@triton.jit`` helper inside the kernel, for every program of the grid: a walk over
the language modules (``inspect.getmembers``) that finds them patched already. The kernels here are
built from small helpers called in their loops, so in a profile of the whole tiny model through the
Triton backend that walk took a third of the time.

``skip_repeated_patching()`` makes a helper's call skip the walk when the modules it names are
already patched for the launch in progress; the launch's own patching and its undoing are unchanged
(a launch's scope, undone, forgets what was patched). What runs is the same either way:
``tests/test_triton_interpreter.py`` checks a kernel's bits with and without. Where the interpreter's
internals are not the ones this knows, nothing is changed.
"""

from __future__ import annotations

import inspect


def skip_repeated_patching() -> bool:
    """Install the skip; whether it was installed (False: another Triton, or already installed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "skips_repeats", False):
        return False
    languages = (tl, tl.core)
    patched: set[int] = set()  # the language modules patched for the launch in progress
    undo = scope_type.restore

    def patch_once(fn):
        names = {id(value) for value in fn.__globals__.values()
                 if inspect.ismodule(value) and any(value is lang for lang in languages)}
        if names and names <= patched:
            return scope_type()  # nothing changed, nothing to undo
        scope = patch_lang(fn)
        patched.update(names)
        return scope

    def restore(self):
        patched.clear()
        undo(self)

    patch_once.skips_repeats, patch_once.original = True, patch_lang
    interpreter._patch_lang = patch_once
    scope_type.restore = restore
    return True


if __name__ == "__main__":  # python -m tests.triton_interpreter SCRIPT ARGS...: run a script with the skip
    import runpy
    import sys

    skip_repeated_patching()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
