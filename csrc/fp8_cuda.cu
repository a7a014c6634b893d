// torch.ops.fastml.quantize_fp8: a bf16 matrix cast to fp8 (e4m3 or e5m2) under a scale taken from its own current
// absolute maximum, just before the cast: scale = fp8_max / amax, so that the largest element lands on fp8_max and
// nothing is ever clipped (no scale remembered from earlier steps, which a growing tensor would overflow). It
// returns the fp8 matrix row-major, its transpose row-major, or both (the fp8 GEMMs of a linear layer's backward pass
// read the transposes), and the inverse scale that dequantizes them (`_scaled_mm`'s scale_a / scale_b).
//
// Two passes over memory, the fewest the data allows: the scale depends on every element, so one pass finds the
// absolute maximum and a second casts. Where the kernel that made x already took its maximum (the fused SwiGLU,
// executor/model/fused.py, gives one for each block of its output: `partial_amax`), the first pass reduces those
// instead, and x is read once. Both are one kernel, launched cooperatively (every block resident at once),
// whose blocks wait for each other between the passes: two kernels, as the op first was (one tiny block a tile), spent
// about a fifth of their time launching and draining blocks (benchmarks/NOTES.md). The cast reads each 64 x 128 tile
// once and writes the row-major cast directly and the transposed one through shared memory, so both outputs cost one
// read.
//
// The tile's shape and order were measured (benchmarks/NOTES.md, issue 25 part 9). Four 16-byte loads a thread, at
// three blocks a multiprocessor, beat two loads at five; more blocks, or the next tile's loads in flight, were slower.
// The blocks at work together cover groups of 8 tile rows, down a group before across it: walked row by row, they
// wrote 64 bytes into each of thousands of rows of the transpose at once, and a long-rowed matrix's transposing cast
// ran at 0.74 of HBM. The walk goes from the last tile to the first: the maximum pass read the end of the matrix
// last, so the cast finds that part still in L2.

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "cuda_util.h"

namespace fastml {
namespace {

constexpr int kTileRows = 64;         // a cast block's tile: kTileRows x kTileCols elements
constexpr int kTileCols = 128;
constexpr int kGroupRows = 8;         // tile rows of a group, walked down before across (the header says why)
constexpr int kThreads = 256;         // threads of a block
constexpr int kBlocksPerMultiprocessor = 3;  // registers for four tile loads a thread in flight, without spills
constexpr int kVector = 8;            // bf16 elements of one 16-byte load
constexpr int kPad = 4;               // bytes after each tile row in shared memory, to spread the transposed reads
constexpr int kAmaxLoads = 4;         // 16-byte loads a thread of the maximum pass has in flight

// The largest finite value of an fp8 format, from torch's own definition of the type (executor/model/fp8.py's FP8_MAX
// reads the same through torch.finfo), so the scale fp8_max / amax is the reference's.
template <typename Float8>
float finite_max() {
  return static_cast<float>(std::numeric_limits<Float8>::max());
}

__device__ __forceinline__ uint32_t abs_bits(__nv_bfloat16 x) {
  // |x| as float32 bits: non-negative floats order as unsigned integers, and a NaN's bits exceed every number's.
  return (static_cast<uint32_t>(__bfloat16_as_ushort(x)) << 16) & 0x7FFFFFFFu;
}

__device__ __forceinline__ uint32_t packed_amax(const uint4 packed) {
  const auto* values = reinterpret_cast<const __nv_bfloat16*>(&packed);
  uint32_t local = 0;
#pragma unroll
  for (int j = 0; j < kVector; ++j) local = max(local, abs_bits(values[j]));
  return local;
}

// A block's maximum into amax_bits, with every other block's (atomicMax).
__device__ void block_amax(uint32_t local, uint32_t* __restrict__ amax_bits) {
  for (int shift = 16; shift > 0; shift /= 2) local = max(local, __shfl_xor_sync(0xFFFFFFFFu, local, shift));
  __shared__ uint32_t warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) local = max(local, warps[w]);
    atomicMax(amax_bits, local);
  }
}

