// FlatEP against NCCL's all-to-all with one process per GPU (design §7, §9; L2): the fork launcher starts one rank
// per GPU, the ranks share CUDA VMM regions through the ipc transport, and every rank also joins one NCCL
// communicator. R = the number of GPUs (or --ranks). Configs: DeepEP's (S=4096, E=256, H=7168, K=8, uniform routing)
// and MoonEP's (S=8192, E=384, H=7168, K=8) at maxvio 0.2/1/10/20 (routing generator, per-rank seeds). Per case:
//   flatep            plan: Buffer::plan; dispatch: Buffer::dispatch into the symmetric receive buffer (expert-grouped
//                     rows, duplicates fanned out on the destination); combine: Buffer::combine, weighted
//   nccl_a2a_dedup    ncclSend/ncclRecv to every peer (self included) in one group, one row per (token, home rank of
//                     one of its experts): the rows DeepEP's dispatch (and an all_to_all_single with per-rank dedup)
//                     moves. "combine" is the same exchange in reverse; it moves rows and sums nothing
//   nccl_a2a_entries  the same with one row per (token, expert) entry: Megatron's permute + all_to_all_single
// Baselines send to the experts' home ranks (no replicas); FlatEP sends to the ranks its plan chose.
// Timing: per op, --warmup runs, then --iters runs each timed with CUDA events on the rank's stream. Each iteration
// holds the stream until the host has enqueued the op (so host launch work, e.g. Buffer::plan's allocation of the
// plan's words, is not timed; an enqueue slower than 100 ms releases the hold and counts as host-bound), then runs a
// GPU barrier of all ranks (no rank is timed while it waits for a late peer), then start event, op, stop event. The
// step time of an iteration is the max over ranks; the reported time is its median (and min).
// Checks (every run; a failure prints FAIL with the first bad row and makes the exit status 1):
//   - the GPU plan equals the host planner's (global arrays and this rank's entry routing), bitwise;
//   - every receive row of FlatEP's dispatch holds its (source, token) row and routing weight, padding rows zero;
//   - rows that both FlatEP and nccl_a2a_dedup deliver to a rank are bitwise equal; NCCL's rows are the right rows
//     and come back unchanged in the reverse direction;
//   - the weighted combine of the dispatched rows is within 2% of x * sum_k w_k (bf16 partial sums).
// Every row is a function of (source rank, token) (elements 0-3 spell them), every weight of (source, token, k).
//
//   ep_bench_multi [--csv ep_bench_multi.csv] [--ranks R] [--iters 20] [--warmup 5] [--preset deepep,moonep]
//                  [--maxvio 0.2,1,10,20] [shape flags] [--timeout 60] [--deadline 600] [--memory-gib G]
//
// Flags: benchmarks/common/flags.hpp (the set every driver shares); --ranks is one value here (default: every
// visible GPU) and replaces the presets' R.
//
// Before anything is allocated every rank prints nothing but checks its GPU's free memory against the estimate of a
// rank's device memory (common/memory.hpp; rank 0 prints it) and all refuse together, exit status 2 and one line, when
// a case does not fit one GPU (--memory-gib G: G GiB a GPU, checked before the ranks start).
//
// CSV: one row per (config, maxvio, op, impl); the columns are described at kCsvHeader. Exits 0 with "SKIP" when
// fewer than 2 GPUs are visible.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_timing.cuh"
#include "common/device_memory.cuh"
#include "common/flags.hpp"
#include "flatep/buffer.hpp"
#include "flatep/ipc.hpp"
#include "internal/api.hpp"

using namespace flatep;

namespace {

constexpr uint64_t kSeed = 42;
constexpr double kNvlinkGBps = 450.0;  // H200 NVLink per GPU and direction (900 GB/s both ways)
constexpr float kCombineTolerance = 0.02f;
constexpr int kProbeNoGpu = 0;

#define NCCL_CHECK(expr)                                                                                   \
    do {                                                                                                   \
        const ncclResult_t nccl_res_ = (expr);                                                             \
        if (nccl_res_ != ncclSuccess)                                                                      \
            FLATEP_THROW(ErrorCategory::kRuntime, #expr, " failed: ", ncclGetErrorString(nccl_res_), " (", \
                         ncclGetLastError(nullptr), ")");                                                  \
    } while (0)

// ---- Data: a pure function of (source rank, token[, k]), so any rank can check any row it holds ----

FLATEP_HD uint64_t splitmix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// bf16 bits of element h of token t of source rank s. Elements 0-3 are 1 + (s, t's three 7-bit digits)/128, the rest
// finite values of either sign with magnitude in [2^-7, 2^8): never zero and never the 0xffff poison.
FLATEP_HD uint16_t row_value(int s, int t, int h) {
    if (h == 0) return uint16_t(0x3f80u | (uint32_t(s) & 0x7fu));
    if (h < 4) return uint16_t(0x3f80u | ((uint32_t(t) >> (7 * (h - 1))) & 0x7fu));
    const uint64_t z = splitmix((uint64_t(s) << 48) ^ (uint64_t(t) << 20) ^ uint64_t(h));
    return uint16_t(((z & 1) << 15) | ((120 + (z >> 1) % 15) << 7) | ((z >> 8) & 0x7f));
}

// Routing weight of entry (t, k) of source s: (1 + 20 random bits) / 2^20, exact in fp32, in (0, 1].
FLATEP_HD float weight_value(int s, int t, int k) {
    const uint64_t z = splitmix(0x5bd1e995ull ^ (uint64_t(s) << 48) ^ (uint64_t(t) << 8) ^ uint64_t(k));
    return float(1 + int((z >> 44) & 0xfffff)) * (1.0f / 1048576.0f);
}

// A row id names the row a receive (or send) buffer row must hold: (s*S + t)*K + k, or -1 for a zero padding row.
struct RowId {
    int src, token, k;
};
FLATEP_HD RowId decode_row_id(int32_t id, int S, int K) { return RowId{id / K / S, (id / K) % S, id % K}; }
FLATEP_HD int32_t row_id(int src, int token, int k, int S, int K) { return (int32_t(src) * S + token) * K + k; }

// ---- Kernels (fills and checks; none of them is timed) ----

// dst[row] = the row of ids[row] (zero for -1); ids == null: row j of source `src` is token j.
__global__ void fill_rows_kernel(uint16_t* dst, const int32_t* ids, int src, int64_t num_rows, int H, int S, int K) {
    for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
        const int32_t id = ids != nullptr ? ids[row] : row_id(src, int(row), 0, S, K);
        const RowId r = decode_row_id(id < 0 ? 0 : id, S, K);
        for (int h = threadIdx.x; h < H; h += blockDim.x)
            dst[row * H + h] = id < 0 ? uint16_t(0) : row_value(r.src, r.token, h);
    }
}

__global__ void fill_weights_kernel(float* w, int src, int num_tokens, int K) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < int64_t(num_tokens) * K;
         i += int64_t(gridDim.x) * blockDim.x)
        w[i] = weight_value(src, int(i / K), int(i % K));
}

// result[0] += rows that differ, result[1] = min over them of the row index (ULLONG_MAX when none).
__device__ void report_bad_row(bool bad, int64_t row, unsigned long long* result) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        atomicAdd(&result[0], 1ull);
        atomicMin(&result[1], static_cast<unsigned long long>(row));
    }
}

