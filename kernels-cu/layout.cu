// Data movement: strided box copies (narrow, cat, permute, patchify / unpatchify, halo pack into
// and unpack out of pre-padded conv inputs), nearest upsampling, Wan2.2's AvgDown3D / DupUp3D,
// and diffusers' tile blend.
#include "common.cuh"

// A box of up to 8 dimensions: element `idx` (row-major over `extent`) is read at
// `sum(idx_d * src_stride[d])` and written at `sum(idx_d * dst_stride[d])` (strides in elements,
// offsets folded into the pointers). Covers every copy the tensor layer makes.
struct Box8 {
    u64 extent[8];
    i64 src_stride[8];
    i64 dst_stride[8];
    int rank;
};

// Element types do not matter to a copy: one body for f32 and for 16-bit (bf16) storage.
//
// The box is walked by rows of its last dimension, each cut into segments of at most
// COPY_SEGMENT elements: a segment's offsets are decomposed once (the 64-bit divisions of the
// other dimensions), then 32 virtual lanes (consecutive threads of the grid-stride range over
// (segment, lane) pairs) step through it, so a warp reads and writes 32 consecutive elements
// wherever the last dimension is the contiguous one, and the per-element work is one multiply-add
// per side. Rows shorter than a warp take one thread each. The backend first drops dimensions of
// extent 1 and merges dimensions that are contiguous in both source and destination (a narrow of
// whole rows becomes one long row), so rows are as long as they can be; the segments keep one
// long row (a whole contiguous tensor) spread over the device instead of on 32 lanes (on an H200
// such a copy of 16 M elements took 106 ms in one block).
#define COPY_SEGMENT 2048

template <typename T>
__device__ __forceinline__ void copy_box_impl(const T* src, T* dst, const Box8& box, u64 n) {
    const int last = box.rank - 1;
    const u64 e = last >= 0 ? box.extent[last] : 1;
    const i64 ss = last >= 0 ? box.src_stride[last] : 0, ds = last >= 0 ? box.dst_stride[last] : 0;
    const u64 rows = e == 0 ? 0 : n / e;
    const u64 segments = (e + COPY_SEGMENT - 1) / COPY_SEGMENT;
    const int lanes_log2 = e >= 32 ? 5 : 0;
    GRID_STRIDE(j, (rows * segments) << lanes_log2) {
        const u64 v = j >> lanes_log2, segment = v % segments;
        u64 rest = v / segments;
        i64 s = 0, d = 0;
        for (int k = last - 1; k >= 0; --k) {
            const u64 ext = box.extent[k];
            const u64 at = rest % ext;
            rest /= ext;
            s += (i64)at * box.src_stride[k];
            d += (i64)at * box.dst_stride[k];
        }
        const u64 lanes = (u64)1 << lanes_log2;
        const u64 end = segment * COPY_SEGMENT + COPY_SEGMENT < e ? segment * COPY_SEGMENT + COPY_SEGMENT : e;
        for (u64 i = segment * COPY_SEGMENT + (j & (lanes - 1)); i < end; i += lanes) {
            dst[d + (i64)i * ds] = src[s + (i64)i * ss];
        }
    }
}

extern "C" __global__ void copy_box_f32(const float* src, float* dst, Box8 box, u64 n) {
    copy_box_impl(src, dst, box, n);
}

extern "C" __global__ void copy_box_u16(const unsigned short* src, unsigned short* dst, Box8 box, u64 n) {
    copy_box_impl(src, dst, box, n);
}

// `F.interpolate(scale_factor=f, mode="nearest")` (and nearest-exact, equal for integer f) of
// the last two dimensions; `planes` is the product of the leading ones.
//
// Each input row `r` (of `planes * h`) is read once and written to output rows `r * f + dy`
// (no division: `oh = h * f`); 32 virtual lanes (consecutive threads of the grid-stride range over
// (row, lane) pairs) step through the row, so a warp reads 32 consecutive elements and, for the
// usual f = 2, stores each one's pair of copies in one access (8 bytes of f32, 4 of bf16; rows of
// `2w` elements keep pairs aligned).
// Two copies of an element's bits in one pack (bits, not values: a NaN's payload is kept).
__device__ __forceinline__ Pack<8> pair_of(float v) {
    Pack<8> p;
    p.w[0] = p.w[1] = __float_as_uint(v);
    return p;
}
__device__ __forceinline__ Pack<4> pair_of(unsigned short v) {
    Pack<4> p;
    p.w[0] = (unsigned int)v | ((unsigned int)v << 16);
    return p;
}

template <typename T>
__device__ __forceinline__ void upsample_nearest2d_impl(const T* x, T* out, u64 planes, u64 h, u64 w, u64 f) {
    const u64 ow = w * f;
    const bool pairs = f == 2 && aligned(out, 2 * (int)sizeof(T));
    GRID_STRIDE(j, planes * h * 32) {
        const u64 row = j >> 5;
        const T* xr = x + row * w;
        T* o = out + row * f * ow;
        for (u64 ix = j & 31; ix < w; ix += 32) {
            const T v = xr[ix];
            if (pairs) {
                const auto p = pair_of(v);
                pack_store<2 * sizeof(T)>(o + 2 * ix, p);
                pack_store<2 * sizeof(T)>(o + ow + 2 * ix, p);
            } else {
                for (u64 dy = 0; dy < f; ++dy)
                    for (u64 dx = 0; dx < f; ++dx) o[dy * ow + ix * f + dx] = v;
            }
        }
    }
}