// The first pass: amax_bits (zeroed before) receives max |x| as float32 bits: from x itself, or from the maxima of
// x's parts that the kernel that made x wrote (`partials`, `partial_count` of them, float32 bits of |x|'s maxima).
__device__ void amax_pass(const __nv_bfloat16* __restrict__ x, int64_t numel, bool vectorized,
                          const uint32_t* __restrict__ partials, int64_t partial_count,
                          uint32_t* __restrict__ amax_bits) {
  uint32_t local = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (partials != nullptr) {
    for (int64_t i = first; i < partial_count; i += stride) local = max(local, partials[i]);
  } else if (vectorized) {  // numel divisible by kVector and x 16-byte aligned
    const auto* vectors = reinterpret_cast<const uint4*>(x);
    const int64_t count = numel / kVector;
    int64_t v = first;
    // kAmaxLoads loads issued before any is used: one at a time, a thread waits out each load's latency and the
    // pass kept too few bytes in flight to reach HBM's rate.
    for (; v + (kAmaxLoads - 1) * stride < count; v += kAmaxLoads * stride) {
      uint4 packed[kAmaxLoads];
#pragma unroll
      for (int u = 0; u < kAmaxLoads; ++u) packed[u] = vectors[v + u * stride];
#pragma unroll
      for (int u = 0; u < kAmaxLoads; ++u) local = max(local, packed_amax(packed[u]));
    }
    for (; v < count; v += stride) local = max(local, packed_amax(vectors[v]));
  } else {
    for (int64_t i = first; i < numel; i += stride) local = max(local, abs_bits(x[i]));
  }
  block_amax(local, amax_bits);
}

template <typename Fp8>
__device__ __forceinline__ uint8_t to_fp8(float value);
template <>
__device__ __forceinline__ uint8_t to_fp8<__nv_fp8_e4m3>(float value) {
  return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3);
}
template <>
__device__ __forceinline__ uint8_t to_fp8<__nv_fp8_e5m2>(float value) {
  return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E5M2);
}

// The scale from the absolute maximum: fp8_max / amax, at most FLT_MAX (an amax near float32's smallest would give
// infinity), or 1 for an all-zero tensor. A NaN or infinite amax gives a NaN or zero scale, so that a non-finite input
// stays visible downstream (the training step is then skipped).
__device__ __forceinline__ float scale_of(uint32_t amax_bits, float fp8_max) {
  const float amax = __uint_as_float(amax_bits);
  const float scale = __fdiv_rn(fp8_max, amax);
  return amax == 0.0f ? 1.0f : scale > FLT_MAX ? FLT_MAX : scale;
}

struct QuantizeArgs {
  const __nv_bfloat16* x;
  int64_t rows, cols;
  bool vectorized;  // the maximum pass may read x 16 bytes at a time
  bool aligned;     // full tiles may use 16-byte loads, 8-byte row-major stores and 4-byte transposed ones
  float fp8_max;
  const uint32_t* partials;  // maxima of x's parts, or null: the first pass then reads x
  int64_t partial_count;
  uint32_t* amax_bits;  // zeroed before the launch
  uint8_t* q;           // rows x cols, or null
  uint8_t* q_t;         // cols x rows, or null
  float* scale_inv;
};

