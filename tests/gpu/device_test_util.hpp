// Small CUDA helpers of the plain-main GPU tests (no GoogleTest on the device machine): a check that exits with
// the failing call's text, and synchronous copies of vectors to and from device memory.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CUDA_OK(expr)                                                               \
    do {                                                                            \
        cudaError_t e_ = (expr);                                                    \
        if (e_ != cudaSuccess) {                                                    \
            std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
            std::exit(3);                                                           \
        }                                                                           \
    } while (0)

namespace flatep::gpu_test {

// A device copy of v (at least min_elems elements allocated). The copy runs on the legacy stream: callers using
// other streams synchronise the device before their kernels read it.
template <typename T>
T* to_device(const std::vector<T>& v, size_t min_elems = 1) {
    T* p = nullptr;
    CUDA_OK(cudaMalloc(&p, std::max(v.size(), min_elems) * sizeof(T)));
    if (!v.empty()) CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}

template <typename T>
std::vector<T> from_device(const T* p, int64_t n) {
    std::vector<T> v(static_cast<size_t>(n));
    CUDA_OK(cudaMemcpy(v.data(), p, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

}  // namespace flatep::gpu_test
