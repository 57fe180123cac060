// The calling thread's CUDA device. Torch-free.
#pragma once

namespace flatep {

// Makes `device`'s primary context current on the calling thread (cudaSetDevice, which since CUDA 12 also initialises
// the context and binds it to the thread), whatever the thread did before: a thread that never called into CUDA has
// no current context, and a library that finds none there (cuBLAS's handle creation, say) either warns and binds one
// itself or, inside a CUDA graph capture, fails. Cheap when the context is current already; allowed while a stream
// captures (it enqueues nothing). Throws kInvalidArgument for a device outside [0, device count), kRuntime in a build
// without CUDA.
void make_device_current(int device);

}  // namespace flatep