// Every row against its id (bitwise), and, when weights is not null, its weight (0 for padding rows).
__global__ void check_rows_kernel(const uint16_t* rows, const float* weights, const int32_t* ids, int64_t num_rows,
                                  int H, int S, int K, unsigned long long* result) {
    for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
        const int32_t id = ids[row];
        const RowId r = decode_row_id(id < 0 ? 0 : id, S, K);
        bool bad = false;
        for (int h = threadIdx.x; h < H; h += blockDim.x)
            bad |= rows[row * H + h] != (id < 0 ? uint16_t(0) : row_value(r.src, r.token, h));
        if (threadIdx.x == 0 && weights != nullptr)
            bad |= !(weights[row] == (id < 0 ? 0.0f : weight_value(r.src, r.token, r.k)));
        report_bad_row(bad, row, result);
    }
}

// Row a_rows[j] of a against row b_rows[j] of b, bitwise.
__global__ void compare_rows_kernel(const uint16_t* a, const int32_t* a_rows, const uint16_t* b, const int32_t* b_rows,
                                    int64_t num_pairs, int H, unsigned long long* result) {
    for (int64_t j = blockIdx.x; j < num_pairs; j += gridDim.x) {
        const int64_t ra = a_rows[j], rb = b_rows[j];
        bool bad = false;
        for (int h = threadIdx.x; h < H; h += blockDim.x) bad |= a[ra * H + h] != b[rb * H + h];
        report_bad_row(bad, j, result);
    }
}

// Weighted combine of the dispatched rows themselves: out[t] must be x_t * sum_k w_k within `tolerance` (relative).
__global__ void check_combine_kernel(const uint16_t* out, int src, int num_tokens, int H, int K, float tolerance,
                                     unsigned long long* result) {
    for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        float sum_w = 0.0f;
        for (int k = 0; k < K; ++k) sum_w += weight_value(src, int(t), k);
        bool bad = false;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            const float want = bf16_to_float(row_value(src, int(t), h)) * sum_w;
            const float got = bf16_to_float(out[t * H + h]);
            bad |= !(fabsf(got - want) <= tolerance * fabsf(want));  // NaN (poison) fails
        }
        report_bad_row(bad, t, result);
    }
}

constexpr int kCheckBlocks = 1024, kCheckThreads = 256;

// Holds the stream until the host has enqueued the op to time (host-side launch work stays out of the timed range),
// at most sync.timeout_s: then the iteration is counted as host-bound (its time includes host work) and runs.
__global__ void hold_kernel(sync::SyncArgs sync, const uint64_t* release, uint64_t value, int32_t* host_bound) {
    if (!sync::device::wait_flag_at_least(sync, sync::kOpNone, sync.rank, release, value)) atomicAdd(host_bound, 1);
}
constexpr double kHoldTimeoutS = 0.1;

// ---- Small host helpers ----

template <typename T>
class DeviceArray {
  public:
    DeviceArray() = default;
    explicit DeviceArray(int64_t count) : count_(count) {
        FLATEP_CUDA_CHECK(cudaMalloc(&ptr_, size_t(std::max<int64_t>(count, 1)) * sizeof(T)));
    }
    ~DeviceArray() {
        if (ptr_ != nullptr) cudaFree(ptr_);
    }
    DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }
    DeviceArray& operator=(DeviceArray&& o) noexcept {
        std::swap(ptr_, o.ptr_);
        std::swap(count_, o.count_);
        return *this;
    }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    T* get() const { return ptr_; }
    int64_t size() const { return count_; }
    size_t bytes() const { return size_t(count_) * sizeof(T); }

  private:
    T* ptr_ = nullptr;
    int64_t count_ = 0;
};

template <typename T>
DeviceArray<T> upload(const std::vector<T>& v, cudaStream_t stream) {
    DeviceArray<T> d(int64_t(v.size()));
    if (!v.empty()) FLATEP_CUDA_CHECK(cudaMemcpyAsync(d.get(), v.data(), d.bytes(), cudaMemcpyHostToDevice, stream));
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return d;
}

// Runs one check kernel on `stream` and returns {rows that failed, first failing row (-1 when none)}.
struct CheckResult {
    int64_t bad = 0, first = -1;
};
CheckResult run_check(cudaStream_t stream, const std::function<void(unsigned long long*)>& launch) {
    DeviceArray<unsigned long long> result(2);
    const unsigned long long init[2] = {0ull, ULLONG_MAX};
    FLATEP_CUDA_CHECK(cudaMemcpyAsync(result.get(), init, sizeof(init), cudaMemcpyHostToDevice, stream));
    launch(result.get());
    FLATEP_CUDA_CHECK_LAUNCH();
    unsigned long long host[2];
    FLATEP_CUDA_CHECK(cudaMemcpyAsync(host, result.get(), sizeof(host), cudaMemcpyDeviceToHost, stream));
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return CheckResult{int64_t(host[0]), host[0] == 0 ? -1 : int64_t(host[1])};
}

float median_of(const std::vector<float>& v) { return bench::median(v); }

std::string join(const std::vector<double>& values, const char* format) {
    std::string text;
    char buf[64];
    for (size_t i = 0; i < values.size(); ++i) {
        std::snprintf(buf, sizeof(buf), format, values[i]);
        text += (i ? ";" : "") + std::string(buf);
    }
    return text;
}

// ---- The cases ----

struct Case {
    std::string config;  // the preset's name
    int E, S, K, H, align;
    double maxvio_target;  // < 0: routing of the given sigma (0: uniform)
    double sigma;
};

// topk_idx [S][K] of every source rank (the generator's per-rank streams).
std::vector<std::vector<int32_t>> make_routing(const Case& c, int R) {
    const std::vector<double> pop = routing::popularity(c.E, c.sigma, kSeed);
    std::vector<std::vector<int32_t>> idx(R, std::vector<int32_t>(size_t(c.S) * c.K));
    for (int s = 0; s < R; ++s) routing::sample_topk(pop, c.S, c.K, kSeed, s, idx[s].data());
    return idx;
}

// The host planner's plan of the same step: global part plus every source's entry routing.
struct Reference {
    std::unique_ptr<planner::HostPlan> plan;
    std::vector<std::vector<int32_t>> entry_rank, entry_row;  // [source][S*K]
};

Reference make_reference(const Layout& l, const std::vector<std::vector<int32_t>>& idx) {
    Reference ref;
    ref.plan = std::make_unique<planner::HostPlan>(l);
    const PlanView& p = ref.plan->view;
    for (int s = 0; s < l.num_ranks; ++s) {
        for (int32_t e : idx[s]) ++p.tpe_all[int64_t(s) * l.num_experts + e];
    }
    planner::plan_counts(l, PlannerKind::kBalanced, p);
    const std::string problem = planner::check_plan(l, p);
    FLATEP_CHECK_RUNTIME(problem.empty(), "host reference plan is invalid: ", problem);
    const int64_t entries = int64_t(l.num_tokens) * l.topk;
    for (int s = 0; s < l.num_ranks; ++s) {
        const int64_t bad = planner::route_entries(l, p, s, idx[s].data(), 4, l.num_tokens);
        FLATEP_CHECK_RUNTIME(bad < 0, "routing of rank ", s, " has an invalid expert id at ", bad);
        ref.entry_rank.emplace_back(p.entry_rank, p.entry_rank + entries);
        ref.entry_row.emplace_back(p.entry_row, p.entry_row + entries);
    }
    return ref;
}

