// torch.ops.fastml.adamw_step_ on the CPU: one AdamW step over optimizer state in host memory, in one pass per
// element: read the gradient, update the master weight and Adam's m and v, write the weight (bf16 or fp32) that goes
// back to the GPU. The arithmetic, and the stochastic rounding of bf16 masters and moments, is adamw_math.h's,
// shared with the GPU op (adamw_cuda.cu).
//
// The loop is plain C++ that the compiler vectorises (as fast as at::vec::Vectorized here, and free of its
// compile-time ISA choice). GCC compiles it once per ISA level (target_clones) and the loader picks the best one for
// the CPU it runs on, so a build cached on one machine runs on any other; the results are the same bits on all.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "adamw_op.h"

namespace fastml {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTML_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTML_ISA_CLONES
#endif

constexpr const char* kOnCpu = "a CPU tensor (the op steps optimizer state in host memory)";
constexpr int64_t kGrainSize = 1 << 16;  // elements a thread takes at least: ~2 MB of traffic, well above the cost
                                         // of waking a thread

// `c` by value and the buffers restrict: GCC then keeps the constants in registers and vectorises the loop.
template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Out, typename Low>
C10_ALWAYS_INLINE void step_range(const StepConstants c, Master* __restrict__ master, State* __restrict__ exp_avg,
                                  State* __restrict__ exp_avg_sq, const Grad* __restrict__ grad,
                                  Out* __restrict__ out, Low* __restrict__ low, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    step_element<kLerpFromEnd>(c, master, exp_avg, exp_avg_sq, grad, out, low, i);
  }
}

// One clone per ISA level; each instantiation's loop is vectorised on its own.
FASTML_ISA_CLONES void step_chunk(const StepConstants& c, const StepBuffers& b, int64_t begin, int64_t end) {
  dispatch_step(c, b.kinds, [&](auto lerp_from_end, auto* master, auto* state, auto* grad, auto* out, auto* low)
                                C10_ALWAYS_INLINE_ATTRIBUTE {
    step_range<decltype(lerp_from_end)::value>(
        c, static_cast<decltype(master)>(b.master), static_cast<decltype(state)>(b.exp_avg),
        static_cast<decltype(state)>(b.exp_avg_sq), static_cast<decltype(grad)>(b.grad),
        static_cast<decltype(out)>(b.out), static_cast<decltype(low)>(b.low), begin, end);
  });
}

void adamw_step_cpu(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step, double grad_scale, int64_t seed,
                    int64_t offset, const std::optional<at::Tensor>& master_low) {
  const auto checked =
      checked_step(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale, seed, offset, master_low, c10::DeviceType::CPU, kOnCpu);
  const StepConstants constants = checked.first;  // named: a lambda cannot capture structured bindings in C++17
  const StepBuffers buffers = checked.second;
  at::parallel_for(0, master.numel(), kGrainSize,
                   [&](int64_t begin, int64_t end) { step_chunk(constants, buffers, begin, end); });
}

// Checks only, so that tracing (torch.compile, FakeTensor) can pass over the op. The dispatcher also picks this
// kernel when a meta tensor is mixed with CPU ones: then the meta ones are refused as not on the CPU.
void adamw_step_meta(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double, double, double,
                     double, double, int64_t, double, int64_t, int64_t, const std::optional<at::Tensor>& master_low) {
  const auto tensors = named_tensors(master, exp_avg, exp_avg_sq, grad, weight_out, master_low);
  const bool all_meta =
      std::all_of(tensors.begin(), tensors.end(), [](const NamedTensor& t) { return t.tensor.is_meta(); });
  check_tensors(tensors, all_meta ? c10::DeviceType::Meta : c10::DeviceType::CPU, all_meta ? "on meta" : kOnCpu);
  check_dtypes(master, exp_avg, exp_avg_sq, weight_out, master_low);
}

}  // namespace

TORCH_LIBRARY(fastml, m) {
  m.def(
      "adamw_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
      "Tensor(d!)? weight_out, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "float grad_scale, int seed, int offset, Tensor(e!)? master_low=None) -> ()");
}

TORCH_LIBRARY_IMPL(fastml, CPU, m) { m.impl("adamw_step_", &adamw_step_cpu); }

TORCH_LIBRARY_IMPL(fastml, Meta, m) { m.impl("adamw_step_", &adamw_step_meta); }

}  // namespace fastml
