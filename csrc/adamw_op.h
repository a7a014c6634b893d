// The checks and buffers of torch.ops.fastml.adamw_step_, shared by its CPU kernel (cpu_adam.cpp) and its CUDA one
// (adamw_cuda.cu): the same refusals, word for word, on both.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "adamw_math.h"

namespace fastml {

struct NamedTensor {
  const at::Tensor& tensor;
  const char* name;
};

inline std::vector<NamedTensor> named_tensors(const at::Tensor& master, const at::Tensor& exp_avg,
                                              const at::Tensor& exp_avg_sq, const at::Tensor& grad,
                                              const std::optional<at::Tensor>& weight_out,
                                              const std::optional<at::Tensor>& master_low) {
  std::vector<NamedTensor> tensors = {
      {master, "master"}, {exp_avg, "exp_avg"}, {exp_avg_sq, "exp_avg_sq"}, {grad, "grad"}};
  if (weight_out.has_value()) tensors.push_back({*weight_out, "weight_out"});
  if (master_low.has_value()) tensors.push_back({*master_low, "master_low"});
  return tensors;
}

// Each tensor is float32 or bfloat16, contiguous, of master's length, on `device` (the kernel's: CPU or CUDA; meta
// for the meta kernel when every tensor is on meta).
inline void check_tensors(const std::vector<NamedTensor>& tensors, c10::DeviceType device, const char* where) {
  const c10::SymInt numel = tensors.front().tensor.sym_numel();  // symbolic where torch.compile traces dynamic shapes
  for (const auto& [t, name] : tensors) {
    const auto dtype = t.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fastml::adamw_step_: ", name,
                " must be float32 or bfloat16, got ", dtype);
    TORCH_CHECK(t.device().type() == device, "fastml::adamw_step_: ", name, " must be ", where, ", got one on ",
                t.device());
    TORCH_CHECK(t.is_contiguous(), "fastml::adamw_step_: ", name, " must be contiguous");
    TORCH_CHECK(t.sym_numel() == numel, "fastml::adamw_step_: ", name, " has ", t.sym_numel(),
                " elements, master has ", numel);
    TORCH_CHECK(t.device() == tensors.front().tensor.device(), "fastml::adamw_step_: ", name, " is on ", t.device(),
                ", master on ", tensors.front().tensor.device());
  }
}

// m and v share a dtype; a weight to write goes with float32 masters only (bf16 masters are the weights themselves);
// a compensation with bfloat16 masters only, in bfloat16.
inline void check_dtypes(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                         const std::optional<at::Tensor>& weight_out, const std::optional<at::Tensor>& master_low) {
  TORCH_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type(),
              "fastml::adamw_step_: exp_avg and exp_avg_sq must have one dtype, got ", exp_avg.scalar_type(), " and ",
              exp_avg_sq.scalar_type());
  TORCH_CHECK(!weight_out.has_value() || master.scalar_type() == at::kFloat,
              "fastml::adamw_step_: weight_out goes with float32 masters; bfloat16 masters are the weights");
  // the message is built only on failure, where master_low is given
  TORCH_CHECK(!master_low.has_value() ||
                  (master.scalar_type() == at::kBFloat16 && master_low->scalar_type() == at::kBFloat16),
              "fastml::adamw_step_: master_low, the compensation of bfloat16 masters, goes with bfloat16 masters and "
              "is bfloat16; got ", master.scalar_type(), " masters and a ", master_low->scalar_type(), " master_low");
}

inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.const_data_ptr());
  const auto* b_begin = static_cast<const char*>(b.const_data_ptr());
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

// The loop reads and writes the buffers through restrict pointers: no two of them may share memory.
inline void check_no_overlap(const std::vector<NamedTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      TORCH_CHECK(!overlaps(tensors[i].tensor, tensors[j].tensor), "fastml::adamw_step_: ", tensors[i].name, " and ",
                  tensors[j].name, " share memory; each must be a buffer of its own");
    }
  }
}

inline void check_arguments(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                            double grad_scale, int64_t offset, int64_t numel) {
  // The same bounds as torch.optim.AdamW's, plus the step count that bias correction divides by.
  TORCH_CHECK(lr >= 0.0, "fastml::adamw_step_: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "fastml::adamw_step_: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "fastml::adamw_step_: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "fastml::adamw_step_: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "fastml::adamw_step_: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(step >= 1, "fastml::adamw_step_: step counts the steps taken including this one, so it is >= 1, got ",
              step);
  TORCH_CHECK(std::isfinite(grad_scale), "fastml::adamw_step_: grad_scale must be finite, got ", grad_scale);
  // The rounding hashes 32 bits of the element's index (adamw_math.h, random_bits).
  TORCH_CHECK(offset >= 0 && offset + numel <= (INT64_C(1) << 32), "fastml::adamw_step_: offset + elements must be "
              "within [0, 2**32], got offset ", offset, " and ", numel, " elements");
}

inline Kind kind_of(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? Kind::kBFloat16 : Kind::kFloat; }

struct StepBuffers {
  void* master;
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* out;
  void* low;
  StepKinds kinds;
};

// Checks everything, then the constants and buffers of one call on `device`.
inline std::pair<StepConstants, StepBuffers> checked_step(
    const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& grad,
    const std::optional<at::Tensor>& weight_out, double lr, double beta1, double beta2, double eps,
    double weight_decay, int64_t step, double grad_scale, int64_t seed, int64_t offset,
    const std::optional<at::Tensor>& master_low, c10::DeviceType device, const char* where) {
  const auto tensors = named_tensors(master, exp_avg, exp_avg_sq, grad, weight_out, master_low);
  check_tensors(tensors, device, where);
  check_dtypes(master, exp_avg, exp_avg_sq, weight_out, master_low);
  check_no_overlap(tensors);
  check_arguments(lr, beta1, beta2, eps, weight_decay, step, grad_scale, offset, master.numel());
  StepBuffers buffers{master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.const_data_ptr(),
                      weight_out.has_value() ? weight_out->data_ptr() : nullptr,
                      master_low.has_value() ? master_low->data_ptr() : nullptr,
                      {kind_of(master), kind_of(exp_avg), kind_of(grad),
                       weight_out.has_value() ? kind_of(*weight_out) : Kind::kNone,
                       master_low.has_value() ? kind_of(*master_low) : Kind::kNone}};
  return {step_constants(lr, beta1, beta2, eps, weight_decay, step, grad_scale, seed, offset), buffers};
}

}  // namespace fastml