// Row ids of `rank`'s receive rows [0, end of its last group): the entry each real row holds, -1 for padding rows.
std::vector<int32_t> expected_receive_rows(const Layout& l, const Reference& ref, int rank) {
    const int G = l.num_groups(), K = l.topk, S = l.num_tokens;
    const int32_t rows_end = ref.plan->view.cu_seqlens[int64_t(rank) * G + G - 1];
    std::vector<int32_t> ids(size_t(rows_end), -1);
    for (int s = 0; s < l.num_ranks; ++s) {
        for (int64_t i = 0; i < int64_t(S) * K; ++i) {
            if (ref.entry_rank[s][i] != rank) continue;
            const int32_t row = ref.entry_row[s][i];
            FLATEP_CHECK_RUNTIME(row >= 0 && row < rows_end && ids[row] < 0, "reference plan: entry ", i, " of rank ",
                                 s, " goes to row ", row, " of rank ", rank, " (groups end at ", rows_end,
                                 row >= 0 && row < rows_end ? ", already taken)" : ")");
            ids[row] = row_id(s, int(i / K), int(i % K), S, K);
        }
    }
    return ids;
}

// Rows per rank that an op delivers (logical, self included) and that leave / enter this GPU over NVLink.
struct RowCounts {
    int64_t logical = 0, nvlink_out = 0, nvlink_in = 0;
};

// (token, destination) pairs of source s whose destination (entry_rank) is d, for every d.
std::vector<int64_t> pairs_by_destination(const std::vector<int32_t>& entry_rank, int S, int K, int R) {
    std::vector<int64_t> pairs(R, 0);
    for (int t = 0; t < S; ++t) {
        for (int k = 0; k < K; ++k) {
            const int d = entry_rank[int64_t(t) * K + k];
            bool seen = d < 0;
            for (int k0 = 0; k0 < k && !seen; ++k0) seen = entry_rank[int64_t(t) * K + k0] == d;
            if (!seen) ++pairs[d];
        }
    }
    return pairs;
}

// FlatEP's rows on `rank`: dispatch delivers every entry routed to it (duplicates fanned out locally) and sends one
// row per (token, other destination); combine reduces the rank's own S*K entries and pulls one bf16 partial per
// (token, other destination).
void flatep_rows(const Layout& l, const Reference& ref, int rank, int64_t received_entries, RowCounts& dispatch,
                 RowCounts& combine) {
    const int R = l.num_ranks;
    const std::vector<int64_t> mine = pairs_by_destination(ref.entry_rank[rank], l.num_tokens, l.topk, R);
    int64_t out = 0, in = 0, own_entries = 0;
    for (int d = 0; d < R; ++d) out += d == rank ? 0 : mine[d];
    for (int s = 0; s < R; ++s) {
        if (s != rank) in += pairs_by_destination(ref.entry_rank[s], l.num_tokens, l.topk, R)[rank];
    }
    for (int32_t d : ref.entry_rank[rank]) own_entries += d >= 0;
    dispatch = RowCounts{received_entries, out, in};
    combine = RowCounts{own_entries, in, out};
}

// One all-to-all of a baseline: rows to every peer and from every peer (self included), grouped by peer in rank
// order, each peer's rows in (token, k) order. Rows go to the experts' home ranks.
struct Exchange {
    std::vector<int64_t> send_rows, send_off, recv_rows, recv_off;  // [R], in rows
    std::vector<int32_t> send_ids, recv_ids;                        // row ids of the send and receive buffers
    DeviceArray<uint16_t> send, recv, back;                         // back: where the reverse exchange lands
    DeviceArray<int32_t> send_ids_d, recv_ids_d;

    // dispatch: rows received (logical), sent to and received from other GPUs; combine: the reverse.
    RowCounts dispatch_rows(int rank) const {
        RowCounts c;
        for (size_t p = 0; p < send_rows.size(); ++p) {
            c.logical += recv_rows[p];
            if (int(p) != rank) c.nvlink_out += send_rows[p], c.nvlink_in += recv_rows[p];
        }
        return c;
    }
    RowCounts combine_rows(int rank) const {
        const RowCounts d = dispatch_rows(rank);
        int64_t sent = 0;
        for (int64_t n : send_rows) sent += n;
        return RowCounts{sent, d.nvlink_in, d.nvlink_out};
    }
};

// per_entry false: one row per (token, home rank) pair (dedup); true: one row per (token, k) entry.
void plan_exchange(const Layout& l, const std::vector<std::vector<int32_t>>& idx, int rank, bool per_entry,
                   Exchange& x) {
    const int R = l.num_ranks, S = l.num_tokens, K = l.topk;
    // Rows source `src` sends to `dst`, in (token, k) order.
    auto rows_of = [&](int src, int dst, std::vector<int32_t>& ids) {
        for (int t = 0; t < S; ++t) {
            for (int k = 0; k < K; ++k) {
                if (l.home_rank(idx[src][int64_t(t) * K + k]) != dst) continue;
                ids.push_back(row_id(src, t, per_entry ? k : 0, S, K));
                if (!per_entry) break;  // the token's row already goes to dst
            }
        }
    };
    x.send_rows.assign(R, 0);
    x.send_off.assign(R, 0);
    x.recv_rows.assign(R, 0);
    x.recv_off.assign(R, 0);
    for (int p = 0; p < R; ++p) {
        x.send_off[p] = int64_t(x.send_ids.size());
        rows_of(rank, p, x.send_ids);
        x.send_rows[p] = int64_t(x.send_ids.size()) - x.send_off[p];
        x.recv_off[p] = int64_t(x.recv_ids.size());
        rows_of(p, rank, x.recv_ids);
        x.recv_rows[p] = int64_t(x.recv_ids.size()) - x.recv_off[p];
    }
}

// One group of ncclSend/ncclRecv per peer; reverse: the receive buffer goes back into `back`. Empty transfers are
// skipped on both sides (both sides know the counts).
void nccl_exchange(const Exchange& x, int H, bool reverse, ncclComm_t comm, cudaStream_t stream) {
    NCCL_CHECK(ncclGroupStart());
    for (size_t p = 0; p < x.send_rows.size(); ++p) {
        const int peer = int(p);
        const int64_t num_send = reverse ? x.recv_rows[p] : x.send_rows[p];
        const int64_t num_recv = reverse ? x.send_rows[p] : x.recv_rows[p];
        const uint16_t* src = reverse ? x.recv.get() + x.recv_off[p] * H : x.send.get() + x.send_off[p] * H;
        uint16_t* dst = reverse ? x.back.get() + x.send_off[p] * H : x.recv.get() + x.recv_off[p] * H;
        if (num_send > 0) NCCL_CHECK(ncclSend(src, size_t(num_send) * H, ncclBfloat16, peer, comm, stream));
        if (num_recv > 0) NCCL_CHECK(ncclRecv(dst, size_t(num_recv) * H, ncclBfloat16, peer, comm, stream));
    }
    NCCL_CHECK(ncclGroupEnd());
}

// ---- Per-case results, gathered on rank 0 ----

