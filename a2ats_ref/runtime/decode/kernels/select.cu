// RET-DECODE on CUDA: the select kernel's body (mx.fast.cuda_kernel source). MLX builds its signature from the
// input and output names in runtime/decode/cuda.py's KERNELS; the shared helpers are in common.cuh.
    constexpr int H2 = D / 2;
    const int r = blockIdx.y, h = r % NKV, tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int Tc = codes_shape[2];
    const a2ats_step P(ipa_shape, ipb_shape);
    const int kk = P.kk, c0 = P.c0, c1 = P.c1, counted = P.counted, kept = P.kept, sinks = P.sinks, w = P.w;
    __shared__ float qs[G * D], rot[4 * H2];
    __shared__ int cnt[KS];
    __shared__ int hist[G * 256];
    __shared__ unsigned pre[G];
    __shared__ int rem[G], above[G], nge[G], n12[2];
    // EQ-12. The angles depend on the pair i only. The applied angle is the float32 product qpos * inv[i] (what
    // mlx-lm's rope formed) and its cos/sin are taken in double: cosf/sinf of an argument past ~1e5 rad
    // (positions past 105,615 at inv = 1) take CUDA's slow reduction path (0.23 ms at 256K)
    for (int i = tid; i < H2; i += nt) {
        if (TABLES) { rot[i] = tc[i]; rot[H2 + i] = ts[i]; }
        else { double sd, cd; sincos((double)(P.qpos * inv[i]), &sd, &cd); rot[i] = (float)cd; rot[H2 + i] = (float)sd; }
        float s2, c2;
        sincosf(P.b * inv[i], &s2, &c2);
        rot[2 * H2 + i] = c2;
        rot[3 * H2 + i] = s2;
    }
    __syncthreads();
    for (int e = tid; e < G * H2; e += nt) {
        const int g = e / H2, i = e - g * H2;
        const int ia = TRAD ? 2 * i : i, ib = TRAD ? 2 * i + 1 : i + H2;
        const size_t base = ((size_t)r * G + g) * D;
        const float x0 = a2ats_f32(q[base + ia]), x1 = a2ats_f32(q[base + ib]);
        const float c1_ = rot[i], s1 = rot[H2 + i], c2 = rot[2 * H2 + i], s2 = rot[3 * H2 + i];
        const float a1 = x0 * c1_ + x1 * s1, b1 = x1 * c1_ - x0 * s1;
        qs[g * D + ia] = (a1 * c2 - b1 * s2) * P.scale;
        qs[g * D + ib] = (a1 * s2 + b1 * c2) * P.scale;
    }
    __syncthreads();
    // The LUT: each thread four adjacent codes, one 16-byte load of CT per dimension (more bytes in flight per
    // thread: one block reads the row's whole codebook)
    float* lrow = lut + (size_t)r * G * KS;
    if (KS % 4 == 0) {
        const float4* col = reinterpret_cast<const float4*>(CT + (size_t)h * D * KS);
        for (int k4 = tid; k4 < KS / 4; k4 += nt) {
            float acc[G][4];
            for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
#pragma unroll 8
            for (int dd = 0; dd < D; ++dd) {
                const float4 c = col[(size_t)dd * (KS / 4) + k4];
                for (int g = 0; g < G; ++g) {
                    const float qv = qs[g * D + dd];
                    acc[g][0] = fmaf(qv, c.x, acc[g][0]);
                    acc[g][1] = fmaf(qv, c.y, acc[g][1]);
                    acc[g][2] = fmaf(qv, c.z, acc[g][2]);
                    acc[g][3] = fmaf(qv, c.w, acc[g][3]);
                }
            }
            for (int g = 0; g < G; ++g)
                *reinterpret_cast<float4*>(lrow + (size_t)g * KS + 4 * k4) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        }
    } else {
        for (int k = tid; k < KS; k += nt) {
            float acc[G];
            for (int g = 0; g < G; ++g) acc[g] = 0.0f;
            const float* col = CT + (size_t)h * D * KS + k;
            for (int dd = 0; dd < D; ++dd) {
                const float c = col[(size_t)dd * KS];
                for (int g = 0; g < G; ++g) acc[g] = fmaf(qs[g * D + dd], c, acc[g]);
            }
            for (int g = 0; g < G; ++g) lrow[(size_t)g * KS + k] = acc[g];
        }
    }
    // the candidates' code counts: the kept counts less the sinks and the coded window tail, or counted here
    if (kept) {
        for (int c = tid; c < KS; c += nt) cnt[c] = counts[(size_t)r * KS + c];
        __syncthreads();
        for (int p = tid; p < sinks; p += nt)
            if (p < c0) atomicSub(&cnt[(int)codes[(size_t)r * Tc + p]], 1);
        for (int j = tid; j < w; j += nt)
            if (c1 + j < counted) atomicSub(&cnt[(int)codes[(size_t)r * Tc + c1 + j]], 1);
    } else {
        for (int c = tid; c < KS; c += nt) cnt[c] = 0;
        __syncthreads();
        for (int j = c0 + tid; j < c1; j += nt) atomicAdd(&cnt[(int)codes[(size_t)r * Tc + j]], 1);
    }
    if (tid < G) { pre[tid] = 0u; rem[tid] = kk; above[tid] = 0; }
    if (tid < 2) n12[tid] = 0;
    // (the barrier at the first pass also makes this block's LUT stores visible to all its threads)
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const unsigned himask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        for (int e = tid; e < G * 256; e += nt) hist[e] = 0;
        __syncthreads();
        for (int c = tid; c < KS; c += nt) {
            const int n = cnt[c];
            if (n > 0) {
                for (int g = 0; g < G; ++g) {
                    const unsigned key = a2ats_key(lrow[(size_t)g * KS + c]);
                    if (((key ^ pre[g]) & himask) == 0u) atomicAdd(&hist[g * 256 + ((key >> shift) & 255u)], n);
                }
            }
        }
        __syncthreads();
        if (warp < G) {
            const int g = warp;
            int loc = 0;
            for (int i = 0; i < 8; ++i) loc += hist[g * 256 + 255 - 8 * lane - i];
            int incl = loc;
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            const int need = rem[g];
            const unsigned hit = __ballot_sync(0xffffffffu, incl >= need && incl - loc < need);
            const int L = hit ? __ffs(hit) - 1 : 31;
            if (lane == L) {
                int acc = incl - loc, digit = 255 - 8 * lane - 7;
                for (int i = 0; i < 8; ++i) {
                    const int bin = 255 - 8 * lane - i;
                    const int hb = hist[g * 256 + bin];
                    if (acc + hb >= need) { digit = bin; break; }
                    acc += hb;
                }
                pre[g] |= ((unsigned)digit) << shift;
                rem[g] = need - acc;
                above[g] += acc;
                if (pass == 3) nge[g] = above[g] + hist[g * 256 + digit];
            }
        }
        __syncthreads();
    }
    int a1 = 0, a2 = 0;
    for (int c = tid; c < KS; c += nt) {
        bool must = false, ge = false;
        for (int g = 0; g < G; ++g) {
            const unsigned key = a2ats_key(lrow[(size_t)g * KS + c]);
            const bool gt = key > pre[g], eq = key == pre[g];
            must = must || gt || (eq && nge[g] == kk);
            ge = ge || gt || eq;
        }
        const int lv = must ? 1 : (ge ? 2 : 0);
        levels[(size_t)r * KS + c] = (unsigned char)lv;
        if (lv == 1) a1 += cnt[c];
        if (lv == 2) a2 += cnt[c];
    }
    for (int off = 16; off > 0; off >>= 1) {
        a1 += __shfl_down_sync(0xffffffffu, a1, off);
        a2 += __shfl_down_sync(0xffffffffu, a2, off);
    }
    if (lane == 0) { atomicAdd(&n12[0], a1); atomicAdd(&n12[1], a2); }
    __syncthreads();
    // the third column is the attend kernel's ticket: zero here, reset by its last block
    if (tid == 0) { nsel[r * 3] = n12[0]; nsel[r * 3 + 1] = n12[1]; nsel[r * 3 + 2] = 0; }
