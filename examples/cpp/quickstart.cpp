// FlatEP's C++ quick start: R processes (one per EP rank) on the CPU backend, joined by the ipc transport over host
// memory; each rank plans a skewed step, dispatches its tokens, runs a stand-in expert on the rows it received and
// combines the results back. Checked bit for bit against the dense sum. Exits 0 when every rank's check passes.
//
//   build/examples/cpp/flatep_quickstart_cpp [R]      (R in {1, 2, 4, 8}; default 4; CTest: example.cpp_quickstart)
//
// README.md (C++ API) shows the body of rank_main as written here; tests/python/test_readme.py keeps the two in step.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "flatep/flatep.hpp"
#include "flatep/ipc.hpp"

namespace {

constexpr int S = 32, H = 64, E = 8, K = 2;  // tokens per rank, hidden, experts, experts per token

// bf16 as the API carries it (uint16_t bits). The example's values are small multiples of 0.5: exact in bf16.
uint16_t to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return uint16_t(bits >> 16);
}
float from_bf16(uint16_t b) {
    const uint32_t bits = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

int rank_main(int rank, int R, std::shared_ptr<flatep::Bootstrap> bootstrap) {
    std::shared_ptr<flatep::Transport> transport = flatep::make_ipc_transport(bootstrap, flatep::MemoryKind::kHost);
    flatep::Config cfg{
        .num_ranks = R, .rank = rank, .num_experts = E, .num_tokens = S, .topk = K, .hidden = H, .align = 8};
    flatep::Buffer buffer(cfg, transport);  // collective: the ranks agree on cfg and map each other's buffers

    std::vector<int64_t> topk_idx(S * K);  // [S][K]: expert 0 is hot (every token's first choice)
    std::vector<float> topk_w(S * K, 0.5f);
    std::vector<uint16_t> x(S * H);
    for (int t = 0; t < S; ++t) {
        topk_idx[t * K] = 0;
        topk_idx[t * K + 1] = 1 + (t + rank) % (E - 1);
        for (int h = 0; h < H; ++h) x[t * H + h] = to_bf16(float((t + 3 * rank + h) % 5) - 2.0f);
    }
    flatep::Plan plan = buffer.plan(topk_idx.data(), 8, S);  // collective; every rank will compute S*K rows
    uint16_t* recv_x = buffer.symmetric_recv_x();            // receive rows in place (valid until the next dispatch)
    float* recv_w = buffer.symmetric_recv_w();
    buffer.dispatch(plan, x.data(), topk_w.data(), recv_x, recv_w);

    // Group g < epn holds own expert rank*epn + g, group epn + j a replica of expert slot_expert[j]; cu_seqlens are
    // the groups' inclusive padded ends (a grouped GEMM's offs). The stand-in expert e multiplies its rows by e + 1.
    const int epn = E / R;
    std::span<const int32_t> ends = plan.cu_seqlens(rank), slots = plan.slot_expert(rank);
    std::vector<uint16_t> y(size_t(ends.back()) * H);
    for (int g = 0, row = 0; g < 2 * epn; ++g) {
        const int expert = g < epn ? rank * epn + g : slots[g - epn];
        for (; row < ends[g]; ++row)
            for (int h = 0; h < H; ++h) y[row * H + h] = to_bf16(from_bf16(recv_x[row * H + h]) * float(expert + 1));
    }
    std::vector<uint16_t> out(S * H);
    buffer.combine(plan, y.data(), recv_w, out.data());  // collective: out[t] = sum_k w[t][k] * expert_k(x[t])

    int wrong = 0;
    for (int t = 0; t < S; ++t)
        for (int h = 0; h < H; ++h) {
            const float scale = 0.5f * float(topk_idx[t * K] + 1) + 0.5f * float(topk_idx[t * K + 1] + 1);
            wrong += from_bf16(out[t * H + h]) != from_bf16(x[t * H + h]) * scale;
        }
    const flatep::PlanStats& st = plan.stats();
    std::printf("rank %d: computed %d rows (hottest rank without replicas: %d), %d replicas, %d wrong values\n", rank,
                st.loads_after[rank], st.max_load_before, st.total_replicas, wrong);
    return wrong == 0 && st.loads_after[rank] == S * K ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    const int R = argc > 1 ? std::atoi(argv[1]) : 4;
    if (R < 1 || E % R != 0) {
        std::fprintf(stderr, "flatep_quickstart_cpp: R must divide E=%d, got '%s'\n", E, argv[1]);
        return 2;
    }
    std::vector<int> codes = flatep::run_forked(R, [R](int rank, std::shared_ptr<flatep::Bootstrap> bootstrap) {
        return rank_main(rank, R, std::move(bootstrap));
    });
    int failed = 0;
    for (int code : codes) failed += code != 0;
    std::printf("flatep_quickstart_cpp: %d ranks, %s\n", R, failed ? "FAILED" : "OK");
    return failed ? 1 : 0;
}