// Wan2.2 `DupUp3D`: `y[n, o, t*ft + dt - drop, h*fs + dh, w*fs + dw] = x[n, j / repeats, t, h, w]`
// with `j = ((o*ft + dt)*fs + dh)*fs + dw`; `drop` leading output frames are skipped (the first
// chunk drops `ft - 1`).
template <typename T>
__device__ __forceinline__ void dup_up3d_impl(
    const T* x, T* out, u64 batch, u64 channels, u64 t, u64 h, u64 w,
    u64 out_channels, u64 ft, u64 fs, u64 repeats, u64 drop) {
    const u64 to = t * ft - drop, ho = h * fs, wo = w * fs;
    GRID_STRIDE(i, batch * out_channels * to * ho * wo) {
        const u64 ox = i % wo, oy = (i / wo) % ho, ot = (i / (wo * ho)) % to;
        const u64 o = (i / (wo * ho * to)) % out_channels, b = i / (wo * ho * to * out_channels);
        const u64 tf = ot + drop;
        const u64 j = ((o * ft + tf % ft) * fs + oy % fs) * fs + ox % fs;
        out[i] = x[(((b * channels + j / repeats) * t + tf / ft) * h + oy / fs) * w + ox / fs];
    }
}

// Wan2.2 `AvgDown3D`: `pad_t` zero frames in front, each `ft x fs x fs` block folded into
// channels `k = ((c*ft + dt)*fs + dh)*fs + dw`, and groups of `group` consecutive folded
// channels averaged (summed in f64, rounded once, as the CPU backend).
template <typename T>
__device__ __forceinline__ void avg_down3d_impl(
    const T* x, T* out, u64 batch, u64 channels, u64 t, u64 h, u64 w,
    u64 out_channels, u64 ft, u64 fs, u64 group, u64 pad_t) {
    const u64 t2 = (t + pad_t) / ft, h2 = h / fs, w2 = w / fs;
    GRID_STRIDE(i, batch * out_channels * t2 * h2 * w2) {
        const u64 ox = i % w2, oy = (i / w2) % h2, ot = (i / (w2 * h2)) % t2;
        const u64 o = (i / (w2 * h2 * t2)) % out_channels, b = i / (w2 * h2 * t2 * out_channels);
        double sum = 0.0;
        for (u64 g = 0; g < group; ++g) {
            const u64 k = o * group + g;
            const u64 dw = k % fs, dh = (k / fs) % fs, dt = (k / (fs * fs)) % ft, c = k / (fs * fs * ft);
            const u64 tp = ot * ft + dt;
            if (tp < pad_t) continue;
            sum += (double)load_f32(&x[(((b * channels + c) * t + (tp - pad_t)) * h + oy * fs + dh) * w + ox * fs + dw]);
        }
        store_f32(&out[i], (float)(sum / (double)group));
    }
}

#define RESAMPLE(SUFFIX, T)                                                                                \
    extern "C" __global__ void upsample_nearest2d_##SUFFIX(const T* x, T* out, u64 planes, u64 h, u64 w, u64 f) { \
        upsample_nearest2d_impl(x, out, planes, h, w, f);                                                  \
    }                                                                                                      \
    extern "C" __global__ void dup_up3d_##SUFFIX(const T* x, T* out, u64 batch, u64 channels, u64 t, u64 h, \
                                                u64 w, u64 out_channels, u64 ft, u64 fs, u64 repeats, u64 drop) { \
        dup_up3d_impl(x, out, batch, channels, t, h, w, out_channels, ft, fs, repeats, drop);             \
    }                                                                                                      \
    extern "C" __global__ void avg_down3d_##SUFFIX(const T* x, T* out, u64 batch, u64 channels, u64 t, u64 h, \
                                                  u64 w, u64 out_channels, u64 ft, u64 fs, u64 group, u64 pad_t) { \
        avg_down3d_impl(x, out, batch, channels, t, h, w, out_channels, ft, fs, group, pad_t);            \
    }

RESAMPLE(f32, float)
RESAMPLE(bf16, unsigned short)

// diffusers' `blend_v` / `blend_h` in place along one dimension of `[outer, len, inner]`:
// `cur[o, y, i] = prev[o, len_prev - e + y, i] * wp[y] + cur[o, y, i] * wc[y]` for `y < e`, two
// roundings and an add, no fused multiply-add (as PyTorch evaluates it).
extern "C" __global__ void blend_leading_f32(
    float* cur, const float* prev, const float* w_prev, const float* w_cur,
    u64 outer, u64 len_cur, u64 len_prev, u64 inner, u64 e) {
    GRID_STRIDE(i, outer * e * inner) {
        const u64 k = i % inner, y = (i / inner) % e, o = i / (inner * e);
        const float a = __fmul_rn(prev[(o * len_prev + len_prev - e + y) * inner + k], w_prev[y]);
        float* c = &cur[(o * len_cur + y) * inner + k];
        *c = __fadd_rn(a, __fmul_rn(*c, w_cur[y]));
    }
}
