// flatep::Launch: where one op of a device Buffer / ExpertPools runs and how many SMs it may use -- an argument of the
// call, never state of the object. The CPU backend runs ops synchronously on the calling thread and ignores both.
#pragma once

namespace flatep {

// The largest SM budget accepted (num_sms; FLATEP_NUM_SMS).
inline constexpr int kMaxNumSms = 1 << 20;

struct Launch {
    // The cudaStream_t the op is enqueued on (null: the legacy default stream). Ops never synchronise with the host.
    void* stream = nullptr;
    // The SM budget of this call: the most thread blocks one kernel launch of the op uses, in [0, kMaxNumSms] (0: no
    // cap). -1: the object's num_sms() (FLATEP_NUM_SMS at construction, default 0). A captured CUDA graph keeps the
    // budget it was captured with.
    int num_sms = -1;
};

}  // namespace flatep
