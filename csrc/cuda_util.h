// Small helpers of fastml's CUDA ops (csrc/*.cu).

#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fastml {

// The streaming multiprocessors of the current device: grid-stride kernels launch a few blocks per multiprocessor.
inline int64_t multiprocessors() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace fastml
