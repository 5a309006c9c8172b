// DeviceKernels, the kernels a device runs on model state in its own memory, is public:
// include/strata/device_kernels.h (a third-party device implements it from the installed
// headers). This header stays for the engine's and the devices' includes; the exact-equality
// notes of strata's own implementations are in kernels/cuda_kernels.h (the CUDA kernels compute
// what the CPU kernels of kernels/adam.h, grad_stats.h and casts.h compute; on FMA CPU targets a
// shard's result is bit-identical whichever side computes it, except NaN payloads and chunk sums
// on AVX-512, which add in another lane order).
#pragma once

#include "strata/device_kernels.h"
