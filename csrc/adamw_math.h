// One AdamW step of one element, shared by the CPU op (cpu_adam.cpp) and the GPU one (adamw_cuda.cu), so that both
// compute the same bits: torch.optim.AdamW's single-tensor step, op for op and rounding for rounding as torch's
// vectorised CPU kernels round (adamw_step_reference_ in executor/memory/cpu_adam.py is the reference beside them). Each
// operation is rounded on its own (both builds have -ffp-contract=off for host code, the GPU's --fmad=false for device
// code) but for the two fused multiply-adds written here, those of torch's vectorised lerp and addcmul. The square
// root and the division are the correctly rounded ones on both. (A NaN's payload may differ; a bf16 NaN is 0x7FC0.)
//
// Each of master, exp_avg and exp_avg_sq is float32 or bfloat16. A bfloat16 one is written with stochastic
// rounding: the float32 result rounds up with probability equal to how far it lies towards the next bfloat16, so that
// an update smaller than half a bfloat16 step still moves the weight on average instead of being lost. The random
// bits are a hash of a per-call seed and the element's index (`random_bits`): no generator state, the same bits on
// the CPU and the GPU, and a resumed run draws exactly what the uninterrupted one drew.
//
// A bfloat16 master may instead come with a compensation (`low`, bfloat16, knobs.master_dtype "bf16_kahan"): the
// master is then the sum master + low, about 16 significant bits, and both are written rounded to nearest, master to
// the bfloat16 nearest the float32 result and low to the one nearest what that rounding dropped. An update too small
// for the weight's own bits accumulates in low until it moves the weight, without the noise stochastic rounding adds
// to every weight at every step (the Kahan summation of Zamirai et al., "Revisiting BFloat16 Training", 2020).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

// Everything here is inlined into its caller: the CPU op's loop must be compiled inside the function GCC clones for
// each ISA level (cpu_adam.cpp, target_clones). A call out of it, to an element's step that GCC chose not to inline,
// compiled that step for the baseline ISA, one element per call and fma from libm: ten times slower.
#if defined(__CUDACC__)
#define FASTML_HD __host__ __device__ __forceinline__
#define FASTML_DISPATCH inline
#elif defined(__GNUC__)
#define FASTML_HD inline __attribute__((always_inline))
#define FASTML_DISPATCH inline __attribute__((always_inline))
#else
#define FASTML_HD inline
#define FASTML_DISPATCH inline
#endif

namespace fastml {

// The step's per-tensor constants, each computed in double on the host and rounded to float as torch rounds a
// Python scalar handed to a float tensor's op.
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
  uint32_t key_low, key_high;  // the stochastic rounding's 64-bit seed, mixed (`rounding_keys`)
  uint64_t offset;  // index of the first element in the whole parameter: a slice draws what the whole would
};

inline StepConstants step_constants(double lr, double beta1, double beta2, double eps, double weight_decay,
                                    int64_t step, double grad_scale, int64_t seed, int64_t offset);

// --- the random bits of stochastic rounding ------------------------------------------------------------------------

// A 32-bit integer hash with full avalanche: the "lowbias32" shift and multiply constants found by Chris Wellons'
// hash-prospector. A bijection, so distinct inputs never collide.
FASTML_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= UINT32_C(0x7feb352d);
  x ^= x >> 15;
  x *= UINT32_C(0x846ca68b);
  x ^= x >> 16;
  return x;
}

// Two 32-bit keys from the 64-bit seed, each depending on all of it: two seeds draw alike only if both keys match.
inline void rounding_keys(int64_t seed, uint32_t* low, uint32_t* high) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t a = static_cast<uint32_t>(s), b = static_cast<uint32_t>(s >> 32);
  *low = mix32(a ^ mix32(b));
  *high = mix32(b ^ mix32(a + UINT32_C(0x9E3779B9)));
}

// 32 random bits for element `index` under the keys; a second word, for the third tensor, is mix32 of the first.
FASTML_HD uint32_t random_bits(uint32_t key_low, uint32_t key_high, uint64_t index) {
  return mix32(mix32(static_cast<uint32_t>(index) ^ key_low) + key_high);
}

// --- bfloat16, as its bits ------------------------------------------------------------------------------------------

FASTML_HD uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

FASTML_HD float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

