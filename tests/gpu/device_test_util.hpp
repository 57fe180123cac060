// Small CUDA helpers of the plain-main GPU tests (no GoogleTest on the device machine): a check that exits with
// the failing call's text, synchronous copies of vectors to and from device memory, and the ipc tests' command line
// and device choice (one GPU for all rank processes, or one GPU per rank).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "flatep/ipc.hpp"

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
    if (n > 0) CUDA_OK(cudaMemcpy(v.data(), p, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

// Command line of the ipc GPU tests: `[--gpu-per-rank] [R ...]`. Returns false (after printing the usage) on an
// unknown flag or a rank count below 1.
struct IpcTestArgs {
    bool gpu_per_rank = false;  // rank r on device r % device count; default: every rank on device 0
    std::vector<int> rank_counts;
};

inline bool parse_ipc_test_args(int argc, char** argv, const std::vector<int>& default_counts, IpcTestArgs& out) {
    out = IpcTestArgs{};
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--gpu-per-rank") == 0) {
            out.gpu_per_rank = true;
            continue;
        }
        const int count = std::atoi(argv[i]);
        if (count < 1) {
            std::fprintf(stderr, "%s: unknown argument '%s'\nusage: %s [--gpu-per-rank] [R ...]\n", argv[0], argv[i],
                         argv[0]);
            return false;
        }
        out.rank_counts.push_back(count);
    }
    if (out.rank_counts.empty()) out.rank_counts = default_counts;
    return true;
}

// Device of `rank`: r % cudaGetDeviceCount() with gpu_per_rank, else 0. Makes it current and initialises its primary
// context now, so the ipc transport (which allocates on the current context's device) and later runtime calls agree.
// Call it in the rank's process before creating the transport.
inline int use_rank_device(int rank, bool gpu_per_rank) {
    int count = 0;
    CUDA_OK(cudaGetDeviceCount(&count));
    const int device = gpu_per_rank ? rank % count : 0;
    CUDA_OK(cudaSetDevice(device));
    CUDA_OK(cudaFree(nullptr));
    return device;
}

// Runs `child` in R forked rank processes (60 s collective timeout, 300 s deadline), prints every rank that did not
// exit 0 and a repro line for `test` (the binary's name). Returns how many ranks failed.
inline int run_rank_processes(const char* test, int R, bool gpu_per_rank,
                              const std::function<int(int rank, std::shared_ptr<Bootstrap>)>& child) {
    ForkOptions options;
    options.timeout_s = 60;
    options.deadline_s = 300;
    const std::vector<int> codes = run_forked(R, child, options);
    int failed = 0;
    for (int r = 0; r < R; ++r) {
        if (codes[r] != 0) {
            std::printf("R=%d rank %d: exit code %d\n", R, r, codes[r]);
            ++failed;
        }
    }
    if (failed != 0) std::printf("  repro: %s%s %d\n", test, gpu_per_rank ? " --gpu-per-rank" : "", R);
    return failed;
}

}  // namespace flatep::gpu_test
