// torch.ops.fastml.adamw_step_: one AdamW step over optimizer state in host memory, in one pass per element: read
// the gradient, update the fp32 master weight and Adam's m and v, write the weight (bf16 or fp32) that goes back to
// the GPU. The arithmetic is torch.optim.AdamW's single-tensor step, op for op and rounding for rounding as torch's
// vectorised CPU kernels round (adamw_step_reference_ in executor/cpu_adam.py, the reference beside this op): built
// with -ffp-contract=off, each operation is rounded on its own but for the two fused multiply-adds written here with
// std::fma, those of torch's vectorised lerp and addcmul. The square root is the correctly rounded one.
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

namespace fastml {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTML_ISA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTML_ISA_CLONES
#endif

constexpr int64_t kGrainSize = 1 << 16;  // elements a thread takes at least: ~2 MB of traffic, well above the cost
                                         // of waking a thread

// The step's per-tensor constants, each computed in double and rounded to float as torch rounds a Python scalar
// handed to a float tensor's op.
struct StepConstants {
  float decay_factor;     // master.mul_(1 - lr * weight_decay)
  float lerp_coeff;       // exp_avg.lerp_(g, 1 - beta1): torch's vectorised lerp computes
  bool lerp_from_end;     //   fma(coeff, g - m, base), base m and coeff w when |w| < 0.5, else base g and coeff w - 1
  float beta2;            // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;  //   .addcmul_(g, g, value=1 - beta2): fma(value * g, g, v * beta2) vectorised
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
  float grad_scale;
};

StepConstants step_constants(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             double grad_scale) {
  StepConstants c;
  c.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  const float weight = static_cast<float>(1.0 - beta1);
  c.lerp_from_end = !(std::abs(weight) < 0.5f);
  c.lerp_coeff = c.lerp_from_end ? weight - 1.0f : weight;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double steps = static_cast<double>(step);
  // std::pow as Python's ** (both are C's pow), so the constants match the Python reference's bit for bit.
  c.bias_correction2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, steps), 0.5));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, steps))));
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// bf16 values travel as their bits. Rounding to nearest even as c10::BFloat16 rounds (NaN to 0x7FC0), in integer
// arithmetic only: c10's float NaN test is a branch that keeps GCC from vectorising the loop.
inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  const bool is_nan = (bits & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000);
  return is_nan ? UINT16_C(0x7FC0) : static_cast<uint16_t>(rounded);
}

inline float bf16_to_float(uint16_t bits) { return c10::detail::f32_from_bits(bits); }

inline float load_grad(const float* grad, int64_t i) { return grad[i]; }
inline float load_grad(const uint16_t* grad, int64_t i) { return bf16_to_float(grad[i]); }

// A bf16 gradient is scaled as the GPU path clips it in place: scaled in float, rounded back to bf16.
inline float scale_grad(float g, float scale, const float*) { return g * scale; }
inline float scale_grad(float g, float scale, const uint16_t*) { return bf16_to_float(bf16_bits(g * scale)); }

struct NoOutput {};
inline void store_weight(float* out, int64_t i, float value) { out[i] = value; }
inline void store_weight(uint16_t* out, int64_t i, float value) { out[i] = bf16_bits(value); }
inline void store_weight(NoOutput*, int64_t, float) {}

// `c` by value: a reference could alias the buffers, and GCC would reload it in the loop instead of vectorising.
// kLerpFromEnd is a template parameter for the same reason: a select on a run-time flag stops GCC when the loop mixes
// 16- and 32-bit types.
template <bool kLerpFromEnd, typename Grad, typename Out>
C10_ALWAYS_INLINE void step_range(const StepConstants c, float* __restrict master, float* __restrict exp_avg,
                                  float* __restrict exp_avg_sq, const Grad* __restrict grad, Out* __restrict out,
                                  int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = scale_grad(load_grad(grad, i), c.grad_scale, grad);
    const float decayed = master[i] * c.decay_factor;
    const float m_old = exp_avg[i];
    const float m = std::fma(c.lerp_coeff, g - m_old, kLerpFromEnd ? g : m_old);
    const float v = std::fma(c.one_minus_beta2 * g, g, exp_avg_sq[i] * c.beta2);
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    const float updated = decayed + c.neg_step_size * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = updated;
    store_weight(out, i, updated);
  }
}

enum class GradKind { kFloat, kBFloat16 };
enum class OutKind { kNone, kFloat, kBFloat16 };

struct StepBuffers {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* out;
  GradKind grad_kind;
  OutKind out_kind;
};

template <typename Grad, typename Out>
C10_ALWAYS_INLINE void step_range(const StepConstants& c, const StepBuffers& b, int64_t begin, int64_t end) {
  const auto* grad = static_cast<const Grad*>(b.grad);
  auto* out = static_cast<Out*>(b.out);
  if (c.lerp_from_end) step_range<true>(c, b.master, b.exp_avg, b.exp_avg_sq, grad, out, begin, end);
  else step_range<false>(c, b.master, b.exp_avg, b.exp_avg_sq, grad, out, begin, end);
}

