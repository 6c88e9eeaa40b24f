// Fused AdamW over one owned range of a flat buffer (entries adamw_f32, adamw_f32_half, adamw_f32_bf16,
// adamw_f32_bf16bits, adamw_f64).
// NumPy twin: hpengine.kernels.adamw_numpy; launcher: hpengine.kernels.adamw_cupy.
//
// Launch assumptions
//   * 1-D grid and 1-D blocks of any size: every loop is grid-stride, so any grid covers any n
//     (the launcher uses 256 threads and at most a few blocks per SM).
//   * p, g, m, v hold the same n elements (the owned range); mask holds n bytes, nonzero where the
//     element's tensor takes weight decay; half (adamw_f32_half) receives the n updated weights as fp16,
//     bf16 (adamw_f32_bf16) as float32 holding the nearest bfloat16 (ties to even; a NaN becomes the
//     canonical 0x7FC00000, inf stays inf: hpengine.precision.round_bf16_), bits (adamw_f32_bf16bits) as the
//     uint16 bits of that bfloat16 (a NaN keeps its sign and high payload, quiet bit set:
//     hpengine.device.bf16_bits.TO_BF16_BODY). The arrays do not overlap.
//   * 16-byte vector loads when p, g, m, v (and bf16; half and bits, 8 bytes) sit at the same offset from a 16-byte
//     boundary: a scalar peel up to p's first aligned element, vectors, a scalar tail. Otherwise every
//     element runs scalar (still coalesced). The launcher keeps m and v aligned like p.
//   * Every operation is IEEE round-to-nearest with subnormals kept (inline PTX: CuPy appends -ftz=true,
//     which would flush them in the intrinsics), in the order of the NumPy twin, so both agree bit for bit.
//
// Coefficients, computed in double on the host and rounded once to T (coef = clip / loss_scale):
//   c1 = (1 - b1) coef;  c2 = (1 - b2) coef^2;  step = lr sqrt(bc2) / bc1;  eps' = eps sqrt(bc2);
//   keep = 1 - lr wd.  Per element:
//   m = m b1 + g c1;  v = v b2 + (g g) c2;  p = (mask ? p keep : p) - (m / (sqrt(v) + eps')) step

typedef unsigned long long u64;