FASTML_HD bool is_nan_bits(uint32_t bits) { return (bits & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000); }

// Round to nearest even as c10::BFloat16 rounds (NaN to 0x7FC0), in integer arithmetic only: c10's float NaN test is
// a branch that keeps GCC from vectorising the loop.
FASTML_HD uint16_t bf16_nearest(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  return is_nan_bits(bits) ? UINT16_C(0x7FC0) : static_cast<uint16_t>(rounded);
}

// Stochastic rounding: add 16 random bits below the kept ones and truncate. The result rounds away from zero with
// probability (dropped bits) / 2**16, which makes its expectation the float32 value exactly. Infinities stay (their
// dropped bits are zero, so nothing carries); a NaN becomes 0x7FC0.
FASTML_HD uint16_t bf16_stochastic(float value, uint32_t random16) {
  const uint32_t bits = float_bits(value);
  const uint32_t rounded = (bits + (random16 & UINT32_C(0xFFFF))) >> 16;
  return is_nan_bits(bits) ? UINT16_C(0x7FC0) : static_cast<uint16_t>(rounded);
}

FASTML_HD float bf16_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

// Loads and stores by role: a bfloat16 travels as uint16_t. Master weights and Adam's moments are stored with
// stochastic rounding; the weight rounded from an fp32 master (`out`) to nearest even, as torch's copy_ rounds.
struct NoOutput {};
FASTML_HD float load(const float* p, int64_t i) { return p[i]; }
FASTML_HD float load(const uint16_t* p, int64_t i) { return bf16_float(p[i]); }
FASTML_HD void store_rounded(float* p, int64_t i, float value, uint32_t) { p[i] = value; }
FASTML_HD void store_rounded(uint16_t* p, int64_t i, float value, uint32_t random16) {
  p[i] = bf16_stochastic(value, random16);
}
FASTML_HD void store_weight(float* out, int64_t i, float value) { out[i] = value; }
FASTML_HD void store_weight(uint16_t* out, int64_t i, float value) { out[i] = bf16_nearest(value); }
FASTML_HD void store_weight(NoOutput*, int64_t, float) {}

// The master's value, and its store: alone (`NoOutput` low), or bf16 with its compensation.
template <typename Master>
FASTML_HD float load_master(const Master* master, const NoOutput*, int64_t i) { return load(master, i); }
FASTML_HD float load_master(const uint16_t* master, const uint16_t* low, int64_t i) {
  return bf16_float(master[i]) + bf16_float(low[i]);
}
template <typename Master>
FASTML_HD void store_master(Master* master, NoOutput*, int64_t i, float value, uint32_t random16) {
  store_rounded(master, i, value, random16);
}
FASTML_HD void store_master(uint16_t* master, uint16_t* low, int64_t i, float value, uint32_t) {
  const uint16_t high = bf16_nearest(value);
  master[i] = high;
  low[i] = bf16_nearest(value - bf16_float(high));  // exact in float32: value and high are within a bf16 step
}

// A bf16 gradient is scaled as the GPU path clips it in place: scaled in float, rounded back to bf16. On the GPU by
// its one conversion instruction, which rounds as bf16_nearest does but for a NaN's bits (0x7FFF, which the GPU's
// arithmetic after it does not keep), instead of bf16_nearest's integer arithmetic: the step's integer pipeline was
// its busiest (ncu), and the instruction made the step 4% faster (benchmarks/NOTES.md).
FASTML_HD float scale_grad(float g, float scale, const float*) { return g * scale; }
FASTML_HD float scale_grad(float g, float scale, const uint16_t*) {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__float2bfloat16_rn(g * scale));
#else
  return bf16_float(bf16_nearest(g * scale));
#endif
}

FASTML_HD float fused_multiply_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