enum OpIndex : int {
    kPlanFlat,
    kDispatchFlat,
    kCombineFlat,
    kDispatchDedup,
    kCombineDedup,
    kDispatchEntries,
    kCombineEntries,
    kNumOps
};
const char* const kOpName[kNumOps] = {"plan", "dispatch", "combine", "dispatch", "combine", "dispatch", "combine"};
const char* const kImplName[kNumOps] = {"flatep",         "flatep",           "flatep",          "nccl_a2a_dedup",
                                        "nccl_a2a_dedup", "nccl_a2a_entries", "nccl_a2a_entries"};
// The nccl_a2a_dedup op of the same direction (time ratio column); -1 for none.
const int kBaselineOf[kNumOps] = {
    -1, kDispatchDedup, kCombineDedup, kDispatchDedup, kCombineDedup, kDispatchDedup, kCombineDedup};

struct RankSummary {  // trivially copyable: sent as bytes through the bootstrap
    int32_t failures;
    int32_t device;
    double maxvio;
    int32_t replicas, makespan, max_load_before;
    RowCounts rows[kNumOps];
    int32_t host_bound[kNumOps];  // timed iterations whose host enqueue outlasted the hold (kHoldTimeoutS)
};

struct Options {
    std::string csv_path = "ep_bench_multi.csv";
    int ranks = 0;  // 0: every visible GPU
    int iters = 20, warmup = 5;
    std::vector<bench::Case> cases;  // the sweep (ranks replaced by the process count)
    double timeout_s = 60, deadline_s = 600;
    double memory_gib = 0;  // --memory-gib: 0, each GPU's free memory
};

// Everything one rank process does for one case. Returns the rank's summary; times[op] holds its iterations (us).
class RankBench {
  public:
    RankBench(int rank, int num_ranks, std::shared_ptr<Bootstrap> boot, std::shared_ptr<Transport> transport,
              ncclComm_t comm, cudaStream_t stream, const Options& options)
        : rank_(rank),
          R_(num_ranks),
          boot_(std::move(boot)),
          transport_(std::move(transport)),
          comm_(comm),
          stream_(stream),
          options_(options) {
        // GPU-side start barrier: flags in a symmetric region of the ipc transport, the kernels library's barrier.
        flags_ = transport_->allocate(sizeof(uint64_t) * kMaxRanks);
        epoch_ = DeviceArray<uint64_t>(sync::kEpochWords);
        status_ = DeviceArray<int32_t>(4);
        FLATEP_CUDA_CHECK(cudaMemset(epoch_.get(), 0, epoch_.bytes()));
        FLATEP_CUDA_CHECK(cudaMemset(status_.get(), 0, status_.bytes()));
        FLATEP_CUDA_CHECK(cudaDeviceSynchronize());
        gate_ = sync::SyncArgs{};
        for (int p = 0; p < R_; ++p) gate_.flags[p] = reinterpret_cast<uint64_t*>(flags_.peers[p]);
        gate_.epoch = epoch_.get();
        gate_.status = status_.get();
        gate_.rank = rank_;
        gate_.num_ranks = R_;
        gate_.timeout_s = options_.timeout_s;
        // The host's release word of the hold (host-mapped), the hold's own status words and host-bound counter.
        FLATEP_CUDA_CHECK(cudaHostAlloc(&hold_host_, sizeof(uint64_t), cudaHostAllocMapped));
        *hold_host_ = 0;
        FLATEP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&hold_device_), hold_host_, 0));
        hold_status_ = DeviceArray<int32_t>(4);
        host_bound_ = DeviceArray<int32_t>(1);
        hold_ = sync::SyncArgs{};
        hold_.status = hold_status_.get();
        hold_.rank = rank_;
        hold_.num_ranks = R_;
        hold_.timeout_s = kHoldTimeoutS;
    }
    ~RankBench() {
        cudaFreeHost(hold_host_);
        transport_->release(flags_);
    }

    RankSummary run(const Case& c, std::vector<std::vector<float>>& times);

  private:
    // Times `op` on the stream: warm-up, then iterations. Each iteration: the stream is held until the host has
    // enqueued everything, then a GPU barrier of all ranks, then the start event, the op and the stop event.
    // Returns the times (us) and sets host_bound to the timed iterations whose hold timed out.
    std::vector<float> time_op(const std::function<void()>& op, int32_t& host_bound) {
        std::vector<float> us;
        for (int it = 0; it < options_.warmup + options_.iters; ++it) {
            if (it == options_.warmup) FLATEP_CUDA_CHECK(cudaMemsetAsync(host_bound_.get(), 0, 4, stream_));
            FLATEP_CUDA_CHECK(cudaMemsetAsync(hold_status_.get(), 0, hold_status_.bytes(), stream_));
            ++hold_value_;
            hold_kernel<<<1, 1, 0, stream_>>>(hold_, hold_device_, hold_value_, host_bound_.get());
            FLATEP_CUDA_CHECK_LAUNCH();
            kernels::launch_barrier(gate_, sync::kOpNone, stream_);
            events_.start(stream_);
            op();
            events_.stop(stream_);
            __atomic_store_n(hold_host_, hold_value_, __ATOMIC_RELEASE);  // everything is enqueued: let it run
            const float t = events_.elapsed_us();
            if (it >= options_.warmup) us.push_back(t);
        }
        int32_t status[4];
        FLATEP_CUDA_CHECK(cudaMemcpy(status, status_.get(), sizeof(status), cudaMemcpyDeviceToHost));
        FLATEP_CHECK_RUNTIME(status[sync::kStatusCode] == sync::kStatusOk, "rank ", rank_,
                             ": the GPU start barrier timed out waiting for rank ", status[sync::kStatusPeer]);
        FLATEP_CUDA_CHECK(cudaMemcpy(&host_bound, host_bound_.get(), sizeof(int32_t), cudaMemcpyDeviceToHost));
        return us;
    }

    // Prints a failed check (first bad row, and what describe says about it) and counts it.
    void expect(const std::string& what, const CheckResult& r,
                const std::function<std::string(int64_t)>& describe = {}) {
        if (r.bad == 0) return;
        ++failures_;
        std::fprintf(stderr, "rank %d: FAIL %s: %lld rows differ, first %lld%s\n", rank_, what.c_str(),
                     static_cast<long long>(r.bad), static_cast<long long>(r.first),
                     describe ? describe(r.first).c_str() : "");
    }

    // Rows [0, ids.size()) of `rows` (and their `weights` when not null) against the row ids `ids`.
    void expect_rows(const std::string& what, const uint16_t* rows, const float* weights,
                     const DeviceArray<int32_t>& ids, const Layout& l,
                     const std::function<std::string(int64_t)>& describe = {}) {
        const CheckResult r = run_check(stream_, [&](unsigned long long* result) {
            check_rows_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(rows, weights, ids.get(), ids.size(),
                                                                           l.hidden, l.num_tokens, l.topk, result);
        });
        expect(what, r, describe);
    }

    int rank_, R_;
    std::shared_ptr<Bootstrap> boot_;
    std::shared_ptr<Transport> transport_;
    ncclComm_t comm_;
    cudaStream_t stream_;
    const Options& options_;
    SymmetricRegion flags_;
    DeviceArray<uint64_t> epoch_;
    DeviceArray<int32_t> status_;
    sync::SyncArgs gate_{};
    uint64_t* hold_host_ = nullptr;    // host-mapped release word of the hold
    uint64_t* hold_device_ = nullptr;  // the same word as the device sees it
    uint64_t hold_value_ = 0;
    DeviceArray<int32_t> hold_status_, host_bound_;
    sync::SyncArgs hold_{};
    bench::EventPair events_;
    int failures_ = 0;
};

