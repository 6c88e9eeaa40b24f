// Fused layer kernels for the CuPy path: each replaces a chain of element-wise CuPy calls (one launch and
// one pass over memory each) by a single launch that reads its inputs once. Entries <op>_f32 and <op>_f64;
// and, for bf16 amp, float32 math with the arrays below as bfloat16 bits (unsigned short, the float32's high
// half rounded to nearest even, as TO_BF16_BODY of hpengine/device/bf16_bits.py rounds; read exactly), so
// that a GEMM's input or output needs no conversion pass of its own. <op>_f32_bf16, the outputs in bits:
//   gelu_fwd, swiglu_fwd, layernorm_fwd, rmsnorm_fwd: the output (y, a) in bits; s, xhat, rstd float32;
//   swiglu_bwd: dg and du in bits; rope_fwd, rope_bwd: y (dx) in bits, the input float32 (strided as ever);
//   causal_softmax_f32_bf16(z, p, ...): not in place: float32 scores z in (unchanged), the bits of the
//     probabilities out, whose float32 values before rounding are causal_softmax_f32's;
//   softmax_bwd, grouped_softmax_bwd: p read as bits; ds float32, in place.
// <op>_f32_bf16x, the output and the cache in bits: layernorm_fwd, rmsnorm_fwd: y and xhat in bits (y from the
//   float32 xhat, rounded once), rstd float32.
// <op>_f32_bf16o, a separate bits output: softmax_bwd(ds, p, rs, out, ...), grouped_softmax_bwd(ds, p, rs, out,
//   ...): not in place: ds (= dP) float32 in, left as it is; p read as bits; out = (ds - rs) * p in bits.
// <op>_f32_bf16i, the inputs (a GEMM's outputs) in bits too:
//   rope_fwd: x read as bits (a strided view, as ever), y in bits;
//   gelu_fwd: x read as bits, y and s in bits; gelu_bwd: x, s read as bits, dy float32, dx in bits;
//   swiglu_fwd: g, u read as bits, a and s in bits; swiglu_bwd: g, u, s read as bits, da float32, dg, du bits;
//   gelu_recompute(x, s, y): y = x s, swiglu_recompute(g, u, s, a): a = (g s) u; all bits.
//   With the cache s in bits the forwards compute y (a) from the value s's bits hold, so that the
//   recompute entries rebuild the forward's output bit for bit from the cache.
//   layernorm_bwd, rmsnorm_bwd: xhat read as bits (a _bf16x forward's), dy, rstd, w and dx float32;
//   colsum_prod_part(a, b, part, ...): b read as bits, a and part float32 (the norm weights' sum(dy xhat));
//   colsum_part(a, part, ...): a read as bits, part float32 (a bias gradient from a bits output gradient).
// NumPy twins: the NumPy code in hpengine/nn (gelu_forward, gelu_backward, attention_forward's softmax,
// attention_backward's softmax gradient, gqa_attention_backward's softmax gradient, layernorm_forward,
// layernorm_backward's dx, rmsnorm_forward, rmsnorm_backward's dx, rope_forward, rope_backward,
// swiglu_forward, swiglu_backward, cross_entropy_forward, cross_entropy_backward, the bias and norm weight
// gradients' column sums), which computes the same formulas (for the bits, then rounds with
// bf16_bits.to_bf16_bits); hpengine/nn/fused.py launches these.
//
// Launch assumptions
//   * point-wise entries (gelu_*, softmax_bwd_*, grouped_softmax_bwd_*, rope_*, swiglu_*, xent_bwd): 1-D
//     grid-stride loops, any grid covers any n.
//   * row entries (causal_softmax_*, layernorm_*, rmsnorm_*, xent_fwd): one block per row (grid-stride over
//     rows), blockDim.x a multiple of 32 and at most 1024; rows are contiguous, n_cols elements apart.
//   * colsum_part*: blocks of (32, 8) threads, gridDim.x * 32 >= n_cols, gridDim.y chunks of rows;
//     colsum_finish: 1-D grid-stride, part holding gridDim.y rows of the part entry's grid.
//   * all arrays C-contiguous, except the input of rope_*, read through the four element strides passed;
//     outputs do not overlap inputs unless the entry says "in place".
//   * causal_softmax_f32/_f64 work in place on p; causal_softmax_f32_bf16's z and p are separate arrays.
//   * the softmax gradients work in place on ds, but the _bf16o entries, whose out is a separate array.

#define MAX_WARPS 32

