// Small public value types shared by the C++ API, the host backend and the CUDA kernels.
#pragma once

#include <cstdint>
#include <string>

namespace flatep {

// Largest number of EP ranks any data-plane object supports (peer pointer arrays are this long).
inline constexpr int kMaxRanks = 64;
// Largest top-k.
inline constexpr int kMaxTopk = 32;

enum class PlannerKind : int32_t {
    kGreedy = 0,    // one-donor greedy (design §4, constraint 3): the reference baseline
    kBalanced = 1,  // the default: balances donors and receivers jointly to lower the prefetch makespan
    kOwner = 2,     // no replicas: every entry computed on its expert's home rank (decode); receive capacity R*S*K
    kStatic = 3,  // a fixed placement of replicas (Buffer::set_placement), each expert's entries split evenly over its
                  // copies by a fixed rule (design §4 "The static planner"); receive capacity R*S*K
};

// "greedy", "balanced", "owner", "static" ("unknown" for any other value).
const char* planner_name(PlannerKind kind);
// The kind of a planner_name; throws flatep::Error(kInvalidArgument) naming the value for any other name.
PlannerKind planner_from_name(const std::string& name);

// Cheap statistics of a plan (fixed size, so it can live in device memory).
struct PlanStats {
    int64_t entries_total;      // N: valid entries this step, all ranks
    int64_t entries_moved;      // entries computed on a rank other than their source rank
    int64_t entries_on_source;  // entries computed on their source rank (N - entries_moved)
    int32_t max_load_before;    // max over ranks of the group load G_r (what rank r computes without FlatEP)
    int32_t max_load_after;     // max over ranks of sum_e alloc[r][e]
    int32_t min_load_after;
    int32_t total_replicas;  // number of (rank, slot) pairs holding a replica
    int32_t makespan;        // P = max over ranks of max(replicas received, replica copies sent)
    int32_t max_replicas_in;
    int32_t max_replicas_out;
    int32_t loads_before[kMaxRanks];
    int32_t loads_after[kMaxRanks];
    int32_t replicas_in[kMaxRanks];   // slots used on rank r
    int32_t replicas_out[kMaxRanks];  // copies of rank r's experts placed elsewhere
};

}  // namespace flatep