RankSummary RankBench::run(const Case& c, std::vector<std::vector<float>>& times) {
    failures_ = 0;
    const Config cfg{.num_ranks = R_,
                     .rank = rank_,
                     .num_experts = c.E,
                     .num_tokens = c.S,
                     .topk = c.K,
                     .hidden = c.H,
                     .align = c.align};
    Buffer buffer(cfg, transport_);
    const Launch on{stream_};  // every op of the rank on its stream
    const Layout& l = internal::layout(buffer);
    const int S = l.num_tokens, K = l.topk, H = l.hidden;

    // Routing of every rank (each rank regenerates all of it: the reference needs every source) and the reference.
    const std::vector<std::vector<int32_t>> idx = make_routing(c, R_);
    const Reference ref = make_reference(l, idx);
    const std::vector<int32_t> expected = expected_receive_rows(l, ref, rank_);
    const int64_t rows_end = int64_t(expected.size());
    int64_t received_entries = 0;
    for (int32_t id : expected) received_entries += id >= 0;

    RankSummary summary{};
    summary.device = 0;
    FLATEP_CUDA_CHECK(cudaGetDevice(&summary.device));
    summary.maxvio = routing::maxvio(ref.plan->view.tpe_all, R_, l.num_experts);
    summary.replicas = ref.plan->view.stats->total_replicas;
    summary.makespan = ref.plan->view.stats->makespan;
    summary.max_load_before = ref.plan->view.stats->max_load_before;
    flatep_rows(l, ref, rank_, received_entries, summary.rows[kDispatchFlat], summary.rows[kCombineFlat]);

    // Inputs.
    const DeviceArray<int32_t> topk = upload(idx[rank_], stream_);
    DeviceArray<uint16_t> x(int64_t(S) * H);
    DeviceArray<float> w(int64_t(S) * K);
    fill_rows_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(x.get(), nullptr, rank_, S, H, S, K);
    FLATEP_CUDA_CHECK_LAUNCH();
    fill_weights_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(w.get(), rank_, S, K);
    FLATEP_CUDA_CHECK_LAUNCH();

    // FlatEP: the plan against the host planner's.
    Plan plan = buffer.plan(topk.get(), 4, S, nullptr, on);
    {
        const planner::HostPlan& got = internal::host_plan(plan);  // synchronising copy
        const PlanSizes sizes = make_plan_sizes(l);
        int64_t bad = -1;
        for (int64_t i = 0; i < sizes.entry_rank && bad < 0; ++i)
            if (got.view.tpe_all[i] != ref.plan->view.tpe_all[i]) bad = i;
        if (bad >= 0) {
            ++failures_;
            std::fprintf(stderr, "rank %d: FAIL plan: global plan word %lld differs from the host planner's\n", rank_,
                         static_cast<long long>(bad));
        }
        for (int64_t i = 0; i < int64_t(S) * K; ++i) {
            if (got.view.entry_rank[i] != ref.entry_rank[rank_][i] ||
                got.view.entry_row[i] != ref.entry_row[rank_][i]) {
                ++failures_;
                std::fprintf(stderr, "rank %d: FAIL plan: entry %lld goes to rank %d row %d, host planner: %d row %d\n",
                             rank_, static_cast<long long>(i), got.view.entry_rank[i], got.view.entry_row[i],
                             ref.entry_rank[rank_][i], ref.entry_row[rank_][i]);
                break;
            }
        }
    }

    // FlatEP dispatch into the poisoned symmetric receive buffer, every receive row checked.
    uint16_t* recv_x = buffer.symmetric_recv_x();
    float* recv_w = buffer.symmetric_recv_w();
    FLATEP_CUDA_CHECK(cudaMemsetAsync(recv_x, 0xff, size_t(l.num_recv_rows) * l.row_bytes(), stream_));
    FLATEP_CUDA_CHECK(cudaMemsetAsync(recv_w, 0xff, size_t(l.num_recv_rows) * sizeof(float), stream_));
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    boot_->all_gather("poisoned");  // no peer writes into this rank's rows before the poison landed
    buffer.dispatch(plan, x.get(), w.get(), recv_x, recv_w, on);
    buffer.check_status(on);
    const DeviceArray<int32_t> expected_d = upload(expected, stream_);
    auto describe_flat_row = [&](int64_t row) {
        uint16_t got[4];
        FLATEP_CUDA_CHECK(cudaMemcpy(got, recv_x + row * H, sizeof(got), cudaMemcpyDeviceToHost));
        char want[96] = "a zero padding row";
        if (expected[row] >= 0) {
            const RowId r = decode_row_id(expected[row], S, K);
            std::snprintf(want, sizeof(want), "source %d token %d k %d", r.src, r.token, r.k);
        }
        char text[200];
        std::snprintf(text, sizeof(text), " (its first elements %04x %04x %04x %04x; expected %s)", got[0], got[1],
                      got[2], got[3], want);
        return std::string(text);
    };
    expect_rows("flatep dispatch rows and weights vs the host plan", recv_x, recv_w, expected_d, l, describe_flat_row);

    // Baselines: send buffers, one exchange each way, checked.
    Exchange dedup, entries;
    plan_exchange(l, idx, rank_, false, dedup);
    plan_exchange(l, idx, rank_, true, entries);
    summary.rows[kDispatchDedup] = dedup.dispatch_rows(rank_);
    summary.rows[kCombineDedup] = dedup.combine_rows(rank_);
    summary.rows[kDispatchEntries] = entries.dispatch_rows(rank_);
    summary.rows[kCombineEntries] = entries.combine_rows(rank_);
    for (Exchange* ex : {&dedup, &entries}) {
        const char* name = ex == &dedup ? "nccl_a2a_dedup" : "nccl_a2a_entries";
        ex->send_ids_d = upload(ex->send_ids, stream_);
        ex->recv_ids_d = upload(ex->recv_ids, stream_);
        ex->send = DeviceArray<uint16_t>(int64_t(ex->send_ids.size()) * H);
        ex->recv = DeviceArray<uint16_t>(int64_t(ex->recv_ids.size()) * H);
        ex->back = DeviceArray<uint16_t>(int64_t(ex->send_ids.size()) * H);
        fill_rows_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(ex->send.get(), ex->send_ids_d.get(), rank_,
                                                                      ex->send_ids_d.size(), H, S, K);
        FLATEP_CUDA_CHECK_LAUNCH();
        FLATEP_CUDA_CHECK(cudaMemsetAsync(ex->recv.get(), 0xff, ex->recv.bytes(), stream_));
        FLATEP_CUDA_CHECK(cudaMemsetAsync(ex->back.get(), 0xff, ex->back.bytes(), stream_));
        nccl_exchange(*ex, H, false, comm_, stream_);
        nccl_exchange(*ex, H, true, comm_, stream_);
        expect_rows(std::string(name) + " dispatch rows", ex->recv.get(), nullptr, ex->recv_ids_d, l);
        expect_rows(std::string(name) + " rows back after the reverse exchange", ex->back.get(), nullptr,
                    ex->send_ids_d, l);
    }

    // FlatEP's rows against NCCL's for the (source, token) pairs both deliver to this rank.
    {
        std::vector<int32_t> nccl_row_of(size_t(R_) * S, -1);
        for (size_t j = 0; j < dedup.recv_ids.size(); ++j) {
            const RowId r = decode_row_id(dedup.recv_ids[j], S, K);
            nccl_row_of[size_t(r.src) * S + r.token] = int32_t(j);
        }
        std::vector<int32_t> flat_rows, nccl_rows;
        for (int64_t row = 0; row < rows_end; ++row) {
            if (expected[row] < 0) continue;
            const RowId r = decode_row_id(expected[row], S, K);
            const int32_t j = nccl_row_of[size_t(r.src) * S + r.token];
            if (j < 0) continue;  // a replica's row: NCCL sent this token to its expert's home rank instead
            flat_rows.push_back(int32_t(row));
            nccl_rows.push_back(j);
        }
        const DeviceArray<int32_t> a = upload(flat_rows, stream_), b = upload(nccl_rows, stream_);
        expect("flatep dispatch rows vs the rows nccl_a2a_dedup delivered",
               run_check(stream_,
                         [&](unsigned long long* res) {
                             compare_rows_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(
                                 recv_x, a.get(), dedup.recv.get(), b.get(), a.size(), H, res);
                         }),
               [&](int64_t j) { return " (receive row " + std::to_string(flat_rows[j]) + ")"; });
        if (rank_ == 0)
            std::printf(
                "%s R=%d routing sigma %.3f: rank 0 compared %zu of its %lld FlatEP receive rows with NCCL's "
                "copy of the same token row\n",
                c.config.c_str(), R_, c.sigma, flat_rows.size(), static_cast<long long>(received_entries));
    }

    // Combine inputs: the dispatched rows and weights themselves (copies: the symmetric buffer is op scratch).
    DeviceArray<uint16_t> y(int64_t(l.num_recv_rows) * H);
    DeviceArray<float> y_w(l.num_recv_rows);
    DeviceArray<uint16_t> out(int64_t(S) * H);
    FLATEP_CUDA_CHECK(cudaMemcpyAsync(y.get(), recv_x, y.bytes(), cudaMemcpyDeviceToDevice, stream_));
    FLATEP_CUDA_CHECK(cudaMemcpyAsync(y_w.get(), recv_w, y_w.bytes(), cudaMemcpyDeviceToDevice, stream_));
    FLATEP_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), stream_));
    buffer.combine(plan, y.get(), y_w.get(), out.get(), on);
    buffer.check_status(on);
    expect("flatep weighted combine vs x * sum_k w_k",
           run_check(stream_,
                     [&](unsigned long long* res) {
                         check_combine_kernel<<<kCheckBlocks, kCheckThreads, 0, stream_>>>(out.get(), rank_, S, H, K,
                                                                                           kCombineTolerance, res);
                     }),
           [](int64_t) { return std::string(" (token)"); });

    // Timing.
    times.assign(kNumOps, {});
    {
        // Plans live until every iteration is timed: freeing one (cudaFree) would synchronise inside the timed region.
        std::vector<Plan> timed;
        timed.reserve(size_t(options_.warmup + options_.iters));
        times[kPlanFlat] = time_op([&] { timed.push_back(buffer.plan(topk.get(), 4, S, nullptr, on)); },
                                   summary.host_bound[kPlanFlat]);
    }
    times[kDispatchFlat] = time_op([&] { buffer.dispatch(plan, x.get(), w.get(), recv_x, recv_w, on); },
                                   summary.host_bound[kDispatchFlat]);
    times[kCombineFlat] =
        time_op([&] { buffer.combine(plan, y.get(), y_w.get(), out.get(), on); }, summary.host_bound[kCombineFlat]);
    times[kDispatchDedup] =
        time_op([&] { nccl_exchange(dedup, H, false, comm_, stream_); }, summary.host_bound[kDispatchDedup]);
    times[kCombineDedup] =
        time_op([&] { nccl_exchange(dedup, H, true, comm_, stream_); }, summary.host_bound[kCombineDedup]);
    times[kDispatchEntries] =
        time_op([&] { nccl_exchange(entries, H, false, comm_, stream_); }, summary.host_bound[kDispatchEntries]);
    times[kCombineEntries] =
        time_op([&] { nccl_exchange(entries, H, true, comm_, stream_); }, summary.host_bound[kCombineEntries]);
    buffer.check_status(on);
    FLATEP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    summary.failures = failures_;
    return summary;
}

