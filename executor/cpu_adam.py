"""fastml's C++ CPU AdamW, `torch.ops.fastml.adamw_step_` (csrc/cpu_adam.cpp): one AdamW step over optimizer state
in host memory, in one pass over memory, for the layers whose optimizer states or master weights are offloaded.

The op is compiled on first use with torch's JIT extension builder (a C++ compiler and ninja, nothing else) and
cached; a machine that cannot build it gets one `UserError`, never a slower Python step in its place.
`adamw_step_reference_` is the same step in plain torch ops: the reference the op is tested against.
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

NAME = "fastml_cpu_adam"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_adam.cpp"
"""The repository's csrc/ on an editable install; fastml/csrc/ (package data) on a normal one."""
FIRST_BUILD_S = 15
"""About how long the first build takes, for the line that says why the first use waits: g++ 12 took 9-14 s on a
2-core machine (one source file: more cores do not help). A cached load takes about 0.15 s."""

STALE_LOCK_S = 600
"""A build lock older than this was left by a killed build: a build takes seconds."""

_lock = threading.Lock()
_loaded = False


def load(verbose: bool = False) -> None:
    """Registers torch.ops.fastml.adamw_step_ in this process: loads the cached build, or compiles one first.
    `verbose` shows the compiler's commands and output."""
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
    """`cache_dir()/torch_extensions/cpu_adam-<key>`: beside fastml's other caches ($FASTML_CACHE moves them all), and
    keyed by everything the binary depends on. torch's default directory (~/.cache/torch_extensions/py311_cpu/NAME)
    is keyed by Python and CUDA versions only, so two environments with different torch versions would rebuild over
    each other's library, or load one built against another torch's ABI."""
    key = "\n".join([SOURCE.read_text(), " ".join(_cflags()), torch.__version__, str(torch.version.git_version),
                     sys.version, platform.machine(), os.environ.get("CXX", "c++")])
    return cache_dir() / "torch_extensions" / f"cpu_adam-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


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
        raise UserError(f"cannot load fastml's C++ CPU AdamW from {library} ({_first_line(e)}); delete "
                        f"{library.parent} to build it again") from None


def _build(build_dir: Path, verbose: bool) -> None:
    _check_tools()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {build_dir} to build fastml's C++ CPU AdamW in ({e.strerror}); set "
                        "$FASTML_CACHE to a writable directory") from None
    _remove_stale_lock(build_dir / "lock")
    print(f"compiling fastml's C++ CPU AdamW (first use, about {FIRST_BUILD_S} s)", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension  # imported here: it takes a while and a cached load does not need it

    flags = _cflags()
    try:
        cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=flags, extra_ldflags=[f for f in flags if "openmp" in f],
                           build_directory=str(build_dir), is_python_module=False, verbose=verbose)
    except Exception as e:  # noqa: BLE001: whatever failed, the user gets one line and the whole story in a file
        log = build_dir / "build.log"
        log.write_text(f"{type(e).__name__}: {e}\n")
        raise UserError(f"compiling {SOURCE} (fastml's C++ CPU AdamW) failed: {_build_error(e)}; the compiler's "
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
        raise UserError(f"fastml's C++ CPU AdamW is compiled on first use, and no C++ compiler was found ({compiler!r} "
                        "is not on PATH): install g++ (Debian/Ubuntu: apt-get install g++) or name one in $CXX")
    if shutil.which("ninja") is None:
        try:  # the ninja wheel (a dependency of fastml) is on PATH only in an activated environment
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise UserError("fastml's C++ CPU AdamW is compiled on first use with ninja, which was not found: "
                            "pip install ninja") from None


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _build_error(error: Exception) -> str:
    """The compiler's first error line, if it said one, else the first line of what torch's builder raised."""
    said = [line.strip() for line in str(error).splitlines() if "error:" in line]
    return said[0] if said else _first_line(error)


def adamw_step_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """One AdamW step in place, by the C++ op (built on first use). master, exp_avg, exp_avg_sq: contiguous fp32 CPU
    tensors; grad: bf16 or fp32; weight_out (optional, bf16 or fp32) receives the new master weights rounded to
    nearest even. `step` counts this step (1 on the first). The gradient is multiplied by `grad_scale` first (in
    bf16 for a bf16 gradient, as clipping it in place would). Arithmetic: `adamw_step_reference_`."""
    load()
    torch.ops.fastml.adamw_step_(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay,
                                 step, grad_scale)


@torch.no_grad()
def adamw_step_reference_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                          weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """The op's step in plain torch ops, those of torch.optim.AdamW's single-tensor step (torch/optim/adam.py,
    `_single_tensor_adam` with decoupled weight decay) in the same order."""
    g = (grad * grad_scale if grad_scale != 1 else grad).to(master.dtype)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (_sqrt(exp_avg_sq) / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if weight_out is not None:
        weight_out.copy_(master)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as the op, the GPU and torch's fused CPU AdamW take it. torch's float32
    `sqrt` on a CPU (MKL's vector math in x86 builds) is 1 ulp off for about one value in six; taken in float64 and
    rounded once, the root is exact (a double rounding of sqrt is harmless from 53 bits to 24: 53 >= 2 * 24 + 2)."""
    return x.double().sqrt().to(x.dtype)
