// Fused causal attention, flash-attention style, with grouped-query heads (query head h reads key/value
// head h / (H / KH)). Entries flash_fwd_<S>, flash_bwd_dq_<S>, flash_bwd_dkdv_<S> for S = f32 (float),
// f64 (double) and bf16 (bfloat16 storage as unsigned short, float math; stores round to nearest even).
// NumPy twin: hpengine/nn/flash.py (flash_forward_core, flash_backward_core); launcher: nn/flash_cuda.py.
//
// Forward: one block per (ROWS query rows, batch row x query head). A key tile of KT rows of k and v
// sits in shared memory; each thread owns CPT = HD_MAX / TPR columns of one query row (TPR threads per row,
// adjacent lanes), holds that part of q and of the output accumulator in registers, and gets a score as
// a TPR-lane shuffle sum of partial dot products. Online softmax over the key tiles (row max m, row sum l);
// key tiles past the block's last query are never loaded. Saves o and lse = m + log l.
// Backward, as FlashAttention-2, from lse and D = rowsum(dO * O):
//   flash_bwd_dq   (run first) one block per query tile: writes D, then dq = scale sum_j ds_ij k_j;
//   flash_bwd_dkdv one block per (ROWS keys, batch row x key/value head): walks the g query heads of the
//                  group and the query tiles at or below the diagonal; dv = sum_i p_ij dO_i,
//                  dk = scale sum_i ds_ij q_i, with p = exp(scale q.k - lse), ds = p (dO.v - D).
// SIMT arithmetic (no tensor cores): fp32 math for f32 and bf16, fp64 for f64.
// Packed documents: seg, the last argument of every entry, is null (one document a row) or (B, T) int32
// document ids, nondecreasing along a row. A query then sees a key iff causal and of its document; a pair of
// query and key tiles whose ranges of ids do not meet (the twin's _TilePlan) is skipped, never loaded:
// the walks start (fwd, dq) or end (dkdv) at the tile the rule names (doc_start, doc_end).
// A row may see no key of a tile it visits (its document has not begun): its running max stays -inf and
// the shift is 0 there, so the exponentials are exact zeros (every row sees itself, so l > 0 at the end).
//
// Launch assumptions (flash_cuda.plan computes them)
//   * blockDim.x = ROWS * TPR (a multiple of 32); grid = (ceil(T / ROWS), B * H) for fwd and dq,
//     (ceil(T / ROWS), B * KH) for dkdv;
//   * dynamic shared memory: fwd and dq 2 * KT * hd values of A, dkdv 2 * KT * (hd + 1);
//   * hd <= HD_MAX; q, k, v, o, dO, dq, dk, dv are (B, heads, T, hd) with element strides (sb, sh, st)
//     and a contiguous last axis; lse and D are contiguous (B, H, T) arrays of A; seg (if any) contiguous.
//   * static shared memory: KT ints of the tile's document ids (besides the dynamic tiles).

#define HD_MAX 128
#define FULL 0xffffffffu

