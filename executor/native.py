"""fastml's native ops (csrc/, registered as torch.ops.fastml.*), compiled on first use with torch's JIT extension
builder and cached, one build per source, flags and torch; a machine that cannot build them gets one `UserError`,
never a slower Python path in their place. Two libraries:

- the C++ ops (csrc/*.cpp; a C++ compiler and ninja, nothing else): `adamw_step_` on the CPU (cpu_adam.cpp, the
  AdamW of offloaded optimizer states, executor/memory/cpu_adam.py) and `host_barrier` (hostcomm.cpp, the barrier between
  the ranks of a node of the memcpy collectives, hostcomm.py). `load`.
- the CUDA ops (csrc/*.cu; nvcc too), built for the GPU in use: `adamw_step_` on the GPU (adamw_cuda.cu, bf16
  masters and moments with stochastic rounding) and `quantize_fp8` (fp8_cuda.cu, the casts of fp8 matmuls,
  executor/model/fp8.py). `load_cuda`, which loads the C++ ops first (they define `adamw_step_`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastml.config import UserError, first_line
from fastml.hwprofiles import cache_dir

CSRC = Path(__file__).resolve().parent.parent / "csrc"
"""The repository's csrc/ on an editable install; fastml/csrc/ (package data) on a normal one."""
STALE_LOCK_S = 600
"""A build lock older than this was left by a killed build: a build takes a minute at most."""


@dataclass(frozen=True)
class Library:
    name: str
    what: str
    pattern: str
    """The sources' file names in csrc/."""
    first_build_s: int
    """About how long the first build takes, for the line that says why the first use waits."""


CPU_OPS = Library("fastml_native", "fastml's C++ ops (csrc/)", "*.cpp", 30)
"""g++ 12 took 9-14 s on a 2-core machine for cpu_adam.cpp before its bf16 states (about twice the instantiations
now), the longest source: ninja compiles the others beside it. A cached load takes about 0.15 s."""
CUDA_OPS = Library("fastml_cuda", "fastml's CUDA ops (csrc/)", "*.cu", 60)

_lock = threading.Lock()
_loaded: set[str] = set()


def load(verbose: bool = False) -> None:
    """Registers the C++ ops in this process: loads the cached build, or compiles one first. `verbose` shows the
    compiler's commands and output."""
    _load(CPU_OPS, verbose)