// A full tile's transpose into q_t (cols x rows): each thread reads 4 x 4 blocks of the tile (two of its 512) as four
// 4-byte words, transposes their bytes in registers and writes four 4-byte pieces of four rows of q_t; the 16 threads
// of a half warp cover one 64-byte row of the tile's transpose (of 128 rows). (Gathered one byte a shared-memory
// load, the cast of both layouts stayed at 0.73 of HBM: benchmarks/NOTES.md.)
__device__ __forceinline__ void write_transposed(const QuantizeArgs& a, int64_t row0, int64_t col0,
                                                 const uint8_t (&tile)[kTileRows][kTileCols + kPad]) {
  constexpr int kBlocks = kTileRows * kTileCols / 16;  // 4 x 4 blocks of a tile
  static_assert(kBlocks % kThreads == 0, "a tile's 4 x 4 blocks are shared evenly by the block's threads");
#pragma unroll
  for (int i = 0; i < kBlocks / kThreads; ++i) {
    const int block = threadIdx.x + i * kThreads;
    const int r = (block % (kTileRows / 4)) * 4, c = (block / (kTileRows / 4)) * 4;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = *reinterpret_cast<const uint32_t*>(&tile[r + j][c]);
    // byte i of out[k] is byte k of w[i]: pair the rows' bytes, then the pairs
    const uint32_t low01 = __byte_perm(w[0], w[1], 0x5140), high01 = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t low23 = __byte_perm(w[2], w[3], 0x5140), high23 = __byte_perm(w[2], w[3], 0x7362);
    const uint32_t out[4] = {__byte_perm(low01, low23, 0x5410), __byte_perm(low01, low23, 0x7632),
                             __byte_perm(high01, high23, 0x5410), __byte_perm(high01, high23, 0x7632)};
#pragma unroll
    for (int k = 0; k < 4; ++k) *reinterpret_cast<uint32_t*>(a.q_t + (col0 + c + k) * a.rows + row0 + r) = out[k];
  }
}

// The second pass over one kTileRows x kTileCols tile (its first row and column): q[r][c] = fp8(x[r][c] * scale) and
// q_t[c][r] = the same byte, each written only where requested (non-null).
template <typename Fp8>
__device__ void cast_tile(const QuantizeArgs& a, float scale, int64_t row0, int64_t col0,
                          uint8_t (&tile)[kTileRows][kTileCols + kPad]) {
  const bool full = a.aligned && row0 + kTileRows <= a.rows && col0 + kTileCols <= a.cols;
  constexpr int kSegments = kTileRows * kTileCols / kVector;  // 8-element row segments of a tile
  constexpr int kPerThread = kSegments / kThreads;
  static_assert(kSegments % kThreads == 0, "a tile's segments are shared evenly by the block's threads");
  uint4 packed[kPerThread];
  if (full) {  // every load issued before any is used, as in the maximum pass
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int s = threadIdx.x + k * kThreads;
      const int r = s / (kTileCols / kVector), c = (s % (kTileCols / kVector)) * kVector;
      packed[k] = *reinterpret_cast<const uint4*>(a.x + (row0 + r) * a.cols + col0 + c);
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int s = threadIdx.x + k * kThreads;
    const int r = s / (kTileCols / kVector), c = (s % (kTileCols / kVector)) * kVector;
    const int64_t row = row0 + r, col = col0 + c;
    alignas(8) uint8_t bytes[kVector];
    if (full) {
      const auto* values = reinterpret_cast<const __nv_bfloat16*>(&packed[k]);
#pragma unroll
      for (int j = 0; j < kVector; ++j) bytes[j] = to_fp8<Fp8>(__bfloat162float(values[j]) * scale);
      if (a.q != nullptr) *reinterpret_cast<uint2*>(a.q + row * a.cols + col) = *reinterpret_cast<const uint2*>(bytes);
    } else {
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        const bool inside = row < a.rows && col + j < a.cols;
        bytes[j] = inside ? to_fp8<Fp8>(__bfloat162float(a.x[row * a.cols + col + j]) * scale) : 0;
        if (inside && a.q != nullptr) a.q[row * a.cols + col + j] = bytes[j];
      }
    }
    if (a.q_t != nullptr) {  // two 4-byte stores: a row of the tile starts 4-byte aligned
      auto* words = reinterpret_cast<uint32_t*>(&tile[r][c]);
      words[0] = *reinterpret_cast<const uint32_t*>(bytes);
      words[1] = *reinterpret_cast<const uint32_t*>(bytes + 4);
    }
  }
  if (a.q_t == nullptr) return;
  __syncthreads();
  if (full) {
    write_transposed(a, row0, col0, tile);
  } else {  // q_t is cols x rows: its row (col0 + c) holds the tile's column c, one byte at a time
    for (int s = threadIdx.x; s < kTileRows * kTileCols; s += kThreads) {
      const int c = s / kTileRows, r = s % kTileRows;
      if (col0 + c < a.cols && row0 + r < a.rows) a.q_t[(col0 + c) * a.rows + row0 + r] = tile[r][c];
    }
  }
  __syncthreads();  // the tile's bytes are read before the next tile writes them
}

