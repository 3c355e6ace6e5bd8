"""Compiled kernels (numba only).

Pure functions over flat numpy arrays: no validation, no random number
generation, no classes. The public, validated wrappers live in
:mod:`fastper.trees`, :mod:`fastper.samplers` and :mod:`fastper.buffers`.
"""