FASTML_HD float square_root(float x) {  // correctly rounded on both
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// `c` by value: a reference could alias the buffers, and GCC would reload it in the loop instead of vectorising.
// kLerpFromEnd is a template parameter for the same reason: a select on a run-time flag stops GCC when the loop mixes
// 16- and 32-bit types.
template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Out, typename Low>
FASTML_HD void step_element(const StepConstants c, Master* __restrict__ master, State* __restrict__ exp_avg,
                            State* __restrict__ exp_avg_sq, const Grad* __restrict__ grad, Out* __restrict__ out,
                            Low* __restrict__ low, int64_t i) {
  const float g = scale_grad(load(grad, i), c.grad_scale, grad);
  const float decayed = load_master(master, low, i) * c.decay_factor;
  const float m_old = load(exp_avg, i);
  const float m = fused_multiply_add(c.lerp_coeff, g - m_old, kLerpFromEnd ? g : m_old);
  const float v = fused_multiply_add(c.one_minus_beta2 * g, g, load(exp_avg_sq, i) * c.beta2);
  const float denom = square_root(v) / c.bias_correction2_sqrt + c.eps;
  const float updated = decayed + c.neg_step_size * m / denom;
  // Unused (and so not computed) where all three are float32.
  const uint32_t bits = random_bits(c.key_low, c.key_high, c.offset + static_cast<uint64_t>(i));
  store_rounded(exp_avg, i, m, bits >> 16);
  store_rounded(exp_avg_sq, i, v, mix32(bits));
  store_master(master, low, i, updated, bits);
  store_weight(out, i, updated);
}

inline StepConstants step_constants(double lr, double beta1, double beta2, double eps, double weight_decay,
                                    int64_t step, double grad_scale, int64_t seed, int64_t offset) {
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
  rounding_keys(seed, &c.key_low, &c.key_high);
  c.offset = static_cast<uint64_t>(offset);
  return c;
}

// The dtypes of one call, and the one instantiation of step_element for them: `run` is called with null pointers of
// the six types and the lerp flag as std::integral_constant, and casts the buffers itself. The switch sits outside
// the loops so that each loop is compiled (and vectorised) for its types alone.
enum class Kind { kNone, kFloat, kBFloat16 };

struct StepKinds {
  Kind master, state, grad, out, low;
};

template <bool kLerpFromEnd, typename Master, typename State, typename Grad, typename Run>
FASTML_DISPATCH void with_out(const StepKinds& k, Run&& run) {
  const std::integral_constant<bool, kLerpFromEnd> lerp;
  if constexpr (std::is_same_v<Master, float>) {  // bf16 masters are the weights themselves: no output
    if (k.out == Kind::kFloat) {
      return run(lerp, (Master*)nullptr, (State*)nullptr, (const Grad*)nullptr, (float*)nullptr, (NoOutput*)nullptr);
    }
    if (k.out == Kind::kBFloat16) {
      return run(lerp, (Master*)nullptr, (State*)nullptr, (const Grad*)nullptr, (uint16_t*)nullptr,
                 (NoOutput*)nullptr);
    }
  } else if (k.low == Kind::kBFloat16) {  // a compensation goes with bf16 masters only
    return run(lerp, (Master*)nullptr, (State*)nullptr, (const Grad*)nullptr, (NoOutput*)nullptr, (uint16_t*)nullptr);
  }
  run(lerp, (Master*)nullptr, (State*)nullptr, (const Grad*)nullptr, (NoOutput*)nullptr, (NoOutput*)nullptr);
}

template <bool kLerpFromEnd, typename Master, typename State, typename Run>
FASTML_DISPATCH void with_grad(const StepKinds& k, Run&& run) {
  if (k.grad == Kind::kBFloat16) with_out<kLerpFromEnd, Master, State, uint16_t>(k, run);
  else with_out<kLerpFromEnd, Master, State, float>(k, run);
}

template <bool kLerpFromEnd, typename Run>
FASTML_DISPATCH void with_master(const StepKinds& k, Run&& run) {
  const bool bf16_state = k.state == Kind::kBFloat16;
  if (k.master == Kind::kBFloat16) {
    if (bf16_state) with_grad<kLerpFromEnd, uint16_t, uint16_t>(k, run);
    else with_grad<kLerpFromEnd, uint16_t, float>(k, run);
  } else if (bf16_state) {
    with_grad<kLerpFromEnd, float, uint16_t>(k, run);
  } else {
    with_grad<kLerpFromEnd, float, float>(k, run);
  }
}

template <typename Run>
FASTML_DISPATCH void dispatch_step(const StepConstants& c, const StepKinds& k, Run&& run) {
  if (c.lerp_from_end) with_master<true>(k, run);
  else with_master<false>(k, run);
}

}  // namespace fastml