// Tile t's first row and column, in groups of kGroupRows tile rows walked down before across (a permutation of the
// row-major order; the last group may be shorter).
__device__ __forceinline__ void tile_origin(int64_t t, int64_t tile_rows, int64_t tile_cols, int64_t& row0,
                                            int64_t& col0) {
  const int64_t group = t / (kGroupRows * tile_cols), first = group * kGroupRows;
  const int64_t height = min(static_cast<int64_t>(kGroupRows), tile_rows - first);
  const int64_t within = t - group * kGroupRows * tile_cols;
  row0 = (first + within % height) * kTileRows;
  col0 = (within / height) * kTileCols;
}

// Both passes: the maximum over the whole grid, a wait for every block, then the tiles, the last one first.
template <typename Fp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor) quantize_kernel(const QuantizeArgs a) {
  __shared__ alignas(16) uint8_t tile[kTileRows][kTileCols + kPad];  // read and written 4 bytes at a time
  amax_pass(a.x, a.rows * a.cols, a.vectorized, a.partials, a.partial_count, a.amax_bits);
  cooperative_groups::this_grid().sync();  // a fence too: every block's atomicMax is seen after it
  const float scale = scale_of(*reinterpret_cast<volatile uint32_t*>(a.amax_bits), a.fp8_max);
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale_inv = __frcp_rn(scale);
  const int64_t tile_cols = (a.cols + kTileCols - 1) / kTileCols, tile_rows = (a.rows + kTileRows - 1) / kTileRows;
  for (int64_t t = tile_rows * tile_cols - 1 - blockIdx.x; t >= 0; t -= gridDim.x) {
    int64_t row0, col0;
    tile_origin(t, tile_rows, tile_cols, row0, col0);
    cast_tile<Fp8>(a, scale, row0, col0, tile);
  }
}

// As many blocks as the GPU holds at once (a cooperative launch may not ask for more), but no more than there are
// tiles: a block without a tile would only add to the maximum pass's wait. The occupancy is asked once a process: the
// op is built for the one GPU architecture in use (executor/native.py). A cooperative grid starts only when all of
// it fits beside what else runs, so a collective's kernel on another stream delays the cast (not yet traced on two
// GPUs).
template <typename Fp8>
int resident_blocks() {
  static const int per_multiprocessor = [] {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, quantize_kernel<Fp8>, kThreads, 0));
    TORCH_CHECK(blocks > 0, "fastml::quantize_fp8: the kernel cannot run on this GPU (no block fits)");
    return blocks;
  }();
  return static_cast<int>(per_multiprocessor * multiprocessors());
}