// ---- Rank 0: report ----

constexpr const char* kCsvHeader =
    "config,R,maxvio_target,maxvio,op,impl,time_us,time_us_min,time_us_per_rank,logical_rows_per_rank,"
    "logical_bytes_max,nvlink_out_bytes_per_rank,nvlink_in_bytes_per_rank,nvlink_bytes_max,logical_GBps,nvlink_GBps,"
    "nvlink_ratio_450,time_vs_nccl_dedup,replicas,makespan,host_bound_iters,check";

void report(const Case& c, int R, int iters, const std::vector<RankSummary>& ranks,
            const std::vector<std::vector<std::vector<float>>>& times, FILE* csv) {
    const double row_bytes = 2.0 * c.H;
    const RankSummary& r0 = ranks[0];
    int failures = 0;
    for (const RankSummary& s : ranks) failures += s.failures;
    char target[32];
    if (c.maxvio_target < 0) {
        std::snprintf(target, sizeof(target), c.sigma == 0 ? "uniform" : "of sigma %g", c.sigma);
    } else {
        std::snprintf(target, sizeof(target), "%g", c.maxvio_target);
    }
    std::printf("%s maxvio %s (realised %.3f): replicas %d, P %d, hottest rank without FlatEP %.2f x S*K; checks %s\n",
                c.config.c_str(), target, r0.maxvio, r0.replicas, r0.makespan,
                double(r0.max_load_before) / (double(c.S) * c.K), failures == 0 ? "PASS" : "FAIL");
    std::printf("  %-8s %-16s %9s %9s %11s %11s %9s %9s %6s %9s\n", "op", "impl", "time_us", "min_us", "logical_MB",
                "nvlink_MB", "log_GB/s", "nvl_GB/s", "/450", "/nccl_dd");
    // Step time of an iteration: the slowest rank. Median and min over the iterations.
    std::vector<float> step_us(kNumOps), step_min_us(kNumOps);
    for (int op = 0; op < kNumOps; ++op) {
        std::vector<float> steps(size_t(iters), 0.0f);
        for (int it = 0; it < iters; ++it) {
            for (int r = 0; r < R; ++r) steps[it] = std::max(steps[it], times[r][op][it]);
        }
        step_us[op] = median_of(steps);
        step_min_us[op] = *std::min_element(steps.begin(), steps.end());
    }
    for (int op = 0; op < kNumOps; ++op) {
        std::vector<double> per_rank_us, logical_rows, out_bytes, in_bytes, nvlink_gbps_rank;
        double logical_max = 0, nvlink_max = 0;
        int host_bound = 0;
        for (int r = 0; r < R; ++r) host_bound = std::max(host_bound, int(ranks[r].host_bound[op]));
        for (int r = 0; r < R; ++r) {
            const RowCounts& rc = ranks[r].rows[op];
            const double rank_us = median_of(times[r][op]);
            const double nvlink = double(std::max(rc.nvlink_out, rc.nvlink_in)) * row_bytes;  // busier direction
            per_rank_us.push_back(rank_us);
            logical_rows.push_back(double(rc.logical));
            out_bytes.push_back(double(rc.nvlink_out) * row_bytes);
            in_bytes.push_back(double(rc.nvlink_in) * row_bytes);
            nvlink_gbps_rank.push_back(rank_us > 0 ? nvlink / (rank_us * 1e-6) / 1e9 : 0.0);
            logical_max = std::max(logical_max, double(rc.logical) * row_bytes);
            nvlink_max = std::max(nvlink_max, nvlink);
        }
        const double seconds = step_us[op] * 1e-6;
        const double logical_gbps = seconds > 0 ? logical_max / seconds / 1e9 : 0.0;
        const double nvlink_gbps = seconds > 0 ? nvlink_max / seconds / 1e9 : 0.0;
        const int base = kBaselineOf[op];
        const double vs = base >= 0 && step_us[base] > 0 ? step_us[op] / step_us[base] : 0.0;
        char vs_text[32] = "";
        if (base >= 0) std::snprintf(vs_text, sizeof(vs_text), "%.3f", vs);
        std::printf("  %-8s %-16s %9.1f %9.1f %11.1f %11.1f %9.0f %9.0f %6.3f %9s%s\n", kOpName[op], kImplName[op],
                    step_us[op], step_min_us[op], logical_max / 1e6, nvlink_max / 1e6, logical_gbps, nvlink_gbps,
                    nvlink_gbps / kNvlinkGBps, vs_text,
                    host_bound > 0 ? "  (some iterations host-bound: see host_bound_iters)" : "");
        for (int r = 0; r < R; ++r) {
            std::printf(
                "    rank %d (GPU %d): %9.1f us, logical %8.1f MB, NVLink out %8.1f MB, in %8.1f MB: %6.0f GB/s "
                "(%.3f of 450)\n",
                r, ranks[r].device, per_rank_us[r], logical_rows[r] * row_bytes / 1e6, out_bytes[r] / 1e6,
                in_bytes[r] / 1e6, nvlink_gbps_rank[r], nvlink_gbps_rank[r] / kNvlinkGBps);
        }
        if (csv != nullptr) {
            std::fprintf(csv, "%s,%d,%s,%.4f,%s,%s,%.2f,%.2f,%s,%s,%.0f,%s,%s,%.0f,%.1f,%.1f,%.4f,%s,%d,%d,%d,%s\n",
                         c.config.c_str(), R, target, r0.maxvio, kOpName[op], kImplName[op], step_us[op],
                         step_min_us[op], join(per_rank_us, "%.2f").c_str(), join(logical_rows, "%.0f").c_str(),
                         logical_max, join(out_bytes, "%.0f").c_str(), join(in_bytes, "%.0f").c_str(), nvlink_max,
                         logical_gbps, nvlink_gbps, nvlink_gbps / kNvlinkGBps, vs_text, r0.replicas, r0.makespan,
                         host_bound, failures == 0 ? "PASS" : "FAIL");
        }
    }
    std::fflush(stdout);
    if (csv != nullptr) std::fflush(csv);
}

