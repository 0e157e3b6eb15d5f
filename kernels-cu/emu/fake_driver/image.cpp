// Reading module images: PTX text (entries, parameter lists, `.maxntid`, `.target`, `.version`)
// and ELF cubins (global function symbols, and the `.nv.info` attributes ptxas writes: register
// counts, launch bounds, parameter sizes; `.nv.shared.<kernel>` sizes).
#include "image.h"

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace fake_cuda {
namespace {

// The newest PTX ISA the CUDA 12.9 driver accepts.
constexpr int kMaxPtxMajor = 8, kMaxPtxMinor = 8;

// ---------------------------------------------------------------- PTX

bool is_ident(char c) { return std::isalnum((unsigned char)c) || c == '_' || c == '$' || c == '.'; }

const char* skip_space(const char* p) {
    while (*p && std::isspace((unsigned char)*p)) ++p;
    return p;
}

// The size of one `.param` declaration, e.g. `.param .u64 k_param_0` or
// `.param .align 8 .b8 k_param_4[136]`; 0 if it cannot be read.
std::size_t param_size(const std::string& decl) {
    static const struct {
        const char* type;
        std::size_t size;
    } kTypes[] = {{".u8", 1},  {".s8", 1},  {".b8", 1},  {".u16", 2}, {".s16", 2}, {".b16", 2}, {".f16", 2},
                  {".u32", 4}, {".s32", 4}, {".b32", 4}, {".f32", 4}, {".u64", 8}, {".s64", 8}, {".b64", 8},
                  {".f64", 8}};
    std::size_t elem = 0;
    std::size_t at = 0;
    while (at < decl.size()) {
        while (at < decl.size() && std::isspace((unsigned char)decl[at])) ++at;
        std::size_t end = at;
        while (end < decl.size() && !std::isspace((unsigned char)decl[end])) ++end;
        const std::string token = decl.substr(at, end - at);
        for (const auto& t : kTypes) {
            if (token == t.type) elem = t.size;
        }
        at = end;
    }
    if (elem == 0) return 0;
    const std::size_t open = decl.find('[');
    if (open == std::string::npos) return elem;
    return elem * (std::size_t)std::strtoull(decl.c_str() + open + 1, nullptr, 10);
}

CUresult parse_ptx(const char* text, int cc_major, int cc_minor, Image& out, std::string& why) {
    const char* version = std::strstr(text, ".version");
    const char* target = std::strstr(text, ".target");
    if (!version || !target) {
        why = "neither a cubin (ELF) nor PTX text (no .version / .target)";
        return CUDA_ERROR_INVALID_IMAGE;
    }
    int major = 0, minor = 0;
    if (std::sscanf(version, ".version %d.%d", &major, &minor) != 2) {
        why = "unreadable PTX .version";
        return CUDA_ERROR_INVALID_PTX;
    }
    if (major > kMaxPtxMajor || (major == kMaxPtxMajor && minor > kMaxPtxMinor)) {
        why = "PTX ISA " + std::to_string(major) + "." + std::to_string(minor) + " is newer than this driver's " +
              std::to_string(kMaxPtxMajor) + "." + std::to_string(kMaxPtxMinor);
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    }
    int sm = 0;
    if (std::sscanf(target, ".target sm_%d", &sm) != 1) {
        why = "unreadable PTX .target";
        return CUDA_ERROR_INVALID_PTX;
    }
    // PTX for sm_XY is JIT-compiled for any device of compute capability X.Y or later.
    if (sm > cc_major * 10 + cc_minor) {
        why = "PTX for sm_" + std::to_string(sm) + " on a device of compute capability " + std::to_string(cc_major) +
              "." + std::to_string(cc_minor);
        return CUDA_ERROR_INVALID_PTX;
    }
    out.kind = "PTX";
    for (const char* p = std::strstr(text, ".entry"); p; p = std::strstr(p + 1, ".entry")) {
        if (p != text && is_ident(p[-1])) continue;
        const char* q = skip_space(p + 6);
        const char* name_end = q;
        while (*name_end && is_ident(*name_end) && *name_end != '.') ++name_end;
        if (name_end == q) {
            why = "a PTX .entry without a name";
            return CUDA_ERROR_INVALID_PTX;
        }
        ImageKernel k;
        k.params_known = true;
        const char* r = skip_space(name_end);
        if (*r == '(') {
            const char* close = std::strchr(r, ')');
            if (!close) {
                why = "an unterminated PTX parameter list";
                return CUDA_ERROR_INVALID_PTX;
            }
            const std::string list(r + 1, close);
            std::size_t at = 0;
            while (at < list.size()) {
                std::size_t comma = list.find(',', at);
                if (comma == std::string::npos) comma = list.size();
                const std::string decl = list.substr(at, comma - at);
                if (decl.find(".param") != std::string::npos) {
                    const std::size_t size = param_size(decl);
                    if (size == 0) {
                        why = "an unreadable PTX parameter: " + decl;
                        return CUDA_ERROR_INVALID_PTX;
                    }
                    k.param_sizes.push_back(size);
                }
                at = comma + 1;
            }
            r = close + 1;
        }
        // Performance directives between the parameter list and the body.
        const char* body = std::strchr(r, '{');
        const std::string directives(r, body ? body : r + std::strlen(r));
        for (const char* d : {".maxntid", ".reqntid"}) {
            const std::size_t at = directives.find(d);
            if (at == std::string::npos) continue;
            unsigned x = 1, y = 1, z = 1;
            if (std::sscanf(directives.c_str() + at + std::strlen(d), " %u , %u , %u", &x, &y, &z) >= 1) {
                k.max_threads = x * y * z;
            }
        }
        out.kernels[std::string(q, name_end)] = k;
    }
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- cubin (ELF64)

template <typename T>
T read(const unsigned char* base, std::uint64_t offset) {
    T v;
    std::memcpy(&v, base + offset, sizeof v);
    return v;
}

struct Section {
    std::uint32_t name, type;
    std::uint64_t offset, size;
    std::uint32_t link, info;
    std::uint64_t entsize;
};

constexpr std::uint32_t kSymtab = 2, kNobits = 8, kNvInfo = 0x70000000;
// A kernel's `.nv.shared.<kernel>` also holds the 1 KiB that sm_80 and later reserve per block
// for the system; the kernel's own static shared memory is the rest.
constexpr std::uint64_t kReservedShared = 1024;
constexpr std::uint8_t kSttFunc = 2, kStbGlobal = 1;
// `.nv.info` attribute formats and the attributes read here.
constexpr std::uint8_t kFmtSval = 0x04;
constexpr std::uint8_t kAttrMaxThreads = 0x05, kAttrKparamInfo = 0x17, kAttrRegcount = 0x2f;

// Walks the attributes of one `.nv.info` section: `f(attribute, value, size)`. Formats 1-3 carry
// at most two bytes in the record's own four; format 4 a 16-bit size and that many bytes.
template <typename F>
bool for_each_attribute(const unsigned char* b, std::uint64_t size, F f) {
    std::uint64_t i = 0;
    while (i + 4 <= size) {
        const std::uint8_t fmt = b[i], attr = b[i + 1];
        if (fmt == kFmtSval) {
            const std::uint16_t len = read<std::uint16_t>(b, i + 2);
            if (i + 4 + len > size) return false;
            f(attr, b + i + 4, (std::size_t)len);
            i += 4 + len;
        } else if (fmt >= 1 && fmt <= 3) {
            f(attr, b + i + 2, (std::size_t)2);
            i += 4;
        } else {
            return false;
        }
    }
    return true;
}

CUresult parse_cubin(const unsigned char* d, int cc_major, int cc_minor, Image& out, std::string& why) {
    if (d[4] != 2 || d[5] != 1) {
        why = "not a little-endian ELF64 cubin";
        return CUDA_ERROR_INVALID_IMAGE;
    }
    // e_flags: the SASS architecture in the low byte (0x5a: sm_90). SASS runs on devices of the
    // same major version and an equal or later minor one.
    const unsigned arch = read<std::uint32_t>(d, 0x30) & 0xff;
    if ((int)arch / 10 != cc_major || (int)arch % 10 > cc_minor) {
        why = "cubin for sm_" + std::to_string(arch) + " on a device of compute capability " +
              std::to_string(cc_major) + "." + std::to_string(cc_minor);
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
    const std::uint64_t shoff = read<std::uint64_t>(d, 0x28);
    const std::uint16_t shentsize = read<std::uint16_t>(d, 0x3a), shnum = read<std::uint16_t>(d, 0x3c),
                        shstrndx = read<std::uint16_t>(d, 0x3e);
    if (shentsize != 64 || shnum == 0 || shstrndx >= shnum) {
        why = "a cubin without a readable section table";
        return CUDA_ERROR_INVALID_IMAGE;
    }
    std::vector<Section> sections(shnum);
    for (unsigned i = 0; i < shnum; ++i) {
        const std::uint64_t h = shoff + (std::uint64_t)i * shentsize;
        sections[i] = {read<std::uint32_t>(d, h),      read<std::uint32_t>(d, h + 4),  read<std::uint64_t>(d, h + 24),
                       read<std::uint64_t>(d, h + 32), read<std::uint32_t>(d, h + 40), read<std::uint32_t>(d, h + 44),
                       read<std::uint64_t>(d, h + 56)};
    }
    const auto section_name = [&](const Section& s) {
        return std::string((const char*)d + sections[shstrndx].offset + s.name);
    };

    // The kernels: global function symbols. Symbol indexes name them in `.nv.info`.
    std::map<std::uint32_t, std::string> by_symbol;
    for (const Section& s : sections) {
        if (s.type != kSymtab || s.entsize != 24 || s.link >= shnum) continue;
        const std::uint64_t strtab = sections[s.link].offset;
        for (std::uint64_t e = 0; e < s.size / 24; ++e) {
            const std::uint64_t sym = s.offset + e * 24;
            const std::uint8_t info = d[sym + 4];
            if ((info & 0xf) != kSttFunc || (info >> 4) != kStbGlobal) continue;
            const std::string name((const char*)d + strtab + read<std::uint32_t>(d, sym));
            by_symbol[(std::uint32_t)e] = name;
            out.kernels[name];
        }
    }
    if (out.kernels.empty()) {
        why = "a cubin without kernels";
        return CUDA_ERROR_INVALID_IMAGE;
    }
    out.kind = "cubin";
    for (const Section& s : sections) {
        const std::string name = section_name(s);
        if (s.type == kNobits && name.rfind(".nv.shared.", 0) == 0) {
            const auto k = out.kernels.find(name.substr(11));
            if (k != out.kernels.end()) k->second.static_shared = s.size > kReservedShared ? s.size - kReservedShared : 0;
        }
        if (s.type != kNvInfo) continue;
        if (name == ".nv.info") {
            for_each_attribute(d + s.offset, s.size, [&](std::uint8_t attr, const unsigned char* v, std::size_t n) {
                if (attr != kAttrRegcount || n != 8) return;
                const auto k = by_symbol.find(read<std::uint32_t>(v, 0));
                if (k != by_symbol.end()) out.kernels[k->second].registers = read<std::uint32_t>(v, 4);
            });
        } else if (name.rfind(".nv.info.", 0) == 0) {
            const auto k = out.kernels.find(name.substr(9));
            if (k == out.kernels.end()) continue;
            ImageKernel& kernel = k->second;
            std::map<std::uint16_t, std::size_t> params;  // ordinal -> size
            const bool ok =
                for_each_attribute(d + s.offset, s.size, [&](std::uint8_t attr, const unsigned char* v, std::size_t n) {
                    if (attr == kAttrMaxThreads && n == 12) {
                        kernel.max_threads =
                            read<std::uint32_t>(v, 0) * read<std::uint32_t>(v, 4) * read<std::uint32_t>(v, 8);
                    } else if (attr == kAttrKparamInfo && n == 12) {
                        // {index, ordinal: u16, offset: u16, flags: u32 with the size in bits 18..31}
                        params[read<std::uint16_t>(v, 4)] = (read<std::uint32_t>(v, 8) >> 18) & 0x3fff;
                    }
                });
            if (!ok) continue;
            kernel.params_known = true;
            for (const auto& [ordinal, size] : params) {
                if (ordinal != kernel.param_sizes.size()) {
                    kernel.params_known = false;  // a gap: not what this reader understands
                    break;
                }
                kernel.param_sizes.push_back(size);
            }
        }
    }
    return CUDA_SUCCESS;
}

}  // namespace

CUresult parse_image(const void* data, int cc_major, int cc_minor, Image& out, std::string& why) {
    if (!data) {
        why = "no image";
        return CUDA_ERROR_INVALID_VALUE;
    }
    const auto* bytes = static_cast<const unsigned char*>(data);
    if (std::memcmp(bytes, "\x7f" "ELF", 4) == 0) return parse_cubin(bytes, cc_major, cc_minor, out, why);
    // A fatbinary (what nvcc embeds) starts with this magic; this build never makes one.
    if (std::memcmp(bytes, "\x50\xed\x55\xba", 4) == 0) {
        why = "fatbinary images are not emulated (load the PTX or the cubin)";
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return parse_ptx(static_cast<const char*>(data), cc_major, cc_minor, out, why);
}

}  // namespace fake_cuda
