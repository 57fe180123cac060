// Device memory for the ipc transport: CUDA VMM allocations (cuMemCreate) exportable as POSIX file descriptors,
// imported by peers (cuMemImportFromShareableHandle) and mapped with cuMemMap + cuMemSetAccess for this process's
// device. Compiled only in builds with CUDA (library flatep_transport_cuda).
#pragma once

#include <memory>

#include "transport/ipc_memory.hpp"

namespace flatep::transport {

// Memory on CUDA device `device` (-1: the device of the calling thread's current context, device 0 when none is
// current). Retains that device's primary context (torch's) for its lifetime and binds it around every driver call,
// on whatever thread, restoring the caller's context after. Throws kRuntime when the device cannot export POSIX-fd
// VMM handles.
std::unique_ptr<IpcMemory> make_cuda_ipc_memory(int device);

}  // namespace flatep::transport
