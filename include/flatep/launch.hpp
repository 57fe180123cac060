// flatep::Launch: how one op of a Buffer / ExpertPools runs -- where (stream), with how many SMs, and its mode flags
// (OpOptions) -- the last argument of every op, never state of the object. The CPU backend runs ops synchronously on
// the calling thread and ignores the stream and the SM budget (not the options).
#pragma once

namespace flatep {

// The largest SM budget accepted (num_sms; FLATEP_NUM_SMS).
inline constexpr int kMaxNumSms = 1 << 20;

// Mode flags of one call. Each op's comment says which it takes; an op given a flag it does not take throws
// kInvalidArgument naming the flag, so a flag is never ignored.
struct OpOptions {
    // dispatch, dispatch_fp8, combine, and the prefetch of serving pools (every rank alike): the op takes no entry
    // barrier, ordered instead by the plan op that made its plan. Each of those ops' comments gives the caller's part.
    bool plan_ordered = false;
};

struct Launch {
    // The cudaStream_t the op is enqueued on (null: the legacy default stream). Ops never synchronise with the host.
    void* stream = nullptr;
    // The SM budget of this call: the most thread blocks one kernel launch of the op uses, in [0, kMaxNumSms] (0: no
    // cap). -1: the object's num_sms() (FLATEP_NUM_SMS at construction, default 0). A captured CUDA graph keeps the
    // budget it was captured with.
    int num_sms = -1;
    OpOptions options = {};
};

}  // namespace flatep