template <typename Fp8>
void launch_quantize(QuantizeArgs args, int64_t tiles, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(resident_blocks<Fp8>(), tiles));
  void* params[] = {&args};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&quantize_kernel<Fp8>), dim3(blocks),
                                             dim3(kThreads), params, 0, stream));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_fp8_cuda(const at::Tensor& x, at::ScalarType dtype,
                                                                 bool rowwise, bool transposed,
                                                                 const std::optional<at::Tensor>& partial_amax) {
  TORCH_CHECK(x.is_cuda(), "fastml::quantize_fp8: x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fastml::quantize_fp8: x must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "fastml::quantize_fp8: x must be a matrix, got ", x.dim(), " dimensions");
  TORCH_CHECK(x.is_contiguous(), "fastml::quantize_fp8: x must be contiguous");
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "fastml::quantize_fp8: dtype must be float8_e4m3fn or float8_e5m2, got ", dtype);
  TORCH_CHECK(rowwise || transposed, "fastml::quantize_fp8: ask for the row-major cast, the transposed one or both");
  if (partial_amax.has_value()) {
    const at::Tensor& p = *partial_amax;
    TORCH_CHECK(p.device() == x.device() && p.scalar_type() == at::kInt && p.is_contiguous(),
                "fastml::quantize_fp8: partial_amax must be a contiguous int32 tensor on x's device (the float32 "
                "bits of |x|'s maxima), got ", p.scalar_type(), " on ", p.device());
    TORCH_CHECK(p.numel() > 0 || x.numel() == 0, "fastml::quantize_fp8: partial_amax is empty, x is not");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto options = x.options().dtype(dtype);
  at::Tensor q = at::empty({rowwise ? rows : 0, rowwise ? cols : 0}, options);
  at::Tensor q_t = at::empty({transposed ? cols : 0, transposed ? rows : 0}, options);
  at::Tensor scale_inv = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor amax_bits = at::empty({}, x.options().dtype(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // zeroed by a memset, not by at::zeros' fill kernel: one kernel fewer a cast
  C10_CUDA_CHECK(cudaMemsetAsync(amax_bits.mutable_data_ptr(), 0, sizeof(uint32_t), stream));
  const int64_t numel = x.numel();
  if (numel == 0) {
    scale_inv.fill_(1.0);
    return {q, q_t, scale_inv};
  }
  const auto* input = reinterpret_cast<const __nv_bfloat16*>(x.const_data_ptr());
  QuantizeArgs args;
  args.x = input;
  args.rows = rows;
  args.cols = cols;
  args.vectorized = numel % kVector == 0 && aligned16(input);
  // Full tiles use 16-byte loads and 8-byte stores along a row, 4-byte stores along a transposed one: rows of x and
  // of q_t must keep them aligned.
  args.aligned = aligned16(input) && cols % kVector == 0 && rows % kVector == 0;
  const void* partials = partial_amax.has_value() ? partial_amax->const_data_ptr() : nullptr;
  args.partials = reinterpret_cast<const uint32_t*>(partials);
  args.partial_count = partial_amax.has_value() ? partial_amax->numel() : 0;
  args.amax_bits = reinterpret_cast<uint32_t*>(amax_bits.mutable_data_ptr());
  args.q = rowwise ? reinterpret_cast<uint8_t*>(q.mutable_data_ptr()) : nullptr;
  args.q_t = transposed ? reinterpret_cast<uint8_t*>(q_t.mutable_data_ptr()) : nullptr;
  args.scale_inv = scale_inv.mutable_data_ptr<float>();
  const int64_t tiles = ((rows + kTileRows - 1) / kTileRows) * ((cols + kTileCols - 1) / kTileCols);
  if (dtype == at::kFloat8_e4m3fn) {
    args.fp8_max = finite_max<c10::Float8_e4m3fn>();
    launch_quantize<__nv_fp8_e4m3>(args, tiles, stream);
  } else {
    args.fp8_max = finite_max<c10::Float8_e5m2>();
    launch_quantize<__nv_fp8_e5m2>(args, tiles, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, q_t, scale_inv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastml, m) {
  m.def("quantize_fp8(Tensor x, ScalarType dtype, bool rowwise, bool transposed, Tensor? partial_amax=None) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastml, CUDA, m) { m.impl("quantize_fp8", &quantize_fp8_cuda); }

}  // namespace fastml