template <typename T> __device__ __forceinline__ T ex(T x);
template <> __device__ __forceinline__ float ex<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ double ex<double>(double x) { return exp(x); }
template <typename T> __device__ __forceinline__ T lg(T x);
template <> __device__ __forceinline__ float lg<float>(float x) { return logf(x); }
template <> __device__ __forceinline__ double lg<double>(double x) { return log(x); }
template <typename T> __device__ __forceinline__ T rsq(T x);
template <> __device__ __forceinline__ float rsq<float>(float x) { return 1.0f / sqrtf(x); }
template <> __device__ __forceinline__ double rsq<double>(double x) { return 1.0 / sqrt(x); }
template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// float32 v -> the bits of the bfloat16 nearest v (ties to even); inf stays inf, a NaN keeps its sign and high
// payload with the quiet bit 0x0040 set: TO_BF16_BODY of hpengine/device/bf16_bits.py
__device__ __forceinline__ unsigned short bf16_bits(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7F800000u) == 0x7F800000u) return (unsigned short)((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// a value -> the element of storage type E that holds it (bits: rounded), and an element -> its value (exact)
template <typename E, typename T> __device__ __forceinline__ E element(T v) { return v; }
template <> __device__ __forceinline__ unsigned short element<unsigned short, float>(float v) { return bf16_bits(v); }
__device__ __forceinline__ float value(float v) { return v; }
__device__ __forceinline__ double value(double v) { return v; }
__device__ __forceinline__ float value(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }

// stores and loads in an array's storage type: bits are rounded on the way in, exact on the way out
__device__ __forceinline__ void put(float* __restrict__ a, long long i, float v) { a[i] = v; }
__device__ __forceinline__ void put(double* __restrict__ a, long long i, double v) { a[i] = v; }
__device__ __forceinline__ void put(unsigned short* __restrict__ a, long long i, float v) { a[i] = bf16_bits(v); }
// put, then the value the array now holds: v itself, or for bits the bfloat16 value v rounded to
__device__ __forceinline__ float stored(float* __restrict__ a, long long i, float v) { a[i] = v; return v; }
__device__ __forceinline__ double stored(double* __restrict__ a, long long i, double v) { a[i] = v; return v; }
__device__ __forceinline__ float stored(unsigned short* __restrict__ a, long long i, float v) {
    const unsigned short b = bf16_bits(v);
    a[i] = b;
    return value(b);
}
__device__ __forceinline__ float get(const float* __restrict__ a, long long i) { return a[i]; }
__device__ __forceinline__ double get(const double* __restrict__ a, long long i) { return a[i]; }
__device__ __forceinline__ float get(const unsigned short* __restrict__ a, long long i) { return value(a[i]); }

struct Sum { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct Max { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; } };

// Reduce v over the block; every thread gets the result. `sh` holds MAX_WARPS values; the trailing
// barrier lets the caller reuse `sh` for the next reduction.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* sh, Op op) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = sh[0];
    for (int w = 1; w < nwarps; ++w) v = op(v, sh[w]);
    __syncthreads();
    return v;
}

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)
#define ROWS(r, n_rows) for (long long r = blockIdx.x; r < (n_rows); r += gridDim.x)

// ---- GELU, tanh approximation, as sigmoid: y = x s, s = 1 / (1 + exp(-2K (x + A x^3)))
#define GELU_K 0.7978845608028654
#define GELU_A 0.044715

// (Y: y's storage, X: that of x and s; T or bits. y is x times the value s holds: gelu_recompute's y)
template <typename T, typename Y = T, typename X = T>
__device__ void gelu_fwd(const X* __restrict__ x, Y* __restrict__ y, X* __restrict__ s, long long n) {
    GRID_STRIDE(i, n) {
        const T xi = get(x, i);
        T u = xi * xi;
        u *= (T)(-2.0 * GELU_A * GELU_K);
        u -= (T)(2.0 * GELU_K);
        u *= xi;
        const T si = stored(s, i, (T)1 / (ex<T>(u) + (T)1));
        put(y, i, xi * si);
    }
}

// dx = dy s (1 + (1 - s) x (2K + 6AK x^2)) (X: the storage of x and s, D: dx's, T or bits)
template <typename T, typename X = T, typename D = T>
__device__ void gelu_bwd(const X* __restrict__ x, const X* __restrict__ s, const T* __restrict__ dy,
                         D* __restrict__ dx, long long n) {
    GRID_STRIDE(i, n) {
        const T xi = get(x, i), si = get(s, i);
        T d = xi * xi;
        d *= (T)(6.0 * GELU_A * GELU_K);
        d += (T)(2.0 * GELU_K);
        d *= xi;
        d *= (T)1 - si;
        d += (T)1;
        d *= si;
        put(dx, i, d * dy[i]);
    }
}

