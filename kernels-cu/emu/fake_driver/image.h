// What a module image (PTX text or an sm_XY cubin) says about its kernels, read the way the
// driver reads it, so the fake can refuse what the real driver refuses (an image for another
// architecture, a kernel the image does not contain, a launch beyond a kernel's limits).
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "driver_api.h"

namespace fake_cuda {

// One kernel (`.entry` in PTX, a global function symbol in a cubin).
struct ImageKernel {
    // The parameters' sizes in bytes, in order (PTX `.param` list; a cubin's KPARAM_INFO).
    std::vector<std::size_t> param_sizes;
    // Whether the image described the parameters (every PTX does; a cubin without its
    // `.nv.info.<kernel>` section does not).
    bool params_known = false;
    // `__launch_bounds__` (PTX `.maxntid`, cubin MAX_THREADS); 0 when none.
    unsigned max_threads = 0;
    // Registers per thread (cubin only: PTX is register-allocated by the JIT); 0 when unknown.
    unsigned registers = 0;
    // Static shared memory, bytes (cubin `.nv.shared.<kernel>`; unknown in PTX: 0).
    std::size_t static_shared = 0;
};

struct Image {
    const char* kind = "";  // "PTX" or "cubin"
    std::map<std::string, ImageKernel> kernels;
};

// Reads `data` (what cuModuleLoadData received) for a device of compute capability
// `cc_major.cc_minor`. On failure returns the driver's error code and says why in `why`.
CUresult parse_image(const void* data, int cc_major, int cc_minor, Image& out, std::string& why);

}  // namespace fake_cuda
