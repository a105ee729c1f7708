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

``index_one_element_arrays()`` lets an older interpreter (Triton 3.6, the GPU machine's) take a scalar
as an index under NumPy 2.4 and later. The interpreter holds a scalar derived from ``tl.program_id`` as a
one-element array, and its ``__index__`` (what ``range`` and ``tl.range`` call on their bounds) is
``int(array)``, which NumPy 2.4 refuses for an array that has a dimension ("only 0-dimensional arrays can
be converted to Python scalars"): every kernel whose loop bounds depend on its program failed there.
Later interpreters take the array's one element (Triton 3.9: ``int(data.squeeze())``), which is what this
installs where the interpreter's own ``__index__`` fails on such an array.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace


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


def index_one_element_arrays() -> bool:
    """Install the one-element index where the interpreter's own fails; whether it was installed."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "indexes_one_element_arrays", False):
        return False

    probe = SimpleNamespace(handle=SimpleNamespace(data=np.array([3], dtype=np.int32)))  # one element

    def index(self) -> int:
        return int(self.handle.data.item())  # (an array of more than one element still fails)

    def patch_tensor_indexing(tensor, scope):
        patch_tensor(tensor, scope)
        try:
            tensor.__index__(probe)
        except TypeError:
            scope.set_attr(tensor, "__index__", index)  # undone with the launch's other patches

    patch_tensor_indexing.indexes_one_element_arrays = True
    interpreter._patch_lang_tensor = patch_tensor_indexing
    return True


if __name__ == "__main__":  # python -m tests.triton_interpreter SCRIPT ARGS...: run a script with the shims
    import runpy
    import sys

    skip_repeated_patching()
    index_one_element_arrays()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
