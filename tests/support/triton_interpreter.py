"""Triton's interpreter without its repeated patching of triton.language inside one launch.

A launch (interpreter.GridExecutor) patches triton.language for the interpreter, runs the whole grid and restores it.
Triton 3.9 also patches it again at every call of a @triton.jit helper from inside the kernel
(InterpretedFunction.__call__ -> _patch_lang: an inspect.getmembers scan of tl, tl.core, tl.math and tl.tensor each
time) and never restores that: the launch's restore undoes it. moetune's kernels call helpers in their inner loops,
and the scans were 40 to 60% of the interpreted time (the sparse attention child tests 67 -> 42 s, KDA's 27 -> 10 s).
Here a helper whose modules the running launch patched already runs under that patch: the same interpreted program,
without the scans."""

from __future__ import annotations

import threading

import triton.language as tl
from triton.runtime import interpreter


def _languages(fn) -> set[int]:
    """The triton.language modules a jitted function sees (what _patch_lang patches for it)."""
    return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}


def skip_repatching_within_a_launch() -> None:
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__  # fails loudly if they moved
    running = threading.local()  # the languages the running launch patched; None outside a launch

    def patch_once(fn):
        patched = getattr(running, "languages", None)
        if patched is not None and _languages(fn) <= patched:
            return interpreter._LangPatchScope()  # nothing to restore: the launch restores its own patch
        scope = patch_lang(fn)
        if patched is not None:
            patched |= _languages(fn)
        return scope

    def launch_patching_once(self, *args, **kwargs):
        outer, running.languages = getattr(running, "languages", None), set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.languages = outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
