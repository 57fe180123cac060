#include "memory.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace flatep::bench {

int64_t MemoryPart::total() const {
    const int64_t one =
        (std::max<int64_t>(bytes, 1) + kAllocationGranule - 1) / kAllocationGranule * kAllocationGranule;
    return bytes > 0 ? one * count : 0;
}

void MemoryEstimate::add(std::string name, int64_t bytes, int64_t count) {
    parts.push_back(MemoryPart{std::move(name), bytes, count});
}

int64_t MemoryEstimate::total() const {
    int64_t sum = kMemoryAllowance;
    for (const MemoryPart& p : parts) sum += p.total();
    return sum;
}

std::string size_text(int64_t bytes) {
    char buf[48];
    if (bytes >= kGiB)
        std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(kGiB));
    else if (bytes >= (1 << 20))
        std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(1 << 20));
    else
        std::snprintf(buf, sizeof buf, "%.1f KiB", double(bytes) / 1024.0);
    return buf;
}

std::string MemoryEstimate::describe() const {
    std::string s;
    for (const MemoryPart& p : parts) {
        if (p.bytes <= 0) continue;
        s += (s.empty() ? "" : ", ") + p.name + " " + (p.count > 1 ? std::to_string(p.count) + " x " : std::string()) +
             size_text(p.bytes);
    }
    return s + (s.empty() ? "" : ", ") + "allowance " + size_text(kMemoryAllowance) + ": " + size_text(total());
}

MemoryEstimate kernel_step_memory(const Layout& l, const std::vector<int64_t>& expert_bytes, int pool_slots, bool grads,
                                  int64_t plan_workspace_bytes) {
    // KernelStep's constructor, allocation by allocation (each rank's own cudaMalloc; the symmetric regions are one
    // allocation of R regions on a shared GPU, counted here as R).
    const int64_t R = l.num_ranks, S = l.num_tokens, K = l.topk, nvs = l.num_recv_rows, epn = l.experts_per_rank;
    const int64_t row = l.row_bytes();
    MemoryEstimate e;
    e.add("symmetric region", make_symmetric_layout(l).total_bytes, R);
    e.add("plan", make_plan_sizes(l).total_words * 4, R);
    e.add("plan workspace", plan_workspace_bytes, R);
    e.add("top-k ids", S * K * 4, R);
    e.add("input rows", S * row, R);
    e.add("weights", S * K * 4, R);
    e.add("expert outputs", nvs * row, R);
    e.add("combine output", S * row, R);
    e.add("receive weights", nvs * 4, R);
    for (size_t q = 0; q < expert_bytes.size(); ++q) {
        const std::string of = expert_bytes.size() > 1 ? " of projection " + std::to_string(q) : "";
        e.add("own experts" + of, epn * expert_bytes[q], R);
        e.add("slot pool" + of, int64_t(pool_slots) * expert_bytes[q], R);
    }
    if (grads && !expert_bytes.empty()) {  // fp32 over projection 0's bf16 elements: twice its bytes
        e.add("fp32 grads", epn * expert_bytes[0] * 2, R);
        e.add("fp32 reduce pool", int64_t(pool_slots) * expert_bytes[0] * 2, R);
    }
    return e;
}

MemoryEstimate ep_rank_memory(const Layout& l, int64_t plan_workspace_bytes, int plan_slots) {
    const int64_t R = l.num_ranks, S = l.num_tokens, K = l.topk, nvs = l.num_recv_rows, row = l.row_bytes();
    MemoryEstimate e;
    e.add("symmetric region", make_symmetric_layout(l).total_bytes);
    e.add("plan slots", int64_t(plan_slots) * make_plan_sizes(l).total_words * 4);
    e.add("plan workspace", plan_workspace_bytes);
    e.add("top-k ids", S * K * 4);
    e.add("input rows", S * row);
    e.add("weights", S * K * 4);
    e.add("row checks", nvs * 4, 3);  // expected receive rows, and the FlatEP / NCCL row lists compared
    e.add("expert outputs", nvs * row);
    e.add("expert weights", nvs * 4);
    e.add("combine output", S * row);
    // dedup: a token goes to a rank once; it sends to at most min(K, R) ranks. entries: a token sends a row per
    // expert, at most min(K, epn) of them to one rank.
    const int64_t dedup_send = S * std::min<int64_t>(K, R), dedup_recv = R * S;
    const int64_t entries_send = S * K, entries_recv = R * S * std::min<int64_t>(K, l.experts_per_rank);
    e.add("nccl dedup send + back rows", dedup_send * row, 2);
    e.add("nccl dedup receive rows", dedup_recv * row);
    e.add("nccl entries send + back rows", entries_send * row, 2);
    e.add("nccl entries receive rows", entries_recv * row);
    e.add("nccl row ids", (dedup_send + dedup_recv + entries_send + entries_recv) * 4);
    e.add("nccl communicator (allowance)", kNcclAllowance);
    return e;
}

std::string does_not_fit(const MemoryEstimate& e, int64_t free_bytes, const std::string& device, bool given) {
    if (e.total() <= free_bytes) return "";
    return e.what + " needs " + size_text(e.total()) + " on " + device + ", " + size_text(free_bytes) +
           (given ? " by --memory-gib" : " free (--memory-gib overrides)");
}

int64_t available_bytes(double memory_gib, int64_t device_free) {
    return memory_gib > 0 ? int64_t(memory_gib * double(kGiB)) : device_free;
}

void require_fit(const std::string& program, const std::vector<MemoryEstimate>& estimates, int64_t free_bytes,
                 const std::string& device, bool given) {
    // Cases that differ only where no size depends (the routing's skew) have the same estimate: printed once.
    std::vector<std::string> printed;
    for (const MemoryEstimate& e : estimates) {
        const std::string line = e.what + ": " + e.describe();
        if (std::find(printed.begin(), printed.end(), line) != printed.end()) continue;
        printed.push_back(line);
        std::printf("memory estimate: %s\n", line.c_str());
    }
    for (const MemoryEstimate& e : estimates) {
        const std::string refusal = does_not_fit(e, free_bytes, device, given);
        if (refusal.empty()) continue;
        std::fflush(stdout);
        std::fprintf(stderr, "%s: does not fit: %s\n", program.c_str(), refusal.c_str());
        std::exit(2);
    }
    std::fflush(stdout);
}

}  // namespace flatep::bench