__device__ __forceinline__ float mul_rn(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float add_rn(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float sub_rn(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float div_rn(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float sqrt_rn(float a) { float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r; }
__device__ __forceinline__ double mul_rn(double a, double b) { double r; asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b)); return r; }
__device__ __forceinline__ double add_rn(double a, double b) { double r; asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b)); return r; }
__device__ __forceinline__ double sub_rn(double a, double b) { double r; asm("sub.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b)); return r; }
__device__ __forceinline__ double div_rn(double a, double b) { double r; asm("div.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b)); return r; }
__device__ __forceinline__ double sqrt_rn(double a) { double r; asm("sqrt.rn.f64 %0, %1;" : "=d"(r) : "d"(a)); return r; }

__device__ __forceinline__ unsigned short to_half(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float to_bf16_value(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return (u & 0x007FFFFFu) ? __uint_as_float(0x7FC00000u) : x;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xFFFF0000u);
}

// the bits of x's nearest bfloat16 (ties to even): TO_BF16_BODY of hpengine/device/bf16_bits.py
__device__ __forceinline__ unsigned short to_bf16_bits(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7F800000u) == 0x7F800000u) return (unsigned short)((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

enum { NO_COPY = 0, HALF_COPY = 1, BF16_COPY = 2, BF16_BITS_COPY = 3 };

template <typename T> struct Vec;
template <> struct Vec<float> { typedef float4 type; enum { N = 4 }; };
template <> struct Vec<double> { typedef double2 type; enum { N = 2 }; };

template <typename T> struct Coefs { T b1, c1, b2, c2, step, eps, keep; };

__device__ __forceinline__ bool aligned(const void* ptr, unsigned bytes) {
    return ((u64)ptr & (u64)(bytes - 1)) == 0;
}

// One element, in the twin's order (see the header); m and v are updated in place.
template <typename T>
__device__ __forceinline__ T update(T p, T g, T& m, T& v, unsigned char decay, const Coefs<T>& c) {
    m = add_rn(mul_rn(m, c.b1), mul_rn(g, c.c1));
    v = add_rn(mul_rn(v, c.b2), mul_rn(mul_rn(g, g), c.c2));
    T u = mul_rn(div_rn(m, add_rn(sqrt_rn(v), c.eps)), c.step);
    if (decay) p = mul_rn(p, c.keep);
    return sub_rn(p, u);
}

template <typename T, int COPY>
__device__ void adamw_body(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, const unsigned char* __restrict__ mask,
                           void* __restrict__ copy, long long n, const Coefs<T> c) {
    unsigned short* half = (unsigned short*)copy;
    float* bf16 = (float*)copy;
    typedef typename Vec<T>::type VT;
    const int N = Vec<T>::N;
    long long head = (long long)(((16 - ((u64)p & 15)) & 15) / sizeof(T));
    if (head > n) head = n;
    bool vec = aligned(g + head, 16) && aligned(m + head, 16) && aligned(v + head, 16) &&
               ((COPY != HALF_COPY && COPY != BF16_BITS_COPY) || aligned(half + head, 2 * N)) &&
               (COPY != BF16_COPY || aligned(bf16 + head, 16));
    if (!vec) head = n;                                   // uniform across the grid: no divergence
    const long long nvec = (n - head) / N, rest = n - nvec * N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long k = tid; k < nvec; k += stride) {
        const long long i = head + k * N;
        VT pv = *reinterpret_cast<const VT*>(p + i), gv = *reinterpret_cast<const VT*>(g + i);
        VT mv = *reinterpret_cast<const VT*>(m + i), vv = *reinterpret_cast<const VT*>(v + i);
        T* pe = reinterpret_cast<T*>(&pv);
        const T* ge = reinterpret_cast<const T*>(&gv);
        T* me = reinterpret_cast<T*>(&mv);
        T* ve = reinterpret_cast<T*>(&vv);
#pragma unroll
        for (int e = 0; e < N; ++e) pe[e] = update(pe[e], ge[e], me[e], ve[e], mask[i + e], c);
        *reinterpret_cast<VT*>(p + i) = pv;
        *reinterpret_cast<VT*>(m + i) = mv;
        *reinterpret_cast<VT*>(v + i) = vv;
        if (COPY == HALF_COPY) {                          // only instantiated for float: N == 4
            uint2 h;
            h.x = (unsigned)to_half((float)pe[0]) | ((unsigned)to_half((float)pe[1]) << 16);
            h.y = (unsigned)to_half((float)pe[2]) | ((unsigned)to_half((float)pe[3]) << 16);
            *reinterpret_cast<uint2*>(half + i) = h;
        }
        if (COPY == BF16_COPY) {                          // float only: N == 4
            float4 b = make_float4(to_bf16_value((float)pe[0]), to_bf16_value((float)pe[1]),
                                   to_bf16_value((float)pe[2]), to_bf16_value((float)pe[3]));
            *reinterpret_cast<float4*>(bf16 + i) = b;
        }
        if (COPY == BF16_BITS_COPY) {                     // float only: N == 4
            uint2 h;
            h.x = (unsigned)to_bf16_bits((float)pe[0]) | ((unsigned)to_bf16_bits((float)pe[1]) << 16);
            h.y = (unsigned)to_bf16_bits((float)pe[2]) | ((unsigned)to_bf16_bits((float)pe[3]) << 16);
            *reinterpret_cast<uint2*>(half + i) = h;
        }
    }
    for (long long r = tid; r < rest; r += stride) {      // the peel [0, head) and the tail
        const long long i = r < head ? r : r + nvec * N;
        T mi = m[i], vi = v[i];
        const T pi = update(p[i], g[i], mi, vi, mask[i], c);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (COPY == HALF_COPY) half[i] = to_half((float)pi);
        if (COPY == BF16_COPY) bf16[i] = to_bf16_value((float)pi);
        if (COPY == BF16_BITS_COPY) half[i] = to_bf16_bits((float)pi);
    }
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v,
                                     const unsigned char* mask, long long n, float b1, float c1,
                                     float b2, float c2, float step, float eps, float keep) {
    const Coefs<float> c = {b1, c1, b2, c2, step, eps, keep};
    adamw_body<float, NO_COPY>(p, g, m, v, mask, 0, n, c);
}

extern "C" __global__ void adamw_f32_half(float* p, const float* g, float* m, float* v,
                                          const unsigned char* mask, unsigned short* half, long long n,
                                          float b1, float c1, float b2, float c2, float step, float eps,
                                          float keep) {
    const Coefs<float> c = {b1, c1, b2, c2, step, eps, keep};
    adamw_body<float, HALF_COPY>(p, g, m, v, mask, half, n, c);
}

extern "C" __global__ void adamw_f32_bf16(float* p, const float* g, float* m, float* v,
                                          const unsigned char* mask, float* bf16, long long n,
                                          float b1, float c1, float b2, float c2, float step, float eps,
                                          float keep) {
    const Coefs<float> c = {b1, c1, b2, c2, step, eps, keep};
    adamw_body<float, BF16_COPY>(p, g, m, v, mask, bf16, n, c);
}

extern "C" __global__ void adamw_f32_bf16bits(float* p, const float* g, float* m, float* v,
                                              const unsigned char* mask, unsigned short* bits, long long n,
                                              float b1, float c1, float b2, float c2, float step, float eps,
                                              float keep) {
    const Coefs<float> c = {b1, c1, b2, c2, step, eps, keep};
    adamw_body<float, BF16_BITS_COPY>(p, g, m, v, mask, bits, n, c);
}

extern "C" __global__ void adamw_f64(double* p, const double* g, double* m, double* v,
                                     const unsigned char* mask, long long n, double b1, double c1,
                                     double b2, double c2, double step, double eps, double keep) {
    const Coefs<double> c = {b1, c1, b2, c2, step, eps, keep};
    adamw_body<double, NO_COPY>(p, g, m, v, mask, 0, n, c);
}