template <typename A> __device__ __forceinline__ A ex(A x);
template <> __device__ __forceinline__ float ex<float>(float x) { return expf(x); }
template <> __device__ __forceinline__ double ex<double>(double x) { return exp(x); }
template <typename A> __device__ __forceinline__ A lg(A x);
template <> __device__ __forceinline__ float lg<float>(float x) { return logf(x); }
template <> __device__ __forceinline__ double lg<double>(double x) { return log(x); }
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// storage <-> math
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double ld(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const unsigned short* p, long long i) {
    return __uint_as_float(((unsigned)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void st(unsigned short* p, long long i, float v) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = 0x7fc0; return; }      // NaN stays a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                     // round to nearest, ties to even
    p[i] = (unsigned short)(u >> 16);
}

// sum over the TPR adjacent lanes that share a row; every one of them gets the result
template <int TPR, typename A>
__device__ __forceinline__ A row_sum(A v) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// rows [r0, r0 + n) of one (batch, head) slice into sh (n x hd, zero past T), times mul
template <typename S, typename A>
__device__ __forceinline__ void load_tile(A* sh, const S* base, long long stt, int r0, int n, int T, int hd, A mul) {
    for (int e = threadIdx.x; e < n * hd; e += blockDim.x) {
        const int c = e / hd, col = e - c * hd, j = r0 + c;
        sh[e] = j < T ? (A)ld(base, (long long)j * stt + col) * mul : (A)0;
    }
}

// ids rise along a row, so the tiles the rule keeps are contiguous: the key tiles of a query block start at
// the one holding the first key of its first query's document (doc_start), the query tiles of a key block
// end before the first query past its last key's document (doc_end); binary searches over the row
__device__ __forceinline__ int doc_start(const int* sg, int i) {
    int lo = 0, hi = i;                       // the first j <= i with sg[j] == sg[i]
    const int d = sg[i];
    while (lo < hi) { const int mid = (lo + hi) >> 1; if (sg[mid] < d) lo = mid + 1; else hi = mid; }
    return lo;
}
__device__ __forceinline__ int doc_end(const int* sg, int j, int T) {
    int lo = j + 1, hi = T;                   // the first i > j with sg[i] > sg[j], else T
    const int d = sg[j];
    while (lo < hi) { const int mid = (lo + hi) >> 1; if (sg[mid] <= d) lo = mid + 1; else hi = mid; }
    return lo;
}

#define COLS for (int t = 0; t < HD_MAX / TPR; ++t)
#define COL (sub + TPR * t)

template <typename S, typename A, int ROWS, int TPR, int KT>
__device__ void flash_fwd(const S* q, long long q_sb, long long q_sh, long long q_st,
                          const S* k, long long k_sb, long long k_sh, long long k_st,
                          const S* v, long long v_sb, long long v_sh, long long v_st,
                          S* o, long long o_sb, long long o_sh, long long o_st,
                          A* lse, int H, int KH, int T, int hd, A scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int ksg[KT];
    A* ks = (A*)smem;
    A* vs = ks + KT * hd;
    const int sub = threadIdx.x % TPR, r = threadIdx.x / TPR;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kh = h / (H / KH);
    const int q0 = blockIdx.x * ROWS, i = q0 + r;
    const bool live = i < T;
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    const int qsg = sg ? sg[live ? i : T - 1] : 0;
    const S* qp = q + b * q_sb + h * q_sh + (long long)(live ? i : 0) * q_st;
    const S* kb = k + b * k_sb + kh * k_sh;
    const S* vb = v + b * v_sb + kh * v_sh;
    A qr[HD_MAX / TPR], acc[HD_MAX / TPR];
#pragma unroll
    COLS { qr[t] = (COL < hd && live) ? (A)ld(qp, COL) * scale : (A)0; acc[t] = 0; }
    A m = neg_inf<A>(), l = 0;
    const int kend = min(q0 + ROWS, T);
    for (int k0 = sg ? doc_start(sg, q0) / KT * KT : 0; k0 < kend; k0 += KT) {
        __syncthreads();
        load_tile(ks, kb, k_st, k0, KT, T, hd, (A)1);
        load_tile(vs, vb, v_st, k0, KT, T, hd, (A)1);
        if (sg) for (int c = threadIdx.x; c < KT; c += blockDim.x) ksg[c] = k0 + c < T ? sg[k0 + c] : -1;
        __syncthreads();
        A s[KT];
        A mt = neg_inf<A>();
#pragma unroll
        for (int c = 0; c < KT; ++c) {
            A part = 0;
#pragma unroll
            COLS { if (COL < hd) part += qr[t] * ks[c * hd + COL]; }
            part = row_sum<TPR>(part);
            const int j = k0 + c;
            s[c] = (j <= i && j < T && (!sg || ksg[c] == qsg)) ? part : neg_inf<A>();
            mt = s[c] > mt ? s[c] : mt;
        }
        // without documents mn is finite (the first tile holds key 0, seen by every row) and sh is mn
        const A mn = mt > m ? mt : m;
        const A sh = mn == neg_inf<A>() ? (A)0 : mn;
        const A alpha = ex<A>(m - sh);
        l *= alpha;
#pragma unroll
        COLS { acc[t] *= alpha; }
#pragma unroll
        for (int c = 0; c < KT; ++c) {
            const A p = ex<A>(s[c] - sh);
            l += p;
#pragma unroll
            COLS { if (COL < hd) acc[t] += p * vs[c * hd + COL]; }
        }
        m = mn;
    }
    if (live) {
        S* op = o + b * o_sb + h * o_sh + (long long)i * o_st;
        const A inv = (A)1 / l;
#pragma unroll
        COLS { if (COL < hd) st(op, COL, acc[t] * inv); }
        if (sub == 0) lse[(long long)bh * T + i] = m + lg<A>(l);
    }
}

template <typename S, typename A, int ROWS, int TPR, int KT>
__device__ void flash_bwd_dq(const S* q, long long q_sb, long long q_sh, long long q_st,
                             const S* k, long long k_sb, long long k_sh, long long k_st,
                             const S* v, long long v_sb, long long v_sh, long long v_st,
                             const S* o, long long o_sb, long long o_sh, long long o_st,
                             const S* dout, long long d_sb, long long d_sh, long long d_st,
                             const A* lse, A* dd, S* dq, long long dq_sb, long long dq_sh, long long dq_st,
                             int H, int KH, int T, int hd, A scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int ksg[KT];
    A* ks = (A*)smem;
    A* vs = ks + KT * hd;
    const int sub = threadIdx.x % TPR, r = threadIdx.x / TPR;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kh = h / (H / KH);
    const int q0 = blockIdx.x * ROWS, i = q0 + r;
    const bool live = i < T;
    const long long row = live ? i : 0;
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    const int qsg = sg ? sg[row] : 0;
    if (!sg) for (int c = threadIdx.x; c < KT; c += blockDim.x) ksg[c] = 0;     // one document: every id 0
    const S* qp = q + b * q_sb + h * q_sh + row * q_st;
    const S* op = o + b * o_sb + h * o_sh + row * o_st;
    const S* dp_ = dout + b * d_sb + h * d_sh + row * d_st;
    const S* kb = k + b * k_sb + kh * k_sh;
    const S* vb = v + b * v_sb + kh * v_sh;
    A qr[HD_MAX / TPR], dor[HD_MAX / TPR], acc[HD_MAX / TPR];
    A dsum = 0;
#pragma unroll
    COLS {
        const bool in = COL < hd && live;
        qr[t] = in ? (A)ld(qp, COL) * scale : (A)0;
        dor[t] = in ? (A)ld(dp_, COL) : (A)0;
        dsum += in ? dor[t] * (A)ld(op, COL) : (A)0;
        acc[t] = 0;
    }
    const A D = row_sum<TPR>(dsum);
    if (live && sub == 0) dd[(long long)bh * T + i] = D;
    const A li = live ? lse[(long long)bh * T + i] : (A)0;
    const int kend = min(q0 + ROWS, T);
    for (int k0 = sg ? doc_start(sg, q0) / KT * KT : 0; k0 < kend; k0 += KT) {
        __syncthreads();
        load_tile(ks, kb, k_st, k0, KT, T, hd, (A)1);
        load_tile(vs, vb, v_st, k0, KT, T, hd, (A)1);
        if (sg) for (int c = threadIdx.x; c < KT; c += blockDim.x) ksg[c] = k0 + c < T ? sg[k0 + c] : -1;
        __syncthreads();
#pragma unroll 2
        for (int c = 0; c < KT; ++c) {
            A s = 0, dp = 0;
#pragma unroll
            COLS { if (COL < hd) { s += qr[t] * ks[c * hd + COL]; dp += dor[t] * vs[c * hd + COL]; } }
            s = row_sum<TPR>(s);
            dp = row_sum<TPR>(dp);
            const int j = k0 + c;
            const A p = (live && j <= i && ksg[c] == qsg) ? ex<A>(s - li) : (A)0;
            const A ds = p * (dp - D);
#pragma unroll
            COLS { if (COL < hd) acc[t] += ds * ks[c * hd + COL]; }
        }
    }
    if (live) {
        S* qo = dq + b * dq_sb + h * dq_sh + (long long)i * dq_st;
#pragma unroll
        COLS { if (COL < hd) st(qo, COL, acc[t] * scale); }
    }
}

template <typename S, typename A, int ROWS, int TPR, int KT>
__device__ void flash_bwd_dkdv(const S* q, long long q_sb, long long q_sh, long long q_st,
                               const S* k, long long k_sb, long long k_sh, long long k_st,
                               const S* v, long long v_sb, long long v_sh, long long v_st,
                               const S* dout, long long d_sb, long long d_sh, long long d_st,
                               const A* lse, const A* dd,
                               S* dk, long long dk_sb, long long dk_sh, long long dk_st,
                               S* dv, long long dv_sb, long long dv_sh, long long dv_st,
                               int H, int KH, int T, int hd, A scale, const int* seg) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int qsg[KT];
    A* qs = (A*)smem;
    A* dos = qs + KT * hd;
    A* ls = dos + KT * hd;
    A* ds_ = ls + KT;
    const int sub = threadIdx.x % TPR, r = threadIdx.x / TPR;
    const int bk = blockIdx.y, b = bk / KH, kh = bk % KH, g = H / KH;
    const int k0 = blockIdx.x * ROWS, j = k0 + r;
    const bool live = j < T;
    const long long row = live ? j : 0;
    const S* kp = k + b * k_sb + kh * k_sh + row * k_st;
    const S* vp = v + b * v_sb + kh * v_sh + row * v_st;
    const int* sg = seg ? seg + (long long)b * T : nullptr;
    const int ksg = sg ? sg[row] : 0, qend = sg ? doc_end(sg, min(k0 + ROWS, T) - 1, T) : T;
    A kr[HD_MAX / TPR], vr[HD_MAX / TPR], dka[HD_MAX / TPR], dva[HD_MAX / TPR];
#pragma unroll
    COLS {
        const bool in = COL < hd && live;
        kr[t] = in ? (A)ld(kp, COL) : (A)0;
        vr[t] = in ? (A)ld(vp, COL) : (A)0;
        dka[t] = 0;
        dva[t] = 0;
    }
    for (int hh = 0; hh < g; ++hh) {
        const int h = kh * g + hh;
        const long long bh = (long long)b * H + h;
        const S* qb = q + b * q_sb + h * q_sh;
        const S* db = dout + b * d_sb + h * d_sh;
        for (int q0 = (k0 / KT) * KT; q0 < qend; q0 += KT) {   // query tiles wholly before k0: skipped
            __syncthreads();
            load_tile(qs, qb, q_st, q0, KT, T, hd, scale);
            load_tile(dos, db, d_st, q0, KT, T, hd, (A)1);
            for (int c = threadIdx.x; c < KT; c += blockDim.x) {
                ls[c] = q0 + c < T ? lse[bh * T + q0 + c] : (A)0;
                ds_[c] = q0 + c < T ? dd[bh * T + q0 + c] : (A)0;
                if (sg) qsg[c] = q0 + c < T ? sg[q0 + c] : -1;
            }
            __syncthreads();
#pragma unroll 4
            for (int c = 0; c < KT; ++c) {
                A s = 0, dp = 0;
#pragma unroll
                COLS { if (COL < hd) { s += kr[t] * qs[c * hd + COL]; dp += vr[t] * dos[c * hd + COL]; } }
                s = row_sum<TPR>(s);
                dp = row_sum<TPR>(dp);
                const int i = q0 + c;
                const A p = (live && j <= i && i < T && (!sg || qsg[c] == ksg)) ? ex<A>(s - ls[c]) : (A)0;
                const A ds = p * (dp - ds_[c]);
#pragma unroll
                COLS { if (COL < hd) { dva[t] += p * dos[c * hd + COL]; dka[t] += ds * qs[c * hd + COL]; } }
            }
        }
    }
    if (live) {
        S* ko = dk + b * dk_sb + kh * dk_sh + (long long)j * dk_st;
        S* vo = dv + b * dv_sb + kh * dv_sh + (long long)j * dv_st;
#pragma unroll
        COLS { if (COL < hd) { st(ko, COL, dka[t]); st(vo, COL, dva[t]); } }
    }
}