def load_cuda(verbose: bool = False) -> None:
    """Registers the CUDA ops (after the C++ ones, which define `adamw_step_`), built for this process's GPU."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise UserError(f"{CUDA_OPS.what} need a CUDA GPU and a CUDA build of torch; this process has "
                        f"{'no GPU' if torch.version.cuda else 'a CPU-only torch ' + torch.__version__}")
    load(verbose)
    _load(CUDA_OPS, verbose)
    from fastml.executor.model import fp8  # the fake implementations, so that torch.compile traces the ops

    fp8.register_fakes()


def _load(library: Library, verbose: bool) -> None:
    with _lock:
        if library.name in _loaded:
            return
        build_dir = build_directory(library)
        if is_built(library):
            _load_built(library, build_dir / f"{library.name}.so")  # no compiler needed once built
        else:
            _build(library, build_dir, verbose)
            (build_dir / "complete").touch()  # after the build: an interrupted one is built again next time
        _loaded.add(library.name)


def is_built(library: Library = CPU_OPS) -> bool:
    """Whether `library` is built for this environment (its first use will not compile it)."""
    return (build_directory(library) / "complete").is_file()


def build_directory(library: Library = CPU_OPS) -> Path:
    """`cache_dir()/torch_extensions/<library>-<key>`: beside fastml's other caches ($FASTML_CACHE moves them all),
    and keyed by everything the binary depends on (its sources and the headers they share, flags, torch, Python, the
    machine and, for CUDA, the GPU's architecture). torch's default directory (~/.cache/torch_extensions/py311_cpu/NAME)
    is keyed by Python and CUDA versions only, so two environments with different torch versions would rebuild over
    each other's library, or load one built against another torch's ABI."""
    texts = [p.read_text() for p in [*sources(library), *sorted(CSRC.glob("*.h"))]]
    key = "\n".join([*texts, " ".join(_cflags(library)), torch.__version__, str(torch.version.git_version),
                     sys.version, platform.machine(), os.environ.get("CXX", "c++")])
    short = "native" if library is CPU_OPS else "cuda"
    return cache_dir() / "torch_extensions" / f"{short}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def sources(library: Library = CPU_OPS) -> list[Path]:
    return sorted(CSRC.glob(library.pattern))


def _cflags(library: Library = CPU_OPS) -> list[str]:
    if library is CUDA_OPS:
        # Built for this GPU's architecture only: fp8 conversions need sm_89 or later to be native. --fmad=false for
        # the device code and -ffp-contract=off for the host code (the step's constants), as the C++ ops are built:
        # the AdamW step's bits are the CPU op's.
        major, minor = torch.cuda.get_device_capability()
        return ["-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off",
                f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    # No -march=native: a cached build would crash with an illegal instruction on an older CPU sharing the cache (a
    # home directory on NFS); the source picks the ISA at load time instead (target_clones). -ffp-contract=off keeps
    # each operation rounded on its own, but for the fused multiply-adds the source asks for (those of torch's
    # vectorised lerp and addcmul); -fno-math-errno lets sqrt vectorise.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    if "OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")  # at::parallel_for is header code: without OpenMP it runs on one thread
    return flags


def _load_built(library: Library, path: Path) -> None:
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        raise UserError(f"cannot load {library.what} from {path} ({first_line(e)}); delete "
                        f"{path.parent} to build it again") from None


def _build(library: Library, build_dir: Path, verbose: bool) -> None:
    _check_tools(library)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {build_dir} to build {library.what} in ({e.strerror}); set "
                        "$FASTML_CACHE to a writable directory") from None
    _remove_stale_lock(build_dir / "lock")
    print(f"compiling {library.what} (first use, about {library.first_build_s} s)", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension  # imported here: it takes a while and a cached load does not need it

    flags = _cflags(library)
    if library is CUDA_OPS:
        compiler_flags = dict(extra_cuda_cflags=flags, extra_cflags=["-O3", "-ffp-contract=off"])
    else:
        compiler_flags = dict(extra_cflags=flags, extra_ldflags=[f for f in flags if "openmp" in f])
    try:
        cpp_extension.load(library.name, [str(p) for p in sources(library)], build_directory=str(build_dir),
                           extra_include_paths=[str(CSRC)], is_python_module=False, verbose=verbose,
                           **compiler_flags)
    except Exception as e:  # noqa: BLE001: whatever failed, the user gets one line and the whole story in a file
        log = build_dir / "build.log"
        log.write_text(f"{type(e).__name__}: {e}\n")
        raise UserError(f"compiling {CSRC} ({library.what}) failed: {_build_error(e)}; the compiler's "
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


def _check_tools(library: Library = CPU_OPS) -> None:
    compiler = os.environ.get("CXX", "c++")
    if library is CUDA_OPS and shutil.which("nvcc") is None and not _cuda_home_nvcc():
        raise UserError(f"{library.what} are compiled on first use, and nvcc was not found (not on PATH, nor in "
                        "$CUDA_HOME/bin): install the CUDA toolkit of your torch's CUDA version "
                        f"({torch.version.cuda}) or set $CUDA_HOME")
    if shutil.which(compiler) is None:
        raise UserError(f"{library.what} are compiled on first use, and no C++ compiler was found ({compiler!r} "
                        "is not on PATH): install g++ (Debian/Ubuntu: apt-get install g++) or name one in $CXX")
    if shutil.which("ninja") is None:
        try:  # the ninja wheel (a dependency of fastml) is on PATH only in an activated environment
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise UserError(f"{library.what} are compiled on first use with ninja, which was not found: "
                            "pip install ninja") from None


def _cuda_home_nvcc() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").is_file()


def _build_error(error: Exception) -> str:
    """The compiler's first error line, if it said one, else the first line of what torch's builder raised."""
    said = [line.strip() for line in str(error).splitlines() if "error:" in line]
    return said[0] if said else first_line(error)