// y = x s from gelu_fwd's input and cache: its output again (X: x's and s's storage, Y: y's)
template <typename T, typename X, typename Y>
__device__ void gelu_recompute(const X* __restrict__ x, const X* __restrict__ s, Y* __restrict__ y, long long n) {
    GRID_STRIDE(i, n) put(y, i, (T)get(x, i) * (T)get(s, i));
}

// ---- causal softmax over score rows z of a query block into p, both (n_rows, n_cols) with
// n_rows = batch*heads*n_q; row r is query q0 + r % n_q, which sees keys 0 .. q0 + r % n_q; the keys
// after it become exact zeros. P = T: in place (p is z), the exponentials kept in the row between the
// passes; P bits: z is left as it is and the last pass computes the same exponentials again.
template <typename T, typename P>
__device__ void causal_softmax(const T* z, P* p, long long n_rows, int n_cols, int n_q, int q0) {
    const bool in_place = sizeof(P) == sizeof(T);
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* zr = z + r * n_cols;
        P* row = p + r * n_cols;
        const int seen = q0 + (int)(r % n_q) + 1;
        T m = neg_inf<T>();
        for (int j = threadIdx.x; j < seen; j += blockDim.x) m = m > zr[j] ? m : zr[j];
        m = block_reduce(m, sh, Max());
        T s = 0;
        for (int j = threadIdx.x; j < seen; j += blockDim.x) {
            const T e = ex<T>(zr[j] - m);
            if (in_place) put(row, j, e);
            s += e;
        }
        s = (T)1 / block_reduce(s, sh, Sum());
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x)
            put(row, j, j < seen ? (in_place ? (T)get(row, j) : ex<T>(zr[j] - m)) * s : (T)0);
    }
}

// ---- softmax gradient: out = (ds - rs) * p with ds = dP, rs one value per query row; row r of the
// (batch*heads*n_q, n_cols) block is query q0 + r % n_q of head r / n_q, whose rs sits at
// rs[(r / n_q) * rs_len + q0 + r % n_q]. In place when out is ds. (P: p's storage, O: out's; T or bits.
// out is stored through its own pointer, not put: put's promise of no aliasing does not hold in place)
template <typename T, typename P = T, typename O = T>
__device__ void softmax_bwd(const T* ds, const P* __restrict__ p, const T* __restrict__ rs, O* out, long long n,
                            int n_cols, int n_q, int q0, int rs_len) {
    GRID_STRIDE(i, n) {
        const long long r = i / n_cols;
        out[i] = element<O>((ds[i] - rs[(r / n_q) * rs_len + q0 + r % n_q]) * (T)get(p, i));
    }
}

// ---- layer norm over rows of x (n_rows, n_cols): xhat = (x - mean) rstd, y = xhat w + b; rstd per row
// (Y: y's storage, H: xhat's; T or bits. y from the unrounded xhat)
template <typename T, typename Y = T, typename H = T>
__device__ void layernorm_fwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                              Y* __restrict__ y, H* __restrict__ xhat, T* __restrict__ rstd, long long n_rows,
                              int n_cols, T eps) {
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* xr = x + r * n_cols;
        T s = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) s += xr[j];
        const T mean = block_reduce(s, sh, Sum()) / (T)n_cols;
        T v = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) { const T d = xr[j] - mean; v += d * d; }
        const T rs = rsq<T>(block_reduce(v, sh, Sum()) / (T)n_cols + eps);
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) {
            const T h = (xr[j] - mean) * rs;
            put(xhat, r * n_cols + j, h);
            put(y, r * n_cols + j, h * w[j] + b[j]);
        }
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w (H: xhat's storage, T or bits)
template <typename T, typename H = T>
__device__ void layernorm_bwd(const T* __restrict__ dy, const H* __restrict__ xhat, const T* __restrict__ rstd,
                              const T* __restrict__ w, T* __restrict__ dx, long long n_rows, int n_cols) {
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* dr = dy + r * n_cols;
        const H* hr = xhat + r * n_cols;
        T sg = 0, sgx = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) {
            const T g = dr[j] * w[j];
            sg += g;
            sgx += g * value(hr[j]);
        }
        const T rs = rstd[r];
        const T mg = block_reduce(sg, sh, Sum()) / (T)n_cols * rs;
        const T mgx = block_reduce(sgx, sh, Sum()) / (T)n_cols * rs;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x)
            dx[r * n_cols + j] = dr[j] * w[j] * rs - mg - value(hr[j]) * mgx;
    }
}

