// torch.ops.fastml.host_barrier: the barrier between the ranks of a node that the memcpy collectives
// (executor/parallel/hostcomm.py) pass between copying their data into shared host memory and reading the others' from it.
//
// The ranks share one int64 flag per rank in shared memory (a cache line apart). A rank arriving at its n-th barrier
// stores n into its flag with release ordering, so that every write it made before (the copies it waited for) is
// visible to a rank that reads the flag with acquire ordering; it then waits until every flag holds at least n. This
// needs the atomics of C++: Python can neither order a store after a device copy on every CPU nor wait without
// holding the interpreter lock (a torch op call releases it). The wait spins briefly, then sleeps in short naps, and
// gives up after `timeout_s`, naming the ranks that never arrived.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <sstream>
#include <thread>

namespace fastml {
namespace {

constexpr int64_t kFlagStride = 8;  // int64s between two ranks' flags: one 64-byte cache line each
constexpr int kSpins = 2000;        // busy polls before the wait starts to sleep

int64_t load_acquire(const int64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

void host_barrier(const at::Tensor& flags, int64_t rank, int64_t size, int64_t generation, double timeout_s) {
  TORCH_CHECK(flags.device().is_cpu() && flags.scalar_type() == at::kLong && flags.is_contiguous(),
              "fastml::host_barrier: flags must be a contiguous int64 CPU tensor");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size && flags.numel() >= size * kFlagStride,
              "fastml::host_barrier: flags hold ", flags.numel(), " int64s, too few for rank ", rank, " of ", size);
  TORCH_CHECK(generation >= 1, "fastml::host_barrier: generation counts barriers from 1, got ", generation);
  int64_t* base = flags.data_ptr<int64_t>();
  __atomic_store_n(base + rank * kFlagStride, generation, __ATOMIC_RELEASE);
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 0;; ++spins) {
    bool all_arrived = true;
    for (int64_t r = 0; r < size && all_arrived; ++r) {
      all_arrived = load_acquire(base + r * kFlagStride) >= generation;
    }
    if (all_arrived) {
      return;
    }
    if (spins < kSpins) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    if (waited.count() > timeout_s) {
      std::ostringstream missing;
      for (int64_t r = 0; r < size; ++r) {
        if (load_acquire(base + r * kFlagStride) < generation) {
          missing << (missing.tellp() > 0 ? ", " : "") << r;
        }
      }
      TORCH_CHECK(false, "fastml::host_barrier: rank ", rank, " waited ", static_cast<int64_t>(waited.count()),
                  " s at barrier ", generation, " for ranks ", missing.str(), " of this node");
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastml, m) {
  m.def("host_barrier(Tensor flags, int rank, int size, int generation, float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(fastml, CPU, m) { m.impl("host_barrier", &host_barrier); }

}  // namespace fastml
