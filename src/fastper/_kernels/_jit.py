"""numba's ``njit``, with fastper's own on-disk cache of compiled kernels.

``from ._jit import njit`` replaces ``from numba import njit`` in the kernel
modules: the same decorator and options, but ``cache=True`` stores the
compiled code where a new install can already find it. Compared with numba's
own cache (``__pycache__`` next to each module, stamped with that file's
modification time on older numba versions):

* **A stamp that follows what a kernel inlines**: a SHA-256 of its module
  and of every module of this package it imports, directly or not. A
  kernel inlines helpers of other modules (the proportional kernels inline
  the tree's), which numba's per-file stamp does not see; here a change to
  any of them invalidates it. Content, not modification times, so a
  wheel's cache stays valid after ``pip install`` (which does not keep them).
* **A cache that ships**: :data:`PACKAGE_CACHE` (``_kernels/_numba_cache``)
  is filled when the wheel is built (``setup.py``) or by
  ``python -m fastper.warmup``, and read first. Its entries are keyed, as
  all of numba's, by signature, numba version and CPU (name and features):
  on another CPU or numba version they simply miss and the kernel is
  compiled, never loaded.
* **Where it writes**: ``NUMBA_CACHE_DIR`` if set (then the package cache
  is still read, after it); else the package cache if writable; else
  numba's user-wide cache directory (the package cache is still read).
  Nothing writable: kernels are compiled in memory, nothing is saved.
  A cache file that cannot be read or written is a miss, never an error.

Everything here is numba's own machinery (:mod:`numba.core.caching`) with a
different locator; if that machinery is not as expected (another numba
version), the kernels get numba's default cache instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import pkgutil
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numba
from numba.core import caching, sigutils

#: the cache shipped with (and first written into) the installed package
PACKAGE_CACHE = Path(__file__).resolve().parent / "_numba_cache"
#: this copy's folder in the shared cache directories (as numba keys its own: by path)
SHARED_FOLDER = "fastper-" + hashlib.sha1(str(PACKAGE_CACHE).encode()).hexdigest()[:16]


#: ``from .module import ...`` in a kernel module (every import of a sibling is one)
_SIBLING = re.compile(rb"^from \.(\w+) import", re.M)


def stamp_of(module: Path) -> str:
    """SHA-256 (hex) of the source ``module`` and of the sibling modules it imports,
    directly or not: their names and bytes, not their modification times."""
    seen: dict[Path, bytes] = {}
    todo = [module]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = path.read_bytes()
        for name in _SIBLING.findall(seen[path]):
            sibling = path.with_name(name.decode() + ".py")
            if sibling.is_file():
                todo.append(sibling)
    h = hashlib.sha256()
    for path in sorted(seen):
        h.update(path.name.encode() + b"\0" + seen[path] + b"\0")
    return h.hexdigest()


@functools.cache
def source_stamp(module: str) -> str:
    """:func:`stamp_of` the kernel module at path ``module``, once per process."""
    return stamp_of(Path(module))


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


def _user_wide_root() -> Path | None:
    try:
        from numba.misc.appdirs import AppDirs

        return Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)
    except Exception:  # noqa: BLE001 - numba's helper moved: no user-wide cache
        return None


class CacheDirs(NamedTuple):
    """Where compiled kernels are looked for and saved."""

    first: Path | None  #: read first, and where they are saved if ``writable``
    then: Path | None  #: read on a miss in ``first`` (the package cache), or None
    writable: bool


@functools.cache
def cache_dirs() -> CacheDirs:
    """The cache directories of this process (resolved once; see the module). The first
    writable of: ``NUMBA_CACHE_DIR``, the package cache, numba's user-wide folder (in
    numba's own order); :data:`SHARED_FOLDER` in the shared ones."""
    shipped = PACKAGE_CACHE if PACKAGE_CACHE.is_dir() else None
    candidates = [PACKAGE_CACHE]
    if numba.config.CACHE_DIR:
        candidates.insert(0, Path(numba.config.CACHE_DIR) / SHARED_FOLDER)
    user_wide = _user_wide_root()
    if user_wide is not None:
        candidates.append(user_wide / SHARED_FOLDER)
    for path in candidates:
        if _writable(path):
            return CacheDirs(path, None if path == PACKAGE_CACHE else shipped, True)
    return CacheDirs(shipped, None, False)  # read only (or no cache at all)


#: numba's cache classes this module builds on (``numba.core.caching``, the same since
#: numba 0.4x); where one is missing, the kernels get numba's own cache instead
_NUMBA_CACHE_API = all(
    hasattr(caching, name)
    for name in ("_CacheLocator", "CompileResultCacheImpl", "FunctionCache", "IndexDataCacheFile")
)


