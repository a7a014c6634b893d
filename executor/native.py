"""fastml's C++ ops (csrc/*.cpp, registered as torch.ops.fastml.*): compiled together on first use with torch's JIT
extension builder (a C++ compiler and ninja, nothing else) and cached, one build per source, flags and torch. A
machine that cannot build them gets one `UserError`, never a slower Python path in their place.

The ops: `adamw_step_` (cpu_adam.cpp, the CPU AdamW of offloaded optimizer states, executor/cpu_adam.py) and
`host_barrier` (hostcomm.cpp, the barrier between the ranks of a node of the memcpy collectives, hostcomm.py).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from fastml.config import UserError
from fastml.hwprofiles import cache_dir

NAME = "fastml_native"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
"""The repository's csrc/ on an editable install; fastml/csrc/ (package data) on a normal one."""
FIRST_BUILD_S = 15
"""About how long the first build takes, for the line that says why the first use waits: g++ 12 took 9-14 s on a
2-core machine for cpu_adam.cpp, the longest source (ninja compiles the others beside it). A cached load takes
about 0.15 s."""
WHAT = "fastml's C++ ops (csrc/)"

STALE_LOCK_S = 600
"""A build lock older than this was left by a killed build: a build takes seconds."""

_lock = threading.Lock()
_loaded = False


def load(verbose: bool = False) -> None:
    """Registers the torch.ops.fastml ops in this process: loads the cached build, or compiles one first. `verbose`
    shows the compiler's commands and output."""
    global _loaded
    with _lock:
        if _loaded:
            return
        build_dir = build_directory()
        library = build_dir / f"{NAME}.so"
        if (build_dir / "complete").is_file():
            _load_built(library)  # no compiler needed once built: a compute node may have none
        else:
            _build(build_dir, verbose)
            (build_dir / "complete").touch()  # after the build: an interrupted one is built again next time
        _loaded = True


def build_directory() -> Path:
    """`cache_dir()/torch_extensions/native-<key>`: beside fastml's other caches ($FASTML_CACHE moves them all), and
    keyed by everything the binary depends on. torch's default directory (~/.cache/torch_extensions/py311_cpu/NAME)
    is keyed by Python and CUDA versions only, so two environments with different torch versions would rebuild over
    each other's library, or load one built against another torch's ABI."""
    key = "\n".join([*(p.read_text() for p in sources()), " ".join(_cflags()), torch.__version__,
                     str(torch.version.git_version), sys.version, platform.machine(), os.environ.get("CXX", "c++")])
    return cache_dir() / "torch_extensions" / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _cflags() -> list[str]:
    # No -march=native: a cached build would crash with an illegal instruction on an older CPU sharing the cache (a
    # home directory on NFS); the source picks the ISA at load time instead (target_clones). -ffp-contract=off keeps
    # each operation rounded on its own, but for the fused multiply-adds the source asks for (those of torch's
    # vectorised lerp and addcmul); -fno-math-errno lets sqrt vectorise.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    if "OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")  # at::parallel_for is header code: without OpenMP it runs on one thread
    return flags


def _load_built(library: Path) -> None:
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        raise UserError(f"cannot load {WHAT} from {library} ({_first_line(e)}); delete "
                        f"{library.parent} to build it again") from None


def _build(build_dir: Path, verbose: bool) -> None:
    _check_tools()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {build_dir} to build {WHAT} in ({e.strerror}); set "
                        "$FASTML_CACHE to a writable directory") from None
    _remove_stale_lock(build_dir / "lock")
    print(f"compiling {WHAT} (first use, about {FIRST_BUILD_S} s)", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension  # imported here: it takes a while and a cached load does not need it

    flags = _cflags()
    try:
        cpp_extension.load(NAME, [str(p) for p in sources()], extra_cflags=flags,
                           extra_ldflags=[f for f in flags if "openmp" in f],
                           build_directory=str(build_dir), is_python_module=False, verbose=verbose)
    except Exception as e:  # noqa: BLE001: whatever failed, the user gets one line and the whole story in a file
        log = build_dir / "build.log"
        log.write_text(f"{type(e).__name__}: {e}\n")
        raise UserError(f"compiling {CSRC} ({WHAT}) failed: {_build_error(e)}; the compiler's "
                        f"output is in {log}") from None


def _remove_stale_lock(lock: Path) -> None:
    """torch's builder makes other processes wait while one builds (torchrun's ranks), until the builder removes its
    lock file; a builder that was killed leaves it behind, and the next build would wait for ever. No build takes
    minutes."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


def _check_tools() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise UserError(f"{WHAT} are compiled on first use, and no C++ compiler was found ({compiler!r} "
                        "is not on PATH): install g++ (Debian/Ubuntu: apt-get install g++) or name one in $CXX")
    if shutil.which("ninja") is None:
        try:  # the ninja wheel (a dependency of fastml) is on PATH only in an activated environment
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise UserError(f"{WHAT} are compiled on first use with ninja, which was not found: "
                            "pip install ninja") from None


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _build_error(error: Exception) -> str:
    """The compiler's first error line, if it said one, else the first line of what torch's builder raised."""
    said = [line.strip() for line in str(error).splitlines() if "error:" in line]
    return said[0] if said else _first_line(error)


