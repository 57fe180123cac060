// Args of prefetch (design §3, §5): the replicas' weights of this step into the slot pools. One op moves every
// projection of a layer (up to kMaxPrefetchProjections) behind one barrier (pull) or one pair (push): a projection
// is bytes, so FP8 weights and their scales travel in the same op.
#pragma once

#include <cstdint>

#include "common/macros.hpp"
#include "ops/check.hpp"
#include "ops/forward.hpp"
#include "sync/sync.hpp"

namespace flatep {

// Projections one prefetch op moves; a layer with more is moved by several ops.
inline constexpr int kMaxPrefetchProjections = 8;

// One projection: an expert's weights are expert_bytes bytes, the experts of a rank contiguous.
struct PrefetchProjection {
    int64_t expert_bytes;              // bytes of one expert's weights (e.g. H*F bf16, or F*H/128 fp32 scales)
    const uint8_t* weights;            // push: this rank's own experts [epn][expert_bytes]
    const uint8_t* owners[kMaxRanks];  // pull: every rank's own experts [epn][expert_bytes], as mapped here
    uint8_t* slot_pools[kMaxRanks];    // every rank's slot pool [B][expert_bytes], as mapped here (pull: [rank] only)
};

struct PrefetchArgs {
    int rank;
    int num_ranks;
    int experts_per_rank;
    int num_slots;               // B: slots per rank (epn in training)
    const int32_t* slot_expert;  // [R][epn] from the plan (slots j >= B are -1)
    // Push (training): every owner copies its replicated experts into the holders' slots; two barriers (the holders'
    // previous slots are free; every slot is filled).
    // Pull (serving): every rank copies the experts of its own slots from their owners' memory; one barrier (the
    // owners' weights are final); no rank writes another's memory.
    bool pull;
    // Pull only: no barrier of its own. The plan op that made slot_expert met every rank after that rank's last write
    // of its own weights, so the owners' weights are already final for this pull; the caller promises that no owner
    // writes them between that plan op and this step's next collective op (serving writes weights between steps).
    bool plan_ordered;
    int num_projections;  // in [1, kMaxPrefetchProjections]
    PrefetchProjection projections[kMaxPrefetchProjections];
    sync::SyncArgs sync;
};

// prefetch's contract, checked once per call for both backends.
inline void check_prefetch_args(const PrefetchArgs& a) {
    FLATEP_CHECK(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "prefetch: num_ranks must be in [1, ", kMaxRanks,
                 "], got ", a.num_ranks);
    check_op_rank("prefetch", a.rank, a.num_ranks);
    FLATEP_CHECK(a.num_slots >= 0 && a.num_slots <= a.experts_per_rank,
                 "prefetch: num_slots must be in [0, epn=", a.experts_per_rank, "], got ", a.num_slots);
    FLATEP_CHECK(a.num_projections >= 1 && a.num_projections <= kMaxPrefetchProjections,
                 "prefetch: num_projections must be in [1, ", kMaxPrefetchProjections, "], got ", a.num_projections);
    check_given("prefetch", "slot_expert", a.slot_expert);
    FLATEP_CHECK(a.pull || !a.plan_ordered,
                 "prefetch: plan_ordered must be false for a push (training's prefetch needs its two barriers), got "
                 "true");
    for (int p = 0; p < a.num_projections; ++p) {
        const PrefetchProjection& pr = a.projections[p];
        FLATEP_CHECK(pr.expert_bytes > 0 && pr.expert_bytes % 16 == 0, "prefetch: projection ", p,
                     ": expert_bytes must be a positive multiple of 16, got ", pr.expert_bytes);
        if (!a.pull) check_given("prefetch", "weights", pr.weights);
        check_aligned16("prefetch", "weights", pr.weights);
        for (int r = 0; r < a.num_ranks; ++r) {
            const bool needed = a.num_slots > 0 && (!a.pull || r == a.rank);
            check_given("prefetch", "a slot pool", pr.slot_pools[r], needed ? 1 : 0);
            check_aligned16("prefetch", "a slot pool", pr.slot_pools[r]);
            check_given("prefetch", "an owner's weights", pr.owners[r], a.pull ? 1 : 0);
            check_aligned16("prefetch", "an owner's weights", pr.owners[r]);
        }
    }
}

namespace host {

// The CPU twin (src/host/prefetch.cpp). Runs rank args.rank's part. Push (collective): barrier; for every rank d
// and slot j whose expert slot_expert[d][j] is owned by this rank, copy that expert's weights into d's slot pool at
// slot j; barrier. Pull: barrier unless plan_ordered; for every slot j of this rank holding an expert, copy it from
// its owner's weights.
void run(const PrefetchArgs& args);

}  // namespace host

namespace kernels {

// The CUDA launcher (src/kernels/prefetch): same contract and outputs as host::run (a bitwise copy).
// Push (collective): entry barrier (destinations are done with their previous slots) -> owner push of every
// replicated expert of this rank into the slot of each rank hosting it -> exit barrier (every slot is filled).
// Pull: barrier unless plan_ordered -> this rank's filled slots copied from their owners.
void launch(const PrefetchArgs& args, CUstream_st* stream, int num_sms);

}  // namespace kernels

}  // namespace flatep