// ---- grouped-query softmax gradient: out = (ds - rs) * p over rows of n_cols scores, ds = dP, rs one value
// per row; in place when out is ds (P: p's storage, O: out's; T or bits)
template <typename T, typename P = T, typename O = T>
__device__ void grouped_softmax_bwd(const T* ds, const P* __restrict__ p, const T* __restrict__ rs, O* out,
                                    long long n, int n_cols) {
    GRID_STRIDE(i, n) out[i] = element<O>((ds[i] - rs[i / n_cols]) * (T)get(p, i));
}

// ---- RMS norm over rows of x (n_rows, n_cols): rstd = 1 / sqrt(mean(x^2) + eps), xhat = x rstd, y = xhat w
// (Y: y's storage, H: xhat's; T or bits. y from the unrounded xhat)
template <typename T, typename Y = T, typename H = T>
__device__ void rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ w, Y* __restrict__ y,
                            H* __restrict__ xhat, T* __restrict__ rstd, long long n_rows, int n_cols, T eps) {
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* xr = x + r * n_cols;
        T s = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) s += xr[j] * xr[j];
        const T rs = rsq<T>(block_reduce(s, sh, Sum()) * (T)(1.0 / n_cols) + eps);
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) {
            const T h = xr[j] * rs;
            put(xhat, r * n_cols + j, h);
            put(y, r * n_cols + j, h * w[j]);
        }
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

// dx = rstd (g - xhat mean(g xhat)), g = dy w (H: xhat's storage, T or bits)
template <typename T, typename H = T>
__device__ void rmsnorm_bwd(const T* __restrict__ dy, const H* __restrict__ xhat, const T* __restrict__ rstd,
                            const T* __restrict__ w, T* __restrict__ dx, long long n_rows, int n_cols) {
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* dr = dy + r * n_cols;
        const H* hr = xhat + r * n_cols;
        T sgx = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) sgx += dr[j] * w[j] * value(hr[j]);
        const T m = block_reduce(sgx, sh, Sum()) * (T)(1.0 / n_cols);
        const T rs = rstd[r];
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x)
            dx[r * n_cols + j] = (dr[j] * w[j] - value(hr[j]) * m) * rs;
    }
}

// ---- rotary embedding, "rotate half": pair (x1, x2) = (x[k], x[k + n_k]) of head dim 2 n_k at position t
// turns by +-angle: forward y1 = x1 c - x2 s, y2 = x2 c + x1 s; backward y1 = x1 c + x2 s, y2 = x2 c - x1 s,
// c, s = cos, sin (n_t, n_k) at (t, k). One thread per pair of the C-contiguous output: forward reads
// x (B, n_t, n_h, 2 n_k) and writes (B, n_h, n_t, 2 n_k), backward the other way round; s0..s3 are the
// input's strides in elements, in its own axis order. (X: the input's storage, Y: the output's; T or bits.
// Loads and stores through the offset pointers, not put/get: those promise the compiler no aliasing, which
// would change the f32/f64 entries' code)
template <typename T, bool FWD, typename X = T, typename Y = T>
__device__ void rope(const X* __restrict__ x, const T* __restrict__ cs, const T* __restrict__ sn,
                     Y* __restrict__ y, long long n, int n_t, int n_h, int n_k, long long s0, long long s1,
                     long long s2, long long s3) {
    GRID_STRIDE(i, n) {
        const long long r = i / n_k;                      // output row: (b, h, t) forward, (b, t, h) backward
        const int k = (int)(i - r * n_k);
        const long long q = FWD ? r / n_t : r / n_h;
        const int t = FWD ? (int)(r - q * n_t) : (int)(q % n_t);
        const int h = FWD ? (int)(q % n_h) : (int)(r - q * n_h);
        const long long b = FWD ? q / n_h : q / n_t;
        const X* xi = x + b * s0 + (FWD ? t * s1 + h * s2 : h * s1 + t * s2) + k * s3;
        const T x1 = value(xi[0]), x2 = value(xi[n_k * s3]);
        const T c = cs[(long long)t * n_k + k], s = sn[(long long)t * n_k + k];
        Y* yi = y + r * (2 * n_k) + k;
        yi[0] = element<Y>(FWD ? x1 * c - x2 * s : x1 * c + x2 * s);
        yi[n_k] = element<Y>(FWD ? x2 * c + x1 * s : x2 * c - x1 * s);
    }
}