class _Locator(getattr(caching, "_CacheLocator", object)):  # type: ignore[misc]
    """Numba's cache locator interface, over :func:`cache_dirs` and :func:`source_stamp`."""

    def __init__(self, py_func: Callable[..., Any], path: Path) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._source = str(Path(py_func.__code__.co_filename).resolve())
        self._path = path

    def ensure_cache_path(self) -> None:
        self._path.mkdir(parents=True, exist_ok=True)

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return source_stamp(self._source)

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Callable[..., Any], py_file: str) -> _Locator | None:
        first = cache_dirs().first
        return None if first is None else cls(py_func, first)


class _Impl(getattr(caching, "CompileResultCacheImpl", object)):  # type: ignore[misc]
    _locator_classes = [_Locator]


class KernelCache(getattr(caching, "FunctionCache", object)):  # type: ignore[misc]
    """numba's per-function cache over :func:`cache_dirs`: load from the first
    directory, then the second; save to the first. Unreadable or unwritable
    files are misses."""

    _impl_class = _Impl

    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        dirs = cache_dirs()
        self._writable = dirs.writable
        self._after = None
        if dirs.then is not None:
            self._after = caching.IndexDataCacheFile(
                cache_path=str(dirs.then),
                filename_base=self._impl.filename_base,
                source_stamp=self._impl.locator.get_source_stamp(),
            )

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        if not self._enabled:
            return None
        key = self._index_key(sig, target_context.codegen())
        args = tuple(sigutils.normalize_signature(sig)[0])
        for file in (self._cache_file, self._after):
            if file is None:
                continue
            try:
                data = file.load(key)
                if data is None:
                    continue
                cres = self._impl.rebuild(target_context, data)
            except Exception:  # noqa: BLE001 - a truncated or foreign file: compile instead
                continue
            # an index names its data files by number: two processes saving two signatures
            # at once can leave a number on the other's code; never run that
            if tuple(cres.signature.args) == args:
                return cres
        return None

    def save_overload(self, sig: Any, data: Any) -> None:
        if not self._writable:
            return
        try:
            super().save_overload(sig, data)
        except Exception:  # noqa: BLE001 - a full disk, a foreign index: the kernel still runs
            pass


def _cached(dispatcher: Any) -> Any:
    """``dispatcher`` reading and writing :class:`KernelCache` (numba's cache if that fails)."""
    if not hasattr(dispatcher, "enable_caching"):  # NUMBA_DISABLE_JIT: a Python function
        return dispatcher
    if cache_dirs().first is None:  # nothing to read, nowhere to write: compile in memory
        return dispatcher
    try:
        if not _NUMBA_CACHE_API:
            raise AttributeError("numba.core.caching is not as expected")
        dispatcher._cache = KernelCache(dispatcher.py_func)
    except Exception:  # noqa: BLE001 - numba's cache machinery is not as expected
        try:
            dispatcher.enable_caching()
        except Exception:  # noqa: BLE001 - no cache directory at all: compile in memory
            pass
    return dispatcher


def kernels() -> dict[str, Any]:
    """Every kernel of this package that Python calls and that is cached here, by
    ``"module.name"``: the dispatchers made with ``cache=True``, not inlined (those are
    compiled into their callers). Imports every kernel module; those that cannot be
    imported (the LZ4 kernels without the ``tiers`` extra) are left out."""
    package = __name__.rpartition(".")[0]
    out: dict[str, Any] = {}
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except ImportError:
            continue
        for name, obj in vars(module).items():
            if (
                isinstance(getattr(obj, "_cache", None), KernelCache)
                and obj.py_func.__module__ == module.__name__
                and obj.targetoptions.get("inline", "never") == "never"
            ):
                out[f"{info.name}.{name}"] = obj
    return out


def cache_counts() -> dict[str, tuple[int, int]]:
    """``{kernel: (signatures compiled, signatures loaded from the cache)}`` in this
    process so far, over :func:`kernels`."""
    return {
        name: (sum(d.stats.cache_misses.values()), sum(d.stats.cache_hits.values()))
        for name, d in kernels().items()
    }


def njit(*args: Any, **options: Any) -> Any:
    """``numba.njit`` with the same options; ``cache=True`` uses :class:`KernelCache`."""
    cache = bool(options.pop("cache", False))

    def wrap(func: Callable[..., Any]) -> Any:
        dispatcher = numba.njit(**options)(func)
        return _cached(dispatcher) if cache else dispatcher

    if args:  # bare @njit, or njit(func)
        return wrap(args[0])
    return wrap
