// torch.ops.fastml.adamw_step_ on a GPU: the CPU op's step (adamw_math.h, the same bits) for tensors on the GPU, for
// the layers whose master weights or Adam moments are bf16 and so need stochastic rounding, which torch's fused
// AdamW does not do. The step reads and writes each element once, so it runs at the speed of memory if enough bytes
// are in flight: each thread steps kVector elements at once, loading and storing them 16 bytes at a time (one
// element a thread kept 0.45 of HBM's rate with bf16 buffers, benchmarks/NOTES.md). Built with --fmad=false, so that
// no multiply and add are fused but those adamw_math.h asks for.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "adamw_op.h"
#include "cuda_util.h"

namespace fastml {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
constexpr int kVector = 8;  // elements a thread steps at once: 16 bytes of a bf16 buffer, 32 of a float32 one

template <typename T>
struct alignas(16) Pack {
  T value[kVector];
};

template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Out, typename Low>
__global__ void adamw_kernel(const StepConstants c, Master* __restrict__ master, State* __restrict__ exp_avg,
                             State* __restrict__ exp_avg_sq, const Grad* __restrict__ grad, Out* __restrict__ out,
                             Low* __restrict__ low, int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    step_element<kLerpFromEnd>(c, master, exp_avg, exp_avg_sq, grad, out, low, i);
  }
}

// The same step over `packs` runs of kVector elements, every buffer 16-byte aligned: each run is loaded whole into
// registers, stepped element by element by the scalar kernel's step_element (so the bits are the same by
// construction), and stored whole. At most 64 registers a thread, so that 4 blocks fit a multiprocessor: the step is
// bound by its integer instructions more than by memory (ncu: the integer pipeline 68% busy, DRAM 52%), and with
// the 67 registers it took alone only 3 fit, too few warps to keep that pipeline fed (0.76 -> 0.82 of HBM's rate
// with bf16 weights and moments, benchmarks/NOTES.md).
template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Out, typename Low>
__global__ void __launch_bounds__(kThreads, 4)
    adamw_packed_kernel(const StepConstants c, Master* __restrict__ master, State* __restrict__ exp_avg,
                        State* __restrict__ exp_avg_sq, const Grad* __restrict__ grad, Out* __restrict__ out,
                        Low* __restrict__ low, int64_t packs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += stride) {
    Pack<Master> w = reinterpret_cast<const Pack<Master>*>(master)[p];
    Pack<State> m = reinterpret_cast<const Pack<State>*>(exp_avg)[p];
    Pack<State> v = reinterpret_cast<const Pack<State>*>(exp_avg_sq)[p];
    const Pack<Grad> g = reinterpret_cast<const Pack<Grad>*>(grad)[p];
    Pack<Out> o;
    Pack<Low> l;
    if constexpr (!std::is_same_v<Low, NoOutput>) l = reinterpret_cast<const Pack<Low>*>(low)[p];
    StepConstants here = c;
    here.offset += static_cast<uint64_t>(p) * kVector;  // the random bits of the elements' own indices
#pragma unroll
    for (int j = 0; j < kVector; ++j) {
      step_element<kLerpFromEnd>(here, w.value, m.value, v.value, g.value, o.value, l.value, j);
    }
    reinterpret_cast<Pack<Master>*>(master)[p] = w;
    reinterpret_cast<Pack<State>*>(exp_avg)[p] = m;
    reinterpret_cast<Pack<State>*>(exp_avg_sq)[p] = v;
    if constexpr (!std::is_same_v<Out, NoOutput>) reinterpret_cast<Pack<Out>*>(out)[p] = o;
    if constexpr (!std::is_same_v<Low, NoOutput>) reinterpret_cast<Pack<Low>*>(low)[p] = l;
  }
}

int grid_for(int64_t work) {
  return static_cast<int>(std::min((work + kThreads - 1) / kThreads, multiprocessors() * kBlocksPerSm));
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void adamw_step_cuda(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, double grad_scale, int64_t seed,
                     int64_t offset, const std::optional<at::Tensor>& master_low) {
  const auto checked =
      checked_step(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale, seed, offset, master_low, c10::DeviceType::CUDA, "a CUDA tensor");
  const StepConstants constants = checked.first;  // named: a lambda cannot capture structured bindings in C++17
  const StepBuffers buffers = checked.second;
  const int64_t numel = master.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(master.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Runs of kVector where every buffer starts 16-byte aligned (torch's allocations do; a slice may not), then the
  // elements after the last run, or all of them, one a thread.
  const bool packed = aligned(buffers.master) && aligned(buffers.exp_avg) && aligned(buffers.exp_avg_sq) &&
                      aligned(buffers.grad) && (buffers.out == nullptr || aligned(buffers.out)) &&
                      (buffers.low == nullptr || aligned(buffers.low));
  const int64_t packs = packed ? numel / kVector : 0;
  const int64_t done = packs * kVector;
  StepConstants rest = constants;
  rest.offset += static_cast<uint64_t>(done);
  dispatch_step(constants, buffers.kinds, [&](auto lerp_from_end, auto* m, auto* s, auto* g, auto* o, auto* l) {
    using Master = std::remove_pointer_t<decltype(m)>;
    using State = std::remove_pointer_t<decltype(s)>;
    using Grad = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    using Out = std::remove_pointer_t<decltype(o)>;
    using Low = std::remove_pointer_t<decltype(l)>;
    constexpr bool kLerpFromEnd = decltype(lerp_from_end)::value;
    auto* master_ = static_cast<Master*>(buffers.master);
    auto* exp_avg_ = static_cast<State*>(buffers.exp_avg);
    auto* exp_avg_sq_ = static_cast<State*>(buffers.exp_avg_sq);
    auto* grad_ = static_cast<const Grad*>(buffers.grad);
    auto* out_ = static_cast<Out*>(buffers.out);
    auto* low_ = static_cast<Low*>(buffers.low);
    if (packs > 0) {
      adamw_packed_kernel<kLerpFromEnd><<<grid_for(packs), kThreads, 0, stream>>>(
          constants, master_, exp_avg_, exp_avg_sq_, grad_, out_, low_, packs);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (numel > done) {
      Out* out_rest = out_;  // null, and left so, where no weight is written
      if constexpr (!std::is_same_v<Out, NoOutput>) out_rest += done;
      Low* low_rest = low_;  // likewise where the masters have no compensation
      if constexpr (!std::is_same_v<Low, NoOutput>) low_rest += done;
      adamw_kernel<kLerpFromEnd><<<grid_for(numel - done), kThreads, 0, stream>>>(
          rest, master_ + done, exp_avg_ + done, exp_avg_sq_ + done, grad_ + done, out_rest, low_rest, numel - done);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fastml, CUDA, m) { m.impl("adamw_step_", &adamw_step_cuda); }

}  // namespace fastml