// ---- SiLU gating: s = sigmoid(g), a = g s u; backward du = g s da, dg = ((1 - s) g + 1) s u da
// (Y: the storage of a, or of dg and du; X: that of g, u and s; T or bits. a is (g times the value s holds)
// times u: swiglu_recompute's a)
template <typename T, typename Y = T, typename X = T>
__device__ void swiglu_fwd(const X* __restrict__ g, const X* __restrict__ u, Y* __restrict__ a, X* __restrict__ s,
                           long long n) {
    GRID_STRIDE(i, n) {
        const T gi = get(g, i);
        const T si = stored(s, i, (T)1 / (ex<T>(-gi) + (T)1));
        put(a, i, gi * si * get(u, i));
    }
}

template <typename T, typename Y = T, typename X = T>
__device__ void swiglu_bwd(const X* __restrict__ g, const X* __restrict__ u, const X* __restrict__ s,
                           const T* __restrict__ da, Y* __restrict__ dg, Y* __restrict__ du, long long n) {
    GRID_STRIDE(i, n) {
        const T gi = get(g, i), si = get(s, i), dai = da[i];
        put(du, i, gi * si * dai);
        T d = (T)1 - si;
        d *= gi;
        d += (T)1;
        d *= si;
        d *= get(u, i);
        put(dg, i, d * dai);
    }
}

// a = (g s) u from swiglu_fwd's cache: its output again (X: the storage of g, u and s, Y: a's)
template <typename T, typename X, typename Y>
__device__ void swiglu_recompute(const X* __restrict__ g, const X* __restrict__ u, const X* __restrict__ s,
                                 Y* __restrict__ a, long long n) {
    GRID_STRIDE(i, n) put(a, i, (T)get(g, i) * (T)get(s, i) * (T)get(u, i));
}

// ---- softmax cross-entropy over rows of logits (n_rows, n_cols): p = softmax (written to p),
// nll[r] = log(sum exp(z - max)) - (z[target] - max)
template <typename T>
__device__ void xent_fwd(const T* __restrict__ z, const long long* __restrict__ target, T* __restrict__ p,
                         T* __restrict__ nll, long long n_rows, int n_cols) {
    __shared__ T sh[MAX_WARPS];
    ROWS(r, n_rows) {
        const T* zr = z + r * n_cols;
        T* pr = p + r * n_cols;
        T m = neg_inf<T>();
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) m = m > zr[j] ? m : zr[j];
        m = block_reduce(m, sh, Max());
        T s = 0;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) { const T e = ex<T>(zr[j] - m); pr[j] = e; s += e; }
        s = block_reduce(s, sh, Sum());
        const T inv = (T)1 / s;
        for (int j = threadIdx.x; j < n_cols; j += blockDim.x) pr[j] *= inv;
        if (threadIdx.x == 0) nll[r] = lg<T>(s) - (zr[target[r]] - m);
    }
}

// d = (p - onehot(target)) * scale
template <typename T>
__device__ void xent_bwd(const T* __restrict__ p, const long long* __restrict__ target, T* __restrict__ d,
                         long long n, int n_cols, T scale) {
    GRID_STRIDE(i, n) {
        const long long r = i / n_cols;
        const int j = (int)(i - r * n_cols);
        d[i] = p[i] * scale - (j == target[r] ? scale : (T)0);
    }
}

// ---- column sums of a (n_rows, n_cols), or of a * b: each block (32 x 8 threads) sums 32 columns over one
// chunk of rows into part[chunk]; colsum_finish adds the chunks in order. Deterministic: no atomics.
// (A, B: a's and b's storage, T or bits)
template <typename T, bool PROD, typename B = T, typename A = T>
__device__ void colsum_part(const A* __restrict__ a, const B* __restrict__ b, T* __restrict__ part,
                            long long n_rows, int n_cols) {
    __shared__ T sh[8][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    const long long per = (n_rows + gridDim.y - 1) / gridDim.y;
    const long long r0 = blockIdx.y * per, r1 = r0 + per < n_rows ? r0 + per : n_rows;
    T s = 0;
    if (col < n_cols)
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y)
            s += PROD ? value(a[r * n_cols + col]) * value(b[r * n_cols + col]) : value(a[r * n_cols + col]);
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n_cols) {
        T t = 0;
        for (int y = 0; y < (int)blockDim.y; ++y) t += sh[y][threadIdx.x];
        part[blockIdx.y * (long long)n_cols + col] = t;
    }
}