// ---- Process roles ----

// A rank's device memory per case (common/memory.hpp), every rank alike.
std::vector<bench::MemoryEstimate> rank_memory(const std::vector<Case>& cases, int R) {
    std::vector<bench::MemoryEstimate> all;
    for (const Case& c : cases) {
        const Layout l = make_layout(Config{
            .num_ranks = R, .num_experts = c.E, .num_tokens = c.S, .topk = c.K, .hidden = c.H, .align = c.align});
        bench::MemoryEstimate e =
            bench::ep_rank_memory(l, int64_t(runtime::plan_workspace_bytes(l)), Buffer::kDefaultPlanSlots);
        e.what = "preset " + c.config + " (R" + std::to_string(R) + "_S" + std::to_string(c.S) + "_E" +
                 std::to_string(c.E) + "_H" + std::to_string(c.H) + "_K" + std::to_string(c.K) + ", a rank)";
        all.push_back(e);
    }
    return all;
}

// Rank process exit status when the cases do not fit a GPU (every rank exits with it).
constexpr int kRankRefused = 2;

// Every rank checks its GPU's free memory before NCCL or the transport allocate anything; the refusals are gathered
// so that all ranks stop together (rank 0 prints the estimate and the first refusal). kRankRefused or 0.
int check_rank_memory(int rank, int R, Bootstrap& boot, const std::vector<Case>& cases) {
    const std::vector<bench::MemoryEstimate> estimates = rank_memory(cases, R);
    const int64_t free_bytes = bench::device_free_bytes();
    std::string refusal;
    for (const bench::MemoryEstimate& e : estimates)
        if (refusal.empty()) refusal = bench::does_not_fit(e, free_bytes, bench::current_device_name(), false);
    const std::vector<std::string> all = boot.all_gather(refusal);
    if (rank == 0)
        for (const bench::MemoryEstimate& e : estimates)
            std::printf("memory estimate: %s: %s\n", e.what.c_str(), e.describe().c_str());
    for (const std::string& r : all) {
        if (r.empty()) continue;
        if (rank == 0) {
            std::fflush(stdout);
            std::fprintf(stderr, "ep_bench_multi: does not fit: %s\n", r.c_str());
        }
        return kRankRefused;
    }
    return 0;
}

int rank_main(int rank, int R, std::shared_ptr<Bootstrap> boot, const std::vector<Case>& cases,
              const Options& options) {
    FLATEP_CUDA_CHECK(cudaSetDevice(rank));
    FLATEP_CUDA_CHECK(cudaFree(nullptr));  // the primary context, current now: the ipc transport allocates on it
    if (options.memory_gib <= 0 && check_rank_memory(rank, R, *boot, cases) != 0) return kRankRefused;
    cudaStream_t stream;
    FLATEP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    // NCCL: rank 0's unique id through the bootstrap's all-gather.
    ncclUniqueId id{};
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    const std::vector<std::string> ids =
        boot->all_gather(rank == 0 ? std::string(reinterpret_cast<const char*>(&id), sizeof(id)) : std::string());
    FLATEP_CHECK_RUNTIME(ids[0].size() == sizeof(id), "rank 0 sent an NCCL id of ", ids[0].size(), " bytes");
    std::memcpy(&id, ids[0].data(), sizeof(id));
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommInitRank(&comm, R, id, rank));

    std::shared_ptr<Transport> transport = make_ipc_transport(boot, MemoryKind::kDevice, options.timeout_s);
    FILE* csv = nullptr;
    if (rank == 0) {
        int version = 0;
        NCCL_CHECK(ncclGetVersion(&version));
        cudaDeviceProp prop{};
        FLATEP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        int peer_access = 0;
        FLATEP_CUDA_CHECK(cudaDeviceCanAccessPeer(&peer_access, 0, 1));
        std::printf(
            "ep_bench_multi: R=%d processes, one per GPU (%s; GPU 0 can access GPU 1: %s), ipc transport, NCCL %d, "
            "%d iterations after %d warm-up\n",
            R, prop.name, peer_access ? "yes" : "no", version, options.iters, options.warmup);
        csv = std::fopen(options.csv_path.c_str(), "w");
        FLATEP_CHECK_RUNTIME(csv != nullptr, "cannot open ", options.csv_path);
        std::fprintf(csv, "%s\n", kCsvHeader);
    }

    int failures = 0;
    {
        RankBench bench(rank, R, boot, transport, comm, stream, options);
        for (const Case& c : cases) {
            std::vector<std::vector<float>> times;
            const RankSummary summary = bench.run(c, times);
            failures += summary.failures;
            // Gather summaries and iteration times on every rank (small), report on rank 0.
            std::string blob(reinterpret_cast<const char*>(&summary), sizeof(summary));
            for (const std::vector<float>& t : times)
                blob.append(reinterpret_cast<const char*>(t.data()), t.size() * sizeof(float));
            const std::vector<std::string> blobs = boot->all_gather(blob);
            if (rank != 0) continue;
            std::vector<RankSummary> summaries(R);
            std::vector<std::vector<std::vector<float>>> all_times(R);
            for (int r = 0; r < R; ++r) {
                FLATEP_CHECK_RUNTIME(blobs[r].size() == blob.size(), "rank ", r, " sent ", blobs[r].size(),
                                     " bytes of results, expected ", blob.size());
                std::memcpy(&summaries[r], blobs[r].data(), sizeof(RankSummary));
                const float* f = reinterpret_cast<const float*>(blobs[r].data() + sizeof(RankSummary));
                for (int op = 0; op < kNumOps; ++op, f += options.iters)
                    all_times[r].emplace_back(f, f + options.iters);
            }
            report(c, R, options.iters, summaries, all_times, csv);
        }
    }
    if (csv != nullptr) std::fclose(csv);
    transport.reset();
    NCCL_CHECK(ncclCommFinalize(comm));
    NCCL_CHECK(ncclCommDestroy(comm));
    FLATEP_CUDA_CHECK(cudaStreamDestroy(stream));
    return failures == 0 ? 0 : 1;
}

