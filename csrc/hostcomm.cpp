// torch.ops.fastml.host_barrier: the barrier between the ranks of a node that the memcpy collectives
// (executor/parallel/hostcomm.py) pass between copying their data into shared host memory and reading the others' from it.
//
// The ranks share a line of `flags` each (flags.numel() / size int64s: the caller gives each rank a cache line of its
// own): its first int64 is the rank's barrier count, the next two its process id and PID namespace. A rank arriving at its n-th barrier stores n into its count with release
// ordering, so that every write it made before (the copies it waited for) is visible to a rank that reads the count
// with acquire ordering; it then waits until every count is at least n. This needs the atomics of C++: Python can
// neither order a store after a device copy on every CPU nor wait without holding the interpreter lock (a torch op
// call releases it). The wait spins briefly, then sleeps in short naps. It gives up when a rank it waits for has
// died (its process is gone: a rank killed by a signal never arrives, and the launcher stops a job only once the
// waiting ranks exit), raising a DistBackendError that names that rank, so that the launcher names it too; and after
// `timeout_s`, naming the ranks that never arrived.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <sstream>
#include <thread>

namespace fastml {
namespace {

constexpr int64_t kPid = 1;         // in a rank's line, after its count: its process id
constexpr int64_t kPidNamespace = 2;  // and the inode of its PID namespace (0 where there is none to read)
constexpr int kSpins = 2000;        // busy polls before the wait starts to sleep
constexpr std::chrono::milliseconds kLivenessEvery(50);  // how often a waiting rank looks for dead ones

int64_t load_acquire(const int64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

int64_t pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<int64_t>(st.st_ino) : 0;
}

// Whether rank `r`'s process is known to be gone. Only a process in this rank's PID namespace can be asked (a pid
// means nothing in another), and only once it has arrived at a barrier (its id is written then).
bool died(const int64_t* line, int64_t my_namespace) {
  const int64_t pid = __atomic_load_n(line + kPid, __ATOMIC_RELAXED);
  if (pid <= 0 || __atomic_load_n(line + kPidNamespace, __ATOMIC_RELAXED) != my_namespace) {
    return false;
  }
  return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void host_barrier(const at::Tensor& flags, int64_t rank, int64_t size, int64_t generation, double timeout_s) {
  TORCH_CHECK(flags.device().is_cpu() && flags.scalar_type() == at::kLong && flags.is_contiguous(),
              "fastml::host_barrier: flags must be a contiguous int64 CPU tensor");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "fastml::host_barrier: rank ", rank, " of ", size);
  const int64_t stride = flags.numel() / size;  // int64s between two ranks' lines
  TORCH_CHECK(stride > kPidNamespace, "fastml::host_barrier: flags hold ", flags.numel(), " int64s, too few for ", size,
              " ranks");
  TORCH_CHECK(generation >= 1, "fastml::host_barrier: generation counts barriers from 1, got ", generation);
  static const int64_t my_namespace = pid_namespace();
  int64_t* base = flags.data_ptr<int64_t>();
  int64_t* mine = base + rank * stride;
  __atomic_store_n(mine + kPid, static_cast<int64_t>(getpid()), __ATOMIC_RELAXED);
  __atomic_store_n(mine + kPidNamespace, my_namespace, __ATOMIC_RELAXED);
  __atomic_store_n(mine, generation, __ATOMIC_RELEASE);
  const auto start = std::chrono::steady_clock::now();
  auto looked = start;
  for (int spins = 0;; ++spins) {
    bool all_arrived = true;
    for (int64_t r = 0; r < size && all_arrived; ++r) {
      all_arrived = load_acquire(base + r * stride) >= generation;
    }
    if (all_arrived) {
      return;
    }
    if (spins < kSpins) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    const auto now = std::chrono::steady_clock::now();
    if (now - looked >= kLivenessEvery) {
      looked = now;
      for (int64_t r = 0; r < size; ++r) {
        const int64_t* line = base + r * stride;
        TORCH_CHECK_WITH(DistBackendError, load_acquire(line) >= generation || !died(line, my_namespace),
                         "fastml::host_barrier: rank ", r, " of this node (pid ", line[kPid], ") has died; rank ",
                         rank, " stops waiting for it at barrier ", generation);
      }
    }
    const std::chrono::duration<double> waited = now - start;
    if (waited.count() > timeout_s) {
      std::ostringstream missing;
      for (int64_t r = 0; r < size; ++r) {
        if (load_acquire(base + r * stride) < generation) {
          missing << (missing.tellp() > 0 ? ", " : "") << r;
        }
      }
      TORCH_CHECK_WITH(DistBackendError, false, "fastml::host_barrier: rank ", rank, " waited ",
                       static_cast<int64_t>(waited.count()), " s at barrier ", generation, " for ranks ",
                       missing.str(), " of this node");
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastml, m) {
  m.def("host_barrier(Tensor(a!) flags, int rank, int size, int generation, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(fastml, CPU, m) { m.impl("host_barrier", &host_barrier); }

}  // namespace fastml