// out (+)= the sum over n_parts rows of part
template <typename T>
__device__ void colsum_finish(const T* __restrict__ part, T* out, int n_parts, int n_cols, int accumulate) {
    GRID_STRIDE(j, n_cols) {
        T s = 0;
        for (int q = 0; q < n_parts; ++q) s += part[(long long)q * n_cols + j];
        out[j] = accumulate ? out[j] + s : s;
    }
}

#define ENTRIES(S, T)                                                                                          \
extern "C" __global__ void gelu_fwd_##S(const T* x, T* y, T* s, long long n) { gelu_fwd<T>(x, y, s, n); }      \
extern "C" __global__ void gelu_bwd_##S(const T* x, const T* s, const T* dy, T* dx, long long n) {             \
    gelu_bwd<T>(x, s, dy, dx, n); }                                                                            \
extern "C" __global__ void causal_softmax_##S(T* p, long long n_rows, int n_cols, int n_q, int q0) {           \
    causal_softmax<T, T>(p, p, n_rows, n_cols, n_q, q0); }                                                     \
extern "C" __global__ void softmax_bwd_##S(T* ds, const T* p, const T* rs, long long n, int n_cols, int n_q,   \
                                           int q0, int rs_len) {                                               \
    softmax_bwd<T>(ds, p, rs, ds, n, n_cols, n_q, q0, rs_len); }                                               \
extern "C" __global__ void layernorm_fwd_##S(const T* x, const T* w, const T* b, T* y, T* xhat, T* rstd,       \
                                             long long n_rows, int n_cols, T eps) {                            \
    layernorm_fwd<T>(x, w, b, y, xhat, rstd, n_rows, n_cols, eps); }                                           \
extern "C" __global__ void layernorm_bwd_##S(const T* dy, const T* xhat, const T* rstd, const T* w, T* dx,     \
                                             long long n_rows, int n_cols) {                                   \
    layernorm_bwd<T>(dy, xhat, rstd, w, dx, n_rows, n_cols); }                                                 \
extern "C" __global__ void grouped_softmax_bwd_##S(T* ds, const T* p, const T* rs, long long n, int n_cols) {  \
    grouped_softmax_bwd<T>(ds, p, rs, ds, n, n_cols); }                                                        \
extern "C" __global__ void rmsnorm_fwd_##S(const T* x, const T* w, T* y, T* xhat, T* rstd, long long n_rows,   \
                                           int n_cols, T eps) {                                                \
    rmsnorm_fwd<T>(x, w, y, xhat, rstd, n_rows, n_cols, eps); }                                                \
extern "C" __global__ void rmsnorm_bwd_##S(const T* dy, const T* xhat, const T* rstd, const T* w, T* dx,       \
                                           long long n_rows, int n_cols) {                                     \
    rmsnorm_bwd<T>(dy, xhat, rstd, w, dx, n_rows, n_cols); }                                                   \
extern "C" __global__ void rope_fwd_##S(const T* x, const T* cs, const T* sn, T* y, long long n, int n_t,      \
                                        int n_h, int n_k, long long s0, long long s1, long long s2,           \
                                        long long s3) {                                                        \
    rope<T, true>(x, cs, sn, y, n, n_t, n_h, n_k, s0, s1, s2, s3); }                                           \
extern "C" __global__ void rope_bwd_##S(const T* dy, const T* cs, const T* sn, T* dx, long long n, int n_t,    \
                                        int n_h, int n_k, long long s0, long long s1, long long s2,           \
                                        long long s3) {                                                        \
    rope<T, false>(dy, cs, sn, dx, n, n_t, n_h, n_k, s0, s1, s2, s3); }                                        \
extern "C" __global__ void swiglu_fwd_##S(const T* g, const T* u, T* a, T* s, long long n) {                   \
    swiglu_fwd<T>(g, u, a, s, n); }                                                                            \
extern "C" __global__ void swiglu_bwd_##S(const T* g, const T* u, const T* s, const T* da, T* dg, T* du,       \
                                          long long n) {                                                       \
    swiglu_bwd<T>(g, u, s, da, dg, du, n); }                                                                   \
extern "C" __global__ void xent_fwd_##S(const T* z, const long long* target, T* p, T* nll, long long n_rows,   \
                                        int n_cols) {                                                          \
    xent_fwd<T>(z, target, p, nll, n_rows, n_cols); }                                                          \
extern "C" __global__ void xent_bwd_##S(const T* p, const long long* target, T* d, long long n, int n_cols,     \
                                        T scale) {                                                             \
    xent_bwd<T>(p, target, d, n, n_cols, scale); }                                                            \
extern "C" __global__ void colsum_part_##S(const T* a, T* part, long long n_rows, int n_cols) {                \
    colsum_part<T, false>(a, a, part, n_rows, n_cols); }                                                       \