// Runs in a forked child (the parent must not initialise CUDA): the number of visible GPUs (0 when none), at most
// kMaxProbedGpus so that it cannot be mistaken for a crash's exit code.
constexpr int kMaxProbedGpus = 64;
int probe_gpus() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return kProbeNoGpu;
    return std::min(count, kMaxProbedGpus);
}

void parse(int argc, char** argv, Options& o) {
    bench::Flags flags("ep_bench_multi", "FlatEP against NCCL's all-to-all, one process per GPU");
    flags.add_sweep({"deepep", "moonep"});
    flags.add_timing(&o.iters, &o.warmup);
    flags.add_csv(&o.csv_path);
    flags.add("--timeout", &o.timeout_s, "seconds any wait may take");
    flags.add("--deadline", &o.deadline_s, "seconds the whole run may take");
    flags.add_memory(&o.memory_gib);
    flags.parse(argc, argv);
    o.cases = flags.cases();
    if (flags.given("--ranks")) {
        for (const bench::Case& c : o.cases)
            if (c.shape.ranks != o.cases[0].shape.ranks) flags.fail("--ranks: one value (the number of processes)");
        o.ranks = o.cases.empty() ? 0 : o.cases[0].shape.ranks;
    }
    if (!(o.timeout_s > 0) || !(o.deadline_s > 0)) flags.fail("--timeout and --deadline must be > 0");
}

}  // namespace

static int run(int argc, char** argv) {
    Options options;
    parse(argc, argv, options);
    // Inherited by the rank processes: NVLink multicast stays off (design §7; a must on shared hosts), and every
    // kernel is loaded at context creation (no lazy module load while a peer's kernel spins, see
    // kernels/common/launch.cuh).
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    if (access("/dev/nvidiactl", F_OK) != 0) {
        std::printf("SKIP ep_bench_multi: no CUDA device (/dev/nvidiactl missing)\n");
        return 0;
    }
    ForkOptions probe_options;
    probe_options.timeout_s = options.timeout_s;
    probe_options.deadline_s = 120;
    const int num_gpus = run_forked(
        1, [](int, std::shared_ptr<Bootstrap>) { return probe_gpus(); }, probe_options)[0];
    if (num_gpus > kMaxProbedGpus) {
        std::printf("FAIL ep_bench_multi: the GPU probe process exited with %d\n", num_gpus);
        return 1;
    }
    if (num_gpus < 2) {
        std::printf("SKIP ep_bench_multi: %d GPU(s) visible; one process per GPU needs at least 2\n", num_gpus);
        return 0;
    }
    const int R = options.ranks > 0 ? options.ranks : num_gpus;
    if (R < 2 || R > num_gpus || R > kMaxRanks) {
        std::fprintf(stderr, "ep_bench_multi: --ranks %d: needs 2 <= R <= %d (one process per visible GPU)\n", R,
                     std::min(num_gpus, kMaxRanks));
        return 2;
    }

    // Cases; sigma for each target maxvio by bisection on the generator (host only, before forking; one thread each).
    std::vector<Case> cases;
    for (const bench::Case& bc : options.cases) {
        const bench::Shape& sh = bc.shape;
        Case c{bc.preset,
               sh.experts,
               sh.tokens,
               sh.topk,
               sh.hidden,
               sh.align,
               bc.skew.maxvio_target(),
               bc.skew.is_sigma ? bc.skew.value : 0.0};
        if (c.E % R != 0) {
            std::printf("ep_bench_multi: skipping %s: E=%d is not a multiple of R=%d\n", bc.preset.c_str(), c.E, R);
            continue;
        }
        cases.push_back(c);
    }
    std::vector<std::string> errors(cases.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < cases.size(); ++i) {
        if (cases[i].maxvio_target < 0) continue;
        threads.emplace_back([&, i] {
            Case& c = cases[i];
            try {
                c.sigma = routing::sigma_for_maxvio(c.maxvio_target, R, c.E, c.S, c.K, kSeed);
            } catch (const std::exception& e) {
                errors[i] = e.what();
            }
        });
    }
    for (std::thread& t : threads) t.join();
    for (const std::string& e : errors) {
        if (e.empty()) continue;
        std::fprintf(stderr, "ep_bench_multi: %s\n", e.c_str());
        return 2;
    }

    // --memory-gib: the estimate against it here, before a rank starts (no CUDA in this process); else every rank
    // checks its GPU's free memory.
    if (options.memory_gib > 0)
        bench::require_fit("ep_bench_multi", rank_memory(cases, R), bench::available_bytes(options.memory_gib, 0),
                           "each GPU", true);

    ForkOptions fork_options;
    fork_options.timeout_s = options.timeout_s;
    fork_options.deadline_s = options.deadline_s;
    const std::vector<int> codes = run_forked(
        R, [&](int rank, std::shared_ptr<Bootstrap> boot) { return rank_main(rank, R, boot, cases, options); },
        fork_options);
    if (std::all_of(codes.begin(), codes.end(), [](int code) { return code == kRankRefused; })) return 2;
    bool ok = true;
    std::string text;
    for (int r = 0; r < R; ++r) {
        ok = ok && codes[r] == 0;
        text += (r ? "," : "") + std::to_string(codes[r]);
    }
    std::printf("%s ep_bench_multi: R=%d, %zu cases, CSV %s (rank exit codes %s)\n", ok ? "PASS" : "FAIL", R,
                cases.size(), options.csv_path.c_str(), text.c_str());
    if (!ok) std::printf("  repro: ep_bench_multi --ranks %d --csv %s\n", R, options.csv_path.c_str());
    return ok ? 0 : 1;
}

int main(int argc, char** argv) {
    return bench::run_main("ep_bench_multi", [&] { return run(argc, argv); });
}