// ENTRIES(suffix, storage S, math A, ROWS, TPR, KT): the extern "C" entries of one storage type
#define ENTRIES(SUF, S, A, ROWS, TPR, KT)                                                                        \
extern "C" __global__ void __launch_bounds__(ROWS * TPR) flash_fwd_##SUF(                                       \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        S* o, long long o_sb, long long o_sh, long long o_st, A* lse, int H, int KH, int T, int hd, A scale,   \
        const int* seg) {                                                                                       \
    flash_fwd<S, A, ROWS, TPR, KT>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,               \
                                   o, o_sb, o_sh, o_st, lse, H, KH, T, hd, scale, seg); }                       \
extern "C" __global__ void __launch_bounds__(ROWS * TPR) flash_bwd_dq_##SUF(                                    \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        const S* o, long long o_sb, long long o_sh, long long o_st,                                             \
        const S* dout, long long d_sb, long long d_sh, long long d_st, const A* lse, A* dd,                     \
        S* dq, long long dq_sb, long long dq_sh, long long dq_st, int H, int KH, int T, int hd, A scale,       \
        const int* seg) {                                                                                       \
    flash_bwd_dq<S, A, ROWS, TPR, KT>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,            \
                                      o, o_sb, o_sh, o_st, dout, d_sb, d_sh, d_st, lse, dd,                     \
                                      dq, dq_sb, dq_sh, dq_st, H, KH, T, hd, scale, seg); }                     \
extern "C" __global__ void __launch_bounds__(ROWS * TPR) flash_bwd_dkdv_##SUF(                                  \
        const S* q, long long q_sb, long long q_sh, long long q_st,                                             \
        const S* k, long long k_sb, long long k_sh, long long k_st,                                             \
        const S* v, long long v_sb, long long v_sh, long long v_st,                                             \
        const S* dout, long long d_sb, long long d_sh, long long d_st, const A* lse, const A* dd,               \
        S* dk, long long dk_sb, long long dk_sh, long long dk_st,                                               \
        S* dv, long long dv_sb, long long dv_sh, long long dv_st, int H, int KH, int T, int hd, A scale,       \
        const int* seg) {                                                                                       \
    flash_bwd_dkdv<S, A, ROWS, TPR, KT>(q, q_sb, q_sh, q_st, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st,          \
                                        dout, d_sb, d_sh, d_st, lse, dd, dk, dk_sb, dk_sh, dk_st,               \
                                        dv, dv_sb, dv_sh, dv_st, H, KH, T, hd, scale, seg); }

ENTRIES(f32, float, float, 32, 4, 32)
ENTRIES(bf16, unsigned short, float, 32, 4, 32)
ENTRIES(f64, double, double, 16, 8, 16)