extern "C" __global__ void colsum_prod_part_##S(const T* a, const T* b, T* part, long long n_rows, int n_cols) { \
    colsum_part<T, true>(a, b, part, n_rows, n_cols); }                                                        \
extern "C" __global__ void colsum_finish_##S(const T* part, T* out, int n_parts, int n_cols, int accumulate) { \
    colsum_finish<T>(part, out, n_parts, n_cols, accumulate); }

// the ops of the header's bfloat16 lists (_bf16, _bf16i, _bf16x, _bf16o): the arrays they name as bits
// (unsigned short), T's math otherwise
#define ENTRIES_BF16(S, T)                                                                                     \
extern "C" __global__ void gelu_fwd_##S##_bf16(const T* x, unsigned short* y, T* s, long long n) {             \
    gelu_fwd<T, unsigned short>(x, y, s, n); }                                                                 \
extern "C" __global__ void causal_softmax_##S##_bf16(const T* z, unsigned short* p, long long n_rows,          \
                                                     int n_cols, int n_q, int q0) {                            \
    causal_softmax<T, unsigned short>(z, p, n_rows, n_cols, n_q, q0); }                                        \
extern "C" __global__ void softmax_bwd_##S##_bf16(T* ds, const unsigned short* p, const T* rs, long long n,    \
                                                  int n_cols, int n_q, int q0, int rs_len) {                   \
    softmax_bwd<T, unsigned short>(ds, p, rs, ds, n, n_cols, n_q, q0, rs_len); }                               \
extern "C" __global__ void layernorm_fwd_##S##_bf16(const T* x, const T* w, const T* b, unsigned short* y,     \
                                                    T* xhat, T* rstd, long long n_rows, int n_cols, T eps) {   \
    layernorm_fwd<T, unsigned short>(x, w, b, y, xhat, rstd, n_rows, n_cols, eps); }                           \
extern "C" __global__ void grouped_softmax_bwd_##S##_bf16(T* ds, const unsigned short* p, const T* rs,         \
                                                          long long n, int n_cols) {                           \
    grouped_softmax_bwd<T, unsigned short>(ds, p, rs, ds, n, n_cols); }                                        \
extern "C" __global__ void rmsnorm_fwd_##S##_bf16(const T* x, const T* w, unsigned short* y, T* xhat, T* rstd, \
                                                  long long n_rows, int n_cols, T eps) {                       \
    rmsnorm_fwd<T, unsigned short>(x, w, y, xhat, rstd, n_rows, n_cols, eps); }                                \
extern "C" __global__ void swiglu_fwd_##S##_bf16(const T* g, const T* u, unsigned short* a, T* s,             \
                                                 long long n) {                                                \
    swiglu_fwd<T, unsigned short>(g, u, a, s, n); }                                                            \
extern "C" __global__ void swiglu_bwd_##S##_bf16(const T* g, const T* u, const T* s, const T* da,              \
                                                 unsigned short* dg, unsigned short* du, long long n) {        \
    swiglu_bwd<T, unsigned short>(g, u, s, da, dg, du, n); }                                                   \
extern "C" __global__ void rope_fwd_##S##_bf16(const T* x, const T* cs, const T* sn, unsigned short* y,        \
                                               long long n, int n_t, int n_h, int n_k, long long s0,           \
                                               long long s1, long long s2, long long s3) {                     \
    rope<T, true, T, unsigned short>(x, cs, sn, y, n, n_t, n_h, n_k, s0, s1, s2, s3); }                        \
extern "C" __global__ void rope_bwd_##S##_bf16(const T* dy, const T* cs, const T* sn, unsigned short* dx,      \
                                               long long n, int n_t, int n_h, int n_k, long long s0,           \
                                               long long s1, long long s2, long long s3) {                     \
    rope<T, false, T, unsigned short>(dy, cs, sn, dx, n, n_t, n_h, n_k, s0, s1, s2, s3); }                     \
extern "C" __global__ void rope_fwd_##S##_bf16i(const unsigned short* x, const T* cs, const T* sn,             \
                                                unsigned short* y, long long n, int n_t, int n_h, int n_k,     \
                                                long long s0, long long s1, long long s2, long long s3) {      \
    rope<T, true, unsigned short, unsigned short>(x, cs, sn, y, n, n_t, n_h, n_k, s0, s1, s2, s3); }           \
extern "C" __global__ void gelu_fwd_##S##_bf16i(const unsigned short* x, unsigned short* y, unsigned short* s, \
                                                long long n) {                                                 \
    gelu_fwd<T, unsigned short, unsigned short>(x, y, s, n); }                                                 \