// One clone per ISA level; the dtype switch sits outside the loops so that each loop is vectorised on its own.
FASTML_ISA_CLONES void step_chunk(const StepConstants& c, const StepBuffers& b, int64_t begin, int64_t end) {
  const bool bf16_grad = b.grad_kind == GradKind::kBFloat16;
  switch (b.out_kind) {
    case OutKind::kNone:
      if (bf16_grad) step_range<uint16_t, NoOutput>(c, b, begin, end);
      else step_range<float, NoOutput>(c, b, begin, end);
      break;
    case OutKind::kFloat:
      if (bf16_grad) step_range<uint16_t, float>(c, b, begin, end);
      else step_range<float, float>(c, b, begin, end);
      break;
    case OutKind::kBFloat16:
      if (bf16_grad) step_range<uint16_t, uint16_t>(c, b, begin, end);
      else step_range<float, uint16_t>(c, b, begin, end);
      break;
  }
}

struct NamedTensor {
  const at::Tensor& tensor;
  const char* name;
  bool may_be_bf16;
};

std::vector<NamedTensor> named_tensors(const at::Tensor& master, const at::Tensor& exp_avg,
                                       const at::Tensor& exp_avg_sq, const at::Tensor& grad,
                                       const std::optional<at::Tensor>& weight_out) {
  std::vector<NamedTensor> tensors = {
      {master, "master", false}, {exp_avg, "exp_avg", false}, {exp_avg_sq, "exp_avg_sq", false}, {grad, "grad", true}};
  if (weight_out.has_value()) tensors.push_back({*weight_out, "weight_out", true});
  return tensors;
}

// `device`: CPU for the CPU kernel; meta for the meta kernel when every tensor is on meta.
void check_tensors(const std::vector<NamedTensor>& tensors, c10::DeviceType device) {
  const int64_t numel = tensors.front().tensor.numel();
  for (const auto& [t, name, may_be_bf16] : tensors) {
    const auto dtype = t.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || (may_be_bf16 && dtype == at::kBFloat16), "fastml::adamw_step_: ", name,
                " must be ", may_be_bf16 ? "float32 or bfloat16" : "float32", ", got ", dtype);
    TORCH_CHECK(t.device().type() == device, "fastml::adamw_step_: ", name,
                " must be a CPU tensor (the op steps optimizer state in host memory), got one on ", t.device());
    TORCH_CHECK(t.is_contiguous(), "fastml::adamw_step_: ", name, " must be contiguous");
    TORCH_CHECK(t.numel() == numel, "fastml::adamw_step_: ", name, " has ", t.numel(), " elements, master has ",
                numel);
  }
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.const_data_ptr());
  const auto* b_begin = static_cast<const char*>(b.const_data_ptr());
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

// The loop reads and writes the buffers through restrict pointers: no two of them may share memory.
void check_no_overlap(const std::vector<NamedTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      TORCH_CHECK(!overlaps(tensors[i].tensor, tensors[j].tensor), "fastml::adamw_step_: ", tensors[i].name, " and ",
                  tensors[j].name, " share memory; each must be a buffer of its own");
    }
  }
}

void check_hyperparameters(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                           double grad_scale) {
  // The same bounds as torch.optim.AdamW's, plus the step count that bias correction divides by.
  TORCH_CHECK(lr >= 0.0, "fastml::adamw_step_: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "fastml::adamw_step_: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "fastml::adamw_step_: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "fastml::adamw_step_: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "fastml::adamw_step_: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(step >= 1, "fastml::adamw_step_: step counts the steps taken including this one, so it is >= 1, got ",
              step);
  TORCH_CHECK(std::isfinite(grad_scale), "fastml::adamw_step_: grad_scale must be finite, got ", grad_scale);
}

void adamw_step_cpu(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step, double grad_scale) {
  const auto tensors = named_tensors(master, exp_avg, exp_avg_sq, grad, weight_out);
  check_tensors(tensors, c10::DeviceType::CPU);
  check_no_overlap(tensors);
  check_hyperparameters(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const StepConstants constants = step_constants(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  StepBuffers buffers{master.mutable_data_ptr<float>(), exp_avg.mutable_data_ptr<float>(),
                      exp_avg_sq.mutable_data_ptr<float>(), grad.const_data_ptr(), nullptr,
                      grad.scalar_type() == at::kBFloat16 ? GradKind::kBFloat16 : GradKind::kFloat, OutKind::kNone};
  if (weight_out.has_value()) {
    buffers.out = weight_out->mutable_data_ptr();
    buffers.out_kind = weight_out->scalar_type() == at::kBFloat16 ? OutKind::kBFloat16 : OutKind::kFloat;
  }
  at::parallel_for(0, master.numel(), kGrainSize,
                   [&](int64_t begin, int64_t end) { step_chunk(constants, buffers, begin, end); });
}

// Checks only, so that tracing (torch.compile, FakeTensor) can pass over the op. The dispatcher also picks this
// kernel when a meta tensor is mixed with CPU ones: then the meta ones are refused as not on the CPU.
void adamw_step_meta(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, double, double, double,
                     double, double, int64_t, double) {
  const auto tensors = named_tensors(master, exp_avg, exp_avg_sq, grad, weight_out);
  const bool all_meta =
      std::all_of(tensors.begin(), tensors.end(), [](const NamedTensor& t) { return t.tensor.is_meta(); });
  check_tensors(tensors, all_meta ? c10::DeviceType::Meta : c10::DeviceType::CPU);
}

}  // namespace

TORCH_LIBRARY(fastml, m) {
  m.def(
      "adamw_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
      "Tensor(d!)? weight_out, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "float grad_scale) -> ()");
}

TORCH_LIBRARY_IMPL(fastml, CPU, m) { m.impl("adamw_step_", &adamw_step_cpu); }

TORCH_LIBRARY_IMPL(fastml, Meta, m) { m.impl("adamw_step_", &adamw_step_meta); }

}  // namespace fastml
