// torch.ops.fastml.adamw_step_ on a GPU: the CPU op's step (adamw_math.h, the same bits) for tensors on the GPU, for
// the layers whose master weights or Adam moments are bf16 and so need stochastic rounding, which torch's fused
// AdamW does not do. One element per thread and grid-stride loops: the step reads and writes each element once, so
// it runs at the speed of memory. Built with --fmad=false, so that no multiply and add are fused but those
// adamw_math.h asks for.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "adamw_op.h"
#include "cuda_util.h"

namespace fastml {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Out>
__global__ void adamw_kernel(const StepConstants c, Master* __restrict__ master, State* __restrict__ exp_avg,
                             State* __restrict__ exp_avg_sq, const Grad* __restrict__ grad, Out* __restrict__ out,
                             int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    step_element<kLerpFromEnd>(c, master, exp_avg, exp_avg_sq, grad, out, i);
  }
}

void adamw_step_cuda(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step, double grad_scale, int64_t seed,
                     int64_t offset) {
  const auto checked =
      checked_step(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale, seed, offset, c10::DeviceType::CUDA, "a CUDA tensor");
  const StepConstants constants = checked.first;  // named: a lambda cannot capture structured bindings in C++17
  const StepBuffers buffers = checked.second;
  const int64_t numel = master.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(master.device());
  const int64_t wanted = (numel + kThreads - 1) / kThreads;
  const int64_t most = multiprocessors() *
                       kBlocksPerSm;
  const int blocks = static_cast<int>(std::min(wanted, most));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_step(constants, buffers.kinds, [&](auto lerp_from_end, auto* m, auto* s, auto* g, auto* o) {
    adamw_kernel<decltype(lerp_from_end)::value><<<blocks, kThreads, 0, stream>>>(
        constants, static_cast<decltype(m)>(buffers.master), static_cast<decltype(s)>(buffers.exp_avg),
        static_cast<decltype(s)>(buffers.exp_avg_sq), static_cast<decltype(g)>(buffers.grad),
        static_cast<decltype(o)>(buffers.out), numel);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fastml, CUDA, m) { m.impl("adamw_step_", &adamw_step_cuda); }

}  // namespace fastml