extern "C" __global__ void gelu_bwd_##S##_bf16i(const unsigned short* x, const unsigned short* s, const T* dy, \
                                                unsigned short* dx, long long n) {                             \
    gelu_bwd<T, unsigned short, unsigned short>(x, s, dy, dx, n); }                                            \
extern "C" __global__ void gelu_recompute_##S##_bf16i(const unsigned short* x, const unsigned short* s,        \
                                                      unsigned short* y, long long n) {                        \
    gelu_recompute<T, unsigned short, unsigned short>(x, s, y, n); }                                           \
extern "C" __global__ void swiglu_fwd_##S##_bf16i(const unsigned short* g, const unsigned short* u,            \
                                                  unsigned short* a, unsigned short* s, long long n) {         \
    swiglu_fwd<T, unsigned short, unsigned short>(g, u, a, s, n); }                                            \
extern "C" __global__ void swiglu_bwd_##S##_bf16i(const unsigned short* g, const unsigned short* u,            \
                                                  const unsigned short* s, const T* da, unsigned short* dg,    \
                                                  unsigned short* du, long long n) {                           \
    swiglu_bwd<T, unsigned short, unsigned short>(g, u, s, da, dg, du, n); }                                   \
extern "C" __global__ void swiglu_recompute_##S##_bf16i(const unsigned short* g, const unsigned short* u,      \
                                                        const unsigned short* s, unsigned short* a,            \
                                                        long long n) {                                         \
    swiglu_recompute<T, unsigned short, unsigned short>(g, u, s, a, n); }                                      \
extern "C" __global__ void layernorm_fwd_##S##_bf16x(const T* x, const T* w, const T* b, unsigned short* y,    \
                                                     unsigned short* xhat, T* rstd, long long n_rows,          \
                                                     int n_cols, T eps) {                                      \
    layernorm_fwd<T, unsigned short, unsigned short>(x, w, b, y, xhat, rstd, n_rows, n_cols, eps); }           \
extern "C" __global__ void rmsnorm_fwd_##S##_bf16x(const T* x, const T* w, unsigned short* y,                  \
                                                   unsigned short* xhat, T* rstd, long long n_rows,            \
                                                   int n_cols, T eps) {                                        \
    rmsnorm_fwd<T, unsigned short, unsigned short>(x, w, y, xhat, rstd, n_rows, n_cols, eps); }                \
extern "C" __global__ void layernorm_bwd_##S##_bf16i(const T* dy, const unsigned short* xhat, const T* rstd,   \
                                                     const T* w, T* dx, long long n_rows, int n_cols) {        \
    layernorm_bwd<T, unsigned short>(dy, xhat, rstd, w, dx, n_rows, n_cols); }                                 \
extern "C" __global__ void rmsnorm_bwd_##S##_bf16i(const T* dy, const unsigned short* xhat, const T* rstd,     \
                                                   const T* w, T* dx, long long n_rows, int n_cols) {          \
    rmsnorm_bwd<T, unsigned short>(dy, xhat, rstd, w, dx, n_rows, n_cols); }                                   \
extern "C" __global__ void colsum_prod_part_##S##_bf16i(const T* a, const unsigned short* b, T* part,          \
                                                        long long n_rows, int n_cols) {                        \
    colsum_part<T, true, unsigned short>(a, b, part, n_rows, n_cols); }                                        \
extern "C" __global__ void colsum_part_##S##_bf16i(const unsigned short* a, T* part, long long n_rows,         \
                                                   int n_cols) {                                               \
    colsum_part<T, false, unsigned short, unsigned short>(a, a, part, n_rows, n_cols); }                       \
extern "C" __global__ void softmax_bwd_##S##_bf16o(const T* ds, const unsigned short* p, const T* rs,          \
                                                   unsigned short* out, long long n, int n_cols, int n_q,      \
                                                   int q0, int rs_len) {                                       \
    softmax_bwd<T, unsigned short, unsigned short>(ds, p, rs, out, n, n_cols, n_q, q0, rs_len); }              \
extern "C" __global__ void grouped_softmax_bwd_##S##_bf16o(const T* ds, const unsigned short* p, const T* rs,  \
                                                           unsigned short* out, long long n, int n_cols) {     \
    grouped_softmax_bwd<T, unsigned short, unsigned short>(ds, p, rs, out, n, n_cols); }

ENTRIES(f32, float)
ENTRIES(f64, double)
ENTRIES_BF16(f32, float)
